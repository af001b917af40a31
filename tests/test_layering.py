"""The package layering of docs/architecture.md, checked on every module's imports.

The rule lives once, as the table under "Which package may import which" in docs/architecture.md; this
test reads that table, walks every module of every package (imports inside functions and ``TYPE_CHECKING``
blocks included) and fails on:

- an import of one of our packages that the importing package may not import;
- an import of a third-party package the table forbids (``temporalio`` in the engine node, ...);
- an import of a private module or name (``pkg._module``, ``from pkg.x import _name``) from outside that
  package, instead of its public face (``__all__`` in its ``__init__.py``); a test module may reach into
  the private modules of one package, the one it tests;
- a package of ours that the table does not list (so a new one cannot escape the rule).
"""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Top-level folders of Python code that are not packages of the table but must use the faces too.
CONSUMERS = ("scripts", "tests")


@dataclass(frozen=True)
class Rule:
    may_import: frozenset[str]
    must_not_import: frozenset[str]


def read_rules(text: str) -> dict[str, Rule]:
    """The table under the ``<!-- layering table`` marker: package | may import (of ours) | must not import."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("<!-- layering table")), None)
    if start is None:
        raise ValueError("docs/architecture.md has no '<!-- layering table' marker above the layering table")
    rules: dict[str, Rule] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if rules:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or set(cells[0]) <= {"-", ":"} or cells[0] == "package":
            continue
        names = [re.findall(r"`([A-Za-z_][\w.]*)`", c) for c in cells]
        if len(names[0]) != 1:
            raise ValueError(f"layering table row without one package name: {line!r}")
        rules[names[0][0]] = Rule(frozenset(names[1]), frozenset(names[2]))
    if not rules:
        raise ValueError("the layering table in docs/architecture.md has no rows")
    return rules


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # dotted, absolute
    names: tuple[str, ...]  # the names of a ``from`` import; empty for ``import x``


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every absolute import of a module, wherever it stands; relative imports resolve inside the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append(Import(path, node.lineno, module, tuple(a.name for a in node.names)))
    return out


def _private_part(imp: Import) -> str | None:
    parts = imp.module.split(".")
    private = [p for p in parts[1:] if p.startswith("_")] + [n for n in imp.names if n.startswith("_")]
    return private[0] if private else None


def violations(root: Path, rules: dict[str, Rule]) -> list[str]:
    """What breaks the layering under ``root``, one line each (empty when the code keeps it)."""
    ours = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    found = [f"package {name}/ is not in the layering table" for name in sorted(ours - rules.keys())]
    found += [f"the layering table names {name}, which has no package" for name in sorted(rules.keys() - ours)]
    for folder in sorted(ours | {c for c in CONSUMERS if (root / c).is_dir()}):
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            reached: dict[str, list[str]] = defaultdict(list)  # package -> its private modules this module uses
            for imp in imports_of(path, root):
                top = imp.module.split(".")[0]
                rule = rules.get(folder)
                if rule is not None and top in rule.must_not_import:
                    found.append(f"{where}:{imp.line}: {folder} must not import {top} ({imp.module})")
                if top not in ours or top == folder:
                    continue
                if rule is not None and top not in rule.may_import:
                    found.append(f"{where}:{imp.line}: {folder} may not import {top} ({imp.module})")
                private = _private_part(imp)
                if private is None:
                    continue
                if folder == "tests":
                    reached[top].append(f"{imp.line}: {imp.module}")
                else:
                    found.append(f"{where}:{imp.line}: {imp.module} ({private}) is private to {top}: "
                                 f"import it from {top}'s face")
            if len(reached) > 1:
                found.append(f"{where}: a test reaches into the private modules of {len(reached)} packages "
                             f"({', '.join(sorted(reached))}); use the faces of all but the one it tests: "
                             + "; ".join(f"{p} at {', '.join(v)}" for p, v in sorted(reached.items())))
    return found


def test_the_code_keeps_the_layering_of_the_architecture_page() -> None:
    rules = read_rules(ARCHITECTURE.read_text())
    assert {"hints", "engine_adapter", "orchestrator", "workflows", "replay"} <= rules.keys()
    assert violations(ROOT, rules) == []


@pytest.mark.parametrize("package", ["hints", "predictors", "engine_adapter", "engine_adapter.vllm_backend",
                                     "orchestrator", "workflows", "replay", "diagnose", "hintflow"])
def test_every_face_exports_what_it_lists(package: str) -> None:
    module = importlib.import_module(package)
    exported = module.__all__
    assert exported, f"{package} has an empty public face"
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert getattr(module, name) is not None, f"{package}.{name}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


TABLE = """# Architecture
<!-- layering table: tests/test_layering.py reads it -->
| package | may import (of ours) | must not import (third-party) |
|---|---|---|
| `hints` | — | `torch` |
| `engine_adapter` | `hints` | `temporalio` |
| `orchestrator` | `hints` | `temporalio` |
"""


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    """The checker itself, on a small tree: each bad import is reported, the good ones are not."""
    root = _tree(tmp_path, {
        "hints/__init__.py": "from hints._models import Pin\n",
        "hints/_models.py": "Pin = 1\n",
        "engine_adapter/__init__.py": "",
        "engine_adapter/_engine.py": (
            "from hints import Pin\n"  # fine: through the face
            "from . import _other\n"  # fine: relative, inside the package
            "def f():\n    import orchestrator\n"  # across the rule, inside a function
        ),
        "engine_adapter/_other.py": "from hints._models import Pin\n",  # private module of another package
        "orchestrator/__init__.py": "import temporalio\n",  # forbidden third-party
        "tests/test_x.py": "from engine_adapter._engine import f\nfrom hints._models import Pin\n",
        "newpkg/__init__.py": "",
    })
    found = violations(root, read_rules(TABLE))
    assert any("engine_adapter/_engine.py:4: engine_adapter may not import orchestrator" in v for v in found)
    assert any("engine_adapter/_other.py:1: hints._models (_models) is private to hints" in v for v in found)
    assert any("orchestrator/__init__.py:1: orchestrator must not import temporalio" in v for v in found)
    assert any("tests/test_x.py: a test reaches into the private modules of 2 packages" in v for v in found)
    assert "package newpkg/ is not in the layering table" in found
    assert not any("_engine.py:1" in v or "_engine.py:2" in v for v in found), found
    assert len(found) == 5, found


def test_a_table_without_its_marker_is_an_error() -> None:
    with pytest.raises(ValueError, match="layering table"):
        read_rules("| package | may import | must not |\n|---|---|---|\n| `hints` | — | — |\n")
