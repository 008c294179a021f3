"""What the runs recorded while training, aggregated over seeds: the depth profiles (`models.magnitudes`, a MoE
model's expert loads) at the last evaluation every run of a grid point reached, and the seed-mean routing
matrices and concentration profiles. Pure functions of the rows the gatherer read from the run directories
(`orchestrator.gathering.gather.read_records`); they read no file. Reading every row of every run, and a row per
value, took most of a report at 10^5 runs (issue 39): a run's vectors are kept as the lists it recorded."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd

__all__ = ["MAGNITUDE_QUANTITIES", "PROFILE_COLUMNS", "FoundProfile", "ProfileVector", "depth_profiles",
           "mean_profile", "profile_frame", "profile_vectors", "seed_means"]

# step: the grid point's; seeds: the arm's runs that recorded the quantity; mean, min, max: over those runs
PROFILE_COLUMNS = ("grid_key", "step", "arm", "quantity", "seeds", "index", "mean", "min", "max")
MAGNITUDE_QUANTITIES = ("in_rms", "out_rms", "layer_out_rms", "grad_norm", "layer_grad_norm")
# a run's recorded depth profile: (quantity, its layer or site indexes (None: 0, 1, ...), values (None: not recorded))
ProfileVector = tuple[str, list[int] | None, list[float | None]]
SeedVectors = list[tuple[int, list[int] | None, list[float | None]]]  # per run: (seed, indexes, values)
# a run's last diagnostics row that recorded a profile: (grid key, arm, seed, its step, its profile vectors)
FoundProfile = tuple[str, str, int, int, list[ProfileVector]]


def profile_vectors(diag: dict) -> list[ProfileVector]:
    """The magnitudes across depth a diagnostics row recorded (`models.magnitudes`) and a MoE model's most loaded
    expert's share x experts per layer (`moe_max_load`), each the row's own list: no value is touched while 10^5
    runs are read (millions of values; issue 39)."""
    out: list[ProfileVector] = []
    moe = diag.get("moe")  # a MoE model's expert utilisation (models.training.moe_utilisation)
    if isinstance(moe, dict):
        out.append(("moe_max_load", [int(layer) for layer in moe["layers"]],
                    [max(frac) * len(frac) for frac in moe["fraction"]]))
    mags = diag.get("magnitudes")
    if isinstance(mags, dict):
        out += [(q, None, mags[q]) for q in MAGNITUDE_QUANTITIES if isinstance(mags.get(q), list) and mags[q]]
    return out


def profile_frame(groups: dict[tuple[str, str, str], SeedVectors], steps: dict[str, int]) -> pd.DataFrame:
    """`TrainingRecords.depth_profiles` from each (grid point, arm, quantity)'s run vectors (seed, indexes, values):
    per index, the mean, min and max over the runs that recorded a value there (NaN and None are none; an index
    no run recorded is left out), and how many of the arm's seeds recorded any; `steps`: each grid point's step."""
    cols: dict[str, list] = {name: [] for name in PROFILE_COLUMNS}
    for (point, arm, quantity), vectors in groups.items():
        positions = [range(len(values)) if index is None else index for _, index, values in vectors]
        indexes = sorted({i for where in positions for i in where})
        column = {i: k for k, i in enumerate(indexes)}
        dense = []  # one row per run over `indexes`: the run's own list when it already is one
        for (_, index, values), where in zip(vectors, positions, strict=True):
            if index is None and len(values) == len(indexes):
                dense.append(values)
                continue
            row: list[float | None] = [None] * len(indexes)
            for i, value in zip(where, values, strict=True):
                row[column[i]] = value
            dense.append(row)
        matrix = np.array(dense, dtype=np.float64)  # (runs, indexes); None -> NaN
        present = ~np.isnan(matrix)
        kept = present.any(axis=0)
        if not kept.any():
            continue
        recorded = matrix[:, kept]
        any_value = np.asarray(present.any(axis=1)).tolist()
        seeds = len({seed for (seed, _, _), recorded_any in zip(vectors, any_value, strict=True) if recorded_any})
        n = int(kept.sum())
        fixed: tuple[tuple[str, object], ...] = (("grid_key", point), ("step", steps[point]), ("arm", arm),
                                                 ("quantity", quantity), ("seeds", seeds))
        for name, same in fixed:
            cols[name] += [same] * n
        cols["index"] += np.asarray(indexes)[kept].tolist()
        cols["mean"] += np.nanmean(recorded, axis=0).tolist()
        cols["min"] += np.nanmin(recorded, axis=0).tolist()
        cols["max"] += np.nanmax(recorded, axis=0).tolist()
    return pd.DataFrame(cols, columns=list(PROFILE_COLUMNS))


def depth_profiles(found: list[FoundProfile], vectors_at: Callable[[int, int], Iterable[ProfileVector]]
                   ) -> pd.DataFrame:
    """`TrainingRecords.depth_profiles`: per grid point, each run's profile at the last evaluation every run there
    reached, from `found`, each run's last diagnostics row that recorded one. Usually that is the run's last row;
    a run that stopped earlier (failed, or not finished) sets an earlier step, and the others' vectors there come
    from `vectors_at(i, step)` (the i-th found run's rows at that step, read from its whole file)."""
    steps: dict[str, int] = {}  # grid point -> the last step every run there reached
    for point, _, _, step, _ in found:
        steps[point] = min(steps.get(point, step), step)
    groups: dict[tuple[str, str, str], SeedVectors] = {}
    for i, (point, arm, seed, step, vectors) in enumerate(found):
        at = steps[point]
        for quantity, index, values in (vectors if step == at else vectors_at(i, at)):
            groups.setdefault((point, arm, quantity), []).append((seed, index, values))
    return profile_frame(groups, steps)


def mean_profile(profiles: list[list[float | None]]) -> list[float | None]:
    """Per layer, the mean over the runs that recorded a value there (None where none did)."""
    out: list[float | None] = []
    for values in zip(*profiles, strict=True):
        present = [v for v in values if v is not None]
        out.append(sum(present) / len(present) if present else None)
    return out


def seed_means(routing: dict[str, dict[str, list[np.ndarray]]], sites: dict[tuple[str, str], list[str]],
               profiles: dict[str, dict[str, list[list[float | None]]]]
               ) -> tuple[dict[str, dict[str, tuple[np.ndarray, list[str]]]], dict[str, dict[str, list[float | None]]]]:
    """Per grid point and arm, the mean over seeds of the runs' routing matrices (with the arm's `sites` as their
    row labels) and of their concentration profiles (`mean_profile`): arms at different grid points differ in
    depth or heads, so they are never pooled."""
    return ({point: {a: (np.stack(ms).mean(axis=0), sites[point, a]) for a, ms in arms.items()}
             for point, arms in routing.items()},
            {point: {a: mean_profile(ps) for a, ps in arms.items()} for point, arms in profiles.items()})
