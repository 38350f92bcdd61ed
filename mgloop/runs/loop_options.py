"""How long a run trains, where it writes, and its seed: the runs part of the settings
(`config.loop`); data only: its check is loop_checks.py's.

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

_WHERE = "only where files go"  # reasons why a setting changes no result (HParams)
_WRITES = "only what is written and how often, not what is computed"


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """How long a run trains, where it writes, and its seed: the runs part (`config.loop`)."""

    train_steps: int = setting(400, "train until the global step reaches this (resumes count)",
                               hparam=True)
    steps_per_loop: int = setting(
        20, "steps run inside one compiled tf.function call",
        neutral="the same steps run, only fewer or more per compiled call")
    checkpoint_every: int = setting(
        200, "steps between checkpoints (0: only at the end of training)",
        neutral="a save reads the variables; a resume continues bit-identically")
    keep_checkpoints: int = setting(3, "how many recent checkpoints to keep", neutral=_WRITES)
    logdir: str | None = setting(
        None, "run folder for events, checkpoints, summary.json (default: a fresh timestamped "
        "folder under the temp dir)", neutral=_WHERE)
    export_dir: str | None = setting(
        None, "save the template model here as model.keras (Keras native format)",
        neutral=_WHERE)
    seed: int = setting(0, "seed of data, initialisation and shuffling", hparam=True)
    deterministic: bool = setting(False, "TensorFlow op determinism: bit-repeatable runs",
                                  hparam=True)


# numpy's seed (keras.utils.set_random_seed seeds numpy, Python and TensorFlow) is 32 bits.
MAX_SEED = 2**32 - 1
