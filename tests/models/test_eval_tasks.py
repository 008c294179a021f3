"""The local next-line task (`models.evals.next_line`) and the harness wrapper (`models.evals.harness`): the items
are what the docstring promises (the true next line among lines of other held-out documents, deterministic), the
task runs through lm-evaluation-harness from local files with the hub off, its per-item records agree with the
adapter's own log-likelihoods, and bad task names and unavailable data sets are one line each. Slow tier: the harness
indexes its task registry (about 10 s) and builds the local task from a prepared corpus."""

import json

import pytest
import torch
import yaml

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from reslab.common.errors import ConfigError  # noqa: E402
from reslab.models.backbone import build_model  # noqa: E402
from reslab.models.config import ModelConfig, ResidualConfig  # noqa: E402
from reslab.models.data.corpus import stdlib_documents  # noqa: E402
from reslab.models.data.prepare import PrepareOptions, prepare  # noqa: E402
from reslab.models.data.tokenizer import ByteTokenizer  # noqa: E402
from reslab.models.evals.adapter import ReslabLM  # noqa: E402
from reslab.models.evals.harness import check_tasks, run_tasks, task_manager  # noqa: E402
from reslab.models.evals.next_line import (  # noqa: E402
    CONFIG_FILE,
    ITEMS_FILE,
    TASK_NAME,
    NextLineOptions,
    build_items,
    prepare_next_line,
    val_documents,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hub_off")]  # nothing here may reach the hub


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    docs = [d for _, d in zip(range(80), stdlib_documents(), strict=False)]
    out = tmp_path_factory.mktemp("corpus") / "c"
    prepare(docs, out, PrepareOptions(tokenizer=ByteTokenizer(), val_fraction=0.25, source_description="test"))
    return out


@pytest.fixture(scope="module")
def manager(corpus):
    """The harness's registry with the local task's folder (indexing it takes seconds: once per module)."""
    return task_manager([prepare_next_line(corpus, NextLineOptions(items=40))])


def test_items_are_the_true_next_line_among_other_documents_lines(corpus):
    texts = val_documents(corpus)
    options = NextLineOptions(items=200, distractors=3, seed=1)
    items = list(build_items(texts, options))
    assert len(items) == 200 and items == list(build_items(texts, options))
    lines_of = [t.split("\n") for t in texts]
    for item in items:
        doc, line = item["doc"], item["line"]
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert all(len(c) <= options.max_chars + 1 and len(c.strip()) >= options.min_chars for c in item["choices"])
        assert item["choices"][item["gold"]] == lines_of[doc][line] + "\n"
        assert item["context"].endswith(lines_of[doc][line - 1] + "\n")
        assert len(item["context"]) <= options.context_chars or item["context"].count("\n") == 1
        others = [c for k, c in enumerate(item["choices"]) if k != item["gold"]]
        assert all(any(c[:-1] in lines_of[d] for d in range(len(texts)) if d != doc) for c in others)
    assert len({i["doc"] for i in items}) > 5                 # spread over the split's documents
    assert 0.1 < sum(i["gold"] == 0 for i in items) / len(items) < 0.4


def test_the_task_folder_is_written_once_and_names_its_local_file(corpus):
    folder = prepare_next_line(corpus, NextLineOptions(items=50))
    assert prepare_next_line(corpus, NextLineOptions(items=50)) == folder
    config = yaml.safe_load((folder / CONFIG_FILE).read_text())
    assert config["task"] == TASK_NAME and config["dataset_path"] == "json"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(folder / ITEMS_FILE)
    assert len((folder / ITEMS_FILE).read_text().splitlines()) == 50


def test_bad_options_are_one_line():
    with pytest.raises(ConfigError, match="next_line.distractors: 0"):
        NextLineOptions(distractors=0)
    with pytest.raises(ConfigError, match="next_line.max_chars: 5 is not allowed; allowed: an integer >= 12"):
        NextLineOptions(max_chars=5)


def test_the_harness_runs_the_local_task_offline_and_logs_every_item(corpus, manager):
    folder = prepare_next_line(corpus, NextLineOptions(items=40))
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = build_model(ModelConfig(preset="tiny"), ResidualConfig(), vocab_size=tok.vocab_size).eval()
    lm = ReslabLM(model, tok, batch_size=8)
    result = run_tasks(lm, [TASK_NAME], limit=30, manager=manager)
    records = result.records
    assert len(records) == 30 and set(records["task"]) == {TASK_NAME}
    assert sorted(records["doc_id"]) == list(range(30)) and records["doc_hash"].str.len().gt(0).all()
    assert result.metrics[TASK_NAME]["acc"] == pytest.approx(records["acc"].mean())
    assert result.higher_is_better[TASK_NAME]["acc"] is True
    items = [json.loads(line) for line in (folder / ITEMS_FILE).read_text().splitlines()]
    for row in records.itertuples():
        item = items[row.doc_id]
        requests = [Instance(request_type="loglikelihood", doc=item, arguments=(item["context"], c), idx=k)
                    for k, c in enumerate(item["choices"])]
        scores = [s for s, _ in lm.loglikelihood(requests)]
        assert row.loglikelihoods == pytest.approx(scores, abs=1e-4)
        assert row.acc == float(max(range(4), key=lambda k: scores[k]) == item["gold"])


def test_unknown_task_is_one_line_with_the_closest_names(manager):
    with pytest.raises(ConfigError, match=r"'hellaswg' is not a task.*did you mean 'hellaswag'"):
        check_tasks(["hellaswg"], manager=manager)


@pytest.mark.parametrize(("task", "needs"), [("arc_easy", "'arc_easy' needs the data set 'allenai/ai2_arc'"),
                                             ("mmlu", "'mmlu_.*' needs the data set 'cais/mmlu'")])  # a group's tasks
def test_a_hub_task_not_cached_offline_is_one_line(manager, task, needs):
    with pytest.raises(ConfigError, match=needs + r".* not in the Hugging Face cache and the hub is offline"):
        check_tasks([task], manager=manager)
