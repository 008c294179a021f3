"""`loads`: JSON text parsed as `json.loads` parses it, by orjson where orjson can.

A report at 10^5 runs parses a few hundred thousand rows (each run's eval rows and last diagnostics row, its
tags from the store): orjson takes 2.5x less time than `json` on a diagnostics row and 9x less on a metrics
row (issue 39). orjson refuses some text `json` accepts (NaN and Infinity, which `json.dumps` writes; lone
surrogates), so on any orjson error the text goes to `json`, whose value or error is the answer.

One difference is kept: an integer outside 64 bits (reslab never writes one: steps, token counts and times
are far inside) reads as the nearest float, where `json` gives a Python int. Finding such integers first (a
regex for 19 digits) took longer than orjson's whole parse.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["loads"]


def loads(data: bytes | str) -> Any:
    """`json.loads` of `data` (bytes: UTF-8, a bad byte raises `UnicodeDecodeError`, a `ValueError`)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
