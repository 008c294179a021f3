"""What the registries of models/ share (residual variants, optimizers, schedules): a decorator that files a class
under its name in one table, and the import of a package's modules, which registers the classes they declare."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def registrar(table: dict[str, Any], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`@register("<name>")` for `table`: the class is filed under its name (its `name` attribute set); a second
    class under one name is an error naming both."""

    def register(name: str) -> Callable[[T], T]:
        def wrap(cls: T) -> T:
            if name in table and table[name] is not cls:
                raise ValueError(f"{kind} {name!r} is registered twice ({table[name]} and {cls})")
            setattr(cls, "name", name)  # noqa: B010 (T is any class; the registered ones declare `name`)
            table[name] = cls
            return cls

        return wrap

    return register


_IMPORTED: set[str] = set()  # the packages whose modules are imported (once a process)


def import_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of `package` but `base` and the private ones, once a process: each registers what it
    declares."""
    if package in _IMPORTED:
        return
    for info in pkgutil.iter_modules(list(path)):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
    _IMPORTED.add(package)
