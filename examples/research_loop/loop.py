"""A research loop on reslab: propose settings of Block AttnRes's knobs, ask for a verdict against the pre-norm
control, keep a proposal only when the verdict is "better", stop when the compute budget is spent.

    python examples/research_loop/loop.py --workspace /tmp/loop-ws --budget 250000

Each proposal is a study built in Python (`reslab.api.build`): the control and one treatment arm, the same seeds,
one comparison. Its cost is what its plan says is still to run (`reslab.api.plan`): the control's runs are the
same runs in every proposal (content-addressed run ids), so they are trained once and charged once. A proposal
whose new runs would overrun the budget is not submitted, and the loop ends there. See README.md here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import reslab.api as rl

# a 2-layer, d=32 decoder on 32-token windows, 24 steps: about a second of training per run on one core
BASE: dict[str, Any] = {
    "model": {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 64,
              "seq_len": 32},
    "data": {"corpus": "stdlib", "tokenizer": "byte"},
    "optim": {"batch_size": 4, "warmup_steps": 2, "lr": 3.0e-3},
    "train": {"steps": 24, "eval_every": 12, "log_every": 4, "eval_windows": 8, "tail_k": 2, "checkpoint_every": 12},
    "cost": {"measure": False},
}
# 6 seed pairs: the smallest two-sided sign-flip p is 2/2^6 = 0.031, so a single comparison can reach alpha 0.05
SEEDS = 6
TOKENS_PER_RUN = BASE["train"]["steps"] * BASE["optim"]["batch_size"] * BASE["model"]["seq_len"]
# the knobs the loop proposes settings of (models/residual/block_attnres.py, attnres.py)
KNOBS: dict[str, list[Any]] = {"block_size": [1, 2], "score": ["softmax", "sigmoid"], "key_norm": [True, False]}


@dataclass
class Row:
    """One proposal and what came of it."""

    knobs: dict[str, Any]
    decision: str  # the verdict's, or "not run" (over budget)
    kept: bool
    estimate: float | None
    interval: tuple[float, float] | None
    new_runs: int
    tokens: int  # compute this proposal added: its new runs' training tokens
    exploratory: bool = False  # the verdict's mark: the study's analysis differs from its frozen plan


def proposals(seed: int) -> Iterator[dict[str, Any]]:
    """Every setting of the knobs once, in an order drawn from `seed` (a stand-in for a smarter proposer)."""
    settings = [dict(zip(KNOBS, values, strict=True)) for values in itertools.product(*KNOBS.values())]
    random.Random(seed).shuffle(settings)
    yield from settings


def study_of(knobs: dict[str, Any]) -> rl.Study:
    """The study that asks whether Block AttnRes at `knobs` beats pre-norm. Every proposal's study has the same
    name and control arm, so its control runs are the runs of the first (a run is stored under its study's name
    and its content-addressed id): skipped, not trained again. The study's analysis plan was frozen at the first
    proposal's submission; a later proposal's comparison points at a new arm that had no result when it was
    declared, so it is not exploratory (`results.verdict.plan_status`); a proposal tried again after its arm has
    runs, with another analysis, would be."""
    arm = "-".join(f"{k.replace('_', '')}{str(v).lower()}" for k, v in knobs.items())
    return rl.build({
        "study": "research-loop", "base": BASE, "seeds": SEEDS,
        "arms": {"control": "prenorm", arm: {"residual": {"name": "block_attnres", "options": knobs}}},
        "comparisons": [{"name": "vs-prenorm", "control": "control", "treatments": [arm]}],
    })


def ask(study: rl.Study, workspace: str, log: io.TextIOBase) -> Any:
    """Train what the study still needs (the driver's output into `log`) and read its verdict."""
    with contextlib.redirect_stdout(log):
        rl.submit(study, workspace=workspace)
    (verdict,) = rl.verdict(study, workspace=workspace).verdicts
    return verdict


def run_loop(workspace: str, budget: int, seed: int = 0, log: io.TextIOBase | None = None) -> list[Row]:
    """Propose, ask, keep or discard, until the proposals or the budget (training tokens) run out."""
    rows: list[Row] = []
    spent = 0
    log = log or io.StringIO()
    for knobs in proposals(seed):
        study = study_of(knobs)
        new_runs = rl.plan(study, workspace=workspace).counts.to_dict()["actions"]["to run"]
        cost = new_runs * TOKENS_PER_RUN
        if spent + cost > budget:
            rows.append(Row(knobs, "not run", False, None, None, new_runs, 0))
            break
        v = ask(study, workspace, log)
        spent += cost
        rows.append(Row(knobs, v.decision, v.decision == "better", v.estimate, (v.low, v.high), new_runs, cost,
                        v.exploratory))
    return rows


def table(rows: list[Row], budget: int) -> str:
    """The proposals, their decisions, estimates, intervals and compute, as a plain-text table."""
    lines = [f"{'proposal':<44} {'decision':<12} {'kept':<5} {'estimate':>9} {'interval':>21} {'new runs':>8} "
             f"{'tokens':>8}  exploratory"]
    for r in rows:
        knobs = ", ".join(f"{k}={v}" for k, v in r.knobs.items())
        est = "-" if r.estimate is None else f"{r.estimate:+.4f}"
        ci = "-" if r.interval is None else f"[{r.interval[0]:+.4f}, {r.interval[1]:+.4f}]"
        lines.append(f"{knobs:<44} {r.decision:<12} {'yes' if r.kept else 'no':<5} {est:>9} {ci:>21} "
                     f"{r.new_runs:>8} {r.tokens:>8}  {'yes' if r.exploratory else 'no'}")
    spent = sum(r.tokens for r in rows)
    lines.append(f"compute: {spent:,} of {budget:,} training tokens spent; kept {sum(r.kept for r in rows)} of "
                 f"{sum(r.decision != 'not run' for r in rows)} proposals tried")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", default="research-loop-ws", help="where the runs and verdicts live")
    parser.add_argument("--budget", type=int, default=30 * TOKENS_PER_RUN,
                        help=f"training tokens the loop may spend (default: 30 runs' worth, {30 * TOKENS_PER_RUN:,})")
    parser.add_argument("--seed", type=int, default=0, help="the proposer's order of the settings")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    args = parser.parse_args(argv)
    with rl.ray_session(num_cpus=args.cpus, workspace=args.workspace):
        rows = run_loop(args.workspace, args.budget, args.seed)
    print(table(rows, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
