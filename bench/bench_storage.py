"""What run storage costs a training run, printed as a markdown table.

    python bench/bench_storage.py [--steps 100 --checkpoint-every 10 --d-model 256 --layers 4]
                                  [--bandwidth-mbs 0 50] [--repeats 3]

One run of a one-arm study, trained through `orchestrator.attempt.worker.execute_run` (the code a Ray task
runs) three ways: no storage, a local-path storage, and an S3 bucket on a moto server on 127.0.0.1
(moto[server], the test extra). `--bandwidth-mbs` adds rows with every stored object's upload held
to that many MB/s (a sleep of size / bandwidth in the upload, emulating a store across a network;
0 means unthrottled), so the rows show how much of the upload time lands on the run's wall time.
Wall time is the whole `execute_run`: claim, training, evaluation, checkpoints and the final push.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._args import at_least  # noqa: E402
from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.worker import execute_run
from reslab.orchestrator.durability import storage as storage_module
from reslab.orchestrator.durability.storage import RunStorage
from reslab.orchestrator.tasks import RunTask

STUDY = """
study: bench-storage
base:
  model: {{preset: tiny, d_model: {d_model}, n_layers: {layers}, n_heads: 4, n_kv_heads: 4, seq_len: 64}}
  optim: {{batch_size: 4, warmup_steps: 2}}
  train: {{steps: {steps}, eval_every: {steps}, log_every: 10, eval_windows: 4, checkpoint_every: {every}}}
arms:
  control: prenorm
seeds: 1
"""


class Silent:
    def emit(self, event):
        pass

    def flush(self):
        pass


def moto_server(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A moto S3 server on 127.0.0.1 with a bucket `bench` (its requests logged to `log` if given), and the
    storage URI template of a run store in it (`{i}`: the store's index)."""
    import socket

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
        os.environ.setdefault(key, value)
    with open(log or os.devnull, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    deadline = time.time() + 30
    while True:
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:
            if time.time() > deadline:
                server.terminate()
                raise
            time.sleep(0.2)
    return server, "s3://bench/store-{i}?endpoint_override=127.0.0.1:" + f"{port}&scheme=http"


def throttle(mb_per_s: float) -> None:
    """Hold every upload to `mb_per_s` (0: as fast as the store goes)."""
    original = storage_module.StoredRun._put
    if getattr(original, "throttled", False):
        original = original.original

    def put(self, source, name):
        start = time.perf_counter()
        before = source.tell()
        original(self, source, name)
        if mb_per_s:
            size = source.tell() - before
            time.sleep(max(0.0, size / (mb_per_s * 1e6) - (time.perf_counter() - start)))

    put.throttled, put.original = True, original
    storage_module.StoredRun._put = put


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=at_least(1, int), default=100)
    ap.add_argument("--checkpoint-every", type=at_least(1, int), default=10)
    ap.add_argument("--d-model", type=at_least(4, int), default=256, help="a multiple of the 4 heads")
    ap.add_argument("--layers", type=at_least(1, int), default=4)
    ap.add_argument("--bandwidth-mbs", type=at_least(0.0, float), nargs="*", default=[0.0, 50.0])
    ap.add_argument("--repeats", type=at_least(1, int), default=3, help="runs per row; the median wall is printed")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="reslab-bench-storage-"))
    spec = root / "study.yaml"
    spec.write_text(textwrap.dedent(STUDY.format(d_model=args.d_model, layers=args.layers, steps=args.steps,
                                                 every=args.checkpoint_every)))
    run = expand(load_study(spec))[0]
    server, s3 = moto_server()
    rows = []
    try:
        cases = [("none", None, 0.0)]
        for bw in args.bandwidth_mbs:
            cases += [("local path", str(root / "store-{i}"), bw), ("S3 (moto, 127.0.0.1)", s3, bw)]
        execute_run(RunTask(run=run, run_dir=str(root / "warmup"), submission="warmup"), Silent())  # imports, corpus
        for c, (label, uri, bw) in enumerate(cases):
            throttle(bw)
            walls = []
            for r in range(args.repeats):
                i = f"{c}-{r}"
                os.environ["RESLAB_SCRATCH"] = str(root / f"scratch-{i}")
                stored = None if uri is None else RunStorage.at(uri.format(i=i)).run_uri(run.study, run.run_id)
                task = RunTask(run=run, run_dir=str(root / f"run-{i}"), submission=f"bench-{i}", storage=stored)
                t0 = time.perf_counter()
                outcome = execute_run(task, Silent())
                walls.append(time.perf_counter() - t0)
                assert outcome.state == "SUCCESS", outcome.error
            scratch = root / f"scratch-{i}" / run.study / run.run_id
            ckpt = (scratch if uri else Path(task.run_dir)) / "checkpoint.pt"
            rows.append((label, "-" if uri is None else (f"{bw:g} MB/s" if bw else "unthrottled"),
                         ckpt.stat().st_size / 1e6, statistics.median(walls)))
    finally:
        server.terminate()
        server.wait(10)
    base = rows[0][3]
    checkpoints = args.steps // args.checkpoint_every
    print(f"one run: d_model {args.d_model}, {args.layers} layers, {args.steps} steps, a checkpoint every "
          f"{args.checkpoint_every} ({checkpoints} checkpoints + the final push); median of {args.repeats}\n")
    print("| storage | upload | checkpoint MB | wall s | over no storage |")
    print("|---|---|---:|---:|---:|")
    for label, upload, mb, wall in rows:
        print(f"| {label} | {upload} | {mb:.1f} | {wall:.2f} | {wall - base:+.2f} s |")


if __name__ == "__main__":
    main()
