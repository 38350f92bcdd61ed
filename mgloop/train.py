"""`python -m mgloop.train [--flag=value ...] [--flagfile=FILE]`: train one experiment.

Bad settings end the process with exit code 2 and one line on stderr, before
any device or variable is created. TensorFlow's start-up lines are kept off
stderr unless TF_CPP_MIN_LOG_LEVEL is set (quiet_start.py). With several processes
(TF_CONFIG), a worker that loses a peer (its collective fails, or the peer answers
no health check for --collective_timeout seconds: mgloop/cluster/peer_health.py) ends with
exit code 3 and one line naming the peer when the health checks found it.
SIGTERM or SIGINT ends the run after the current compiled loop, with a checkpoint of that
step and summary.json (`"preempted"`), and exits with 128 + the signal number (143 for
SIGTERM, 130 for SIGINT); a second signal ends the process at once (mgloop/runs/preemption.py).
A full disk, a NaN or infinite loss (mgloop.runs.failures) or a lost logdir end with
exit code 1 and one line naming the path or the steps and how to resume.
"""

from __future__ import annotations

import os
import signal
import sys

from mgloop.runs import quiet_start  # loads no TensorFlow

tf = quiet_start.load_tensorflow()  # its start-up lines off stderr, unless TF_CPP_MIN_LOG_LEVEL

from absl import app  # noqa: E402
from absl import logging  # noqa: E402

from mgloop.runs import collector  # noqa: E402
from mgloop.runs import experiment  # noqa: E402
from mgloop.runs import failures  # noqa: E402
from mgloop.runs import flags as mgloop_flags  # noqa: E402
from mgloop.runs import monitor  # noqa: E402
from mgloop.cluster import peer_health  # noqa: E402
from mgloop import errors  # noqa: E402
from mgloop.errors import ConfigError, TensorBranchError, one_line  # noqa: E402

mgloop_flags.define_flags()



def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = mgloop_flags.config_from_flags()
    collector.for_tracing()  # every module is imported: the collector set for tracing
    try:
        summary = experiment.run(config, command_line=list(sys.argv))
    except (ConfigError, TensorBranchError) as error:
        print(f"mgloop.train: error: {error}", file=sys.stderr)
        sys.exit(2)
    except (monitor.LogdirLost, failures.RunFailed) as error:
        print(f"mgloop.train: error: {error}", file=sys.stderr)
        sys.exit(1)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError) as error:
        if not os.environ.get("TF_CONFIG"):
            raise
        lost = peer_health.find_lost_peer(str(error))  # a peer the health checks gave up on
        detail = lost[1] if lost else one_line(error)
        print(f"mgloop.train: error: lost the other workers ({detail}); the last checkpoint "
              "in --logdir is kept: restart every worker to resume", file=sys.stderr)
        sys.exit(peer_health.LOST_PEERS_EXIT_CODE)
    except KeyboardInterrupt:  # SIGINT before the run's handler was installed
        print("mgloop.train: interrupted before training started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except (tf.errors.OpError, OSError) as error:  # a summary or JSON write on a full disk
        path = failures.disk_full_path(error)
        if path is None:
            raise
        if not path:  # e.g. an OSError from closing a file names none
            path = f"--logdir={config.logdir}" if config.logdir else "the logdir"
        print(f"mgloop.train: error: no space left on the device of {path}; the last complete "
              "checkpoint in --logdir is kept: free space, then rerun the same command to "
              "resume", file=sys.stderr)
        sys.exit(1)
    if summary.get("preempted"):  # the run logged where it stopped and what it saved
        sys.exit(128 + signal.Signals[summary["preempted"]["signal"]])
    speed = summary["examples_per_sec"]
    logging.info("final: train loss %.4f,%s %s on %d towers; "
                 "summary in %s", summary["final_train_loss"] or float("nan"),
                 "" if summary["eval_accuracy"] is None
                 else f" eval accuracy {summary['eval_accuracy']:.3f},",
                 "speed not measured" if speed is None else f"{speed:.0f} examples/sec",
                 summary["num_towers"],
                 os.path.join(summary["config"]["logdir"], experiment.SUMMARY_FILENAME))


if __name__ == "__main__":
    app.run(main, flags_parser=errors.flags_parser("mgloop.train"))
