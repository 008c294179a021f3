"""The progress display: line mode off a terminal, an in-place block on one, and the ETA."""

from __future__ import annotations

import io
import math
import time

from reslab.orchestrator.driving.progress import Progress, fmt_duration


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(stream, tty=None) -> Progress:
    p = Progress("demo", stream=stream, tty=tty, every_s=0.0)
    p.add("a", "control/s0", 100)
    p.add("b", "attnres/s0", 100)
    p.add("c", "control/s1", 100, state="skipped")
    return p


def test_line_mode_prints_events_and_counts():
    out = io.StringIO()
    p = _progress(out)
    assert not p.tty
    p.event({"type": "start", "run_id": "a", "attempt": 1, "start_step": 20, "time": time.time()})
    p.event({"type": "train", "run_id": "a", "step": 40, "metrics": {"train_loss": 2.5}})
    p.event({"type": "eval", "run_id": "a", "step": 50, "metrics": {"val_loss": 2.25}})
    p.retry("b", 2, "the worker process died")
    p.finished("a", "succeeded", "val 2.2500")
    p.render()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/3] start control/s0 (attempt 1, resumed at step 20)"
    assert lines[1] == "[1/3] control/s0 step 50/100 train 2.5000 val 2.2500"
    assert lines[2] == "[1/3] retry attnres/s0 (attempt 2) after: the worker process died"
    assert lines[3] == "[2/3] succeeded control/s0: val 2.2500"
    assert lines[4].startswith("demo: succeeded 1, running 0, failed 0, skipped 1, to run 1 | elapsed")
    assert "\x1b[" not in out.getvalue()


def test_terminal_mode_redraws_one_block_in_place():
    out = FakeTerminal()
    p = _progress(out)
    assert p.tty
    p.event({"type": "start", "run_id": "a", "time": time.time() - 10})
    p.event({"type": "train", "run_id": "a", "step": 50, "metrics": {"train_loss": 2.5}})
    p.render(force=True)
    first = out.getvalue()
    assert first.startswith("demo: succeeded 0, running 1") and "control/s0" in first and "step     50/100" in first
    p.finished("a", "succeeded", "val 2.1")
    text = out.getvalue()[len(first):]
    # the 2-line block is erased, the log line printed, the block redrawn below it
    assert text.startswith("\x1b[2F\x1b[J[2/3] succeeded control/s0: val 2.1\ndemo: succeeded 1, running 0")


def test_eta_from_the_observed_step_rate():
    p = _progress(io.StringIO())
    assert math.isinf(p.eta_s())
    p.event({"type": "start", "run_id": "a", "time": time.time() - 10})
    p.event({"type": "train", "run_id": "a", "step": 50, "metrics": {}})
    # 50 steps in ~10 s; 50 + 100 steps left
    assert 25 < p.eta_s() < 35
    assert fmt_duration(65) == "1m05s" and fmt_duration(3700) == "1h01m" and fmt_duration(math.inf) == "--"


def test_counts_and_eta_kept_as_runs_change_state_match_a_recount():
    """The counts, running lines and ETA sums are kept as runs change state (a line per event must not count every
    run of a 10^5-run submission); after every step of a random history they equal a recount over all runs,
    late events for runs no longer running included."""
    import random

    from reslab.orchestrator.driving.progress import ACTIVE, SUCCEEDED, TO_RUN

    rng = random.Random(7)
    p = Progress("demo", stream=io.StringIO(), tty=False, every_s=1e9)
    p.expect(steps=5000.0, runs=50)
    p.first_start = time.time() - 10.0
    for _ in range(3000):
        rid = f"r{rng.randrange(60)}"
        run, what = p.runs.get(rid), rng.random()
        if run is None:
            p.add(rid, f"arm/s{rid}", rng.choice((50, 100)), state=rng.choice((TO_RUN, TO_RUN, "skipped")))
        elif what < 0.3:
            p.event({"type": "start", "run_id": rid, "attempt": run.attempt, "start_step": rng.randrange(run.steps),
                     "time": time.time()})
        elif what < 0.6:  # also a late row of a run that has ended or is waiting
            p.event({"type": rng.choice(("train", "eval")), "run_id": rid, "step": rng.randrange(run.steps + 1),
                     "metrics": {"train_loss": 2.0, "val_loss": 2.0}})
        elif what < 0.8:
            p.finished(rid, rng.choice((SUCCEEDED, SUCCEEDED, "failed", "interrupted")))
        else:
            p.retry(rid, run.attempt + 1, "lost")
        runs = p.runs.values()
        recount = dict.fromkeys(p.counts(), 0)
        for word, n in p.tally.items():
            recount[word] += n
        for r in runs:
            recount[r.state] = recount.get(r.state, 0) + 1
        assert p.counts() == recount
        assert sorted(line.split()[0] for line in p.lines()[1:]) == sorted(r.label for r in runs if r.state == ACTIVE)
        trained = sum(r.step - r.start_step for r in runs if r.state in (ACTIVE, SUCCEEDED))
        left = p.backlog_steps + sum(r.steps - r.step for r in runs if r.state in (ACTIVE, TO_RUN))
        before = time.time() - p.first_start
        eta = p.eta_s()
        after = time.time() - p.first_start  # the ETA's clock read between the two, however loaded the machine is
        if trained > 0:
            low, high = left / (trained / before), left / (trained / after)
            assert low * (1 - 1e-9) <= eta <= high * (1 + 1e-9), (eta, left, trained)
        else:
            assert eta == math.inf


def test_work_after_training_is_counted_as_units_beside_the_runs():
    """Issue 52, item 12: `reslab eval` on two finished runs read "succeeded 0, running 0, failed 0, skipped 2, to run
    0 | ETA --" while it evaluated them; the evaluations are counted as the units of work they are, and once no run
    trains the ETA is theirs, at the pace of those done (one done in ~10 s, one left: ~10 s)."""
    out = io.StringIO()
    p = Progress("demo", stream=out, tty=False, every_s=0.0)
    p.after_noun = "evaluations"
    p.counted("skipped")
    p.counted("skipped")
    p.after_queued()
    p.after_queued()
    p.after_started()
    assert p.header().startswith("demo: succeeded 0, running 0, failed 0, skipped 2, to run 0; evaluations: 0 "
                                 "succeeded, 1 running, 0 failed, 1 to run | elapsed")
    p.first_after = time.time() - 10
    p.after_ended("succeeded")
    p.after_started()
    assert "evaluations: 1 succeeded, 1 running, 0 failed, 0 to run" in p.header()
    assert 8 < p.eta_s() < 12
    p.after_retry("control/s0", 2, "OutOfMemoryError: killed")  # submitted again at once: still running
    assert "evaluations: 1 succeeded, 1 running, 0 failed, 0 to run" in p.header()
    p.after_ended("succeeded")
    assert "evaluations: 2 succeeded, 0 running, 0 failed, 0 to run" in p.header()
    retried = "[2/2] retry evaluations control/s0 (attempt 2) after: OutOfMemoryError: killed"
    assert retried in out.getvalue().splitlines()
    assert "evaluations" not in Progress("demo", stream=io.StringIO(), tty=False).header()  # none: not shown


def test_the_header_says_what_the_driver_waits_for_until_a_worker_answers():
    out = io.StringIO()
    p = _progress(out)
    p.waiting("Ray to start")
    assert out.getvalue().splitlines()[-1] == "[1/3] waiting for Ray to start"
    p.waiting("workers")
    assert p.header().endswith("| waiting for workers")
    p.event({"type": "start", "run_id": "a", "time": time.time()})
    assert "waiting" not in p.header()
    term = FakeTerminal()
    q = _progress(term)
    q.waiting("Ray to start")
    assert term.getvalue().splitlines()[0].endswith("ETA -- | waiting for Ray to start")
