"""`fastjson.loads` answers what `json.loads` answers (the reference: the standard library's parser), on the
text orjson parses and on the text only `json` takes, which `json.dumps` writes (NaN, Infinity) or a hand edit
can leave (lone surrogates, duplicate keys); bad text raises `json`'s ValueError. The one documented
difference: an integer past 64 bits reads as the nearest float."""

from __future__ import annotations

import json
import math

import pytest

from reslab.orchestrator.durability.fastjson import loads

TEXTS = {
    "a metrics row": '{"kind": "eval", "step": 20, "val_loss": 5.123456789012345, "time": 1733412345.25}',
    "nested, None and unicode": '{"a": [1, null, {"b": "\\u00e9t\\u00e9 \u00e9"}], "c": true, "d": -0.0}',
    "floats at the edge of rounding": json.dumps([0.1, 1e-308, 2.2250738585072014e-308, 1.7976931348623157e308,
                                                 5e-324, 123456789.12345679]),
    "NaN and Infinity, as json.dumps writes them": json.dumps({"x": math.nan, "y": [math.inf, -math.inf]}),
    "64-bit integers at both ends": '{"n": [-9223372036854775808, 18446744073709551615]}',
    "a lone surrogate": '{"s": "\\ud800"}',
    "a duplicate key": '{"k": 1, "k": 2}',
}


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN as text


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_the_value_is_jsons(text):
    for data in (text, text.encode("utf-8", "surrogatepass")):
        assert _same(loads(data), json.loads(text))


def test_an_integer_past_64_bits_reads_as_the_nearest_float():
    assert loads('{"n": 123456789012345678901234567890}') == {"n": float(123456789012345678901234567890)}


@pytest.mark.parametrize("data", [b'{"step": 1', b"{nope}", b'{"s": "\xff"}', b""], ids=["torn", "broken", "not UTF-8",
                                                                                       "empty"])
def test_bad_text_raises_a_value_error(data):
    with pytest.raises(ValueError):
        json.loads(data.decode("utf-8"))
    with pytest.raises(ValueError):
        loads(data)
