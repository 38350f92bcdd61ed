"""`--plugin=MODULE`: a user's module imported before the settings are validated.

The module registers what it brings (an aggregation method with `@register`; later
models and datasets) when it is imported. MODULE is a module name on the Python
path (`my_methods`, `tests.plugins.topk_ef`) or the path of a `.py` file (imported
under its file name without `.py`). `python -m mgloop.train`, `mgloop.launch`
(which forwards its flags to every worker) and `Config(plugins=[...])` all go
through `load_plugins`; the experiment harnesses call it with their own
`--plugin` flags. A module that fails to import is one ConfigError line naming it
and the error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Iterable

from mgloop.errors import ConfigError, one_line


def plugin_list(modules) -> tuple[str, ...]:
    """`modules` as a tuple of names (a lone string is one module, not its letters)."""
    if modules is None:
        return ()
    if isinstance(modules, str):
        return (modules,)
    return tuple(modules)


def load_plugins(modules: Iterable[str] | str | None) -> None:
    """Imports each module (once; importing it again does nothing)."""
    for module in plugin_list(modules):
        if not isinstance(module, str) or not module.strip():
            raise ConfigError(f"--plugin={module!r} is not a module name or a .py file path")
        try:
            if module.endswith(".py") or os.sep in module:
                _import_file(module)
            else:
                importlib.import_module(module)
        except ConfigError:
            raise
        except BaseException as error:  # noqa: BLE001 - a plugin may fail in any way
            if isinstance(error, KeyboardInterrupt):
                raise
            raise ConfigError(f"--plugin={module} failed to import: {one_line(error)}; "
                              "fix the module or leave that --plugin out") from None


def _import_file(path: str) -> None:
    full = os.path.abspath(os.path.expanduser(path))
    name = os.path.splitext(os.path.basename(full))[0]
    if getattr(sys.modules.get(name), "__file__", None) == full:
        return
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no file {full}")
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
