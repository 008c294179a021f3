"""Flag types shared by the benchmarks (standard library only: the fixed-cost bench times its imports)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse `type=`: a `kind` (int or float) no smaller than `low`, else one line naming what is allowed."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is not allowed; allowed: >= {low:g}")
        return value

    return parse
