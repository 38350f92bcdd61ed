"""Modules that moved (docs/moved.md): an old module name that still imports warns and
holds the new module's names; every module the page names today exists.

A shim is a module whose docstring begins "`mgloop.x.y`, the old name of ...": it imports
its new module, warns with a DeprecationWarning naming it, and forwards every name to it.
Nothing in mgloop/ imports a shim, so the library itself never warns.
"""

import ast
import importlib
import os
import re
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "moved.md")
# old module -> (its module today, a name the old module held)
SHIMS = {
    "mgloop.step.hooks.byzantine": ("mgloop.step.hooks.attack_hook", "ByzantineTowers"),
    "mgloop.step.towers": ("mgloop.step.per_tower", "TowerOutput"),
    "mgloop.step.tower_step": ("mgloop.step.training_step", "TowerStep"),
    "mgloop.step.vectorize": ("mgloop.step.pfor", "vectorized_map"),
    "mgloop.cluster.nodes": ("mgloop.cluster.node_layout", "Nodes"),
    "mgloop.aggregation.nodes": ("mgloop.aggregation.placement.between_nodes", "NodeLevel"),
}


def _rows():
    """(old, today, whether the old name warns) of every row of the page's table."""
    for line in open(PAGE).read().splitlines():
        cells = re.findall(r"`(mgloop[\w.]*)`", line)
        if line.startswith("| `") and len(cells) == 2:
            yield cells[0], cells[1], "*warns*" in line


def _module_path(dotted: str) -> str | None:
    base = os.path.join(ROOT, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _shims_in_the_tree() -> set:
    found = set()
    for folder, _, names in os.walk(os.path.join(ROOT, "mgloop")):
        for name in [n for n in names if n.endswith(".py")]:
            path = os.path.join(folder, name)
            doc = ast.get_docstring(ast.parse(open(path).read())) or ""
            if re.match(r"`mgloop[\w.]*`, the old name of ", doc):
                found.add(os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
    return found


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_name_warns_and_holds_the_new_modules_names(old):
    new, name = SHIMS[old]
    sys.modules.pop(old, None)  # imported before (another test): its body runs again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert said == [f"{old} is now {new}; import it from there (the old name goes in "
                    "mgloop 0.2)"]
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError):
        module.no_such_name


def test_every_shim_is_tested_and_on_the_page():
    assert _shims_in_the_tree() == set(SHIMS)
    warns = {old for old, _, warn in _rows() if warn}
    assert warns == set(SHIMS)
    assert all(SHIMS[old][0] == today for old, today, warn in _rows() if warn)


def test_every_module_the_page_names_today_exists_and_no_old_one_does():
    rows = list(_rows())
    assert len(rows) > 50
    assert [today for _, today, _ in rows if _module_path(today) is None] == []
    # an old name is gone, or a shim, or (mgloop.cluster, mgloop.step) a package now
    still = [old for old, _, warn in rows
             if _module_path(old) is not None and not warn
             and not _module_path(old).endswith("__init__.py")]
    assert still == []


def test_nothing_in_mgloop_imports_a_shim():
    shims = set(SHIMS)
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "mgloop")):
        for name in [n for n in names if n.endswith(".py")]:
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                targets = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                           [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                           if isinstance(node, ast.ImportFrom) and node.module else [])
                found += [f"{os.path.relpath(path, ROOT)}: {t}" for t in targets if t in shims]
    assert found == []
