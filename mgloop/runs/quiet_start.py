"""TensorFlow's start-up lines kept off the command line's stderr (entry points only).

`python -m mgloop.train` (and so every worker of `mgloop.launch`) would print,
on a machine without a GPU, TensorFlow 2.21's native start-up lines (oneDNN's
`port.cc`, `cudart_stub.cc`, `cpu_feature_guard.cc`, `cuda_platform.cc`'s failed
cuInit) and one `functional_saver.py: Sharding callback duration` line per
checkpoint. Why `os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")` and
`tf.get_logger().setLevel("WARNING")` in train.py did not silence them:

- `python -m mgloop.train` imports the package first, and `mgloop/__init__`
  imported TensorFlow, so the variable was set after TensorFlow had loaded
  (the package now loads its API lazily, so train.py runs first);
- the `port.cc` and `cudart_stub.cc` lines are logged by absl's C++ logging
  while TensorFlow's shared libraries load (two of them, once each), before
  absl is initialized and before TensorFlow applies TF_CPP_MIN_LOG_LEVEL
  ("WARNING: All log messages before absl::InitializeLog() is called are
  written to STDERR"): no variable silences them;
- the failed cuInit is logged at ERROR, which level 2 keeps;
- the sharding line is logged by TensorFlow's Python code through absl
  logging (logger "absl"), not through `tf.get_logger()`.

So, unless the user has set TF_CPP_MIN_LOG_LEVEL (then TensorFlow logs exactly
as it would without mgloop: that is the opt-out, e.g. TF_CPP_MIN_LOG_LEVEL=0):

- `loading()` sets TF_CPP_MIN_LOG_LEVEL=2 and, while TensorFlow loads and lists
  its devices, points file descriptor 2 at a temporary file; afterwards it
  writes back everything captured except the start-up lines: absl's
  pre-initialization notice, native INFO and WARNING lines, and the ERROR of a
  failed cuInit (no CUDA driver; `--devices=gpu:N` says itself when no GPU is
  visible). Anything else (a Python warning, a native error) still shows.
- `after_loading()` drops the INFO lines of TensorFlow's own Python modules
  (absl logging and `tf.get_logger()`); their warnings and errors, and
  mgloop's own INFO lines, still show.

`load_tensorflow()` does both, and holds back Keras's display-only imports of IPython and
matplotlib while TensorFlow loads (`without_display_modules`).

This module imports no TensorFlow and is used by entry points only (and
`without_display_modules` by the package's lazy API, mgloop/__init__.py).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import types

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LEVEL = "2"  # native INFO and WARNING off once TensorFlow applies it
USER_SET_LEVEL = LEVEL_VARIABLE in os.environ  # read when the entry point starts

_START_UP_LINES = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|[IW]\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\] "  # absl C++ INFO / WARNING
    r"|E\d{4} \d\d:\d\d:[\d.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit")


def quiet() -> bool:
    """True unless the user set TF_CPP_MIN_LOG_LEVEL before the entry point started."""
    return not USER_SET_LEVEL


def is_start_up_line(line: str) -> bool:
    return _START_UP_LINES.match(line) is not None


@contextlib.contextmanager
def loading(enabled: bool | None = None):
    """Wrap the import of TensorFlow (and a first device listing) in this. `enabled`: quiet
    or not (None: `quiet()`; a sweep's worker is told its parent's answer, since the
    variable the parent set is in its environment)."""
    if not (quiet() if enabled is None else enabled):
        yield
        return
    os.environ[LEVEL_VARIABLE] = QUIET_LEVEL
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_start_up_line(line))
            if kept:
                os.write(2, kept.encode("utf-8"))


class _NoTensorFlowInfo(logging.Filter):
    """Drops records below WARNING logged from a file under TensorFlow's package."""

    def __init__(self, package_dir: str):
        super().__init__()
        self.prefix = os.path.join(package_dir, "")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.prefix)


def after_loading(enabled: bool | None = None) -> None:
    """Once TensorFlow is imported: its Python modules' INFO lines off (see the docstring;
    `enabled` as for `loading`)."""
    if not (quiet() if enabled is None else enabled):
        return
    import tensorflow as tf  # already loaded by `loading()`'s block

    tf.get_logger().setLevel("WARNING")
    logging.getLogger("absl").addFilter(_NoTensorFlowInfo(os.path.dirname(tf.__file__)))


# Keras's plotting helpers that hold a matplotlib module read at their import:
# {Keras module: (its attribute, the matplotlib module it holds)}
_KERAS_PLOTTING = {
    "keras.src.visualization.plot_image_gallery": ("plt", "matplotlib.pyplot"),
    "keras.src.visualization.plot_bounding_box_gallery": ("patches", "matplotlib.patches"),
}
_DISPLAY_MODULES = ("IPython", "matplotlib")


class _ImportedOnUse(types.ModuleType):
    """Stands for the module of its name until one of its attributes is read: then imports
    it and reads that attribute there."""

    def __getattr__(self, attribute):
        return getattr(importlib.import_module(self.__name__), attribute)


@contextlib.contextmanager
def without_display_modules():
    """IPython and matplotlib held back while TensorFlow (and with it Keras) loads. Keras
    imports both whenever they are installed, for display only: IPython to show a file
    editor's summary in a notebook (Keras's saving file editor, which takes a failed import
    as "no notebook"), matplotlib.pyplot for its image-gallery plots. In every process an
    entry point starts (none runs in a notebook, none plots while TensorFlow loads) they
    cost about 1.0 s of CPU, a quarter of loading TensorFlow (`python -m experiments.startup
    --cases=tensorflow,tensorflow_without_ipython,tensorflow_without_ipython_or_matplotlib`).
    Afterwards both import as usual (mgloop's plots import matplotlib when they draw), and
    Keras's plotting helpers hold a stand-in that imports their matplotlib module at first
    use, so they plot as before. Nothing is held back where TensorFlow is loaded already
    (Keras has made its imports: holding them would only open a window in which another
    thread's import of them fails), nor a module loaded already (a notebook's IPython)."""
    if "tensorflow" in sys.modules:
        yield
        return
    held = [name for name in _DISPLAY_MODULES if name not in sys.modules]
    for name in held:
        sys.modules[name] = None  # an import of it raises ImportError meanwhile
    try:
        yield
    finally:
        for name in held:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
        if "matplotlib" in held and importlib.util.find_spec("matplotlib") is not None:
            for module, (attribute, target) in _KERAS_PLOTTING.items():
                loaded = sys.modules.get(module)
                if loaded is not None and getattr(loaded, attribute, "absent") is None:
                    setattr(loaded, attribute, _ImportedOnUse(target))


def load_tensorflow(enabled: bool | None = None):
    """Imports TensorFlow (`without_display_modules`) and lists its GPUs (where a machine
    without CUDA logs its failed cuInit) inside `loading`, then `after_loading`; returns
    the module. `enabled` as for `loading`. What every entry point and a sweep's worker
    call first."""
    with loading(enabled), without_display_modules():
        import tensorflow as tf
        tf.config.list_physical_devices("GPU")
    after_loading(enabled)
    return tf
