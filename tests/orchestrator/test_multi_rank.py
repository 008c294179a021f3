"""A run on N ranks through Ray Train (issue 25, `orchestrator.attempt.distributed_run`), on a CPU machine.

One local Ray instance for the module declares 4 GPUs (the ranks hold "GPUs" Ray counts, and train on
gloo because no rank has CUDA: `train.device: auto`), so `--gpus-per-run 2` places two 2-rank runs at once.
A study whose runs set `train.device: cpu` trains on CPU ranks instead, which ask Ray for no GPU (the
pipeline-stage run). A study of
3 arms x 1 seed (PreNorm, Full and Block AttnRes) runs once at 1 rank in this process (`LocalBackend`) and once at
2 ranks; the pairs must agree: the same global batches and maths, up to the order of float sums. A rank killed mid-run
(`rank_kill`, this folder's `$RESLAB_STEP_HOOK` factory) makes Ray Train restart the ranks from the last committed
checkpoint, and the run still finishes once with each step once. Run storage's DCP layout is checked
on a local path, without Ray.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import ray
from orch_helpers import write_study
from rank_kill import HOOK, PLAN_ENV

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.hooks import STEP_HOOK_ENV
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.dispatch.ray_backend import RayBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.storage import DCP_COMMITTED, DCP_DIR, StoredRun, has_checkpoint, local_progress
from reslab.orchestrator.durability.workspace import RunDir, Workspace
from reslab.orchestrator.tasks import SUCCESS
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import import_mlflow

# a global batch of 4 samples: 2 micro-batches of 2 on one rank, one of 2 on each of 2 ranks
STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 2, grad_accum: 2, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: 8, eval_every: 4, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 2, device: auto,
          diagnostics: false}}
  cost: {{decode_batch: 2, new_tokens: 2, repeats: 1}}
arms:
{arms}
seeds: {seeds}
resources: {{gpus_per_run: 2}}
"""
ARMS = "  control: prenorm\n  attnres: {residual: attnres}"
# the reference study's: three runs, so that "at most two at once" can fail, one seed each (a second seed of an
# arm trains the same maths on other batches; 4 runs cost one more 2-rank run, ~20 s on two cores)
REFERENCE_ARMS = ARMS + "\n  block: {residual: {name: block_attnres, options: {block_size: 2}}}"
LOSSES = ("val_loss", "val_loss_tail", "train_loss")


def _study(directory: Path, name: str, arms: str = ARMS, seeds: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_study(directory, name, text=STUDY.format(name=name, arms=arms, seeds=seeds))


def _workspace(path: Path, mlflow_db_template: Path) -> Workspace:
    ws = Workspace(path)
    ws.root.mkdir(parents=True)
    shutil.copy(mlflow_db_template, ws.mlflow_db)
    return ws


def _submit(spec: Path, ws: Workspace, backend, tracked: bool = True, **options):
    study = load_study(spec)
    runs = expand(study)
    said: list[str] = []
    tracker = GuardedTracker(ws.default_tracking_uri(), ws) if tracked else None
    # as `reslab run` does: the study's `resources:` where no flag says otherwise
    options = ExecutionOptions(**options).with_resources(study.resources)
    result = submit(study, runs, ws, backend, tracker, options, stream=io.StringIO(),
                    say=lambda *a: said.append(" ".join(map(str, a))))
    return runs, result, said


@pytest.fixture(scope="module")
def gpu_ray(tmp_path_factory, request):
    """The module's Ray instance: 4 logical CPUs and 4 declared GPUs, Ray Train's health check every 0.2 s
    (its 2 s default adds seconds to every run), no preemption watcher (a spot-instance helper), and the
    fault hook (`rank_kill`, on the workers' path) with its variable naming a file `reference` writes.
    Ray's processes take their environment from the one that starts them, hence set first. A session this
    process already holds (conftest's `ray_session`, without GPUs) is stopped first and a like one (2 CPUs)
    started again after, for the modules that share it."""
    kill_file = tmp_path_factory.mktemp("fault") / "kill.json"
    had_session = ray.is_initialized()
    if had_session:
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
        mp.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # one process less per start of the ranks
        mp.setenv(STEP_HOOK_ENV, HOOK)
        mp.setenv(PLAN_ENV, str(kill_file))
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                            os.environ.get("PYTHONPATH", "")) if p))
        backend = RayBackend("local", workspace=tmp_path_factory.mktemp("ray-ws"), num_cpus=4, num_gpus=4)
        backend.start()
        try:
            yield kill_file
        finally:
            backend.shutdown()
    if had_session:
        again = RayBackend("local", workspace=tmp_path_factory.mktemp("ray-ws-again"), num_cpus=2)
        again.start()

        def stop() -> None:
            # conftest's session teardown stops whichever instance is up, usually first; a Ray call after
            # that would start yet another instance (Ray initialises itself on demand)
            if ray.is_initialized():
                again.shutdown()

        request.config.add_cleanup(stop)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mlflow_db_template, gpu_ray):
    """The study at 1 rank (in this process, untracked; `--gpus-per-run 1` over its `resources:`) and at 2
    ranks (its `resources:`; Ray Train, tracked in MLflow), with rank 1 of the first run killed after step
    3 (once): {"one": ..., "two": ...}, each (workspace, runs, result, said lines), "killed": that run and
    "fired": whether the kill happened. One study serves both tests: on two cores, each 2-rank run costs
    ~10 s of process start-up (a Ray Train controller and two ranks importing torch and Ray Train)."""
    root = tmp_path_factory.mktemp("pairs")
    spec = _study(root / "spec", "ranks", arms=REFERENCE_ARMS, seeds=1)
    one = _workspace(root / "one", mlflow_db_template)
    two = _workspace(root / "two", mlflow_db_template)
    reference = {"one": (one, *_submit(spec, one, LocalBackend(), tracked=False, gpus_per_run=1))}
    killed = reference["one"][1][0]
    gpu_ray.write_text(json.dumps({"run_id": killed.run_id, "rank": 1, "step": 3}))
    reference["two"] = (two, *_submit(spec, two, RayBackend(workspace=two.root)))  # 2 ranks: the study's resources
    return {**reference, "killed": killed, "fired": not gpu_ray.exists()}


def _curve(rd: RunDir) -> list[tuple[str, int, float]]:
    return [(r["kind"], r["step"], r["train_loss" if r["kind"] == "train" else "val_loss"]) for r in rd.metrics()]


def _same_curve(a: list[tuple[str, int, float]], b: list[tuple[str, int, float]]) -> None:
    assert [(k, s) for k, s, _ in a] == [(k, s) for k, s, _ in b]
    for (kind, step, x), (_, _, y) in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=1e-4), f"{kind} loss at step {step}: {x} vs {y}"


def _children(ws: Workspace, study: str) -> list:
    client = import_mlflow()(tracking_uri=ws.default_tracking_uri())
    exp = client.get_experiment_by_name(study)
    return [(kid, client) for kid in client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")]


@pytest.mark.slow
def test_a_study_on_two_ranks_per_run_pairs_with_one_rank(reference):
    ws1, runs, one, _ = reference["one"]
    ws2, _, two, said = reference["two"]
    assert one.ok and one.count("succeeded") == 3
    assert two.ok and two.count("succeeded") == 3, two.errors
    assert any("+ 2 GPU on 2 ranks (ddp), up to 2 at once" in line for line in said), said
    spans = []
    for run in runs:
        rd1, rd2 = ws1.run_dir("ranks", run.run_id), ws2.run_dir("ranks", run.run_id)
        s1, s2 = rd1.summary(), rd2.summary()
        for key in LOSSES:
            assert math.isclose(s1["summary"][key], s2["summary"][key], rel_tol=1e-4), (run.label, key)
        _same_curve(_curve(rd1), _curve(rd2))
        assert (s2["info"]["world_size"], s2["info"]["sharding"]) == (2, "ddp") and "world_size" not in s1["info"]
        assert rd2.state() == SUCCESS and (rd2.path / DCP_DIR).is_dir() and not (rd2.path / ".ray_train").exists()
        times = [r["time"] for r in rd2.metrics()]
        spans.append((min(times), max(times)))
    # never more than two runs training at once: no instant inside three runs' spans
    assert max(sum(a <= t <= b for a, b in spans) for t, _ in spans) <= 2
    kids = _children(ws2, "ranks")
    assert len(kids) == 3 and {k.info.status for k, _ in kids} == {"FINISHED"}
    for kid, client in kids:
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "train_loss")] == list(range(1, 9))


@pytest.mark.slow
def test_a_killed_rank_restarts_the_ranks_and_the_run_finishes_once(reference):
    run, ws = reference["killed"], reference["two"][0]
    assert reference["fired"], "rank 1 was never killed"
    rd = ws.run_dir("ranks", run.run_id)
    assert rd.state() == SUCCESS and rd.status()["attempts"] == 1  # the ranks restarted inside one attempt
    log = rd.log_file.read_text()
    assert log.count("rank 0 of 2 (ddp)") == 2 and f"resumed from {rd.path / DCP_DIR / 'step-000002'}" in log
    steps = [(r["kind"], r["step"]) for r in rd.metrics()]
    assert steps == [*[("train", s) for s in range(1, 5)], ("eval", 4), *[("train", s) for s in range(5, 9)],
                     ("eval", 8)], "a step is missing or repeated after the restart"
    _same_curve(_curve(rd), _curve(reference["one"][0].run_dir("ranks", run.run_id)))  # as if never killed
    (kid,) = [(k, c) for k, c in _children(ws, "ranks") if k.data.tags["run_id"] == run.run_id]
    assert kid[0].info.status == "FINISHED"
    assert [m.step for m in kid[1].get_metric_history(kid[0].info.run_id, "train_loss")] == list(range(1, 9))


def _dcp_step(rd: Path, step: int, committed: bool = True) -> Path:
    folder = rd / DCP_DIR / f"step-{step:06d}"
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "progress.json"):
        (folder / name).write_text(f"{name} of step {step}")
    if committed:
        (folder / DCP_COMMITTED).write_text(f"{step}\n")
    return folder


def test_storage_keeps_the_newest_committed_dcp_step(tmp_path):
    local = RunDir(tmp_path / "scratch" / "r1")
    local.path.mkdir(parents=True)
    local.set_status("RUNNING", attempts=1, checkpoint_step=2)
    _dcp_step(local.path, 2)
    _dcp_step(local.path, 4, committed=False)  # its writer died before committing: not a checkpoint
    assert has_checkpoint(local.path) and local_progress(local) == (0, 1, 2, 0)
    stored = StoredRun.at(str(tmp_path / "store" / "r1"))
    pushed = stored.push(local)
    dcp = [n for n in pushed if n.startswith(DCP_DIR)]
    assert dcp[-1] == f"{DCP_DIR}/step-000002/{DCP_COMMITTED}" and len(dcp) == 5 and pushed[-1] == "status"
    assert stored.dcp_step() == "step-000002" and stored.progress() == (0, 1, 2, 0)

    shutil.rmtree(local.path / DCP_DIR)
    _dcp_step(local.path, 6)
    local.update_status(checkpoint_step=6)
    stored.push(local)
    assert sorted(os.listdir(tmp_path / "store" / "r1" / DCP_DIR)) == ["step-000006"]  # the older step removed

    fresh = RunDir(tmp_path / "elsewhere" / "r1")
    _dcp_step(fresh.path, 8)  # a local checkpoint storage is ahead of is replaced whole
    pulled = stored.pull(fresh, checkpoint=True)
    assert pulled[-1] == f"{DCP_DIR}/step-000006/{DCP_COMMITTED}"
    assert os.listdir(fresh.path / DCP_DIR) == ["step-000006"] and fresh.status()["checkpoint_step"] == 6
    assert (fresh.path / DCP_DIR / "step-000006" / "__1_0.distcp").read_text() == "__1_0.distcp of step 6"

    (tmp_path / "store" / "r1" / DCP_DIR / "step-000006" / DCP_COMMITTED).unlink()  # a push cut short
    assert stored.dcp_step() is None and stored.progress()[2] == 0
    assert not has_checkpoint(tmp_path / "nothing-here")


def test_options_place_each_run_on_its_ranks():
    from reslab.common.errors import ConfigError
    from reslab.experiments.spec import PipelineResources, StudyResources
    from reslab.orchestrator.dispatch import BackendError
    from reslab.orchestrator.tasks import Ranks, Resources

    assert ExecutionOptions().ranks == Ranks() and ExecutionOptions(gpus_per_run=1).ranks.world == 1
    study = StudyResources(gpus_per_run=4, sharding="fsdp")
    assert ExecutionOptions(cpus_per_run=2).with_resources(study).ranks == Ranks(world=4, sharding="fsdp", cpus=0.5)
    flags = ExecutionOptions(gpus_per_run=2, sharding="ddp", rank_restarts=0).with_resources(study)  # the flags win
    assert flags.ranks == Ranks(world=2, sharding="ddp", cpus=0.5, restarts=0)
    staged = StudyResources(gpus_per_run=2, pipeline=PipelineResources(2, "1f1b", 4))  # the ranks are stages
    assert ExecutionOptions().with_resources(staged).ranks == Ranks(world=2, cpus=0.5, stages=2, schedule="1f1b",
                                                                    microbatches=4)
    cached = StudyResources(gpus_per_run=2, pipeline=PipelineResources(2, "gpipe", 2, 2, True))  # issue 38 item 2
    assert ExecutionOptions().with_resources(cached).ranks == Ranks(world=2, cpus=0.5, stages=2, microbatches=2,
                                                                    virtual_stages=2, cache=True)
    for bad in ({"gpus_per_run": 2.5}, {"gpus_per_run": -2.0}, {"sharding": "zero3"}, {"rank_restarts": -1}):
        with pytest.raises(ConfigError, match=f"ExecutionOptions.{next(iter(bad))}"):
            ExecutionOptions(**bad)
    for ranks in (Resources(cpus=1, gpus=2), Resources(cpus=1, ranks=2)):  # on GPU ranks, on CPU ranks
        with pytest.raises(BackendError, match="in-process backend trains a run in one process"):
            LocalBackend().resources(ranks)


def test_runs_on_cpu_ranks_ask_ray_for_cpus_and_say_so(tmp_path):
    """Issue 38: a run on N ranks trains on CPU ranks when the cluster has no GPU, or when every run sets
    `train.device: cpu`: each run then asks Ray for CPUs only (the driver counts its ranks' CPUs and its
    coordinating task's), the placement line says so, and each rank asks Ray Train for CPUs only. A cluster
    with GPUs and runs on `train.device: auto` keep one GPU per rank."""
    from reslab.experiments.spec import PipelineResources, StudyResources
    from reslab.orchestrator.attempt.distributed_run import _scaling
    from reslab.orchestrator.driving.loop import concurrency, cpu_ranks, placement, run_resources
    from reslab.orchestrator.tasks import ClusterInfo

    auto_runs = expand(load_study(_study(tmp_path / "auto", "auto")))  # train.device: auto
    cpu_text = STUDY.format(name="cpu", arms=ARMS, seeds=1).replace("device: auto", "device: cpu")
    cpu_runs = expand(load_study(write_study(tmp_path, "cpu", text=cpu_text)))
    assert {r.config.train.device for r in cpu_runs} == {"cpu"} and {r.config.train.device for r in auto_runs} == {
        "auto"}
    staged = StudyResources(gpus_per_run=4, pipeline=PipelineResources(2, "1f1b", 2))
    options = ExecutionOptions(cpus_per_run=2).with_resources(staged)
    no_gpu, gpus = ClusterInfo("here", cpus=5, gpus=0, nodes=1), ClusterInfo("there", cpus=5, gpus=8, nodes=1)
    for cluster, runs, cpu in ((no_gpu, auto_runs, True), (gpus, cpu_runs, True), (gpus, auto_runs, False)):
        assert cpu_ranks(cluster, options, runs) is cpu, (cluster, runs[0].config.train.device)
    assert not cpu_ranks(no_gpu, ExecutionOptions(), auto_runs)  # one process: no ranks to place
    on_cpus = run_resources(no_gpu, options, True)
    assert (on_cpus.cpus, on_cpus.gpus, on_cpus.ranks) == (2.0, 0.0, 4)
    assert concurrency(no_gpu, on_cpus, options) == 2  # 5 CPUs // (2 + the coordinator's 0.1)
    assert placement(no_gpu, on_cpus, options.ranks, True, 2) == (
        "  cluster here: 1 node(s), 5 CPU, 0 GPU; each run 2 CPU on 4 CPU ranks (gloo, pipeline 2 stages x 2 "
        "replicas), up to 2 at once")
    on_gpus = run_resources(gpus, options, False)
    assert (on_gpus.gpus, concurrency(gpus, on_gpus, options)) == (4.0, 2)
    assert placement(gpus, on_gpus, options.ranks, False, 2).endswith(
        "each run 2 CPU + 4 GPU on 4 ranks (pipeline 2 stages x 2 replicas), up to 2 at once")
    cpu_scaling, gpu_scaling = _scaling(options.ranks, False, True), _scaling(options.ranks, False)
    assert (cpu_scaling.use_gpu, cpu_scaling.resources_per_worker) == (False, {"CPU": 0.5})
    assert (gpu_scaling.use_gpu, gpu_scaling.resources_per_worker) == (True, {"GPU": 1, "CPU": 0.5})


@pytest.mark.slow
def test_a_run_in_two_pipeline_stages_trains_the_one_process_curve_and_records_its_bytes(
        tmp_path, mlflow_db_template, gpu_ray):
    """`resources.pipeline_stages: 2` (issue 38) through the real run path: Ray Train starts 2 CPU ranks (the run
    sets `train.device: cpu`: each rank asks Ray for CPUs only), one stage each (gloo), rank 1 is killed after
    step 3 and the ranks restart from the committed step 2; the run's curve is the one-process run's
    (`--gpus-per-run 1` over its resources), and the bytes it counted equal its variant's declaration, on MLflow
    too."""
    text = STUDY.format(name="stages", arms="  control: attnres", seeds=1).replace(
        "resources: {gpus_per_run: 2}", "resources: {gpus_per_run: 2, pipeline_stages: 2, microbatches: 2}").replace(
        "device: auto", "device: cpu")
    (tmp_path / "spec").mkdir()
    spec = write_study(tmp_path / "spec", "stages", text=text)
    one, two = _workspace(tmp_path / "one", mlflow_db_template), _workspace(tmp_path / "two", mlflow_db_template)
    runs, result1, _ = _submit(spec, one, LocalBackend(), tracked=False, gpus_per_run=1)
    gpu_ray.write_text(json.dumps({"run_id": runs[0].run_id, "rank": 1, "step": 3}))
    _, result2, said = _submit(spec, two, RayBackend(workspace=two.root))
    assert result1.ok and result2.ok, result2.errors
    assert any("each run 1 CPU on 2 CPU ranks (gloo, pipeline 2 stages), up to 3 at once" in line
               for line in said), said  # 4 CPUs // (1 + the coordinator's 0.1)
    assert not gpu_ray.exists(), "rank 1 was never killed"
    rd1, rd2 = one.run_dir("stages", runs[0].run_id), two.run_dir("stages", runs[0].run_id)
    _same_curve(_curve(rd1), _curve(rd2))
    log = rd2.log_file.read_text()
    assert f"resumed from {rd2.path / DCP_DIR / 'step-000002'}" in log
    s2 = rd2.summary()
    assert s2["info"]["pipeline_stages"] == 2 and "pipe_bytes_per_step" not in rd1.summary()["summary"]
    summary = s2["summary"]
    # Full AttnRes before site 2 sends 3 [B, T, d] float32 sources forward and their gradients back: B = 4, T = 32
    assert summary["pipe_bytes_per_step"] == summary["pipe_bytes_declared"] == 2 * 3 * 4 * 32 * 32 * 4
    ((kid, client),) = _children(two, "stages")
    for key in ("pipe_bytes_per_step", "pipe_bytes_declared"):  # the summary's tags (tracking.writer.finish)
        assert float(kid.data.tags[f"summary/{key}"]) == summary[key]
    fwd = client.get_metric_history(kid.info.run_id, "pipe/bytes_fwd/b00")
    assert [m.step for m in fwd] == list(range(1, 9)) and {m.value for m in fwd} == {3 * 4 * 32 * 32 * 4}
