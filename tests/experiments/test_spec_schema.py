"""The study schema: shipped examples load, and every kind of mistake is reported with the file,
the field path and what is allowed."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from reslab.common.metrics import SUMMARY_METRICS
from reslab.experiments import SpecError, expand, load_study

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

BASE = """
study: s
base:
  model: {preset: tiny, d_model: 32, seq_len: 32, n_layers: 2}
  optim: {batch_size: 4}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - control: control
"""


def write(tmp_path: Path, text: str, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def with_change(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new)


def error_of(tmp_path: Path, text: str, overrides=()) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        expand(load_study(path, overrides))
    message = str(info.value)
    assert message.startswith(str(path)), message
    return message


# studies that read a local file the repository cannot ship; tests/models/test_hf_import.py loads each
# with a checkpoint it writes
NEEDS_A_CHECKPOINT = {"delta_from_pretrained"}


def test_shipped_studies_load_and_expand():
    counts = {}
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        if path.stem in NEEDS_A_CHECKPOINT:
            continue
        study = load_study(path)
        runs = expand(study)
        assert len(runs) == len(study.arms) * len(study.seeds) * len(study.grid_points())
        # a gates study's result is its gates' decisions (`gates:`), not a comparison's rows
        assert study.comparisons or study.gates, f"{path.name} declares no comparison"
        counts[path.stem] = len(runs)
    assert set(counts) >= {"quickstart", "attnres_vs_prenorm", "routing_ablation", "head_sweep"}


def test_quickstart_is_the_cpu_study():
    study = load_study(EXPERIMENTS / "quickstart.yaml")
    runs = expand(study)
    assert {r.config.residual.name for r in runs} == {"prenorm", "attnres", "block_attnres"}
    assert {r.config.model.preset for r in runs} == {"tiny"}
    assert len(study.seeds) == 3 and len(runs) == 9
    assert all(r.config.train.steps == 200 and r.config.train.checkpoint_every > 0 for r in runs)


def test_head_sweep_uses_mhar_heads():
    runs = expand(load_study(EXPERIMENTS / "head_sweep.yaml"))
    heads = sorted({r.config.residual.options["heads"] for r in runs if r.config.residual.name == "mhar"})
    assert heads == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("seeds: 2", "seeds: 2\nsedes: 3", ["top level", "'sedes'", "allowed: study, description, base, arms"]),
        ("optim: {batch_size: 4}", "optim: {batch_size: 4, lrr: 0.1}",
         ["base.optim", "'lrr'", "allowed: lr, min_lr_ratio"]),
        ("optim: {batch_size: 4}", "optim: {batch_size: four}", ["base.optim.batch_size", "expected an integer"]),
        ("optim: {batch_size: 4}", "optim: {batch_size: 4, lr: fast}", ["base.optim.lr", "expected a number"]),
        ("attnres: {residual: attnres}", "attnres: {residual: attnress}",
         ["arms.attnres.residual.name", "'attnress'", "allowed:", "block_attnres", "prenorm"]),
        ("attnres: {residual: attnres}", "attnres: {residual: {name: attnres, options: {heads: 4}}}",
         ["arms.attnres.residual.options (attnres)", "'heads'", "allowed: query_init, query_init_std, readout"]),
        ("attnres: {residual: attnres}", "attnres: {residual: {name: attnres, options: {readout: maybe}}}",
         ["arms.attnres.residual.options (attnres).readout", "expected true or false"]),
        ("attnres: {residual: attnres}", "attnres: {resid: attnres}",
         ["arms.attnres", "'resid'", "did you mean 'residual'", "allowed: description, residual, model"]),
        ("  - control: control", "  - control: baseline",
         ["comparisons[0].control", "'baseline' is not an arm", "allowed: control, attnres"]),
        ("  - control: control", "  - {control: control, treatments: [attnres, mhar]}",
         ["comparisons[0].treatments[1]", "'mhar' is not an arm", "allowed: control, attnres"]),
        ("  - control: control", "  - {control: control, metric: val_acc}",
         ["comparisons[0].metric", "'val_acc'", "allowed: " + ", ".join(SUMMARY_METRICS)]),
        ("  - control: control", "  - {control: control, direction: down}",
         ["comparisons[0].direction", "allowed: minimize, maximize"]),
        ("seeds: 2", "seeds: 2\ngrid: {optim.learning_rate: [1.0e-3, 2.0e-3]}",
         ["grid", "'optim.learning_rate'", "unknown field optim.learning_rate", "allowed: optim.lr"]),
        ("seeds: 2", "seeds: 2\ngrid: {optim: [1, 2]}", ["grid", "'optim' is a section"]),
        ("seeds: 2", "seeds: 2\ngrid: {optim.lr.x: [1, 2]}", ["grid", "'optim.lr' is a value, not a section"]),
        ("seeds: 2", "seeds: 2\ngrid: {residual.options.heads: [1, 2]}",
         ["grid.residual.options.heads", "arm 'control'", "'prenorm' has no knob 'heads'", "its knobs: (none)"]),
        ("seeds: 2", "seeds: 2\ngrid: {model.preset: [tiny, huge]}",
         ["arms.control at grid point model.preset='huge'", "unknown preset 'huge'", "allowed: tiny, small"]),
        ("seeds: 2", "seeds: 2\ngrid: {optim.lr: []}", ["grid.optim.lr", "non-empty list"]),
        ("seeds: 2", "seeds: 2\ngrid: {residual.name: [prenorm, attnres]}", ["grid.residual.name", "arms"]),
        ("seeds: 2", "seeds: [1, 1]", ["seeds", "[1] repeat"]),
        ("seeds: 2", "seeds: many", ["seeds", "expected a count"]),
        ("train: {steps: 6}", "train: {steps: 6, seed: 3}", ["base.train.seed", "seeds"]),
        ("train: {steps: 6}", "train: {steps: 0}", ["train.steps", "must be >= 1"]),
        ("attnres: {residual: attnres}",
         "attnres: {residual: attnres, optim: {lr: 1.0e-3}}\nseeds: 1\ngrid: {optim.lr: [1.0e-3]}",
         ["grid", "optim.lr"]),
        ("study: s", "study: 'my study'", ["study", "'my study' is not allowed"]),
    ],
    ids=[
        "unknown-top-key", "unknown-base-key", "wrong-type-int", "wrong-type-float", "unknown-variant",
        "unknown-knob", "knob-wrong-type", "unknown-arm-key", "comparison-missing-control",
        "comparison-missing-treatment", "unknown-metric", "bad-direction", "bad-grid-path",
        "grid-path-is-section", "grid-path-through-value", "grid-knob-not-on-every-arm", "grid-bad-value",
        "grid-empty", "grid-over-variants", "seeds-repeat", "seeds-type", "seed-in-base", "bad-value",
        "arm-and-grid-clash", "bad-study-name",
    ],
)
def test_schema_errors_name_file_path_and_allowed(tmp_path, old, new, expect):
    text = with_change(old, new)
    if "seeds: 1\ngrid" in new:  # that case replaces the seeds line too
        text = text.replace("seeds: 2\n", "", 1)
    message = error_of(tmp_path, text)
    for part in expect:
        assert part in message, f"{part!r} not in: {message}"


def test_duplicate_yaml_key_is_an_error(tmp_path):
    message = error_of(tmp_path, BASE.replace("  attnres: {residual: attnres}",
                                              "  attnres: {residual: attnres}\n  attnres: {residual: block_attnres}"))
    assert "duplicate key 'attnres'" in message and "line" in message


def test_yaml_merge_keys_still_work(tmp_path):
    text = BASE.replace("  attnres: {residual: attnres}", textwrap.dedent("""\
      a1: &arm {residual: attnres, optim: {lr: 2.0e-3}}
      a2: {<<: *arm, residual: block_attnres}""").replace("\n", "\n  ").join(["  ", ""]))
    text = text.replace("  - control: control", "  - {control: control, treatments: [a1, a2]}")
    study = load_study(write(tmp_path, text))
    runs = {r.arm: r for r in expand(study) if r.seed == 0}
    assert runs["a2"].config.optim.lr == 2e-3 and runs["a2"].config.residual.name == "block_attnres"


def test_two_arms_with_one_config_are_an_error(tmp_path):
    text = BASE.replace("  attnres: {residual: attnres}",
                        "  attnres: {residual: attnres}\n  same: {residual: {name: attnres, options: {readout: true}}}")
    message = error_of(tmp_path, text)
    assert "arms.same: resolves to the same config as arms.attnres" in message


def test_arm_overrides_any_base_field_and_replaces_knobs(tmp_path):
    text = BASE.replace("  attnres: {residual: attnres}", textwrap.dedent("""\
      attnres: {residual: attnres}
      block_fast:
        residual: {name: block_attnres, options: {block_size: 2}}
        optim: {lr: 3.0e-3}
        train: {eval_every: 2}""").replace("\n", "\n  ").join(["  ", ""]))
    text = text.replace("  optim: {batch_size: 4}",
                        "  optim: {batch_size: 4, lr: 1.0e-3}\n  residual: {impl: reference}")
    runs = {r.arm: r for r in expand(load_study(write(tmp_path, text))) if r.seed == 1}
    assert runs["block_fast"].config.optim.lr == 3e-3 and runs["attnres"].config.optim.lr == 1e-3
    assert runs["block_fast"].config.optim.batch_size == 4  # the rest of the section stays the base's
    assert runs["block_fast"].config.train.eval_every == 2 and runs["control"].config.train.eval_every == 50
    assert runs["block_fast"].config.residual.options["block_size"] == 2
    assert runs["attnres"].config.residual.options == {"query_init": "zero", "query_init_std": 0.02, "readout": True,
                                                       "key_norm": True, "score": "softmax", "query_form": "static",
                                                       "stream_scale": True}
    assert all(r.config.residual.impl == "reference" for r in runs.values())  # inherited from base


def test_grid_crosses_axes_and_applies_to_every_arm(tmp_path):
    text = BASE.replace("seeds: 2",
                        "seeds: [3]\ngrid:\n  model.d_model: [32, 64]\n  optim.lr: [1.0e-3, 2.0e-3, 4.0e-3]")
    runs = expand(load_study(write(tmp_path, text)))
    assert len(runs) == 2 * 2 * 3
    keys = sorted({r.grid_key for r in runs})
    assert keys[0] == "model.d_model=32,optim.lr=0.001"
    for r in runs:
        point = dict(r.grid)
        assert r.config.model.d_model == point["model.d_model"] and r.config.optim.lr == point["optim.lr"]


def test_grid_over_a_knob_when_every_arm_has_it(tmp_path):
    text = BASE.replace("  control: prenorm\n  attnres: {residual: attnres}",
                        "  full: mhar\n  block: {residual: {name: block_mhar, options: {block_size: 2}}}")
    text = text.replace("seeds: 2", "seeds: 1\ngrid: {residual.options.heads: [1, 2, 4, 8, 16]}")
    text = text.replace("  - control: control", "  - control: full")
    runs = expand(load_study(write(tmp_path, text)))
    assert sorted(r.config.residual.options["heads"] for r in runs if r.arm == "full") == [1, 2, 4, 8, 16]
    assert {r.grid_key for r in runs if r.arm == "block"} == {f"residual.options.heads={h}" for h in (1, 2, 4, 8, 16)}


def test_cli_set_overrides_apply_to_every_run_and_are_checked(tmp_path):
    path = write(tmp_path, BASE)
    runs = expand(load_study(path, [("train.steps", 3), ("optim.lr", 5e-4)]))
    assert all(r.config.train.steps == 3 and r.config.optim.lr == 5e-4 for r in runs)
    with pytest.raises(SpecError, match=r"--set: 'train.stepz': unknown field train.stepz"):
        load_study(path, [("train.stepz", 3)])
    with pytest.raises(SpecError, match=r"--set train.seed: seeds come from"):
        load_study(path, [("train.seed", 3)])


def test_set_a_field_of_the_optional_moe_section(tmp_path, capsys):
    """`--set model.moe.top_k=1` on a spec with no moe section: the section starts from what the missing one
    stands for (tiny-moe's MoE, models.presets.MOE_PRESETS; MoEConfig's defaults on a dense preset) with that
    one field changed; a wrong field or value is one line naming it, exit 2 from the CLI."""
    import dataclasses

    from reslab.models.config import MoEConfig
    from reslab.models.presets import MOE_PRESETS
    from reslab.orchestrator.cli import main

    moe = write(tmp_path, BASE.replace("preset: tiny,", "preset: tiny-moe,"), "moe.yaml")
    runs = expand(load_study(moe, [("model.moe.top_k", 1)]))
    assert {r.config.model.moe for r in runs} == {dataclasses.replace(MOE_PRESETS["tiny-moe"], top_k=1)}
    dense = expand(load_study(write(tmp_path, BASE), [("model.moe.experts", 4)]))
    assert {r.config.model.moe for r in dense} == {MoEConfig(experts=4)}
    off = expand(load_study(moe, [("model.moe", None)]))  # null: the preset's MoE, as if unset
    assert {r.config.model.moe for r in off} == {None}
    with pytest.raises(SpecError, match=r"--set: 'model.moe.topk': unknown field model.moe.topk \(did you mean"):
        load_study(moe, [("model.moe.topk", 1)])
    with pytest.raises(SpecError, match=r"model.moe.top_k: 9 is not allowed; allowed: 1..experts \(8\)"):
        load_study(moe, [("model.moe.top_k", 9)])
    capsys.readouterr()
    assert main(["plan", str(moe), "--set", "model.moe.top_k=1"]) == 0
    assert "MoE: params, FLOPs and tok/param count the active parameters" in capsys.readouterr().out
    for command in ("plan", "run"):
        assert main([command, str(moe), "--set", "model.moe.top_k=9", "--workspace", str(tmp_path / "ws")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "model.moe.top_k: 9 is not allowed" in err, err


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="no such study file"):
        load_study(tmp_path / "nope.yaml")
    bad = write(tmp_path, "arms: [unclosed\n")
    with pytest.raises(SpecError, match=r"study.yaml: invalid YAML at line 2, column 1: while parsing a flow sequence"):
        load_study(bad)


def test_resources_place_runs_and_bad_values_name_what_is_allowed(tmp_path):
    from reslab.experiments.spec import StudyResources

    base = "study: r\nbase: {model: {preset: tiny}}\narms: {control: prenorm}\nseeds: 2\n"
    path = tmp_path / "r.yaml"
    path.write_text(base + "resources: {gpus_per_run: 8, sharding: fsdp}\n")
    assert load_study(path).resources == StudyResources(8, "fsdp")
    path.write_text(base)
    assert load_study(path).resources == StudyResources()
    for bad, says in (("{gpus_per_run: 0}", "resources.gpus_per_run: expected an integer from 1 to 1024"),
                      ("{gpus_per_run: 1.5}", "resources.gpus_per_run"),
                      ("{sharding: zero3}", "resources.sharding: 'zero3' is not allowed; allowed: ddp, fsdp"),
                      ("{gpu_per_run: 2}", "resources"), ("8", "resources: expected a mapping")):
        path.write_text(base + f"resources: {bad}\n")
        with pytest.raises(SpecError, match=re.escape(says)):
            load_study(path)


def test_pipeline_resources_and_what_a_split_cannot_take_are_refused_at_load(tmp_path):
    """`resources.pipeline_stages` (issue 38): each refusal is one line naming the field, exit status 2, at load
    (before any rank starts)."""
    from reslab.experiments.spec import PipelineResources

    def study(resources: str, arm: str = "prenorm", base: str = "model: {preset: tiny, n_layers: 2}") -> Path:
        path = tmp_path / "p.yaml"
        path.write_text(f"study: p\nbase: {{{base}}}\narms: {{control: {arm}}}\nseeds: 1\nresources: {resources}\n")
        return path

    ok = "{gpus_per_run: 2, pipeline_stages: 2, pipeline_schedule: 1f1b, microbatches: 2}"
    assert load_study(study(ok)).resources.pipeline == PipelineResources(2, "1f1b", 2)
    assert load_study(study("{gpus_per_run: 2}")).resources.pipeline == PipelineResources()
    cached = "{gpus_per_run: 2, pipeline_stages: 2, pipeline_virtual_stages: 2, pipeline_cache: true}"
    assert load_study(study(cached, "{residual: block_attnres}", "model: {preset: tiny, n_layers: 4}")
                      ).resources.pipeline == PipelineResources(2, "gpipe", 1, 2, True)
    # 2 replicas of 2 stages: each replica's share of the batch of 4 in 2 micro-batches
    replicated = load_study(study("{gpus_per_run: 4, pipeline_stages: 2, microbatches: 2}", base=(
        "model: {preset: tiny, n_layers: 2}, optim: {batch_size: 4}"))).resources
    assert (replicated.pipeline, replicated.replicas) == (PipelineResources(2, "gpipe", 2), 2)
    triton = "{name: attnres, impl: triton}"
    for resources, arm, base, says in (
        ("{gpus_per_run: 4, pipeline_stages: 4}", "prenorm", "model: {preset: tiny, n_layers: 2}",
         "resources.pipeline_stages: 4 stages for arms.control's model of 2 layers; allowed: 2..2"),
        ("{gpus_per_run: 2, pipeline_stages: 2}", f"{{residual: {triton}}}", "model: {preset: tiny, n_layers: 2}",
         "arms.control.residual (attnres) cannot cross a stage boundary: residual.impl: 'triton' keeps"),
        ("{gpus_per_run: 2, pipeline_stages: 2, microbatches: 3}", "prenorm",
         "model: {preset: tiny, n_layers: 2}, optim: {batch_size: 4}",
         "resources.microbatches: 3 micro-batches x 1 replica(s) (gpus_per_run / pipeline_stages) does not divide "
         "arms.control's optim.batch_size 4"),
        ("{gpus_per_run: 4, pipeline_stages: 2, microbatches: 2}", "prenorm",
         "model: {preset: tiny, n_layers: 2}, optim: {batch_size: 2}",
         "resources.microbatches: 2 micro-batches x 2 replica(s) (gpus_per_run / pipeline_stages) does not divide "
         "arms.control's optim.batch_size 2; allowed: a batch size that is a multiple of microbatches x replicas"),
        ("{gpus_per_run: 3, pipeline_stages: 2}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_stages: 2 stages do not divide gpus_per_run 3"),
        ("{gpus_per_run: 2, pipeline_stages: 2, sharding: fsdp}", "prenorm", "model: {preset: tiny}",
         "resources.sharding: fsdp with pipeline_stages is not supported"),
        ("{gpus_per_run: 2, pipeline_stages: 2}", "prenorm", "model: {preset: tiny}, optim: {name: muon}",
         "arms.control.optim.name: muon with pipeline_stages is not supported"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_schedule: zb}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_schedule: 'zb' is not allowed; allowed: gpipe, 1f1b"),
        ("{microbatches: 2}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_stages: microbatches need pipeline_stages >= 2"),
        # virtual stages and Kimi's cross-stage caching (models.pipeline.virtual_error, cache_error)
        ("{pipeline_cache: true}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_stages: pipeline_cache need pipeline_stages >= 2"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_cache: true}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_cache: Kimi's cross-stage caching needs pipeline_virtual_stages >= 2"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_cache: 1}", "prenorm", "model: {preset: tiny}",
         "resources.pipeline_cache: expected true or false, got 1"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_virtual_stages: 2}", "prenorm",
         "model: {preset: tiny, n_layers: 3}",
         "resources.pipeline_virtual_stages: 2 stages x 2 virtual stages = 4 stage modules for a model of 3 layers"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_virtual_stages: 2, pipeline_schedule: 1f1b, "
         "microbatches: 5}", "prenorm", "model: {preset: tiny, n_layers: 4}, optim: {batch_size: 5}",
         "resources.microbatches: 5 micro-batches under Interleaved 1F1B on 2 ranks, not a multiple of its 2"),
        ("{gpus_per_run: 2, pipeline_stages: 2, pipeline_virtual_stages: 2, pipeline_cache: true}", "dar",
         "model: {preset: tiny, n_layers: 4}",
         "resources.pipeline_cache: dar's state keeps tensors across a boundary (before site 4) but is declared"),
    ):
        with pytest.raises(SpecError, match=re.escape(says)) as caught:
            load_study(study(resources, arm, base))
        assert "\n" not in str(caught.value) and caught.value.exit_code == 2


def test_a_gpus_per_run_flag_that_does_not_fit_the_pipeline_stages_is_refused_before_any_write(tmp_path, capsys):
    """`--gpus-per-run` overrides `resources.gpus_per_run`; on a study of S stages it may be a multiple of S (S x D:
    D replicas of the stages, whose micro-batches must divide each replica's share of the batch) or 1 (one
    process, no stages: the reference the equivalence tests train), nothing else: exit 2, one line, and the
    workspace stays empty."""
    from reslab.orchestrator.cli import main

    path = tmp_path / "p.yaml"
    path.write_text("study: p\nbase: {model: {preset: tiny, n_layers: 2}, optim: {batch_size: 2}}\n"
                    "arms: {control: prenorm}\nseeds: 1\n"
                    "resources: {gpus_per_run: 2, pipeline_stages: 2}\n")
    ws = tmp_path / "ws"
    for flag, says in (("3", "--gpus-per-run: 3 GPUs for a study of resources.pipeline_stages 2; allowed: a "
                              "multiple of 2 (stages x data-parallel replicas) or 1"),
                       ("8", "resources.microbatches: 1 micro-batches x 4 replica(s) (gpus_per_run / pipeline_stages) "
                             "does not divide arms.control's optim.batch_size 2")):
        assert main(["run", str(path), "--workspace", str(ws), "--gpus-per-run", flag]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err
        assert "\n" not in err
    assert not (ws / "runs").exists() or not any((ws / "runs").iterdir())


def test_an_arm_that_names_some_moe_fields_keeps_the_presets_others(tmp_path):
    """An arm's `model: {moe: {top_k: 1}}` on `tiny-moe` changes that one field of the preset's MoE (8 experts of
    width 96), as `--set model.moe.top_k=1` does; before, the section replaced the preset's MoE with MoEConfig's
    defaults (expert_hidden null: the dense width), silently training a different model than the name says."""
    import dataclasses

    from reslab.models.config import MoEConfig
    from reslab.models.presets import MOE_PRESETS

    top1 = "arms:\n  top1: {residual: prenorm, model: {moe: {top_k: 1}}}"
    spec = BASE.replace("preset: tiny,", "preset: tiny-moe,").replace("arms:", top1, 1)
    runs = expand(load_study(write(tmp_path, spec, "moe.yaml")))
    expected = dataclasses.replace(MOE_PRESETS["tiny-moe"], top_k=1)
    assert {r.config.model.moe for r in runs if r.arm == "top1"} == {expected}
    dense = expand(load_study(write(tmp_path, BASE.replace("arms:", top1, 1), "dense.yaml")))
    assert {r.config.model.moe for r in dense if r.arm == "top1"} == {MoEConfig(top_k=1)}
