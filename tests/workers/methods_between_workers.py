"""One worker of a multi-worker job that trains several methods in turn (tests).

    python tests/workers/methods_between_workers.py --devices=cpu:2 [--KEY=INT ...] ROOT SPEC...

Run by `mgloop.launch.launch(..., command=[python, this file])`, which sets TF_CONFIG
and appends `--devices=...`. For each aggregation SPEC (its index i) it trains
`config_for(spec, ..., KEY=INT ...)` into ROOT/i (resuming what ROOT/i holds) (the chief exports ROOT/i/export), so one pair of
processes (one TensorFlow start-up and one gRPC server each) covers every method.
SPEC@S trains S steps first, then runs again on the same logdir, which resumes from the
checkpoint of step S (the chief's and every node's, read back from disk).
A SPEC may carry settings after the method, `METHOD --key=value ...` (e.g.
`--mixed_precision=mixed_float16`, `--partition=dirichlet:alpha=0.5`), and
`--overflow=G:S`: global tower G's gradients are made non-finite at step S (`OverflowAt`);
with a resume, the settings follow it: `METHOD@S --key=value`.
Each worker prints, with its `done`, its loss scale and a digest of its weights.
"""

import contextlib
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from mgloop.runs import quiet_start  # noqa: E402

tf = quiet_start.load_tensorflow()  # as mgloop.train loads it

from mgloop import Config, ConfigError  # noqa: E402
from mgloop.cluster import devices as devices_lib  # noqa: E402
from mgloop.cluster import workers as cluster  # noqa: E402
from mgloop.runs import experiment  # noqa: E402
from mgloop.runs import prepare  # noqa: E402
from mgloop.step.hooks import Hook  # noqa: E402


class OverflowAt(Hook):
    """Global tower `tower`'s gradients times inf (so +-inf, or NaN where 0) at the run's
    step `step` (counted from its start), as an overflow in its scaled backward pass would
    make them; every other tower and step as computed. A test of the agreed skip."""

    def __init__(self, tower: int, step: int, first_tower: int):
        self.local, self.step = tower - first_tower, step  # the tower in this process, if any
        self.count = None

    def step_scope(self):
        if self.count is None:  # made once, when the step is first traced
            with tf.init_scope():
                self.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        return contextlib.nullcontext()

    def unscale(self, t, grads):
        if t != self.local:
            return grads
        factor = tf.where(tf.equal(self.count, self.step), np.inf, 1.0)
        return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]

    def after_exchange(self, grads):
        return [self.count.assign_add(1)]


def hooks_for(spec: str, devices: str) -> list[Hook]:
    """The spec's `--overflow=G:S` as a hook of this process (its towers `devices`)."""
    overflow = prepare.method_settings(spec)[1].get("overflow")
    if overflow is None:
        return []
    tower, step = map(int, str(overflow).split(":"))
    workers = cluster.from_environment()
    towers = devices_lib.parse(devices, 1).num_towers
    return [OverflowAt(tower, step, workers.index * towers if workers else 0)]


def digest(result) -> str:
    """sha256 of this process's trained weights (variable copy 0), bytes in order."""
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                   for w in result.model.get_weights())).hexdigest()[:16]


def config_for(spec: str, root: str, index: int, devices: str, **overrides) -> Config:
    """`prepare.method_config` of the spec in ROOT/i on `devices`; its `--overflow` is a
    hook (hooks_for), not a setting."""
    spec = " ".join(word for word in spec.split() if not word.startswith("--overflow="))
    return prepare.method_config(spec, os.path.join(root, str(index)), devices=devices,
                                 **overrides)


def main(argv):
    settings = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
    devices = settings.pop("devices")
    overrides = {key: int(value) for key, value in settings.items()}  # e.g. --train_steps=2
    root, *specs = [a for a in argv if not a.startswith("--")]
    for index, entry in enumerate(specs):
        head, *own = entry.split()  # "SPEC[@S] [--KEY=VALUE ...]"
        spec, _, first = head.partition("@")
        spec = " ".join([spec, *own])
        try:  # refused the same way on every worker, before anything is built
            if first:  # stop after `first` steps, then resume from the checkpoint on disk
                experiment.run(config_for(spec, root, index, devices,
                                          **dict(overrides, train_steps=int(first))),
                               hooks=hooks_for(spec, devices))
            result = experiment.run(config_for(spec, root, index, devices, **overrides),
                                    hooks=hooks_for(spec, devices))
        except ConfigError as error:
            print(f"[methods] refused {index} {entry}: {error}", flush=True)
            continue
        worker = cluster.from_environment().index
        print(f"[methods] done {index} {entry} | worker={worker} "
              f"loss_scale={result.trainer.loss_scale()} weights={digest(result)}", flush=True)


if __name__ == "__main__":
    from mgloop.runs import collector
    collector.for_tracing()  # as mgloop.train's (runs/collector.py)
    main(sys.argv[1:])
