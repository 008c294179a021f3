"""A variant is known by its own module (issue 50): no package code outside `models/residual/` writes a
variant's name, so nothing branches on one. What a caller needs to know of a variant it asks the variant
(`ResidualPathway.depth_reads`, `throughput_note`, `control`, `decode_state_elems`, ...).

One kind of occurrence is data, not a branch, and is allowed: the default of a config field (a dataclass's
annotated class attribute, `ResidualConfig.name = "prenorm"`): what a run gets when it names no variant.
YAML studies are data too and are not read here."""

from __future__ import annotations

import ast
from pathlib import Path

from reslab.models.residual import variants

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "models", "experiments", "orchestrator", "results", "api")


def _field_defaults(tree: ast.AST) -> set[int]:
    """ids of the constants that are the default of an annotated class attribute (a config field)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out |= {id(s.value) for s in node.body if isinstance(s, ast.AnnAssign) and s.value is not None}
    return out


def names_written(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant in `source` that is exactly a variant name, field defaults
    excepted; docstrings and messages that mention a name among other words are not a name."""
    tree = ast.parse(source)
    defaults = _field_defaults(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in defaults)


def test_the_measure_finds_a_branch_and_spares_a_default():
    source = ('class C:\n    name: str = "attnres"\n\n\ndef f(n):\n    """Says attnres."""\n'
              '    return n == "attnres" or n in ("mhar",)\n')
    assert names_written(source, {"attnres", "mhar"}) == [(7, "attnres"), (7, "mhar")]


def test_no_variant_name_outside_the_variants():
    names = set(variants())
    assert len(names) >= 18  # the registry, not a chosen subset
    bad = [f"{path.relative_to(ROOT)}:{line}: {name!r}"
           for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
           if (ROOT / "models" / "residual") not in path.parents
           for line, name in names_written(path.read_text(), names)]
    assert not bad, "variant names outside models/residual/ (ask the variant instead):\n" + "\n".join(bad)


def test_exactly_one_control():
    from reslab.models.residual import control

    assert [n for n, cls in variants().items() if cls.control] == [control()]
