"""One worker of a multi-worker job that trains several methods in turn (tests).

    python tests/workers/methods_between_workers.py --devices=cpu:2 [--KEY=INT ...] ROOT SPEC...

Run by `mgloop.launch.launch(..., command=[python, this file])`, which sets TF_CONFIG
and appends `--devices=...`. For each aggregation SPEC (its index i) it trains
`config_for(spec, ..., KEY=INT ...)` into ROOT/i (resuming what ROOT/i holds) (the chief exports ROOT/i/export), so one pair of
processes (one TensorFlow start-up and one gRPC server each) covers every method.
SPEC@S trains S steps first, then runs again on the same logdir, which resumes from the
checkpoint of step S (the chief's and every node's, read back from disk). An entry may
carry settings of its own after its SPEC, one argument: "SPEC[@S] --KEY=VALUE ..." (e.g.
"ring --method_at=nodes --towers_per_device=2"), over the job's.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mgloop import Config, ConfigError, aggregation  # noqa: E402
from mgloop.runs import experiment  # noqa: E402

SETTINGS = dict(model="mlp", global_batch_size=64, optimizer="momentum", learning_rate=0.1,
                train_steps=4, steps_per_loop=4, seed=3, deterministic=True, summary_every=0,
                log_every=0, diagnostics=False, collective_timeout=60)


def config_for(spec: str, root: str, index: int, devices: str, **overrides) -> Config:
    settings = dict(SETTINGS, aggregation=spec, devices=devices,
                    logdir=os.path.join(root, str(index)),
                    export_dir=os.path.join(root, str(index), "export"))
    settings.update(overrides)
    method, options = aggregation.parse(spec)
    if method.applies_momentum(options):  # momentum inside the method: plain SGD outside
        settings["optimizer"] = "sgd"
    return Config(**settings)


def parse_entry(entry: str) -> tuple[str, int, dict]:
    """"SPEC[@S] [--KEY=VALUE ...]" -> (SPEC, S or 0, {KEY: VALUE}), an integer VALUE as int."""
    head, *flags = entry.split()
    spec, _, first = head.partition("@")
    settings = dict(flag[2:].split("=", 1) for flag in flags)
    return spec, int(first or 0), {key: int(value) if value.isdigit() else value
                                   for key, value in settings.items()}


def main(argv):
    settings = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
    devices = settings.pop("devices")
    overrides = {key: int(value) for key, value in settings.items()}  # e.g. --train_steps=2
    root, *specs = [a for a in argv if not a.startswith("--")]
    for index, entry in enumerate(specs):
        spec, first, own = parse_entry(entry)
        settings = dict(overrides, **own)
        try:  # refused the same way on every worker, before anything is built
            if first:  # stop after `first` steps, then resume from the checkpoint on disk
                experiment.run(config_for(spec, root, index, devices,
                                          **dict(settings, train_steps=first)))
            experiment.run(config_for(spec, root, index, devices, **settings))
        except ConfigError as error:
            print(f"[methods] refused {index} {entry}: {error}", flush=True)
            continue
        print(f"[methods] done {index} {entry}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
