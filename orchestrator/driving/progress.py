"""The live progress display of `reslab run` (and the snapshot of `reslab status`).

On a terminal, a block of lines redrawn in place at most twice a second: counts of runs succeeded /
running / failed / skipped / queued, elapsed time and an ETA, then one line per running run with
its step and latest losses. Anywhere else (a log file, CI), plain lines: one per run start, eval,
retry and end, plus a count line every `every_s` seconds, so the output stays greppable.

The ETA divides the steps still to train by the step rate of this submission so far (steps
trained since the first run started / time since then). It assumes the remaining runs train at
the average speed of those seen, so it improves as arms of every kind have run.

Work after training (evaluations, interventions: `after.AfterSource`) is counted as the units of work it
is, one task per finished run, beside the runs: "evaluations: 1 succeeded, 1 running, 0 failed, 2 to run".
Once no run trains, the ETA is that of the units known (those handed out, at the pace of those done).
While nothing runs yet, the header says what the driver waits for ("waiting for Ray to start", "waiting
for workers"), until the first worker answers.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from reslab.experiments.expand import RunSpec
from reslab.orchestrator.driving.gates import GatesStatus
from reslab.orchestrator.driving.plan import BUSY, RUN, SKIP, PlanEntry, plan_run
from reslab.orchestrator.driving.sequential import LATER, UNNEEDED, SequentialStatus
from reslab.orchestrator.durability.outage import fmt_duration
from reslab.orchestrator.durability.workspace import RunDir, Workspace, check_lease_timeout, read_runs_in_order
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, RUNNING, SUCCESS

# the words of `tasks.WORDS` a run is shown in
SUCCEEDED, ACTIVE, FAILS, SKIPPED = SUCCESS.label, RUNNING.label, FAILED.label, SKIP.label
TO_RUN, HELD, STOPPED = RUN.label, BUSY.label, INTERRUPTED.label


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}"


@dataclass
class _Run:
    label: str
    steps: int
    state: str = TO_RUN  # a word of `tasks.WORDS`
    step: int = 0
    start_step: int = 0
    train_loss: float | None = None
    val_loss: float | None = None
    attempt: int = 1
    detail: str = ""
    started: float | None = None
    counted: tuple[int, int] = (0, 0)  # what it added to `Progress`'s ETA sums (trained, left) when it took its state


@dataclass
class Progress:
    study: str
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    tty: bool | None = None
    every_s: float = 30.0
    runs: dict[str, _Run] = field(default_factory=dict)  # the runs this submission started, one by one
    # the other runs, counted by word: to run and not started yet (with `backlog_steps`, their steps), skipped, busy
    tally: Counter[str] = field(default_factory=Counter)
    backlog_steps: float = 0.0
    # units of work after training (`after.AfterSource`): what they are called ("" when a submission has none),
    # and how many are in each word of `tasks.WORDS` (to run, running, succeeded, failed)
    after_noun: str = ""
    after: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.tty is None:
            self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()
        # kept as runs change state (`_move`), so that a log line, one or more per run event, does not count
        # every run of a 10^5-run submission (issue 39): runs by state, the running ones, and the ETA's sums
        self._states: Counter[str] = Counter()
        self._active: dict[str, _Run] = {}
        self._trained_done = 0  # steps trained by the runs that have succeeded
        self._left_waiting = 0  # steps left to the runs shown one by one that wait to (re)start
        for run_id, run in self.runs.items():
            self._enter(run_id, run)
        self.first_start: float | None = None
        self.first_after: float | None = None  # when the first unit of work after training was handed out
        self.waiting_for: str | None = None  # what the driver waits for while nothing runs yet
        self._drawn = 0
        self._last_draw = 0.0
        self._last_line = time.time()

    # ------------------------------------------------------------------ updates

    def expect(self, steps: float, runs: int) -> None:
        """`runs` more runs to run, not started yet, of `steps` steps in all (the ETA's estimate)."""
        self.tally[TO_RUN] += runs
        self.backlog_steps += steps

    def counted(self, word: str) -> None:
        """A run that does not run in this submission (skipped, busy elsewhere), counted under `word`."""
        self.tally[word] += 1

    def add(self, run_id: str, label: str, steps: int, state: str = TO_RUN, detail: str = "") -> None:
        """A run shown one by one from now on: one of the runs to run `expect` counted, when it starts."""
        if self.tally[TO_RUN] > 0 and state == TO_RUN:
            self.tally[TO_RUN] -= 1
            self.backlog_steps = max(0.0, self.backlog_steps - steps)
        old = self.runs.get(run_id)
        if old is not None:
            self._leave(run_id, old)
        run = self.runs[run_id] = _Run(label=label, steps=steps, state=state, detail=detail)
        self._enter(run_id, run)

    def _count(self, run: _Run) -> None:
        run.counted = (run.step - run.start_step if run.state == SUCCEEDED else 0,
                       run.steps - run.step if run.state == TO_RUN else 0)
        self._trained_done += run.counted[0]
        self._left_waiting += run.counted[1]

    def _leave(self, run_id: str, run: _Run) -> None:
        self._states[run.state] -= 1
        self._active.pop(run_id, None)
        self._trained_done -= run.counted[0]
        self._left_waiting -= run.counted[1]

    def _enter(self, run_id: str, run: _Run) -> None:
        self._states[run.state] += 1
        if run.state == ACTIVE:
            self._active[run_id] = run
        self._count(run)

    def _step(self, run_id: str, run: _Run, step: int) -> None:
        if run.state == ACTIVE:  # the running runs' steps are summed when asked; `_active` keeps its order
            run.step = max(run.step, step)
        else:  # a late row of a run that has ended or waits
            self._move(run_id, run, run.state, step=max(run.step, step))

    def _move(self, run_id: str, run: _Run, state: str, **fields: Any) -> None:
        """Every change of a shown run's state, with the fields that change with it, goes through here."""
        self._leave(run_id, run)
        run.state = state
        for name, value in fields.items():
            setattr(run, name, value)
        self._enter(run_id, run)

    def _say(self, text: str, on_tty: bool = False) -> None:
        """A log line: always off a terminal; on one only when `on_tty`, printed above the live
        block, which is then redrawn below it."""
        if not self.tty:
            self.stream.write(text + "\n")
            self.stream.flush()
        elif on_tty:
            self.stream.write(self._clear() + text + "\n")
            self._drawn = 0
            self.render(force=True)

    def event(self, ev: dict[str, Any]) -> None:
        run = self.runs.get(ev.get("run_id", ""))
        if run is None:
            return
        self._answered()
        kind = ev.get("type")
        if kind == "start":
            start_step = int(ev.get("start_step", 0))
            self._move(ev["run_id"], run, ACTIVE, attempt=ev.get("attempt", 1), start_step=start_step, step=start_step,
                       started=ev.get("time", time.time()))
            self.first_start = self.first_start or run.started
            resumed = f", resumed at step {run.start_step}" if run.start_step else ""
            self._say(f"{self._prefix()} start {run.label} (attempt {run.attempt}{resumed})", on_tty=bool(resumed))
        elif kind == "train":
            self._step(ev["run_id"], run, int(ev["step"]))
            run.train_loss = ev["metrics"].get("train_loss", run.train_loss)
        elif kind == "eval":
            self._step(ev["run_id"], run, int(ev["step"]))
            run.val_loss = ev["metrics"].get("val_loss", run.val_loss)
            self._say(f"{self._prefix()} {run.label} step {run.step}/{run.steps} train {_num(run.train_loss)} "
                      f"val {_num(run.val_loss)}")

    def finished(self, run_id: str, state: str, detail: str = "") -> None:
        self._answered()
        run = self.runs[run_id]
        self._move(run_id, run, state, detail=detail, **({"step": run.steps} if state == SUCCEEDED else {}))
        self._say(f"{self._prefix()} {state} {run.label}" + (f": {detail}" if detail else ""), on_tty=True)

    def waiting(self, what: str | None) -> None:
        """What the driver waits for while nothing runs yet ("Ray to start", "workers"); None: nothing. Said at
        once, and in the header until the first worker answers."""
        self.waiting_for = what
        if what is not None and self.tty:
            self.render(force=True)
        elif what is not None:
            self._say(f"{self._prefix()} waiting for {what}")

    def _answered(self) -> None:
        self.waiting_for = None

    def after_queued(self) -> None:
        """A unit of work after training to run (a finished run's pending work)."""
        self.after[TO_RUN] += 1

    def after_started(self) -> None:
        self._after_move(TO_RUN, ACTIVE)
        self.first_after = self.first_after or time.time()

    def after_ended(self, word: str) -> None:
        """A unit ended: succeeded, failed or interrupted (its source says its lines)."""
        self._answered()
        self._after_move(ACTIVE, word)

    def after_retry(self, label: str, attempt: int, error: str) -> None:
        """A unit's attempt failed and the loop submits it again at once: still counted running."""
        self._answered()
        self._say(f"{self._prefix()} retry {self.after_noun or 'after training'} {label} (attempt {attempt}) after: "
                  f"{error}", on_tty=True)

    def _after_move(self, old: str, new: str) -> None:
        if self.after[old] > 0:
            self.after[old] -= 1
        self.after[new] += 1

    def retry(self, run_id: str, attempt: int, error: str) -> None:
        run = self.runs[run_id]
        self._move(run_id, run, TO_RUN, attempt=attempt, detail=error)
        self._say(f"{self._prefix()} retry {run.label} (attempt {attempt}) after: {error}", on_tty=True)

    # ------------------------------------------------------------------ rendering

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((SUCCEEDED, ACTIVE, FAILS, SKIPPED, TO_RUN, HELD, STOPPED), 0)
        for word, n in (self.tally + self._states).items():
            out[word] = out.get(word, 0) + n
        return out

    def eta_s(self) -> float:
        if self.first_start is not None and (self._training_left() or not self.after[TO_RUN] + self.after[ACTIVE]):
            return self._training_eta_s()
        return self._after_eta_s()

    def _training_left(self) -> bool:
        return bool(self.backlog_steps or self._left_waiting or self._active)

    def _after_eta_s(self) -> float:
        """The units of work after training known to be left, at the pace of those done since the first began."""
        done = self.after[SUCCEEDED] + self.after[FAILS]
        if self.first_after is None or not done:
            return math.inf
        elapsed = time.time() - self.first_after
        return (self.after[TO_RUN] + self.after[ACTIVE]) * elapsed / done

    def _training_eta_s(self) -> float:
        if self.first_start is None:
            return math.inf
        trained = self._trained_done + sum(r.step - r.start_step for r in self._active.values())
        elapsed = time.time() - self.first_start
        if trained <= 0 or elapsed <= 0:
            return math.inf
        left = self.backlog_steps + self._left_waiting + sum(r.steps - r.step for r in self._active.values())
        return left / (trained / elapsed)

    def _prefix(self) -> str:
        c = self.counts()
        total = len(self.runs) + sum(self.tally.values())
        return f"[{c[SUCCEEDED] + c[SKIPPED]}/{total}]"

    def after_counts(self) -> str:
        """"evaluations: 1 succeeded, 1 running, 0 failed, 2 to run"; "" when the submission has none."""
        if not self.after_noun:
            return ""
        words = [f"{self.after[w]} {w}" for w in (SUCCEEDED, ACTIVE, FAILS, TO_RUN)]
        words += [f"{self.after[STOPPED]} {STOPPED}"] if self.after[STOPPED] else []
        return f"; {self.after_noun}: " + ", ".join(words)

    def header(self) -> str:
        c = self.counts()
        parts = [f"{w} {c[w]}" for w in (SUCCEEDED, ACTIVE, FAILS, SKIPPED, TO_RUN)]
        parts[0] = f"{self.study}: {parts[0]}"
        if c[HELD]:
            parts.append(f"{HELD} elsewhere {c[HELD]}")
        if c[STOPPED]:
            parts.append(f"{STOPPED} {c[STOPPED]}")
        waiting = f" | waiting for {self.waiting_for}" if self.waiting_for else ""
        return (", ".join(parts) + self.after_counts() + f" | elapsed {fmt_duration(time.time() - self.t0)}, "
                f"ETA {fmt_duration(self.eta_s())}" + waiting)

    def lines(self) -> list[str]:
        out = [self.header()]
        for run in self._active.values():
            out.append(f"  {run.label:<34} step {run.step:>6}/{run.steps:<6} train {_num(run.train_loss)}  "
                       f"val {_num(run.val_loss)}" + (f"  (attempt {run.attempt})" if run.attempt > 1 else ""))
        return out

    def render(self, force: bool = False) -> None:
        now = time.time()
        if self.tty:
            if not force and now - self._last_draw < 0.5:
                return
            lines = self.lines()
            self.stream.write(self._clear() + "\n".join(lines) + "\n")
            self.stream.flush()
            self._drawn = len(lines)
            self._last_draw = now
        elif force or now - self._last_line >= self.every_s:
            self._say(self.header())
            self._last_line = now

    def _clear(self) -> str:
        """ANSI: move the cursor up over the drawn block and erase to the end of the screen."""
        return f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""

    def close(self) -> None:
        self.render(force=True)
        self._drawn = 0


@dataclass(frozen=True)
class RunStatus:
    """One run as `reslab status` shows it: its plan entry, state, step and latest losses."""

    entry: PlanEntry
    state: str  # succeeded, running, failed or to run (`tasks.WORDS`)
    step: int
    train_loss: float | None
    val_loss: float | None

    def line(self) -> str:
        run = self.entry.run
        train = "train -" if self.train_loss is None else f"train {self.train_loss:.4f}"
        val = "val -" if self.val_loss is None else f"val {self.val_loss:.4f}"
        why = "" if self.state in (SUCCEEDED, UNNEEDED) else f"  ({self.entry.reason})"
        return (f"  {self.state:<10} {run.run_id:<28} {run.label:<34} step {self.step:>6}/{run.config.train.steps:<6} "
                f"{train}  {val}{why}")


@dataclass(frozen=True)
class StudyStatus:
    runs: list[RunStatus]
    eta_s: float  # math.inf when no run is running
    # a sequential (or gates) study: where its looks stand, and the ETA were every later look run (math.inf: unknown)
    sequential: SequentialStatus | GatesStatus | None = None
    eta_most_s: float = math.inf

    def counts(self) -> dict[str, int]:
        words = (SUCCEEDED, ACTIVE, FAILS, TO_RUN) + ((LATER, UNNEEDED) if self.sequential else ())
        out = dict.fromkeys(words, 0)
        for run in self.runs:
            out[run.state] += 1
        return out

    def header(self, study: str) -> str:
        eta = f" | ETA {fmt_duration(self.eta_s)} at the running runs' pace" if self.eta_s < math.inf else ""
        if eta and self.sequential is not None and self.sequential.later:
            eta = (f" | ETA {fmt_duration(self.eta_s)} for this look, at most {fmt_duration(self.eta_most_s)} "
                   "were every later look run, at the running runs' pace")
        return f"{study}: {len(self.runs)} runs: " + ", ".join(f"{v} {k}" for k, v in self.counts().items()) + eta

    def lines(self, study: str) -> list[str]:
        """The header, then a sequential study's looks (`SequentialStatus.lines`)."""
        return [self.header(study), *(self.sequential.lines() if self.sequential else [])]


def _read_runs(runs: list[RunSpec], workspace: Workspace, lease_timeout_s: float
               ) -> list[tuple[PlanEntry, list[dict[str, Any]]]]:
    """Each run's plan entry and `metrics.jsonl` rows, in run order (`plan.plan_iter`'s entries). A run without
    a run directory (one listing of the study's folder) is new and reads nothing; the others' small files are
    read in order, with the disk read ahead where they are not cached (`workspace.read_runs_in_order`)."""
    check_lease_timeout(lease_timeout_s)
    if not runs:
        return []
    present = workspace.recorded_ids(runs[0].study)
    study_dir = workspace.study_dir(runs[0].study)

    def read(i: int) -> tuple[PlanEntry, list[dict[str, Any]]]:
        run = runs[i]
        if run.run_id not in present:
            return PlanEntry(run, RUN, "new", None), []
        entry = plan_run(run, workspace, lease_timeout_s=lease_timeout_s)
        return entry, RunDir(study_dir / run.run_id).metrics()

    return list(read_runs_in_order(study_dir, [r.run_id for r in runs], ("status", "summary.json", "metrics.jsonl"),
                                   read))


def study_status(runs: list[RunSpec], workspace: Workspace, lease_timeout_s: float,
                 sequential: SequentialStatus | GatesStatus | None = None) -> StudyStatus:
    """The state of every run from its run directory (no Ray, no MLflow, nothing written).

    The ETA divides the steps left (running and to-run runs) by the summed step rate the running
    runs show in their `metrics.jsonl`. A sequential study's runs that the look in progress does not
    need are counted apart (in a later look, or not needed: `sequential`); its ETA is the look's, and
    `eta_most_s` what every later look would add.
    """
    out, left_steps, later_steps, rate = [], 0, 0, 0.0
    for e, rows in _read_runs(runs, workspace, lease_timeout_s):
        steps = e.run.config.train.steps
        step = max((r["step"] for r in rows), default=0)
        train = next((r["train_loss"] for r in reversed(rows) if r.get("kind") == "train"), None)
        val = next((r["val_loss"] for r in reversed(rows) if r.get("kind") == "eval"), None)
        if e.action == SKIP and e.state == SUCCESS:
            state, step = SUCCEEDED, steps
        elif e.action == RUN and e.state == RUNNING and workspace.storage:
            state = ACTIVE  # as its node last pushed it: storage has no leases to tell live from left
        else:
            state = {BUSY: ACTIVE, SKIP: FAILS, RUN: TO_RUN}[e.action]
        if sequential is not None and state != SUCCEEDED:
            state = sequential.word(e.run.run_id) or state
        if state in (ACTIVE, TO_RUN):
            left_steps += steps - step
        elif state == LATER:
            later_steps += steps - step
        if state == ACTIVE and len(rows) > 1 and rows[-1]["time"] > rows[0]["time"]:
            rate += (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
        out.append(RunStatus(e, state, step, train, val))
    eta = left_steps / rate if rate > 0 else math.inf
    most = (left_steps + later_steps) / rate if rate > 0 else math.inf
    return StudyStatus(out, eta, sequential, most)
