"""The settings as parts: each package takes its own options, never the whole Config.

- Importing `mgloop.runs.config` loads no TensorFlow, Keras or numpy, and the sweep's
  parent (its modules imported, its plan made and its report written: `--report_only`)
  loads no TensorFlow: checked in a fresh process, whose `sys.modules` is the truth.
- The whole `Config` travels only inside mgloop/runs/ and the entry points: no function
  elsewhere has a parameter named `config`, and nothing in mgloop reads a setting by
  `getattr(config, ...)` (read from the source with `ast`; each offender named).
- Every package's settings part has one `check(options, context)`, in a module of its own
  (`checks.py`), and its options module holds data only (no `check`): the checks import
  the options and the modules they call, never the other way round.
- The docs' examples work unchanged: every `mgloop.Config(...)` in a code block of docs/
  or the README constructs and validates, and every `python -m mgloop.train` /
  `mgloop.launch` command they quote parses its flags (test_docs.py checks that the
  flags exist; here their values parse).
"""

import ast
import glob
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests import test_docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "mgloop")
ENTRY_POINTS = ("train.py", "launch.py", "sweep.py")
# {options module: the module of its `check`}
CHECK_MODULES = {"mgloop.cluster.options": "mgloop.cluster.checks",
                 "mgloop.aggregation.exchange_options": "mgloop.aggregation.checks",
                 "mgloop.step.options": "mgloop.step.checks",
                 "mgloop.data.options": "mgloop.data.checks",
                 "mgloop.models.options": "mgloop.models.checks",
                 "mgloop.training.options": "mgloop.training.checks",
                 "mgloop.observe.options": "mgloop.observe.checks",
                 "mgloop.runs.loop_options": "mgloop.runs.loop_checks"}


def _loaded_after(code: str, heavy=("tensorflow", "keras", "numpy")) -> list:
    """The top-level modules of `heavy` that a fresh `python -c CODE` has loaded at its end."""
    probe = (f"{code}\nimport sys, json\n"
             f"print(json.dumps(sorted(m for m in {list(heavy)!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_config_loads_no_tensorflow_keras_or_numpy():
    assert _loaded_after("import mgloop.runs.config") == []
    assert _loaded_after("import mgloop; mgloop.Config(devices='cpu:2', learning_rate=0.1)"
                         ".flat()") == []


def test_importing_the_sweeps_parent_loads_no_tensorflow():
    code = ("import pkgutil, importlib, mgloop.sweep, mgloop.runs.sweep as s\n"
            "for m in pkgutil.iter_modules(s.__path__):\n"
            "    importlib.import_module('mgloop.runs.sweep.' + m.name)")
    assert _loaded_after(code, heavy=("tensorflow", "keras")) == []


def test_the_sweeps_plan_and_report_load_no_tensorflow(tmp_path):
    """`python -m mgloop.sweep --report_only`: the flags, the plan's cells and the report
    written from the records found (none here), as the parent makes them."""
    argv = ["mgloop.sweep", f"--output_dir={tmp_path}", "--report_only", "--seeds=2",
            "--vary=learning_rate=0.1,0.2", "--set=train_steps=2"]
    code = ("import atexit, json, runpy, sys\n"
            "atexit.register(lambda: print('LOADED ' + json.dumps(sorted(m for m in "
            "('tensorflow', 'keras') if m in sys.modules)), flush=True))\n"
            f"sys.argv = {argv!r}\n"
            "runpy.run_module('mgloop.sweep', run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "report.md").exists()
    loaded = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert json.loads(loaded[-1].removeprefix("LOADED ")) == []


# --- the whole Config only inside runs/ and the entry points -------------------------------

def _library_sources(everywhere: bool):
    """(path relative to the repository, parsed module) of mgloop's modules: all of them,
    or those outside mgloop/runs/ and the entry points."""
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
        relative = os.path.relpath(path, PACKAGE)
        if not everywhere and (relative.startswith("runs" + os.sep) or relative in ENTRY_POINTS):
            continue
        with open(path, encoding="utf-8") as handle:
            yield os.path.relpath(path, ROOT), ast.parse(handle.read())


def _functions(tree):
    """(qualified name, node) of every function and lambda in a module."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.Lambda):
                yield f"{prefix}<lambda>", child
                yield from walk(child, prefix)
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def test_no_function_outside_runs_and_the_entry_points_takes_a_config():
    offenders = []
    for path, tree in _library_sources(everywhere=False):
        for name, function in _functions(tree):
            arguments = function.args
            names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
            if "config" in names:
                offenders.append(f"{path}:{function.lineno} {name}(config)")
    assert offenders == []


def test_no_setting_is_read_by_getattr_of_a_config():
    def is_config(node):
        return ((isinstance(node, ast.Name) and node.id == "config")
                or (isinstance(node, ast.Attribute) and node.attr == "config"))
    offenders = [f"{path}:{node.lineno} getattr({ast.unparse(node.args[0])}, ...)"
                 for path, tree in _library_sources(everywhere=True)
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id in ("getattr", "hasattr") and node.args
                 and is_config(node.args[0])]
    assert offenders == []


def _module_level_checks(module_name: str) -> list:
    path = os.path.join(ROOT, *module_name.split(".")) + ".py"
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    return [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "check"]


@pytest.mark.parametrize("options_module", CHECK_MODULES)
def test_every_part_has_one_check_of_options_and_context(options_module):
    module_name = CHECK_MODULES[options_module]
    checks = _module_level_checks(module_name)
    assert len(checks) == 1, f"{module_name} defines {len(checks)} module-level check()"
    check = importlib.import_module(module_name).check
    assert list(inspect.signature(check).parameters) == ["options", "context"], module_name
    assert _module_level_checks(options_module) == [], f"{options_module} holds data only"


# --- the docs' examples --------------------------------------------------------------------

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
CALL = re.compile(r"\b(?:mgloop\.)?Config\(")
REFUSED = re.compile(r"refused|ConfigError")  # said on the call's line: a refusal shown


def _config_examples() -> list:
    """(page, the call's source) of every `Config(...)` call in the docs' code blocks."""
    examples = []
    for path in test_docs._markdown_pages() + [test_docs.README]:
        for block in FENCE.findall(test_docs._read(path)):
            for match in CALL.finditer(block):
                ends = [i + 1 for i, c in enumerate(block) if c == ")" and i > match.end()]
                source = next(text for end in ends if _parses(text := block[match.start():end]))
                examples.append((os.path.relpath(path, ROOT), source,
                                 block[match.start():].splitlines()[0]))
    return examples


def _parses(source: str) -> bool:
    try:
        ast.parse(source, mode="eval")
    except SyntaxError:
        return False
    return True


def test_every_documented_config_constructs_and_validates():
    import mgloop
    examples = _config_examples()
    assert len(examples) >= 4, "the extraction found almost no Config(...) example"
    wrong = []
    for page, source, line in examples:
        call = ast.parse(source, mode="eval").body
        try:
            settings = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            config = mgloop.Config(*[ast.literal_eval(a) for a in call.args], **settings)
            config.validated(on_disk=False)
        except mgloop.ConfigError as error:
            if not REFUSED.search(line):
                wrong.append(f"{page}: {source}: refused: {error}")
            continue
        except (TypeError, ValueError) as error:
            wrong.append(f"{page}: {source}: {error}")
            continue
        if REFUSED.search(line):
            wrong.append(f"{page}: {source}: the page says refused, but it validates")
    assert wrong == []


def _command_flags() -> list:
    """(page, program, its own flags, the train flags) of every quoted train/launch command;
    the words after `#`, placeholders (`...`, `<name>`) and flagfiles left out."""
    commands = []
    for page, target, rest in test_docs._quoted_commands():
        program = target.split()[-1]
        if program not in ("mgloop.train", "mgloop.launch"):
            continue
        words = shlex.split(rest.split("#")[0])
        own, train = (words[:words.index("--")], words[words.index("--") + 1:]) \
            if "--" in words else (words, [])
        if program == "mgloop.train":
            own, train = [], own
        keep = [w for w in own + train if w.startswith("--") and "<" not in w
                and not w.startswith("--flagfile")]
        commands.append((page, program, [w for w in own if w in keep],
                         [w for w in train if w in keep]))
    return commands


PARSER = """
import json, sys
from absl import flags
from mgloop import launch  # its own flags; imports no TensorFlow
from mgloop.runs import flags as mgloop_flags
mgloop_flags.define_flags()
wrong = []
for page, program, own, train in json.load(sys.stdin):
    for words in (own, train):
        flags.FLAGS.unparse_flags()
        try:
            flags.FLAGS(["prog", *words])
            if words is train:
                mgloop_flags.config_from_flags()
        except (flags.Error, TypeError, ValueError) as error:
            wrong.append(f"{page}: {program} {' '.join(words)}: {error}")
print(json.dumps(wrong))
"""


def test_every_documented_train_and_launch_command_parses_its_flags():
    commands = _command_flags()
    assert sum(bool(train) for *_, train in commands) >= 8, "found almost no train flags"
    done = subprocess.run([sys.executable, "-c", PARSER], cwd=ROOT, input=json.dumps(commands),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
