"""`RayBackend`: one Ray task per run. The only module in reslab that dispatches Ray tasks; ray is
imported besides only by `orchestrator.attempt.distributed_run` (a run's ranks on Ray Train, inside the task
this module starts) and `orchestrator.driving.jobs` (`reslab submit`'s Ray Jobs client).

Connecting. `--address` / `$RAY_ADDRESS` joins a running cluster (`ray start --head`, KubeRay,
the compose file in docker/). The address is probed with a plain TCP connect first
(`CONNECT_TIMEOUT_S`): `ray.init` itself retries a dead address for good, so without the probe a
typo hangs the command instead of failing it. Ray never sends a token to an explicit address on its own, so for
a cluster with token auth export `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH` (or
`RAY_AUTH_TOKEN`). A loopback address (a head started on this machine) is joined in single-node mode (below),
as Ray would otherwise dial the machine's own address, where a loopback-only head does not listen. Without an
address, a private local instance is started for this submission (`address="local"`, never silently attaching
to some `ray start` left running on the machine) and shut down at the end; an already connected session (a
notebook, a test session) is reused and left running.

A local start passes `include_dashboard=False` (the Ray dashboard is not needed and costs memory
and start time), `num_cpus` = the CPUs this process may use (`sched_getaffinity`, which respects
container CPU sets), a small object store (runs exchange only small records), and
`log_to_driver=False`: training output goes to each run's `train.log` and the driver shows a
progress display instead of interleaved worker output. It also names a metrics export port
(`_metrics_export_port`, which nothing binds with metrics collection off): for each port it is not given, the raylet
waits at most 15 s for the file its dashboard agent writes, and this one's only once all the agent's modules are
imported, which a loaded machine made miss (issue 52). A failed local start is tried again, up to
`START_ATTEMPTS` tries, each retry said in one line on stderr; the whole start has a deadline (`START_TIMEOUT_S`:
`ray.init` may block instead of failing), and so has `shutdown`'s wait for it. Ray 2.5x turns on token authentication
for the local clusters it starts and keeps the token in `~/.ray/auth_token`; reslab keeps that
default and, only when the home directory is not writable, writes the token into the workspace
instead (`RAY_AUTH_TOKEN_PATH`). Ray's temp dir stays the default `/tmp/ray` (its Unix socket
paths must stay short) unless /tmp is not writable, then `<workspace>/.ray`.

Exposure of a local instance. Ray takes its node IP from `get_node_ip_address`, which returns
the loopback address when `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` is false (the single-node mode Ray
uses on macOS and Windows); `ray.init(_node_ip_address="127.0.0.1")` does not do it, Ray rewrites
a loopback address to the machine's. A local start turns that mode on for this process and the
processes Ray spawns, so the GCS, raylet, object manager, workers, dashboard agent, runtime-env
agent and the runtime-env agent all listen on 127.0.0.1 (checked by
`tests/orchestrator/test_listening_ports.py`), and the gRPC endpoints also require Ray's token.
Metrics collection is off (`RAY_enable_metrics_collection=0`), so there is no Prometheus endpoint. A
SIGKILLed driver would leave those processes running for about 60 s (until their own health
checks notice), so a local start also runs `orchestrator/durability/reaper.py`, which kills them within a second of the
driver's death. At the end its autoscaler monitor is SIGKILLed before `ray.shutdown` (which would
otherwise wait a second for it: it answers SIGTERM by reporting to the GCS Ray stopped before it). A
cluster joined by address is left as its operator configured it.

Starting early (`prestart`). A local start takes seconds, most of them spent waiting for the
processes Ray spawns (its GCS, raylet, dashboard head and agents, the prestarted workers) to come
up, so `prestart()` begins it in a background thread and `start()` waits for it. The thread also
creates the progress actor and then runs one empty task (`_warm`) in the idle worker left, which
imports the worker's code (torch, the training loop) there, so the first run starts in a worker
that has it loaded; all of it runs while the driver opens its MLflow store (and, for a new
workspace, loads the study: `reslab run` prestarts before the study's load there). A `shutdown()`
before any `start()` (bad input, nothing to run) lets the start finish without the actor and the
warm-up, then stops it. Ray sets no SIGTERM handler from a thread, so the driver's own stays in
place. A joined cluster or an existing session is not prestarted.

Resources. Each task asks for `cpus` CPUs and `gpus` GPUs; `train.device: auto` then trains on
the GPU Ray assigns (Ray sets `CUDA_VISIBLE_DEVICES`). A request no node can ever satisfy, e.g. a
GPU on a CPU-only cluster, would leave the task pending forever without an error, so `resources()`
checks the live nodes first and fails with a clear message. Ray-level retries are off
(`max_retries=0`): the driver retries, with run-directory state, so it knows what it retries.

A task that carries its own work (`RunTask.work`, e.g. a finished run's evaluations and interventions,
`orchestrator.attempt.after`) asks for what its work says (`Work.asks`: work after training asks for a run's
resources, or one rank's for a run on N ranks, as it works in one process).

A push task (`RunTask.push_from`: the driver has the node that finished a run push its copy to run
storage, after an outage or when storage lacks it) asks for `COORDINATOR_CPUS` and no GPU, and is
placed on that node with a hard node affinity: the Ray node the attempt ran on, else a live node on
its host (a node restarted there keeps its disk); when neither is alive it completes at once with an
error, and the driver pushes what its own copy has. A run whose record names no node (written before
reslab recorded it) is pushed from wherever the task lands, if its copy is there.

A run on N ranks (`RunTask.ranks`: `--gpus-per-run N`, N >= 2) is different: its task only
coordinates (the claim, the lease, the records, storage) and asks for `COORDINATOR_CPUS` and no
GPU, since holding the run's GPUs itself would leave none for its ranks; the ranks, which it starts
through Ray Train (`orchestrator.attempt.distributed_run`), ask for one GPU and `cpus / N` CPUs each. The
driver still counts N GPUs per run in flight (`loop.concurrency`), so it never starts a run whose
ranks it cannot place. On a cluster without a GPU, or for runs that all set `train.device: cpu`, the
ranks are CPU ranks (`tasks.on_cpu_ranks`): they ask for `cpus / N` CPUs each and no GPU, the run for
no GPU at all, and the driver counts its CPUs and its coordinator's. `num_gpus` declares GPUs for a
local instance (Ray detects real ones itself): the tests run N-rank studies on GPU ranks on a CPU
machine that way.

Progress. Workers report events to a small actor (`_EventSink`, zero CPUs) with fire-and-forget
calls; the driver drains it every poll. A worker's last call is awaited before its task returns
and calls from one worker run in order, so every event of a run has reached the sink when the
driver sees the task finish. The sink is pinned to the driver's node (a hard node affinity: on a
worker node, losing that node would take the driver's progress with it) and restarts when its
process dies, with the workers' calls retried against the new process. Losing it never stops the
driver: a drain that fails is skipped, and a sink that is gone for good is replaced for the runs
submitted after. Events lost that way come back from the run directories: a worker's `start`
event carries the run's history, and a finished run's records carry its metrics and diagnostics.

Code shipping (`ship_code`). "on": the driver copies the `reslab` package it imports
(`stage_code`: every subpackage folder, its `.py` files and package data, under a `reslab/`
with an `__init__.py`) and passes it as the job's `runtime_env={"py_modules": [...]}` to
`ray.init` (Ray uploads a local folder only at the job level). Ray puts that folder first on the
worker's `PYTHONPATH` and, `reslab` being a regular package there, Python's path finder takes it
before any other copy: a `reslab` on the node's own `PYTHONPATH`, and the editable install's
finder, which comes after the path finder. "auto" (the default) ships when joining a cluster by
address and not for a local instance, whose workers import the driver's files anyway; an
already connected session keeps the runtime_env it was started with ("on" is refused there).
Either way each worker checks that it imports the driver's code (`envinfo.check_code_fingerprint`).
The source of every variant from outside the package that the driver resolved (`envinfo.external_sources`:
a package folder or one module file) is shipped beside it, and each worker checks it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import ray._private.ray_constants as ray_constants
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from reslab.orchestrator.attempt.envinfo import REPO_ROOT, external_sources, package_dirs
from reslab.orchestrator.attempt.worker import execute_run
from reslab.orchestrator.dispatch import BackendError, failure_text
from reslab.orchestrator.durability import reaper
from reslab.orchestrator.tasks import COORDINATOR_CPUS, ClusterInfo, Completion, Node, Resources, RunOutcome, RunTask

if TYPE_CHECKING:
    from reslab.experiments import RunSpec

_OBJECT_STORE_BYTES = 256 * 2**20
CONNECT_TIMEOUT_S = 5.0
# The deadline of a local start, retry included (`ray.init` may block instead of failing): minutes, as the
# processes Ray spawns come up slowly on a loaded machine
START_TIMEOUT_S = 600.0
# Tries of a local start: Ray's processes miss their fixed start-up deadlines on a loaded machine, and a second
# try finds their imports in the page cache
START_ATTEMPTS = 3
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A local instance's environment (read by the processes Ray spawns): node IP 127.0.0.1, and no
# Prometheus metrics endpoint (unauthenticated HTTP; reslab reads no Ray metrics).
_LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_enable_metrics_collection": "0"}
# Ray runs its workers at nice 15 (its `worker_niceness`): beside any other busy process the runs of a local
# instance then get almost no CPU (a 2-step study took over 900 s beside 8 CPU burners, issue 52), while the study
# is the work the user asked for. A local instance runs them at the driver's priority, unless the user set it.
WORKER_NICENESS = "RAY_worker_niceness"
SHIP_CODE = ("auto", "on", "off")
_log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class _EventSink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def put(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def drain(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


class _ActorReporter:
    """Fire-and-forget event calls to the driver's sink; if the sink is gone (the driver died)
    the run carries on and `flush` says so."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.last: Any = None
        self.broken: Exception | None = None

    def emit(self, event: dict[str, Any]) -> None:
        if self.broken is None:
            try:
                self.last = self.sink.put.remote(event)
            except Exception as exc:  # never let progress reporting stop training
                self.broken = exc

    def flush(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the driver's event sink is unreachable: {self.broken}")
        if self.last is not None:
            ray.get(self.last, timeout=120)


def _run_task(task: RunTask, sink: Any) -> RunOutcome:
    return execute_run(task, _ActorReporter(sink), node=ray.get_runtime_context().get_node_id())


_remote_run = ray.remote(_run_task)


@ray.remote(num_cpus=0, max_retries=0)
def _warm() -> int:
    """Imports what a run needs in the worker it runs in: this module (hence `execute_run`'s) by
    being unpickled, the training loop `execute_run` imports when called, and torch._dynamo, which
    torch.optim imports at an optimizer's first step (1-2 s)."""
    import torch._dynamo  # noqa: F401

    from reslab.models import training  # noqa: F401

    return os.getpid()


def stage_code(dest: Path) -> Path:
    """Copy the `reslab` package this process imports into `dest/reslab` (a regular package, see
    the module doc) and return that folder, the `py_modules` entry."""
    root = dest / "reslab"
    root.mkdir(parents=True)
    for name, src in package_dirs().items():
        shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "__init__.py").write_text('"""reslab as a driver shipped it to its Ray workers."""\n')
    return root


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _home_writable() -> bool:
    ray_dir = Path.home() / ".ray"
    try:
        ray_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(ray_dir, os.W_OK)


def _prepare_local_auth(workspace: Path) -> None:
    """Keep Ray's token auth for a local cluster working when ~/.ray is not writable.

    Ray generates `~/.ray/auth_token` on first local start; with a read-only home it would fail,
    so the token goes into the workspace and `RAY_AUTH_TOKEN_PATH` points Ray (and the processes
    it spawns) to it. The mode itself is left to Ray: setting `RAY_AUTH_MODE` here, after ray's
    import has cached its config, would make the GCS expect a token the driver never created.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if (Path.home() / ".ray" / "auth_token").is_file() or _home_writable():
        return
    token = workspace / ".ray" / "auth_token"
    token.parent.mkdir(parents=True, exist_ok=True)
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)


def probe_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail within `timeout` when nothing accepts TCP connections at a cluster address
    (`host:port`, or `ray://host:port` for Ray Client); `auto` is left to Ray."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port_text = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BackendError(f"--address {address!r}: expected HOST:PORT (e.g. 10.0.0.5:6379), ray://HOST:PORT or auto")
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise BackendError(
            f"--address {address}: no Ray cluster answers there ({why} within {timeout:g}s); start one with "
            "`ray start --head`, fix the address, or leave --address and $RAY_ADDRESS unset to start a local instance"
        ) from None


def check_local_devices(runs: list[RunSpec]) -> None:
    """A local instance trains on this machine, so every `train.device` the runs name must exist
    here and every `residual.impl` must run on it (`ConfigError` naming the field and what is
    allowed); a cluster's workers check their own."""
    from reslab.kernels import select_impl
    from reslab.models.training import pick_device

    for device, impl in sorted({(run.config.train.device, run.config.residual.impl) for run in runs}):
        select_impl(impl, pick_device(device).type)


def _children() -> set[int]:
    return set(reaper.children_of().get(os.getpid(), []))


class _DropAuthNotice(logging.Filter):
    """Ray announces at every local start that token auth is on (its secure default, kept), and,
    started from `prestart`'s thread, that it set no SIGTERM handler (the driver keeps its own)."""

    NOTICES = ("Token authentication is enabled", "SIGTERM handler is not set")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in record.getMessage() for notice in self.NOTICES)


def _local_kwargs(workspace: Path, num_cpus: int | None, num_gpus: int | None) -> dict[str, Any]:
    """The local instance's own `ray.init` arguments, this process's environment set up for its workers (see the
    module doc)."""
    out: dict[str, Any] = {}
    _prepare_local_auth(workspace)
    for name in ("ray._private.authentication.authentication_token_setup", "ray._private.worker"):
        logging.getLogger(name).addFilter(_DropAuthNotice())
    # Workers are spawned by this node's raylet, which inherits this environment.
    path = os.environ.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)
    # `_metrics_export_port`: the raylet waits at most 15 s for each port its dashboard agent has not been
    # given, and the agent writes this one's file only once all its modules are imported, which takes longer on
    # a loaded machine (the raylet then exits and the start fails); with metrics collection off nothing binds it
    out.update(
        include_dashboard=False, num_cpus=num_cpus or available_cpus(),
        object_store_memory=_OBJECT_STORE_BYTES, _metrics_export_port=_free_port(),
    )
    if num_gpus is not None:
        out["num_gpus"] = num_gpus
    if not os.access("/tmp", os.W_OK):
        tmp = workspace / ".ray"
        tmp.mkdir(parents=True, exist_ok=True)
        out["_temp_dir"] = str(tmp)
    return out


class RayBackend:
    name = "Ray"  # what the driver waits for while it starts (`loop.DispatchLoop.run`)

    def __init__(self, address: str | None = None, *, workspace: Path, num_cpus: int | None = None,
                 ship_code: str = "auto", num_gpus: int | None = None) -> None:
        if ship_code not in SHIP_CODE:
            raise BackendError(f"--ship-code {ship_code!r}: allowed: {', '.join(SHIP_CODE)}")
        self.requested_address = address or os.environ.get("RAY_ADDRESS") or "local"
        self.workspace = workspace
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.ship_code = ship_code
        self.staged: Path | None = None
        self.owns_session = False
        self.inflight: dict[Any, RunTask] = {}
        self.unplaced: list[Completion] = []  # push tasks whose node is gone: completions for the next poll
        self.sink: Any = None
        self.reaper: subprocess.Popen | None = None
        self.saved_env: tuple[dict[str, str | None], bool] | None = None
        self.prestarted: threading.Thread | None = None
        self.prestart_error: BaseException | None = None
        self.started, self.released, self.abandoned = threading.Event(), threading.Event(), threading.Event()
        self.start_deadline = 0.0

    def prestart(self) -> None:
        """Begin starting the local instance in a background thread; `start()` waits for it (see
        the module doc). Nothing for a cluster address, an existing session or a second call."""
        if self.prestarted is not None or self.requested_address != "local" or ray.is_initialized():
            return
        if self.ship_code == "on":  # what it ships includes the study's external variants: known after its load
            return
        kwargs = self._init_kwargs(local=True)
        self.prestart_error, self.started, self.released = None, threading.Event(), threading.Event()
        self.abandoned = threading.Event()
        thread = threading.Thread(target=self._prestart, args=(kwargs,), name="reslab-ray-start", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": the machine is out of threads or processes
            self._shutdown()
            raise BackendError(f"could not start a local Ray instance: {_first_line(exc)} (this machine is out of "
                               "threads or processes); run the command again once fewer processes run") from exc
        self.prestarted, self.start_deadline = thread, time.monotonic() + START_TIMEOUT_S

    def _prestart(self, kwargs: dict[str, Any]) -> None:
        try:
            self._init(kwargs, local=True)
            if not self.abandoned.is_set():  # shut down unused (bad input, nothing to run): no warm-up
                self.sink = self._new_sink()
                _warm_a_worker(self.sink)
        except BaseException as exc:  # handed to start()
            self.prestart_error = exc
        finally:
            self.started.set()
        # Ray ties the processes it spawns to the thread that spawned them (PR_SET_PDEATHSIG: they
        # are killed when it ends), so this thread lives until `shutdown` has stopped them
        self.released.wait()

    def start(self) -> ClusterInfo:
        if self.prestarted is None and self.requested_address == "local" and not ray.is_initialized():
            self.prestart()  # a local start always runs in its thread, so that its wait has a deadline
        if self.prestarted is not None:
            if not self.started.wait(self._left()):
                raise BackendError(
                    f"could not start a local Ray instance: ray.init did not return within {START_TIMEOUT_S:g}s; "
                    f"{_start_hint(TimeoutError())}")
            if self.prestart_error is not None:
                raise self.prestart_error
            return self._connected("local (started here)")
        if ray.is_initialized():
            # Already connected (a notebook, or a test session sharing one instance): use it and
            # leave it running at the end.
            if self.ship_code == "on":
                raise BackendError("--ship-code on: this process is already connected to Ray, whose job runtime_env "
                                   "cannot change; use --ship-code auto or off, or ship from a new process")
            return self._connected("existing Ray session")
        local = self.requested_address == "local"
        self._init(self._init_kwargs(local), local)
        return self._connected("local (started here)" if local else self.requested_address)

    def _init_kwargs(self, local: bool) -> dict[str, Any]:
        """`ray.init`'s arguments, with this process's environment set up for them (see the module doc)."""
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if self.ship_code == "on" or (self.ship_code == "auto" and not local):
            self.staged = Path(tempfile.mkdtemp(prefix="reslab-code-"))
            # with the modules of the variants from outside the package this driver resolved (issue 53)
            external = [str(path) for path in external_sources().values()]
            kwargs["runtime_env"] = {"py_modules": [str(stage_code(self.staged)), *external]}
        if not local:
            probe_address(self.requested_address)
            if self.requested_address.removeprefix("ray://").rpartition(":")[0].strip("[]") in _LOOPBACK:
                # a head on this machine (`ray start --head` as `_start_hint` advises): without single-node mode
                # Ray rewrites 127.0.0.1 to the machine's address, where a loopback-only head does not listen
                self._local_env(True)
            return kwargs
        kwargs.update(_local_kwargs(self.workspace, self.num_cpus, self.num_gpus))
        self._local_env(True)
        return kwargs

    def _init(self, kwargs: dict[str, Any], local: bool) -> None:
        before = _children()
        try:
            self._init_tries(kwargs, local, before)
        except Exception as exc:  # Ray's start-up raises a bare Exception and TimeoutError too
            if local:
                self._local_env(False)
                raise BackendError(f"could not start a local Ray instance: {_first_line(exc)}; "
                                   f"{_start_hint(exc)}") from exc
            hint = ""
            if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
                # Ray enables token auth for a cluster it starts, but never for a connection by
                # explicit address (by design: a token is not sent to an arbitrary address).
                hint = (" If the cluster uses token authentication (Ray's default for new clusters), set "
                        "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN) to the cluster's token, "
                        "e.g. ~/.ray/auth_token of the machine that started it.")
            raise BackendError(
                f"could not connect to the Ray cluster at {self.requested_address}: {_first_line(exc)}.{hint}"
            ) from exc
        self.owns_session = True
        if local:
            self.reaper = reaper.watch(sorted(_children() - before))  # the processes ray.init started

    def _init_tries(self, kwargs: dict[str, Any], local: bool, before: set[int]) -> None:
        """`ray.init`, for a local instance up to `START_ATTEMPTS` times, each retry said in one line."""
        for attempt in range(1, START_ATTEMPTS + 1):
            node = ray._private.worker._global_node
            try:
                ray.init(address=self.requested_address, **kwargs)
                return
            except Exception as exc:
                if not local or attempt == START_ATTEMPTS or self.abandoned.is_set():
                    raise
                _stop_failed_start(before, ray._private.worker._global_node is not node)
                print(f"reslab: the local Ray instance did not start ({_first_line(exc)}); trying again "
                      f"({attempt + 1} of {START_ATTEMPTS})", file=sys.stderr, flush=True)

    def _local_env(self, on: bool) -> None:
        """`_LOCAL_ENV` for this process and the ones Ray spawns, and Ray's single-node flag for
        this process (read at ray's import); `on=False` restores what was there, so a later
        connection by address is unaffected."""
        if on:
            wanted = {**_LOCAL_ENV, WORKER_NICENESS: os.environ.get(WORKER_NICENESS, "0")}
            self.saved_env = ({k: os.environ.get(k) for k in wanted}, ray_constants.ENABLE_RAY_CLUSTER)
            os.environ.update(wanted)
            ray_constants.ENABLE_RAY_CLUSTER = False
        elif self.saved_env is not None:
            env, flag = self.saved_env
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            ray_constants.ENABLE_RAY_CLUSTER = flag
            self.saved_env = None

    def _connected(self, address: str) -> ClusterInfo:
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if self.sink is None:
            self.sink = self._new_sink()
        return ClusterInfo(address=address, cpus=float(total.get("CPU", 0)), gpus=float(total.get("GPU", 0)),
                           nodes=len(nodes))

    def _new_sink(self) -> Any:
        # Ray's stubs type the decorated class as itself; the ActorClass's `.options` exists only at runtime
        return _EventSink.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            max_restarts=-1, max_task_retries=-1,
        ).remote()

    def _drain(self) -> list[dict[str, Any]]:
        """The sink's events; none when it cannot answer now (restarting, busy), and a new sink
        when the old one is gone for good (see the module doc)."""
        if self.sink is None:
            return []
        try:
            return ray.get(self.sink.drain.remote(), timeout=60)
        except ray.exceptions.ActorDiedError as exc:
            _log.warning("the progress actor died (%s); starting a new one", _describe(exc))
            self.sink = self._new_sink()
        except ray.exceptions.RayError as exc:
            _log.warning("the progress actor did not answer (%s); trying again at the next poll", _describe(exc))
        return []

    def resources(self, requested: Resources) -> None:
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        total_gpus = sum(n.get("GPU", 0) for n in nodes)
        if requested.gpus > 0 and total_gpus == 0:
            raise BackendError(
                f"each run asks for {requested.gpus:g} GPU but the Ray cluster has no GPU "
                f"(nodes: {len(nodes)}, CPUs: {sum(n.get('CPU', 0) for n in nodes):g}); the tasks would stay "
                "pending forever. Use --gpus-per-run 0 to train on CPUs (or N >= 2 for N CPU ranks), or join a "
                "cluster with GPU workers (--address)."
            )
        fits = [n for n in nodes if n.get("CPU", 0) >= requested.cpus and n.get("GPU", 0) >= requested.gpus]
        if not fits:
            biggest = max(((n.get("CPU", 0), n.get("GPU", 0)) for n in nodes), default=(0, 0))
            raise BackendError(
                f"no Ray node can hold one run ({requested.cpus:g} CPU, {requested.gpus:g} GPU); the largest "
                f"node has {biggest[0]:g} CPU and {biggest[1]:g} GPU. Lower --cpus-per-run / --gpus-per-run."
            )

    def submit(self, task: RunTask, resources: Resources) -> None:
        # a run on N ranks: its ranks hold the GPUs; a push task only reads its node's copy (see the module doc)
        light = task.ranks.world > 1 or task.push_from is not None
        cpus, gpus = (COORDINATOR_CPUS, 0.0) if light else (resources.cpus, resources.gpus)
        if task.work is not None:  # the task's own work (e.g. after training) says what it asks for
            cpus, gpus = task.work.asks(task, resources)
        placed: dict[str, Any] = {}
        if task.push_from is not None and (task.push_from.id or task.push_from.host):  # else: unknown, anywhere
            node = _node_of(task.push_from)
            if node is None:
                self.unplaced.append(Completion(task, error=f"the node that holds its copy ({task.push_from.host}, "
                                                            f"Ray node {task.push_from.id}) is gone"))
                return
            placed["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        ref = _remote_run.options(
            num_cpus=cpus, num_gpus=gpus, max_retries=0, retry_exceptions=False,
            name=f"reslab:{task.run.study}:{task.run.label}" + (":push" if task.push_from is not None else
                                                                f":{task.work.name}" if task.work is not None else ""),
            **placed,
        ).remote(task, self.sink)
        self.inflight[ref] = task

    def poll(self, timeout: float) -> tuple[list[dict[str, Any]], list[Completion]]:
        done, self.unplaced = self.unplaced, []
        if self.inflight:
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
            for ref in ready:
                task = self.inflight.pop(ref)
                try:
                    done.append(Completion(task, outcome=ray.get(ref)))
                except ray.exceptions.RayError as exc:
                    done.append(Completion(task, error=_failure(exc, task)))
        else:
            time.sleep(timeout)
        return self._drain(), done

    def cancel(self) -> list[RunTask]:
        self.unplaced.clear()
        tasks = list(self.inflight.values())
        for ref in list(self.inflight):
            with contextlib.suppress(ray.exceptions.RayError):
                ray.cancel(ref, force=True)
        if self.inflight:
            # let the killed workers go before the driver rewrites their run directories
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=15)
        self.inflight.clear()
        return tasks

    def _left(self) -> float:
        return max(0.0, self.start_deadline - time.monotonic())

    def shutdown(self) -> None:
        if self.prestarted is not None:
            self.abandoned.set()  # a start still under way is let finish (without its warm-up), then stopped
            if not self.started.wait(self._left()):
                # ray.init is stuck: nothing it started can be stopped from here; those processes end with
                # this one (Ray sets their parent-death signal), so the driver ends instead of waiting for good
                _log.debug("the local Ray start did not finish within %gs; left to end with the process",
                           START_TIMEOUT_S)
                self.released.set()
                self.prestarted = None
                return
        try:
            self._shutdown()
        finally:
            if self.prestarted is not None:
                self.released.set()
                self.prestarted = None

    def _shutdown(self) -> None:
        if self.sink is not None:
            with contextlib.suppress(ray.exceptions.RayError):  # the cluster may have gone first
                ray.kill(self.sink)
            self.sink = None
        if self.owns_session:
            if self.reaper is not None:  # a local instance started here
                _kill_local_monitor()
            ray.shutdown()
            self.owns_session = False
        if self.reaper is not None:
            self.reaper.terminate()
            self.reaper.wait()
            self.reaper = None
        if self.staged is not None:
            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None
        self._local_env(False)


def _node_of(where: Node) -> str | None:
    """The live Ray node a push task goes to: the one the attempt ran on, else one on its host (a node
    restarted there, with the same disk); None when neither is alive."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    for node in alive:
        if where.id is not None and node.get("NodeID") == where.id:
            return str(node["NodeID"])
    for node in alive:
        if where.host is not None and node.get("NodeManagerHostname") == where.host:
            return str(node["NodeID"])
    return None


def _kill_local_monitor() -> None:
    """SIGKILL the autoscaler monitor of the local instance (a child of this process). Ray stops it
    after the GCS, and its SIGTERM handler reports its end to that GCS, so `ray.shutdown` waits a
    second for it and then SIGKILLs it anyway; for one local node it holds nothing."""
    for pid in _children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"autoscaler/_private/monitor.py" in cmdline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_failed_start(before: set[int], left_a_node: bool) -> None:
    """What a failed `ray.init` left: its session state (when it got as far as recording its node; a session of
    someone else's in this process is left alone), and the processes it started (children of this process that
    were not there before it), SIGKILLed and reaped."""
    if left_a_node:
        with contextlib.suppress(Exception):
            ray.shutdown()
    started = sorted(_children() - before)
    for pid in reaper.descendants(started):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in started:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _warm_a_worker(sink: Any) -> None:
    """Once the progress actor holds its worker, run `_warm` in an idle one (see the module doc);
    a warm-up that fails only leaves the first run to import the code itself."""
    try:
        ray.get(sink.drain.remote(), timeout=60)
        ray.get(_warm.remote(), timeout=60)
    except ray.exceptions.RayError as exc:
        _log.debug("warming a worker failed: %s", exc)


def _first_line(exc: BaseException) -> str:
    """An exception's first line, without its final stop: Ray's start-up errors append pages of its processes'
    logs."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(exc).__name__


def _start_hint(exc: BaseException) -> str:
    """What to do when a local instance did not start: under load Ray's processes miss its start-up deadlines
    ("timed out during startup"), which a later try or a Ray started once by hand avoids."""
    text = str(exc).lower()
    if isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
        return ("Ray's processes did not come up in time, which happens when the machine is overloaded: run the "
                "command again once the load is lower, or start Ray once with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
                "RAY_worker_niceness=0 ray start --head --port 6379 --include-dashboard false` (it listens on "
                "127.0.0.1 only; Ray gives its raylet a fixed 30 s to register, so on a busy machine run it again if "
                "it says \"timed out during startup\") and run the command with RAY_AUTH_MODE=token in its "
                "environment and --address 127.0.0.1:6379")
    return "Ray's own logs (its session folder under /tmp/ray, or the workspace's .ray) say why"


def _failure(exc: BaseException, task: RunTask) -> str:
    """A task's failure in one line, as the status file, MLflow and the driver's lines record it; a longer text
    (Ray's ~45-line out-of-memory report) is saved whole in the run's folder and the line points to it."""
    text = _describe(exc)
    if "\n" not in text.strip() and len(text) <= 300:
        return text
    return failure_text.one_line(text, failure_text.save_report(text, Path(task.run_dir), task.attempt))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.TaskCancelledError):
        return "cancelled"
    if isinstance(exc, ray.exceptions.WorkerCrashedError):
        return "the worker process died (killed, or out of memory)"
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return f"out of memory: {exc}"
    if isinstance(exc, ray.exceptions.NodeDiedError):
        return f"the node running it died: {exc}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
