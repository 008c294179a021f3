"""Seeds come from the design, never from the caller (issue 55 item 4): a count, `{count: N, replicate: R}` or a
sequential design; a list of seeds, in the file or through `--set`, is one line naming `seeds`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from reslab.experiments import expand
from reslab.experiments.schema import MAX_RUNS_CEILING
from reslab.experiments.spec import REPLICATE_FLOOR, parse_study, replicate_seeds
from reslab.models.config import ConfigError

BASE = {
    "base": {"model": {"preset": "tiny", "d_model": 32, "seq_len": 32, "n_layers": 2}, "optim": {"batch_size": 4},
             "train": {"steps": 6}},
    "arms": {"control": "prenorm", "attnres": {"residual": "attnres"}},
    "comparisons": [{"control": "control", "exploratory": True}],
}


def study(seeds, overrides=()):
    return parse_study({**BASE, "seeds": seeds}, Path("s.yaml"), overrides)


def error(seeds, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        study(seeds, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_count_and_replicate_zero_are_today_s_seeds_and_run_ids():
    a, b = study(3), study({"count": 3, "replicate": 0})
    assert a.seeds == b.seeds == (0, 1, 2) and a.replicate == b.replicate == 0
    assert [r.run_id for r in expand(a)] == [r.run_id for r in expand(b)]


def brute_replicate(count: int, replicate: int) -> list[int]:
    """The documented rule written out again: the first `count` distinct values of sha256("reslab-seeds:R:j")."""
    out: list[int] = []
    j = 0
    while len(out) < count:
        h = int(hashlib.sha256(f"reslab-seeds:{replicate}:{j}".encode()).hexdigest()[:16], 16)
        seed = 2**20 + h % (2**31 - 2**20)
        if seed not in out:
            out.append(seed)
        j += 1
    return out


def test_a_replicate_draws_fresh_seeds_from_the_design():
    s = study({"count": 4, "replicate": 2})
    assert s.replicate == 2 and list(s.seeds) == brute_replicate(4, 2)
    assert all(REPLICATE_FLOOR <= x < 2**31 for x in s.seeds)  # 31-bit, above every count's seeds
    assert MAX_RUNS_CEILING <= REPLICATE_FLOOR  # so never one of 0..N-1 for any count a study may have
    assert replicate_seeds(2, 2) == s.seeds[:2]  # a prefix: a sequential design's looks read the first k
    assert set(replicate_seeds(50, 1)).isdisjoint(replicate_seeds(50, 2))
    assert {r.run_id for r in expand(s)}.isdisjoint(r.run_id for r in expand(study(4)))
    seq = study({"sequential": {"start": 2, "batch": 1, "max": 4}, "replicate": 3})
    assert seq.seeds == replicate_seeds(4, 3) and seq.sequential is not None and seq.replicate == 3


@pytest.mark.parametrize("seeds", [[0, 1, 7], [1, 1], [], [0, -1]])
def test_a_list_of_seeds_is_refused_naming_seeds_why_and_what_is_allowed(seeds):
    msg = error(seeds)
    assert msg.startswith("seeds: a list of seeds is not allowed: seeds come from the design")
    assert "a count (e.g. 3)" in msg and "{count: N, replicate: R}" in msg and "{sequential:" in msg


def test_set_seeds_on_the_command_line_is_held_to_the_same_rule():
    msg = error(2, [("seeds", [0, 5])])
    assert msg.startswith("--set seeds: seeds come from the study's design, never from the command line")
    assert "{count: N, replicate: R}" in msg
    assert error(2, [("seeds.replicate", 4)]).startswith("--set seeds.replicate: seeds come from the study's design")


@pytest.mark.parametrize(("seeds", "expect"), [
    ({"replicate": 2}, "seeds: a mapping takes one of `count` and `sequential`"),
    ({"count": 2, "sequential": {"start": 2, "batch": 1, "max": 4}}, "seeds: a mapping takes one of"),
    ({"count": 0}, "seeds.count: expected a count >= 1, got 0"),
    ({"count": 2, "replicate": -1}, "seeds.replicate: expected a replicate number from 0 to 2147483647, got -1"),
    ({"count": 2, "replicat": 1}, "seeds: unknown key(s) 'replicat' (did you mean 'replicate'?)"),
    ("3", "seeds: expected a count (e.g. 3), {count: N, replicate: R}"),
])
def test_a_mapping_of_seeds_names_what_is_wrong(seeds, expect):
    assert error(seeds).startswith(expect)
