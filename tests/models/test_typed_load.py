"""The one typed loader (`models.config.load`) with field rules (`models.typed_load.Rule`): each error is one
line naming the field path; the expected messages are written out by hand from the rules' documented words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest

from reslab.models.config import TOP, ConfigError, load
from reslab.models.typed_load import Rule, missing


@dataclass(frozen=True, kw_only=True)
class Item:
    kind: Annotated[str, Rule(choices=("holm", "bh"), message="{got} is not allowed{hint}; allowed: holm, bh")] = "holm"


@dataclass(frozen=True, kw_only=True)
class Doc:
    name: Annotated[str | None, Rule(pattern=r"[a-z]+", max_len=5, message="name {got} is not allowed")] = None
    count: Annotated[int, Rule(low=1, high=4)] = 1
    least: Annotated[int | None, Rule(low=0)] = None
    tags: Annotated[tuple[str, ...], Rule(nonempty=True, one_or_list=True, message="expected tags, got {raw}")] = ()
    items: Annotated[tuple[Item, ...], Rule(message="expected a list of items, got {got}")] = ()
    sizes: dict[str, Annotated[int, Rule(low=0)]] = field(default_factory=dict)
    seeds: Annotated[Annotated[int, Rule(low=1, message="a count must be >= 1, got {got}")] | tuple[int, ...],
                     Rule(message="expected a count or a list, got {got}")] = 1


@dataclass(frozen=True, kw_only=True)
class Needs:
    what: str = field(metadata=missing("say what"))
    a: int = 0
    b: int = 0


def error(cls: type, data: Any, where: str = "doc") -> str:
    with pytest.raises(ConfigError) as info:
        load(cls, data, where)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_valid_document_loads_in_canonical_form():
    doc = load(Doc, {"name": "abc", "count": 4, "tags": "one", "items": [{"kind": "bh"}], "sizes": {"x": 0},
                     "seeds": [3, 5]})
    assert doc == Doc(name="abc", count=4, tags=("one",), items=(Item(kind="bh"),), sizes={"x": 0}, seeds=(3, 5))


@pytest.mark.parametrize(("data", "message"), [
    ({"count": 0}, "doc.count: expected an integer from 1 to 4, got 0"),
    ({"count": True}, "doc.count: expected an integer, got True"),
    ({"least": -1}, "doc.least: expected an integer >= 0, got -1"),
    ({"name": "ABC"}, "doc.name: name 'ABC' is not allowed"),
    ({"name": "abcdef"}, "doc.name: name 'abcdef' is not allowed"),
    ({"name": None}, "doc.name: name None is not allowed"),
    ({"tags": []}, "doc.tags: expected tags, got []"),
    ({"tags": [1]}, "doc.tags: expected tags, got [1]"),  # an item of a plain type: the list's words
    ({"items": 5}, "doc.items: expected a list of items, got 5"),
    ({"items": [{}, {"kind": "hlm"}]}, "doc.items[1].kind: 'hlm' is not allowed (did you mean 'holm'?); allowed: "
                                       "holm, bh"),
    ({"items": [{"knd": "bh"}]}, "doc.items[0]: unknown key(s) 'knd' (did you mean 'kind'?); allowed: kind"),
    ({"sizes": {"a": 1, "b": -1}}, "doc.sizes.b: expected an integer >= 0, got -1"),
    ({"seeds": 0}, "doc.seeds: a count must be >= 1, got 0"),  # the union's arm of an integer's shape
    ({"seeds": 2.5}, "doc.seeds: expected a count or a list, got 2.5"),
    ({"seeds": [1, "x"]}, "doc.seeds[1]: expected an integer, got 'x'"),
])
def test_each_error_names_its_field_in_the_rule_s_words(data, message):
    assert error(Doc, data) == message


def test_a_required_field_says_what_to_give():
    assert error(Needs, {}) == "doc.what: missing; say what"
    assert error(Needs, {}, TOP) == "what: missing; say what"


def test_at_the_top_level_fields_have_bare_paths():
    assert error(Doc, {"count": 9}, TOP) == "count: expected an integer from 1 to 4, got 9"
    assert error(Doc, {"cnt": 9}, TOP).startswith("top level: unknown key(s) 'cnt' (did you mean 'count'?)")


def test_unknown_keys_are_named_in_file_order_and_counted_past_five():
    data = {"what": "x", **{f"junk{i}": 1 for i in (9, 3, 7, 1, 5, 2, 8)}}
    assert error(Needs, data) == ("doc: unknown key(s) 'junk9', 'junk3', 'junk7', 'junk1', 'junk5' and 2 more; "
                                  "allowed: what, a, b")
