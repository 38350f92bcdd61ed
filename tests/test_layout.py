"""The package layout is the data path: each package imports only the packages below it.

Read from the source with `ast` (every import, also those inside functions), so a new
import that points upward, or a cycle between packages, fails here with the offending
module named. The ranks are the order of mgloop/__init__.py's docstring; packages of
one rank may not import each other. Each package's own "May import:" line (its
`__init__` docstring) is checked too, module by module where it names modules
(`MAY_IMPORT`), and `experiments/` imports nothing from `tests/`.
"""

import ast
import os

import mgloop

ROOT = os.path.dirname(mgloop.__file__)
GROUND = {"errors", "settings", "phases", "lazy_package"}
ENTRY_POINTS = {"train", "launch", "sweep"}
RANK = {"ground": 0, "cluster": 1, "training": 1, "data": 1, "aggregation": 2, "models": 2,
        "observe": 3, "step": 4, "runs": 5, "entry": 6}
LONGEST_MODULE = 320  # lines; ~300 is the habit: aggregation/base.py, the one above, says why
REPO = os.path.dirname(ROOT)

# Each package's "May import:" line as what an import may name: "ground", a package
# ("data": any of its modules) or one module ("cluster.devices"). `LAZY`: what a package's
# functions may import besides (never at module level, so importing it loads none of it).
MAY_IMPORT = {
    "cluster": {"ground"},
    "training": {"ground"},
    "data": {"ground"},
    "models": {"ground", "data"},  # a text model's vocabulary
    "aggregation": {"ground", "cluster.devices", "cluster.workers", "cluster.node_layout",
                    "training.variables"},
    "observe": {"ground", "cluster", "training", "data",
                "aggregation.traffic", "aggregation.base"},  # the methods' byte counts
    "step": {"ground", "cluster", "training", "data", "aggregation", "models", "observe"},
    # importing a sweep module loads no TensorFlow: a plan unpickles before it loads
    "runs.sweep": {"ground", "observe.stats", "observe.plots",
                   "observe.link_model", "observe.link_report", "runs.config",
                   "runs.callbacks", "runs.preemption", "runs.quiet_start", "runs.collector"},
}
LAZY = {"runs.sweep": {"runs.checkpoint_files", "runs.failures", "runs.run_dir",
                       "observe.summaries", "cluster.devices", "data", "aggregation",
                       # the eval metrics a cell reports: its default loss and metrics
                       "runs.experiment", "training.metrics", "training.perplexity"}}


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


def _targets(path: str):
    """(importing module's target as `package.module` or `package`, inside a function?)
    for every mgloop import of the file at `path`; `from mgloop.data import staging` names
    data.staging, `from mgloop.aggregation import Aggregation` the package aggregation."""
    tree = ast.parse(open(path).read())
    lazy = {id(node) for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for node in ast.walk(function)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mgloop"):
            base = node.module.removeprefix("mgloop").removeprefix(".")
            for alias in node.names:
                name = f"{base}.{alias.name}".strip(".")
                folder = os.path.join(ROOT, *name.split("."))
                yield (name if os.path.exists(folder + ".py") or os.path.isdir(folder)
                       else base), id(node) in lazy
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mgloop."):
                    yield alias.name.removeprefix("mgloop."), id(node) in lazy


def _allowed(target: str, rules: set) -> bool:
    if target.split(".")[0] in GROUND:
        return "ground" in rules
    return any(target == rule or target.startswith(rule + ".") for rule in rules)


def _rule_of(module: str) -> str | None:
    """The most specific package with a finer rule that holds `module`."""
    holders = [p for p in MAY_IMPORT if module.startswith(p + ".")]
    return max(holders, key=len) if holders else None


def test_every_package_imports_only_what_its_docstring_allows():
    broken = []
    for module, path in _modules():
        package = _rule_of(module)
        if package is None:
            continue
        for target, lazy in _targets(path):
            if _allowed(target, MAY_IMPORT[package] | {package}):
                continue
            if lazy and _allowed(target, LAZY.get(package, set())):
                continue
            where = "in a function" if lazy else "at module level"
            broken.append(f"mgloop/{module.replace('.', '/')}.py imports mgloop.{target} "
                          f"{where}: {package}/ may not")
    assert broken == []


def test_the_finer_rules_are_the_docstrings():
    """Every package a rule names is named on its package's "May import:" line (its
    modules there by what they hold, e.g. training/ (variable copies))."""
    unsaid = []
    for package, rules in MAY_IMPORT.items():
        init = os.path.join(ROOT, *package.split("."), "__init__.py")
        doc = ast.get_docstring(ast.parse(open(init).read()))
        line = doc[doc.index("May import"):]
        for rule in rules | LAZY.get(package, set()):
            head = rule.partition(".")[0]
            if rule != "ground" and not rule.startswith(package) and f"{head}/" not in line:
                unsaid.append(f"{package}: {rule}")
    assert unsaid == []


def test_experiments_import_nothing_from_tests():
    found = []
    for folder, _, names in os.walk(os.path.join(REPO, "experiments")):
        for name in [n for n in names if n.endswith(".py")]:
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{os.path.relpath(path, REPO)} imports {m}" for m in modules
                          if m == "tests" or m.startswith("tests.")]
    assert found == []


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
