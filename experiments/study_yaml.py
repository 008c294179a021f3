"""Reading a study file: a safe YAML loader within bounds on what hostile input could cost, every problem one
line naming the file (`experiments.spec` validates what it reads)."""

from __future__ import annotations

import collections.abc
from pathlib import Path
from typing import Any

import yaml

from reslab.models.config import ConfigError, shown

# Bounds on the YAML itself, checked while it is read: file size, nesting, aliases, and the number
# of values after aliases are expanded (an alias bomb is small on disk and huge once expanded).
MAX_FILE_BYTES = 256 * 1024
MAX_DEPTH = 50
MAX_ALIASES = 100
MAX_EXPANDED_NODES = 100_000


class SpecError(ConfigError):
    """A study file is wrong. The message starts with the file and names the field path."""


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key repeated in one mapping (merge keys `<<` excepted),
    nesting deeper than `MAX_DEPTH`, more than `MAX_ALIASES` aliases, a recursive alias, and a
    document that expands to more than `MAX_EXPANDED_NODES` values."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases (*name)", mark)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {})
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values in the document once aliases are expanded (shared nodes counted at every use)."""
    key = id(node)
    if key in sizes:
        if sizes[key] < 0:
            raise yaml.composer.ComposerError(None, None, "an alias refers to the node that contains it",
                                              node.start_mark)
        return sizes[key]
    sizes[key] = -1
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1 + sum(_expanded_size(child, sizes) for child in children)
    if total > MAX_EXPANDED_NODES:
        raise yaml.composer.ComposerError(
            None, None, f"expands to more than {MAX_EXPANDED_NODES} values through its aliases", node.start_mark
        )
    sizes[key] = total
    return total


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, collections.abc.Hashable):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found a list or mapping as a key", key_node.start_mark
            )
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {shown(key)} (first defined on line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file safely within the bounds above; every problem (missing, too large, not
    UTF-8, syntax, duplicate key, alias bomb) raises a one-line `SpecError` with the line."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such study file")
    if not path.is_file():
        raise SpecError(f"{path}: not a regular file; expected a YAML study file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{path}: cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB; a study file is a short YAML text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); expected a YAML study file"
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(str(x) for x in (exc.context, exc.problem) if x)
        raise SpecError(f"{path}: invalid YAML{at}: {what}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(f"{path}: invalid YAML: nested too deeply (at most {MAX_DEPTH} levels)") from None


__all__ = ["MAX_ALIASES", "MAX_DEPTH", "MAX_EXPANDED_NODES", "MAX_FILE_BYTES", "SpecError", "load_yaml"]
