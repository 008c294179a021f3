"""Short labels for a study's grid points: what the report writes in table cells, legends and plot labels
in place of a whole grid key (`model.d_model=32,model.n_layers=2,model.ffn_hidden=96,train.steps=300`),
spelled out once in the report's key table.

A ladder rung is `r<i>` (its place in the ladder, from 0), any other grid point `g<i>` (study order), a
rung of a ladder at several grid points `g<j>.r<i>`; after a colon, the axes that differ between the
study's grid points, each as its short name and value (`r0: d32 L2 ff96 st300`). A key that is not one
of the study's points (a pooled row's, `axis=*`) reads as its compact form with `all` for what it pools.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from reslab.results.stats import grid_parts

__all__ = ["PointLabels", "compact_key", "point_labels"]

# an axis's last path part -> its short name (a value follows it: d32, L2); others read `name=value`
_SHORT = {"d_model": "d", "n_layers": "L", "n_heads": "h", "n_kv_heads": "kv", "ffn_hidden": "ff", "steps": "st",
          "seq_len": "T", "batch_size": "B", "lr": "lr", "preset": "", "block_size": "bs", "vocab_size": "V"}


def _axis_value(axis: str, value: str) -> str:
    name = axis.rsplit(".", 1)[-1]
    short = _SHORT.get(name)
    if value == "*":
        return f"all {short or name}"
    return f"{name}={value}" if short is None else f"{short}{value}"


def compact_key(grid_key: str, axes: Iterable[str] | None = None) -> str:
    """The grid key's axes (those in `axes`, default all) by short name and value, space-separated."""
    keep = None if axes is None else set(axes)
    return " ".join(_axis_value(a, v) for a, v in grid_parts(grid_key) if keep is None or a in keep)


@dataclass(frozen=True)
class PointLabels:
    """grid key -> short label for a study's points, in study order; called on any key (module doc)."""

    labels: dict[str, str] = field(default_factory=dict)
    varying: tuple[str, ...] = ()  # the axes whose values differ between the points

    def __call__(self, grid_key: str | None) -> str:
        if not grid_key:
            return ""
        return self.labels.get(grid_key) or compact_key(grid_key, self._shown(grid_key))

    def _shown(self, grid_key: str) -> list[str] | None:
        axes = [a for a, v in grid_parts(grid_key) if a in self.varying or v == "*"]
        return axes or None

    def key_rows(self) -> list[tuple[str, str]]:
        """(label, the grid key's axes as `axis = value`, ...) per point, for the report's key table."""
        return [(label, ", ".join(f"{a} = {v}" for a, v in grid_parts(key))) for key, label in self.labels.items()]


def point_labels(keys: Iterable[str], ladders: Sequence[tuple[str, Sequence[str]]] = ()) -> PointLabels:
    """Labels for the grid keys `keys` (study order; "" and repeats skipped) and for the rungs of each
    ladder, given as (scope grid key, its rungs' grid keys) as `results.ladder.LadderScope` holds them."""
    points = list(dict.fromkeys(k for k in keys if k))
    for _, rungs in ladders:
        points += [k for k in rungs if k and k not in points]
    values: dict[str, set[str]] = {}
    for key in points:
        for axis, value in grid_parts(key):
            values.setdefault(axis, set()).add(value)
    varying = tuple(a for a, vs in values.items() if len(vs) > 1) or tuple(values)
    prefix: dict[str, str] = {}
    scoped = len(ladders) > 1
    for j, (_, rungs) in enumerate(ladders):
        for i, key in enumerate(rungs):
            prefix.setdefault(key, f"g{j}.r{i}" if scoped else f"r{i}")
    others = [k for k in points if k not in prefix]
    prefix.update({k: f"g{i}" for i, k in enumerate(others)})
    labels = {k: f"{prefix[k]}: {compact_key(k, varying)}" for k in points}
    return PointLabels(labels, varying)
