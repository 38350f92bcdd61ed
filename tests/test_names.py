"""Names that exist: every module a docstring or comment in mgloop/ names is there.

Read from the source (`ast` for docstrings, `tokenize` for comments), nothing imported:
- each package's `__init__` docstring names every module (`name.py`) and subpackage
  (`name/`) of its package, and a bare `name.py` there is a module of that package;
- a `name.py` or `folder/name.py` anywhere in a docstring or comment resolves against
  the file's package (and the packages above it, up to mgloop/), the repository root, or,
  when no other module has that name, the one module in mgloop/ whose path ends with it
  (`assemble.py` is runs/assemble.py; `options.py`, held by several packages, must be
  named with its folder); a dotted `mgloop.x.y` is a module, or a name defined at the
  top level of the module before it (`mgloop.run`; a lazy package's body's names:
  `mgloop.data.as_input`);
- the README's layout section lists mgloop/'s packages as they are, and the repository's
  folders (those git tracks), each of which exists.
Files of other projects quoted by path are in `ELSEWHERE`, each with where it lives.
"""

import ast
import functools
import io
import os
import re
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "mgloop")
# (module of mgloop/ that names it, the name): the project it belongs to
ELSEWHERE = {
    ("training/muon.py", "keras/src/optimizers/muon.py"): "Keras",
    ("training/optim.py", "keras/src/optimizers/sgd.py"): "Keras",
    ("runs/loop.py", "keras/src/backend/tensorflow/trainer.py"): "Keras",
    ("runs/quiet_start.py", "functional_saver.py"): "TensorFlow's log line it quiets",
    ("observe/flops.py", "profiler/internal/flops_registry.py"): "TensorFlow",
    ("aggregation/local/async_diloco.py", "opt.py"): "github:utnslab/halos",
    ("aggregation/kernels/chunked_topk.py", "src/tplr/sparseloco.py"): "github:tplr-ai/templar",
    ("aggregation/placement/node_failures.py", "manager.py"): "github:pytorch/torchft",
    ("aggregation/placement/node_failures.py", "train_diloco.py"): "github:pytorch/torchft",
    ("aggregation/local/noloco.py", "sparse_optimizer_c.py"): "github:jkolehm/noloco",
    ("aggregation/local/outer_schedule.py", "megatron/training/training.py"): "Megatron-LM",
    ("aggregation/local/overlap.py", "torchft/local_sgd.py"): "github:pytorch/torchft",
    ("aggregation/local/sparta.py", "exogym/strategy/sparta.py"): "github:exo-explore/gym",
    ("data/python_text.py", "NAME.py"): "a placeholder: the standard library's modules",
    ("data/python_text.py", "__future__.py"): "the standard library",
    ("data/python_text.py", "queue.py"): "the standard library",
}
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[A-Za-z_]\w*\.py)\b")
DOTTED = re.compile(r"(?<![\w./<-])(mgloop(?:\.[A-Za-z_]\w*)+)")
FOLDER = re.compile(r"(?<![\w./-])([a-z_]+)/(?![\w.])")


def _sources():
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _texts(path: str):
    """(line, text) of every docstring and comment of the file at `path`."""
    source = open(path).read()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node):
                yield (node.body[0].lineno, ast.get_docstring(node))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


@functools.cache
def _modules_ending(name: str) -> tuple:
    return tuple(path for path in _sources() if path.endswith(os.sep + name))


def _file_exists(name: str, folder: str) -> bool:
    bases = [ROOT]
    while folder.startswith(PACKAGE):
        bases.append(folder)
        folder = os.path.dirname(folder)
    return (any(os.path.isfile(os.path.join(base, name)) for base in bases)
            or len(_modules_ending(name)) == 1)


def _top_level_names(path: str) -> set:
    names = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id in ("__all__", "_API") for t in targets):
                value = node.value
                names |= {ast.literal_eval(k) for k in getattr(value, "keys", [])}
                names |= {e.value for e in getattr(value, "elts", [])
                          if isinstance(e, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "lazy_package.getattr_of"):
            body = node.value.args[1].value  # a lazy package: its body's names are its own
            names |= _top_level_names(os.path.join(ROOT, *body.split(".")) + ".py")
    return names


def _dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:k])
        path = (base + ".py" if os.path.isfile(base + ".py")
                else os.path.join(base, "__init__.py"))
        if os.path.isfile(path):
            return k == len(parts) or parts[k] in _top_level_names(path)
    return False


def _where(path: str) -> str:
    return os.path.relpath(path, PACKAGE).replace(os.sep, "/")


def test_every_module_a_docstring_or_comment_names_exists():
    missing = []
    for path in _sources():
        folder = os.path.dirname(path)
        for line, text in _texts(path):
            for name in FILE.findall(text):
                if (_where(path), name) not in ELSEWHERE and not _file_exists(name, folder):
                    missing.append(f"mgloop/{_where(path)}:{line} names {name}")
            missing += [f"mgloop/{_where(path)}:{line} names {dotted}"
                        for dotted in DOTTED.findall(text) if not _dotted_exists(dotted)]
    assert not missing, "\n".join(missing)


def test_every_name_allowed_elsewhere_is_still_quoted():
    """An entry of ELSEWHERE that mgloop/ no longer quotes goes too."""
    quoted = {(_where(path), name) for path in _sources()
              for _, text in _texts(path) for name in FILE.findall(text)}
    assert sorted(set(ELSEWHERE) - quoted) == []


def _package_docstrings():
    for folder, folders, names in os.walk(PACKAGE):
        if "__init__.py" in names:
            init = os.path.join(folder, "__init__.py")
            modules = {n for n in names if n.endswith(".py") and n != "__init__.py"}
            subpackages = {f"{f}/" for f in folders
                           if os.path.isfile(os.path.join(folder, f, "__init__.py"))}
            yield folder, ast.get_docstring(ast.parse(open(init).read())), modules, subpackages


def test_every_package_docstring_lists_its_modules_and_no_other():
    wrong = []
    for folder, doc, modules, subpackages in _package_docstrings():
        where = os.path.relpath(folder, ROOT)
        named = set(FILE.findall(doc))
        wrong += [f"{where}: {name} is not listed" for name in sorted(modules - named)]
        wrong += [f"{where}: {name} is not listed"
                  for name in sorted(subpackages) if not re.search(rf"(?<![\w/]){name}", doc)]
        wrong += [f"{where}: names {name}, not one of its modules"
                  for name in sorted(named) if "/" not in name and name not in modules]
        wrong += [f"{where}: names {name}/, no such folder" for name in FOLDER.findall(doc)
                  if not any(os.path.isdir(os.path.join(base, name))
                             for base in (folder, PACKAGE, ROOT))]
    assert not wrong, "\n".join(wrong)


def _readme_layout() -> dict:
    """{entry of the README's layout block (`mgloop/`): its text}."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries, entry = {}, None
    for line in block.splitlines()[1:]:
        if line and not line[0].isspace():
            entry, line = line.split()[0], line[len(line.split()[0]):]
        if entry:
            entries[entry] = entries.get(entry, "") + " " + line
    return entries


def _tracked_folders() -> set | None:
    """The repository's top-level folders that hold a file git tracks (None: no git)."""
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return {f"{line.split('/')[0]}/" for line in done.stdout.splitlines()
            if "/" in line and not line.startswith(".")}


def test_the_readme_layout_is_the_tree():
    entries = _readme_layout()
    assert [e for e in entries if not os.path.exists(os.path.join(ROOT, e))] == []
    tracked = _tracked_folders()
    if tracked is not None:
        assert sorted(tracked - set(entries)) == []
    listed = set(FOLDER.findall(entries["mgloop/"]))
    packages = {f for f in os.listdir(PACKAGE)
                if os.path.isfile(os.path.join(PACKAGE, f, "__init__.py"))}
    assert sorted(listed) == sorted(packages)
    assert [n for n in FILE.findall(entries["mgloop/"])
            if not os.path.isfile(os.path.join(PACKAGE, n))] == []
