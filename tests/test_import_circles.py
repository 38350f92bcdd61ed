"""No import circle at any scale (DESIGN.md): not between packages (test_layout.py) and
not between the modules of one package.

The graph is read from the source with `ast`. At module level: an edge for every mgloop
import that runs when its module is imported, i.e. at the module's top level, also inside
a top-level `if`/`try`/`with` or class body, but not inside a function, nor under
`if TYPE_CHECKING:`; such a circle makes the import order matter. Counting functions too:
an import inside a function is also an edge, because a circle there is the same seam in
the wrong place (an options module whose `check` imports back the modules that import it),
only deferred. `from mgloop.pkg import name` imports mgloop/pkg/__init__.py, the
submodule mgloop/pkg/name.py when there is one, and otherwise, for a lazy package
(`__getattr__ = lazy_package.getattr_of(__name__, "body")`), the package's body module,
which that import loads on the spot. Relative imports count the same. Strongly connected
components (Tarjan) of two or more modules are the circles.
"""

import ast
import functools
import os

import mgloop

ROOT = os.path.dirname(mgloop.__file__)


def _modules() -> dict[str, str]:
    """Dotted module name (`mgloop.data.options`; a package as `mgloop.data`) -> path."""
    found = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = ["mgloop"] + os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _every_import(body):
    """Every import statement of a module with this body, also inside its functions (but
    not under `if TYPE_CHECKING:`, which never runs)."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _every_import(node.orelse)
        else:
            yield from (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _top_level_imports(body):
    """The import statements run when a module with this body is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            for block in (node.body, node.orelse, node.finalbody,
                          *(handler.body for handler in node.handlers)):
                yield from _top_level_imports(block)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _top_level_imports(node.body)
            yield from _top_level_imports(getattr(node, "orelse", []))
        elif isinstance(node, ast.ClassDef):  # a class body runs at import time
            yield from _top_level_imports(node.body)


def _lazy_body(tree: ast.Module) -> str | None:
    """The body module of a package whose `__init__` is `lazy_package.getattr_of`'s."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets)
                and len(node.value.args) == 2 and isinstance(node.value.args[1], ast.Constant)):
            return node.value.args[1].value
    return None


@functools.cache
def _graph(every: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (`every`: anywhere in it)."""
    imports = _every_import if every else _top_level_imports
    modules = _modules()
    trees = {name: ast.parse(open(path).read()) for name, path in modules.items()}
    lazy = {name: body for name, tree in trees.items()
            if modules[name].endswith("__init__.py") and (body := _lazy_body(tree))}
    edges = {name: set() for name in modules}
    for name, tree in trees.items():
        is_package = modules[name].endswith("__init__.py")
        for node in imports(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the module's package upwards
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base]
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.append(f"{base}.{alias.name}")
                    elif base in lazy and alias.name != "*":
                        targets.append(lazy[base])
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules, Tarjan's."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(start):  # iterative, so a deep graph does not hit the recursion limit
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_sees_a_known_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert _circles(edges) == [["a", "b", "c"], ["d", "e"]]


def test_the_graph_reads_lazy_packages_and_relative_imports():
    edges, every = _graph(), _graph(every=True)
    assert "mgloop.lazy_package" in edges["mgloop.data"]
    assert "mgloop.data.options" in edges["mgloop.runs.config"]
    assert "mgloop.models.registry" in edges["mgloop.models.checks"]
    # Config.validated() imports the gate in its body; the gate names Config for its types only
    assert "mgloop.runs.config_checks" in every["mgloop.runs.config"] - edges["mgloop.runs.config"]
    assert "mgloop.runs.config" not in every["mgloop.runs.config_checks"]


def test_no_import_circle_at_module_level():
    circles = [" <-> ".join(c) for c in _circles(_graph())]
    assert circles == [], "import circles at module level:\n" + "\n".join(circles)


def test_no_import_circle_counting_imports_in_functions():
    circles = [" <-> ".join(c) for c in _circles(_graph(every=True))]
    assert circles == [], "import circles (imports in functions too):\n" + "\n".join(circles)
