"""Every setting of a run: one frozen `Config` composed of each package's own options.

    config.cluster   ClusterOptions   cluster/options.py: devices, towers per device, timeouts
    config.exchange  ExchangeOptions  aggregation/exchange_options.py: the method, what
                                      travels, the nodes
    config.step      StepOptions      step/options.py: how each tower computes its step
    config.data      DataOptions      data/options.py: the dataset, batch and staging
    config.models    ModelOptions     models/options.py: the model and its sizes
    config.optim     OptimOptions     training/options.py: optimizer and schedule
    config.observe   ObserveOptions   observe/options.py: summaries, logs, link model
    config.loop      LoopOptions      runs/loop_options.py: steps, checkpoints, folders, seed

Each field is a `settings.setting`: its help line (the flag's), its choices and whether it
can change a result (HParams) live beside it; flags.py makes the flags from the fields.
Flat keywords map to their part: `Config(devices="cpu:4", aggregation="ring")` sets
`config.cluster.devices` and `config.exchange.aggregation`, and a flat read
(`config.learning_rate`) reads the part's field, so the flags, the summaries and a user's
code keep one name per setting. The library hands each package its own part.
`validated()` (config_checks.py) is the only gate between settings and TensorFlow.
Importing this module loads no TensorFlow (the sweep's parent relies on it).
"""

from __future__ import annotations

import dataclasses
import typing

from mgloop import settings as settings_lib
from mgloop.aggregation.exchange_options import ExchangeOptions
from mgloop.cluster.options import ClusterOptions
from mgloop.data.options import DataOptions
from mgloop.models.options import ModelOptions
from mgloop.observe.options import ObserveOptions
from mgloop.runs.loop_options import LoopOptions
from mgloop.step.options import StepOptions
from mgloop.training.options import OptimOptions

PARTS = {"cluster": ClusterOptions, "exchange": ExchangeOptions, "step": StepOptions,
         "data": DataOptions, "models": ModelOptions, "optim": OptimOptions,
         "observe": ObserveOptions, "loop": LoopOptions}
_OWNER = {field.name: part for part, cls in PARTS.items() for field in dataclasses.fields(cls)}


def setting_fields() -> tuple[dataclasses.Field, ...]:
    """Every setting's field, part by part: the flags, the HParams and the records."""
    return tuple(field for cls in PARTS.values() for field in dataclasses.fields(cls))


def setting_types() -> dict[str, type]:
    """{setting: its resolved type annotation}, e.g. `int | None` (the flags' types)."""
    return {name: hint for cls in PARTS.values()
            for name, hint in typing.get_type_hints(cls).items()}


def part_of(name: str) -> str:
    """The part that holds the setting `name` (a flat field name)."""
    return _OWNER[name]


@dataclasses.dataclass(frozen=True, init=False)
class Config:
    """Settings of one training run: `Config(**flat_settings)` or `Config(step=StepOptions(
    ...), ...)`; flat keywords are applied over the given parts."""

    cluster: ClusterOptions
    exchange: ExchangeOptions
    step: StepOptions
    data: DataOptions
    models: ModelOptions
    optim: OptimOptions
    observe: ObserveOptions
    loop: LoopOptions

    def __init__(self, cluster: ClusterOptions | None = None,
                 exchange: ExchangeOptions | None = None, step: StepOptions | None = None,
                 data: DataOptions | None = None, models: ModelOptions | None = None,
                 optim: OptimOptions | None = None, observe: ObserveOptions | None = None,
                 loop: LoopOptions | None = None, **settings):
        given = dict(cluster=cluster, exchange=exchange, step=step, data=data, models=models,
                     optim=optim, observe=observe, loop=loop)
        changes: dict[str, dict] = {part: {} for part in PARTS}
        for name, value in settings.items():
            if name not in _OWNER:
                raise TypeError(f"Config() got an unexpected keyword argument {name!r}")
            changes[_OWNER[name]][name] = value
        for part, cls in PARTS.items():
            options = given[part] if given[part] is not None else cls()
            if not isinstance(options, cls):
                raise TypeError(f"Config({part}=...) takes a {cls.__name__}, not "
                                f"{type(options).__name__}")
            object.__setattr__(self, part, dataclasses.replace(options, **changes[part]))

    def __getattr__(self, name: str):
        """A flat read: `config.learning_rate` is `config.optim.learning_rate`."""
        part = _OWNER.get(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def parts(self) -> dict[str, object]:
        """{part: its options}, in PARTS order."""
        return {part: getattr(self, part) for part in PARTS}

    def flat(self) -> dict[str, object]:
        """{setting: value} of every setting (summary.json, config.json, the HParams)."""
        return {field.name: getattr(getattr(self, _OWNER[field.name]), field.name)
                for field in setting_fields()}

    def hparams(self) -> dict[str, object]:
        """{setting: value} of the settings that can change a result (`hparam=True`)."""
        values = self.flat()
        return {name: values[name] for name in settings_lib.hparam_names(setting_fields())}

    def replace(self, **settings) -> "Config":
        """A copy with the given flat settings changed."""
        return Config(**self.parts(), **settings)

    @property
    def num_towers(self) -> int:
        """Tower count of a validated config (global batch / per-tower batch)."""
        return self.data.global_batch_size // self.data.batch_size_per_tower

    def validated(self, on_disk: bool = True) -> "Config":
        """Checks every setting; returns a copy with machine-dependent defaults resolved.

        Each part is checked by its package's `check(options, context)`, then the
        combinations of parts, then the folders on disk (config_checks.py). `on_disk`
        False: the folders are checked creatable but not made, and no checkpoints are
        compared (a check ahead of the run, as a sweep's)."""
        from mgloop.runs import config_checks  # TensorFlow loads with the checks, not before
        return config_checks.validated(self, on_disk)
