"""mgloop: a hand-written multi-device tower loop for research on gradient aggregation.

    import mgloop
    summary = mgloop.run(mgloop.Config(devices="cpu:4", aggregation="ring"))

The package is laid out by purpose, in the order of the data path: cluster/ (where it
runs), training/ (what it trains), data/ (what it reads, and staging to the towers),
aggregation/ (the methods under study), models/, observe/ (what it shows), step/ (the
tower loop), runs/ (a run from settings to result); each package's docstring says what
lives there and what it may import. Entry points: train.py, launch.py, sweep.py.
`configure_logical_cpus` (cluster/devices.py) sets up logical CPU devices before
TensorFlow starts.

The ground, which every package may import:

    settings.py      what a setting is: a Config field with its help line, and its checks
    errors.py        the error types for bad input (ConfigError), told apart from a crash
    phases.py        the name scopes of a step's phases, by which a profile is read
    lazy_package.py  a package whose body loads on first use (no TensorFlow on import)

`Config`, `ConfigError` and `run` are loaded on first use, so that importing the
package loads no TensorFlow: `python -m mgloop.train` imports the package before
train.py runs, and train.py must act before TensorFlow loads (runs/quiet_start.py). The
first use loads TensorFlow with Keras's display-only modules held back, as the entry
points do (`quiet_start.without_display_modules`).
"""

import importlib

_API = {"Config": "mgloop.runs.config", "ConfigError": "mgloop.errors",
        "run": "mgloop.runs.experiment", "configure_logical_cpus": "mgloop.cluster.devices"}

__all__ = ["Config", "ConfigError", "run", "configure_logical_cpus"]


def __getattr__(name):
    if name in _API:
        # the first use loads TensorFlow (and Keras) as the entry points do: Keras's
        # display-only imports held back while it loads (runs/quiet_start.py)
        from mgloop.runs import quiet_start
        with quiet_start.without_display_modules():
            module = importlib.import_module(_API[name])
        return getattr(module, name)
    raise AttributeError(f"module 'mgloop' has no attribute {name!r}")
