"""Helpers shared by the orchestrator tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

# Two arms x two seeds of a 2-layer, d=32 decoder on 32-token windows: ~1 s per run on one core.
TINY_STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: {steps}, eval_every: 3, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 3}}
  cost: {{decode_batch: 2, new_tokens: 2, repeats: 1}}  # every cost metric, measured in ~0.1 s
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
comparisons:
  - {{name: main, control: control, treatments: [attnres], exploratory: true}}
"""


# One arm, one seed, no cost measurement: a single run of the same decoder.
ONE_RUN = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: 6, eval_every: 3, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 3}}
  cost: {{measure: false}}
arms:
  control: prenorm
seeds: 1
"""


def write_study(directory: Path, name: str = "tiny", steps: int = 6, text: str | None = None) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(textwrap.dedent(text if text is not None else TINY_STUDY.format(name=name, steps=steps)))
    return path


def submit_quietly(study, runs, ws, lines: list[str], evaluate=None):
    """`submit` (what `reslab run` runs) on the in-process backend with the workspace's own tracking, its
    status lines into `lines`."""
    from reslab.orchestrator.dispatch.local_backend import LocalBackend
    from reslab.orchestrator.driving.loop import ExecutionOptions
    from reslab.orchestrator.driving.submit import submit
    from reslab.orchestrator.tracking.guarded import GuardedTracker

    tracker = GuardedTracker(ws.default_tracking_uri(), ws)
    return submit(study, runs, ws, LocalBackend(), tracker, ExecutionOptions(evaluate=evaluate), stream=io.StringIO(),
                  say=lines.append)


def train_stored_study(root: Path, name: str, text: str):
    """The study `text` trained by one submission in `root/ws`, with run storage (a local folder `root/storage`):
    (study, runs, workspace, its status lines, the submission's result)."""
    from reslab.experiments import expand, load_study
    from reslab.orchestrator.durability.workspace import Workspace

    path = root / f"{name}.yaml"
    path.write_text(text)
    study = load_study(path)
    runs = expand(study)
    ws = Workspace.at(root / "ws", storage=str(root / "storage"))
    lines: list[str] = []
    return study, runs, ws, lines, submit_quietly(study, runs, ws, lines)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """A TCP forwarder on 127.0.0.1 in front of a server, which a test stops (the listener and every open
    connection closed: clients see the server vanish mid-request) and starts again on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        for s in ([listener] if listener else []) + conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:  # each socket is the source of one pump, which closes it
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)
            src.close()


class KilledDriver(BaseException):
    """What a SIGKILLed driver leaves behind cannot be produced in-process by a signal (pytest would die with
    it); raising past every handler after a given number of completed runs leaves the storage and the run
    directories exactly as a killed driver does: the run in flight claimed and checkpointed, the rest queued."""


def forget_work_after_training(study, runs, ws, folder: str) -> None:
    """Remove every run's `folder` of work after training (evaluations, interventions) from the workspace and
    from run storage: the study as if none of that work had run."""
    import shutil

    for run in runs:
        shutil.rmtree(ws.run_dir(study.name, run.run_id).path / folder)
        shutil.rmtree(ws.run_storage().run(study.name, run.run_id).path + f"/{folder}")


def kill_at_second_call(monkeypatch, owner: Any, name: str) -> list[str]:
    """Patch `owner.name`, a unit of work after training called as (cfg, run_dir, ...), so that its second call
    raises `KilledDriver`, once: the driver dies while its second unit runs (in process, it is the driver).
    Returns the run directory names it is called with, in order."""
    calls: list[str] = []
    kill = [True]
    real = getattr(owner, name)

    def counted(cfg, run_dir, *args, **kwargs):
        calls.append(run_dir.name)
        if len(calls) == 2 and kill and kill.pop():
            raise KilledDriver
        return real(cfg, run_dir, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def dying_backend(survive: int, error: type[BaseException] = KilledDriver):
    """An in-process backend (`LocalBackend`) whose driver is killed (`KilledDriver`) at its poll after
    `survive` completed runs; `error=KeyboardInterrupt` is a Ctrl-C landing where the driver waits."""
    from reslab.orchestrator.dispatch.local_backend import LocalBackend

    class DyingBackend(LocalBackend):
        def __init__(self) -> None:
            super().__init__()
            self.survive = survive

        def poll(self, timeout):
            if self.survive == 0:
                raise error
            self.survive -= 1
            return super().poll(timeout)

    return DyingBackend()


# ----------------------------------------------------------------------------- run storage compared whole

# what differs between two runs of one RunSpec and is not their result: clocks, throughput, memory, the submission
_VOLATILE = re.compile(r"time|seconds|per_s|_tps|peak_mem|submission|heartbeat")  # clocks, throughput (`decode_tps`)
# a train.log line of the training loop, its throughput and timings taken out
_LOG_LINE = re.compile(r"\| train |^done: ")
_LOG_NOISE = re.compile(r"[\d.]+k? tok/s|[\d.]+s training|peak mem \d+ MiB")


def stored_tree(root: Path) -> dict[str, bytes]:
    """Every file under a run storage folder (a local path), by its path relative to `root`."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steady(value: Any) -> Any:
    """`value` without what differs between two runs of the same RunSpec (`_VOLATILE` keys); JSON inside
    strings (a checkpoint's history) read as JSON."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if not _VOLATILE.search(str(k))}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    if isinstance(value, str) and value[:1] in "[{":
        with contextlib.suppress(ValueError):
            return _steady(json.loads(value))
    return value


def _same_checkpoint(a: bytes, b: bytes, name: str) -> None:
    import torch

    def flat(data: bytes) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}", v)
            else:
                out[prefix] = value

        walk("", torch.load(io.BytesIO(data), weights_only=True))
        return out

    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys(), (name, fa.keys() ^ fb.keys())
    for key, va in fa.items():
        vb = fb[key]
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), (name, key)  # bit-identical weights, optimizer state and RNG
        else:
            sa, sb = _steady(va), _steady(vb)
            assert sa == sb, (name, key, _first_difference(sa, sb))


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two JSON-like values first differ, for an assertion message."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} != {b!r}"


def _training_lines(log: bytes) -> list[str]:
    lines = [line.split(" ", 2)[-1] for line in log.decode().splitlines()]  # the timestamp dropped
    return [_LOG_NOISE.sub("", line) for line in lines if _LOG_LINE.search(line)]


def assert_same_storage(got: dict[str, bytes], expected: dict[str, bytes]) -> None:
    """Two stored trees (`stored_tree`) hold the same files, each with the same content but for clocks and
    throughput: the checkpoints' tensors bit for bit, the records field by field, train.log's training lines."""
    assert sorted(got) == sorted(expected), (sorted(set(got) ^ set(expected)))
    for name, data in expected.items():
        base = Path(name).name
        if base == "checkpoint.pt" or base.endswith(".distcp"):
            _same_checkpoint(got[name], data, name)
        elif base == "train.log":
            assert _training_lines(got[name]) == _training_lines(data), name
        elif base.endswith(".jsonl"):
            rows = [[_steady(json.loads(line)) for line in d.decode().splitlines()] for d in (got[name], data)]
            assert rows[0] == rows[1], name
        elif base.endswith(".json") or base == "status":
            assert _steady(json.loads(got[name])) == _steady(json.loads(data)), name
        else:
            assert got[name] == data, name


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of the live processes `pids` and every live process below them (each counted once), with what
    each has reaped of its own children (a Ray worker that ended counts in its raylet's): a measure of work that a
    busy machine does not stretch, as it stretches wall time (issue 52, item 22)."""
    from reslab.orchestrator.durability import reaper

    ticks = 0
    for p in set(reaper.descendants(pids)):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{p}/stat") as f:
            text = f.read()
            ticks += sum(int(v) for v in text[text.rindex(")") + 2:].split()[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    return cpu_seconds([pid])


def wait_within(proc: subprocess.Popen, what: str, cpu_s: float, wall_s: float = 3600.0, done=None, cpu=None) -> None:
    """Wait until `done()` (default: `proc` ended) while `proc`'s process tree (or `cpu()`, where the work happens
    in processes of others) has used under `cpu_s` CPU seconds; `wall_s` is a safety net for a hang, not a budget.
    Past either, `proc`'s process group is SIGKILLed and reaped and the test fails, so it does not outlive the test."""
    deadline, used = time.monotonic() + wall_s, 0.0
    while not (done() if done is not None else proc.poll() is not None):
        used = max(used, cpu() if cpu is not None else tree_cpu_seconds(proc.pid))
        why = ("ended before it was done" if done is not None and proc.poll() is not None
               else f"used {used:.0f} CPU s (limit {cpu_s:g})" if used > cpu_s
               else f"not done after its {wall_s:g} s safety net" if time.monotonic() > deadline else None)
        if why is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{what} {why}")
        time.sleep(0.5)
