"""The package layout is the data path: each package imports only the packages below it.

Read from the source with `ast` (every import, also those inside functions), so a new
import that points upward, or a cycle between packages, fails here with the offending
module named. The ranks are the order of mgloop/__init__.py's docstring; packages of
one rank may not import each other.
"""

import ast
import os

import mgloop

ROOT = os.path.dirname(mgloop.__file__)
GROUND = {"errors", "settings", "phases"}
ENTRY_POINTS = {"train", "launch", "sweep"}
RANK = {"ground": 0, "cluster": 1, "spec": 1, "data": 1, "aggregation": 2, "models": 2,
        "observe": 3, "step": 4, "runs": 5, "entry": 6}
LONGEST_MODULE = 320  # lines; ~300 is the habit: aggregation/base.py, the one above, says why


def _package(dotted: str) -> str:
    head = dotted.split(".")[0]
    if head in GROUND:
        return "ground"
    if head in ENTRY_POINTS or head == "__init__":
        return "entry"
    return head


def _modules():
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."), path


def _imports(path: str):
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mgloop"):
            if node.module == "mgloop":
                yield from (alias.name for alias in node.names)
            else:
                yield node.module.removeprefix("mgloop.")
        elif isinstance(node, ast.Import):
            yield from (a.name.removeprefix("mgloop.") for a in node.names
                        if a.name.startswith("mgloop."))


def test_every_package_imports_only_packages_below_it():
    upward = []
    for module, path in _modules():
        source = _package(module)
        for target in _imports(path):
            destination = _package(target)
            if destination not in RANK:
                upward.append(f"{module} imports mgloop.{target}: not a known package")
            elif destination != source and RANK[destination] >= RANK[source]:
                upward.append(f"{module} ({source}) imports mgloop.{target} ({destination})")
    assert upward == []


def test_every_package_says_what_lives_there_and_what_it_may_import():
    silent = []
    for folder, _, names in os.walk(ROOT):
        if "__init__.py" in names:
            doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read()))
            if os.path.relpath(folder, ROOT) != "." and (not doc or "May import" not in doc):
                silent.append(os.path.relpath(folder, ROOT))
    assert silent == []


def test_no_module_is_long():
    long = [(module, n) for module, path in _modules()
            if (n := len(open(path).read().splitlines())) > LONGEST_MODULE]
    assert long == []
