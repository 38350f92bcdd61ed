"""A package whose body loads on first use, so that importing one plain module of it (its
settings part, e.g. data/options.py) loads no TensorFlow.

`__getattr__ = lazy_package.getattr_of(__name__, "mgloop.data.catalog")` in a package's
`__init__`: `package.name` is then the package's module `name` when there is one (imported
directly, never through the body, so a module of the package imported first finds the
body's names without a cycle), else the body's attribute `name`, kept on the package once
found.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Callable


def getattr_of(package: str, body: str) -> Callable[[str], object]:
    """The module `__getattr__` of `package`, whose other names live in module `body`."""
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{package}.{name}") is not None:  # a module of the package
            return importlib.import_module(f"{package}.{name}")
        try:
            value = getattr(importlib.import_module(body), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)  # found once: later reads skip this
        return value
    return __getattr__


def moved_to(old: str, new: str) -> Callable[[str], object]:
    """The module `__getattr__` of `old`, a module's old name kept for a release: importing
    it warns (a DeprecationWarning naming `new`, pointed at the importing line), and every
    name is read from module `new` (docs/moved.md)."""
    module = importlib.import_module(new)
    warnings.warn(f"{old} is now {new}; import it from there (the old name goes in mgloop 0.2)",
                  DeprecationWarning, stacklevel=3)

    def __getattr__(name: str):
        return getattr(module, name)
    return __getattr__
