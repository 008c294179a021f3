"""Planning from run directories, leases and claims (no training, no Ray, no MLflow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.driving.plan import plan
from reslab.orchestrator.durability.lease import lease_for, lease_state
from reslab.orchestrator.durability.workspace import Workspace, write_json
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, RUNNING, SUCCESS

FINISHED = {"summary": {"val_loss": 4.2, "val_loss_tail": 4.3}, "info": {}}  # a finished run's summary.json


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_plan_gives_each_state_its_action_and_reason(tmp_path):
    ws = Workspace(tmp_path / "ws")
    runs = expand(load_study(write_study(tmp_path)))
    assert len(runs) == 4
    rds = [ws.run_dir("tiny", r.run_id) for r in runs]
    for rd in rds:
        rd.path.mkdir(parents=True)
    write_json(rds[0].summary_file, FINISHED)
    rds[0].set_status(SUCCESS)
    rds[1].set_status(FAILED, error="RuntimeError: boom\ntraceback...")
    rds[2].set_status(INTERRUPTED, checkpoint_step=3)
    rds[3].set_status(RUNNING, checkpoint_step=3)
    write_json(rds[3].lease_file, {**lease_for("other-submission"), "pid": _dead_pid()})

    entries = plan(runs, ws)
    got = [(e.action, e.reason) for e in entries]
    assert got[0] == ("skip", "succeeded")
    assert got[1] == ("skip", "failed: RuntimeError: boom (use --rerun-failed)")
    assert got[2] == ("run", "interrupted; resumes from step 3")
    assert got[3][0] == "run" and got[3][1].startswith("stale lease (pid ") and "is gone" in got[3][1]
    assert got[3][1].endswith("resumes from step 3")

    forced = plan(runs, ws, rerun_failed=True)[1]
    assert forced.action == "run" and "forced by --rerun-failed (RuntimeError: boom)" in forced.reason

    # A live lease (this very process) of another submission: busy, left alone.
    write_json(rds[3].lease_file, lease_for("other-submission"))
    busy = plan(runs, ws)[3]
    assert busy.action == "busy" and busy.reason.startswith(f"running, leased by pid {os.getpid()} on ")
    assert busy.reason.endswith(", submission other-submission") and "elsewhere" not in busy.reason  # issue 52
    # ... unless its heartbeat is older than the timeout (a hung or unreachable worker).
    write_json(rds[3].lease_file, {**lease_for("other-submission"), "heartbeat": time.time() - 1000})
    assert plan(runs, ws, lease_timeout_s=60)[3].action == "run"

    # SUCCESS beside a summary that is truncated, or whole JSON without the result, is not finished
    for damaged in (b'{"summary": {"val_lo', b'{"summary": {}}'):
        rds[0].summary_file.write_bytes(damaged)
        rds[0].update_status(checkpoint_step=6)
        repair = plan(runs, ws)[0]
        assert repair.action == "run" and repair.reason.startswith("said SUCCESS, but its summary.json is missing "
                                                                   "or damaged; resumes from step 6"), repair.reason


def test_lease_liveness_uses_pid_start_time_against_pid_reuse():
    lease = lease_for("s")
    assert lease_state(lease, 60)[0]
    assert not lease_state({**lease, "pid_start": "1"}, 60)[0]  # same pid, another process
    assert not lease_state({**lease, "pid": _dead_pid()}, 60)[0]
    assert lease_state({**lease, "host": "elsewhere", "pid": 1}, 60)[0]  # another host: trust the heartbeat
    assert not lease_state({**lease, "host": "elsewhere", "heartbeat": time.time() - 61}, 60)[0]


def test_a_zombie_lease_holder_counts_as_gone():
    # killed but not reaped (as under a container PID 1 that does not reap): it can write nothing
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = {**lease_for("s"), "pid": child.pid, "pid_start": None}
        assert lease_state(lease, 60)[0]
        child.kill()
        deadline = time.time() + 10
        while lease_state(lease, 60)[0] and time.time() < deadline:
            time.sleep(0.05)
        live, why = lease_state(lease, 60)
        assert not live and "is gone" in why, why
        assert Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # not reaped yet
    finally:
        child.kill()
        child.wait()


def test_claim_skips_done_leaves_busy_and_takes_over_stale(tmp_path):
    rd = Workspace(tmp_path).run_dir("s", "r1")
    assert rd.claim("sub-a", 60) == ("run", "claimed", 1)
    assert rd.lease()["submission"] == "sub-a" and rd.lease()["pid"] == os.getpid()
    rd.set_status(RUNNING)
    verdict, why, _ = rd.claim("sub-b", 60)
    assert verdict == "busy" and "held by submission sub-a" in why
    assert rd.claim("sub-a", 60)[0] == "run"  # a retry of the same submission takes it back
    write_json(rd.lease_file, {**rd.lease(), "pid": _dead_pid()})
    assert rd.claim("sub-b", 60)[0] == "run" and rd.lease()["submission"] == "sub-b"
    rd.set_status(SUCCESS)
    rd.release("sub-b")
    assert rd.claim("sub-c", 60)[0] == "run"  # SUCCESS without a summary: claimed, to be repaired
    rd.set_status(SUCCESS)
    rd.release("sub-c")
    write_json(rd.summary_file, FINISHED)
    assert rd.claim("sub-d", 60) == ("skip", "already succeeded", 0)


def test_status_keeps_checkpoint_and_drops_stale_errors(tmp_path):
    rd = Workspace(tmp_path).run_dir("s", "r1")
    rd.path.mkdir(parents=True)
    rd.set_status(FAILED, error="x")
    rd.update_status(checkpoint_step=9)
    assert rd.status()["state"] == FAILED and rd.status()["checkpoint_step"] == 9
    rd.set_status(RUNNING)
    assert "error" not in rd.status() and rd.status()["checkpoint_step"] == 9


def test_cli_plan_lists_every_run_with_id_and_reason(tmp_path, capsys):
    path = write_study(tmp_path)
    ws = tmp_path / "ws"
    runs = expand(load_study(path))
    rd = Workspace(ws).run_dir("tiny", runs[0].run_id)
    rd.path.mkdir(parents=True)
    write_json(rd.summary_file, FINISHED)
    rd.set_status(SUCCESS)
    assert main(["plan", str(path), "--workspace", str(ws)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 4 runs: 3 to run, 1 to skip, 0 busy elsewhere" in out
    for r in runs:
        line = next(line for line in out.splitlines() if r.run_id in line)
        assert r.label in line
        assert line.startswith("skip") == (r is runs[0])
        assert line.endswith("succeeded" if r is runs[0] else "new")


def test_cli_validate_and_errors(tmp_path, capsys):
    path = write_study(tmp_path)
    assert main(["validate", str(path)]) == 0
    assert "4 runs" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("attnres: {residual: attnres}", "attnres: {residual: nope}"))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: arms.attnres.residual.name: unknown residual variant 'nope'; allowed:" in err


def test_the_plan_table_starts_why_at_its_header_on_the_shipped_ladder(tmp_path, capsys):
    """The shipped CPU ladder's labels (`control/model.d_model=32,...,train.steps=300/s0`, 80 characters) ran
    past the fixed 36-character label column: each row's reason sat up to 90 characters off its header."""
    spec = Path(__file__).parents[2] / "experiments" / "scaling_ladder_cpu.yaml"
    assert main(["plan", str(spec), "--workspace", str(tmp_path / "ws")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.rstrip().endswith(" why") and "run id" in line)
    column = lines[header].rindex("why")
    rows = [line for line in lines[header + 1:] if line.startswith(("run ", "skip", "busy"))]
    assert len(rows) == 48
    for row in rows:
        assert row[column:] == "new", row  # every run is new: the reason starts under `why`
