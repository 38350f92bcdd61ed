"""`python -m mgloop.train [--flag=value ...] [--flagfile=FILE]`: train one experiment.

Bad settings end the process with exit code 2 and one line on stderr, before
any device or variable is created. TensorFlow's start-up lines are kept off
stderr unless TF_CPP_MIN_LOG_LEVEL is set (quiet_start.py). With several
processes (TF_CONFIG), a worker that loses its peers (a collective times out)
ends with exit code 3 and one line.
"""

from __future__ import annotations

import os
import sys

from mgloop import quiet_start  # loads no TensorFlow

with quiet_start.loading():  # TensorFlow's start-up lines off stderr, unless TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    tf.config.list_physical_devices("GPU")  # where a machine without CUDA logs its cuInit
quiet_start.after_loading()

from absl import app  # noqa: E402
from absl import logging  # noqa: E402

from mgloop import experiment  # noqa: E402
from mgloop import flags as mgloop_flags  # noqa: E402
from mgloop import monitor  # noqa: E402
from mgloop.errors import ConfigError  # noqa: E402

mgloop_flags.define_flags()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = mgloop_flags.config_from_flags()
    try:
        summary = experiment.run(config, command_line=list(sys.argv))
    except ConfigError as error:
        print(f"mgloop.train: error: {error}", file=sys.stderr)
        sys.exit(2)
    except monitor.LogdirLost as error:
        print(f"mgloop.train: error: {error}", file=sys.stderr)
        sys.exit(1)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError) as error:
        if not os.environ.get("TF_CONFIG"):
            raise
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        print(f"mgloop.train: error: lost the other workers ({type(error).__name__}: "
              f"{first.strip()}); the last checkpoint in --logdir is kept: restart every "
              "worker to resume", file=sys.stderr)
        sys.exit(3)
    logging.info("final: train loss %.4f, eval accuracy %.3f, %.0f examples/sec on %d towers; "
                 "summary in %s", summary["final_train_loss"] or float("nan"),
                 summary["eval_accuracy"], summary["examples_per_sec"] or 0.0,
                 summary["num_towers"],
                 os.path.join(summary["config"]["logdir"], experiment.SUMMARY_FILENAME))


if __name__ == "__main__":
    app.run(main)
