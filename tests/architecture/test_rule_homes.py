"""docs/architecture.md "One home per rule": each rule's home exists and is the only one.

For each row, every file named must exist and define the names after it
(``Class.method`` allowed); a top-level name must be defined in no other
module of the broker or wire/, so a second copy of
the rule under the same name fails here.  Also the "Where each rule of the
specification lives" table: every file and name it gives exists.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# The broker and its codecs (toolkit and clients hold command-line parsers of
# other rules, e.g. cliutil.event_type reads "a/b/c" from a command line).
PRODUCT = ("broker", "wire")


def _table(title: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """Rows of the table under heading ``title``: (rule, [(file, [names])])."""
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start:end if end > 0 else None].splitlines():
        cells = line.split(" | ")
        if len(cells) < 2 or not line.startswith("| ") or line.startswith("|---"):
            continue
        homes: list[tuple[str, list[str]]] = []
        cell, attached, last_end = cells[-1], False, 0
        for match in re.finditer(r"`([^`]+)`", cell):
            token = match.group(1)
            # A name belongs to the file it directly follows (``file`` ``a``, ``b``).
            adjacent = re.fullmatch(r"[\s,]*", cell[last_end:match.start()]) is not None
            last_end = match.end()
            if re.fullmatch(r"[\w/]+\.(py|c)|[\w/]+/", token):
                if "/" not in token and homes:  # ``parquet.py`` next to the file before it
                    token = str(pathlib.PurePosixPath(homes[-1][0]).parent / token)
                homes.append((token, []))
                attached = True
            elif attached and adjacent and re.fullmatch(r"[A-Za-z_][\w.]*", token):
                homes[-1][1].append(token)
            else:
                attached = False
        if homes:
            rows.append((cells[0].strip("| "), homes))
    return rows


def _mentioned(path: pathlib.Path) -> set[str]:
    """Every name a module defines at any depth: functions, classes (and
    Class.method), assigned names and ``self.attributes``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{n.name}" for n in node.body
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def _anywhere() -> set[str]:
    found: set[str] = set()
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            found |= _mentioned(path)
    return found


def _defined(path: pathlib.Path) -> set[str]:
    """Top-level names a module defines, and Class.method for its classes' functions."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{n.name}" for n in node.body
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


_ANYWHERE = _anywhere()
ONE_HOME = _table("One home per rule")
SPEC = _table("Where each rule of the specification lives")


def test_the_tables_are_read():
    assert len(ONE_HOME) >= 10 and len(SPEC) >= 20


@pytest.mark.parametrize(("rule", "homes"), ONE_HOME + SPEC, ids=lambda v: str(v)[:40])
def test_each_home_exists_and_defines_its_names(rule, homes):
    for file, names in homes:
        path = ROOT / file
        assert path.exists(), f"{rule}: {file} does not exist"
        if names and path.suffix == ".py":
            # A name is defined in the file (at any depth); a ``Class.method``
            # the row points to from there may live in another module.
            here = _mentioned(path)
            missing = {n for n in set(names) - here
                       if "." not in n or (n not in _ANYWHERE
                                           and not {*n.split(".", 1)} <= here)}
            assert not missing, f"{rule}: {file} does not define {sorted(missing)}"


def test_each_rule_is_defined_once():
    everywhere: dict[str, list[str]] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for name in _defined(path):
                everywhere.setdefault(name, []).append(str(path.relative_to(ROOT)))
    for rule, homes in ONE_HOME:
        for file, names in homes:
            for name in names:
                if "." in name:
                    continue
                assert everywhere.get(name) == [file], (
                    f"{rule}: {name} is defined in {everywhere.get(name)}, not only in {file}")
