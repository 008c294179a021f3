"""What a field of a typed config may hold beyond its type: `Annotated[T, Rule(...)]`, read by
`models.config.coerce` (the one loader: `models.config.load`).

    gpus_per_run: Annotated[int | None, Rule(low=1, high=1024)] = None
    tasks: Annotated[tuple[str, ...], Rule(nonempty=True, one_or_list=True)]

A value that is not of the field's type, or breaks a bound, raises a one-line `ConfigError`
`<field path>: <message>`: the rule's `message` (with `{got}`, the value as `shown`, and `{raw}`, its full
`repr`), else the loader's own words. An error inside a nested mapping keeps its own deeper path. The missing
text of a required field (`field(metadata=missing("give ..."))`) is what `load` says when it is absent.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reslab.common.errors import ConfigError

# A value quoted in an error message is cut to this many characters (a message stays one short line).
SHOWN_CHARS = 80
# The key under which a field's metadata holds what `load` says when a required field is absent.
MISSING = "reslab.missing"


def shown(value: Any) -> str:
    """`repr(value)` cut to `SHOWN_CHARS` for an error message."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def missing(text: str) -> dict[str, str]:
    """A required field's metadata: `<path>: missing; <text>` when a mapping leaves it out."""
    return {MISSING: text}


class Worded(ConfigError):
    """An error in a rule's words: a rule around it (a union's, a list's) keeps them."""


@dataclass(frozen=True)
class Rule:
    """Bounds and shape of one field's value (module docstring). `low`/`high`: a number's range; `nonempty`: a
    list or mapping with at least one item (null refused too); `max_len` and `pattern`: a string's length and
    form (`re.fullmatch`; null or a non-string refused); `choices`: the values allowed, whatever the type;
    `null: false`: an optional key (None when absent) that may not be written as null;
    `one_or_list`: a single item stands for a list of one; `message`: what an error says
    after the path, for the value's type and every bound alike (`{hint}`: the closest choice, if one is close)."""

    low: float | None = None
    high: float | None = None
    nonempty: bool = False
    max_len: int | None = None
    pattern: str | None = None
    one_or_list: bool = False
    choices: tuple[Any, ...] | None = None
    null: bool = True
    message: str | None = None

    def fail(self, value: Any, where: str, default: str) -> ConfigError:
        if self.message is None:
            return Worded(f"{where}: {default}")
        close = difflib.get_close_matches(str(value)[:100], [str(c) for c in self.choices or ()], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return Worded(f"{where}: {self.message.format(got=shown(value), raw=repr(value), hint=hint)}")

    def bounds_text(self, value: Any) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            return f"expected an integer from {low} to {high}, got {shown(value)}"
        if self.low is not None:
            return f"expected an integer >= {low}, got {shown(value)}"
        return f"expected an integer <= {high}, got {shown(value)}"

    def broken(self, value: Any) -> str | None:
        """The loader's words for a bound `value` (already of the field's type) breaks; None when it keeps all."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and ((self.low is not None and value < self.low) or (self.high is not None and value > self.high)):
            return self.bounds_text(value)
        if self.nonempty and (value is None or (isinstance(value, (tuple, list, dict)) and not value)):
            return f"expected at least one item, got {shown(value)}"
        if self.pattern is not None and not isinstance(value, str):
            return f"{shown(value)} is not allowed"
        if isinstance(value, str):
            if self.max_len is not None and len(value) > self.max_len:
                return f"{shown(value)} is longer than {self.max_len} characters"
            if self.pattern is not None and not re.fullmatch(self.pattern, value):
                return f"{shown(value)} is not allowed"
        return None


def _number(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _sections(tp: Any) -> list[type]:
    """The dataclasses a type is or may be (`X`, `X | None`, `X | str`)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]


def same_shape(tp: Any, value: Any) -> bool:
    """Whether `value` is a mapping for a section or mapping type, a list for a list type, or a value of the very
    scalar type (an integer for `Annotated[int, ...]`): in a union, the arm whose error says what is wrong."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if tp in (int, float, str, bool):
        return type(value) is tp
    origin = typing.get_origin(tp)
    if isinstance(value, dict):
        return origin is dict or (isinstance(tp, type) and dataclasses.is_dataclass(tp))
    return isinstance(value, (list, tuple)) and origin in (tuple, list)


def _speaks_inside(tp: Any) -> bool:
    """Whether a value of `tp` holds parts with their own words: a dataclass or an annotated type anywhere
    inside (a list of sections, a mapping to annotated values). Their errors keep their deeper paths."""
    if (isinstance(tp, type) and dataclasses.is_dataclass(tp)) or typing.get_origin(tp) is typing.Annotated:
        return True
    return any(_speaks_inside(a) for a in typing.get_args(tp) if a is not Ellipsis)


def coerce_annotated(tp: Any, value: Any, where: str, coerce: Callable[[Any, Any, str], Any]) -> Any:
    """`coerce` for `Annotated[T, Rule]`: T's check, then the rule's bounds, every failure in the rule's words.
    A mapping given for a section (a dataclass) is loaded by it, and its own errors name their deeper paths."""
    inner, *extras = typing.get_args(tp)
    rule = next((e for e in extras if isinstance(e, Rule)), Rule())
    if rule.one_or_list and isinstance(value, str):
        value = [value]
    if value is None and not rule.null:  # before a section's type, which reads null as an empty mapping
        raise rule.fail(value, where, "null is not allowed")
    if rule.choices is not None:
        if value not in rule.choices:
            allowed = ", ".join(map(str, rule.choices))
            raise rule.fail(value, where, f"{shown(value)} is not allowed; allowed: {allowed}")
        return value
    if isinstance(value, dict) and _sections(inner):
        return coerce(inner, value, where)
    try:
        out = coerce(inner, value, where)
    except ConfigError as exc:
        deeper = _speaks_inside(inner) and not str(exc).startswith(f"{where}: ")
        if rule.message is None or isinstance(exc, Worded) or deeper:
            raise  # a part's own error keeps its words and its deeper path
        raise rule.fail(value, where, str(exc)) from None
    broken = rule.broken(out)
    if broken is not None:
        raise rule.fail(value, where, broken)
    return out


__all__ = ["MISSING", "Rule", "SHOWN_CHARS", "coerce_annotated", "missing", "same_shape", "shown"]
