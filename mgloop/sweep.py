"""`python -m mgloop.sweep --flagfile=STUDY.flags` (or the flags below): a study.

    --vary=KEY=V1,V2,...   an axis of the grid (repeatable; grid.py: tied keys K1/K2=A/B,
                           aggregation specs keep their own options)
    --set=KEY=VALUE        a setting of every cell (repeatable)
    --seeds=N              every variant with seeds 0..N-1 (default 3)
    --epochs=E             the budget in passes over the training data (or
                           --set=train_steps=S)
    --evals=K              evaluations over the budget (default 20)
    --target=METRIC>=V     time to target is recorded (steps, bytes, modelled seconds);
                           METRIC<=V for a metric to bring down (loss<=2.0,
                           perplexity<=30: a language model's eval metrics); a metric
                           a cell does not report is refused (plan.eval_metrics);
                           --stop_at_target ends a cell there
    --tune=KEY=V1,V2,...   per variant, a tuning grid run first on --tune_seeds=N seeds
                           (1000, 1001, ...), the final --seeds then at the best point
                           (repeatable; KEY a Config field or aggregation.OPTION, an
                           option of the variant's spec: runs/sweep/tune.py)
    --tune_search=grid|coordinate   every point of the tuning grid, or one axis at a
                           time from the middle of each (the sum of the axes' lengths)
    --tune_widen=W         an axis whose best is at its edge gets a value one geometric
                           step past it, up to W times per side (default 0)
    --tune_passes=P        the coordinate search goes over the axes P times, each pass
                           from the point the last chose (default 1)
    --panels=KEY           the plots' small multiples: one panel per value of this --vary
                           axis (default: split when a panel would hold over 6 curves)
    --link=[between:]BANDWIDTH,LATENCY   links to model (repeatable; link_model.py)
    --output_dir=DIR       runs/ (TensorBoard: one HParams run per cell), results/ (one
                           JSON record per finished cell), report.md and plots/
    --processes=P          cells at once (default 1: in this process)
    --cells_per_process=N  a fresh worker process for every N cells (default 4; 0 with
                           --processes=1: every cell in this process)
    --report_only          rewrite report.md and plots/ from the records found

Re-running the same command skips the finished cells and resumes a stopped one from its
checkpoint (runner.py). SIGINT (Ctrl-C) or SIGTERM stops the running cells at their next
loop boundary with a checkpoint, stops every worker process, prints one line and exits
with 128 + the signal number (130, 143); a second signal stops them at once, leaving their
last checkpoints (processes.py). Bad settings (a flag's value, a --vary or --set item, a
cell's Config, a --target metric a cell does not report) end the process with exit code 2
and one line on stderr, before any folder is made or any cell built. So does a variant's
tuning grid none of whose points has a score (tune.py), once its tuning cells have run:
its final seeds are not run at a point chosen without a value. The workers' TensorFlow
start-up lines are kept off stderr as `mgloop.train`'s are (quiet_start.py).

The flags are made from the fields of runs/sweep/options.py (`SweepOptions`, the rules of
`mgloop.train`'s: runs/flags.py) and read back into one; runs/sweep/checks.py refuses a
value out of range.
"""

from __future__ import annotations

import shlex
import signal
import sys

from absl import app
from absl import logging

from mgloop import errors
from mgloop.errors import ConfigError
from mgloop.runs import flags as mgloop_flags  # loads no TensorFlow
from mgloop.runs import quiet_start  # loads no TensorFlow
from mgloop.runs.sweep import checks  # loads no TensorFlow
from mgloop.runs.sweep.options import SweepOptions

mgloop_flags.define_flags_of(SweepOptions, __name__)  # its fields: runs/sweep/options.py


def plan_from_options(options: SweepOptions):
    from mgloop.runs.sweep import plan as plan_lib
    from mgloop.runs.sweep import target as target_lib
    from mgloop.runs.sweep import tune
    return plan_lib.Plan(vary=options.vary, set=options.set,
                         seeds=tuple(range(options.seeds)), output_dir=options.output_dir,
                         epochs=options.epochs, evals=options.evals,
                         target=target_lib.parse_target(options.target),
                         stop_at_target=options.stop_at_target, links=options.links,
                         plugins=options.plugins, tune=options.tune,
                         tune_seeds=tune.tuning_seeds(options.tune_seeds),
                         tune_search=options.tune_search, tune_widen=options.tune_widen,
                         tune_passes=options.tune_passes)


class _Interrupted(Exception):
    """A signal that came while no cell was running (validating, writing the report)."""


def _interrupted(signum, frame):
    raise _Interrupted(signum)


def _error(message: str, code: int):
    print(f"mgloop.sweep: {message}", file=sys.stderr)
    sys.exit(code)


parse_flags = errors.flags_parser("mgloop.sweep")  # a bad value: one line, exit code 2


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupted)  # the runner sets its own while cells run
    try:
        _main(mgloop_flags.options_from_flags(SweepOptions))
    except _Interrupted as stop:
        signum = stop.args[0]
        _error(f"stopped by {signal.Signals(signum).name} while no cell was running; run the "
               "same command to resume", 128 + signum)


def _main(options: SweepOptions):
    try:
        checks.check(options)  # before any folder is made or TensorFlow loads
    except ConfigError as error:
        _error(f"error: {error}", 2)
    if options.tune or not options.report_only:  # the report alone needs no TensorFlow;
        quiet_start.load_tensorflow()  # the cells' checks and --tune's methods load it quietly
    from mgloop.runs.sweep import grid
    from mgloop.runs.sweep import report
    from mgloop.runs.sweep import runner
    try:
        plan = plan_from_options(options)
        cells = plan.cells()
        keys = [key for key, _ in cells[0].variant.axes]
        if options.panels is not None and options.panels not in keys:
            raise ConfigError(f"--panels={options.panels}: not a --vary axis; one of: "
                              f"{', '.join(keys) or 'none (no --vary)'}")
        if not options.report_only:
            runner.run(plan, options.processes, options.cells_per_process,
                       last_words=lambda line: print(f"mgloop.sweep: {line}", file=sys.stderr,
                                                     flush=True))
    except (ConfigError, grid.SpecError) as error:
        _error(f"error: {error}", 2)
    except runner.Stopped as stop:
        _error(str(stop), 128 + stop.signum)
    order = list(dict.fromkeys(cell.variant.name for cell in cells))
    title = options.title or plan.output_dir.rstrip("/").split("/")[-1]
    command = [arg for arg in sys.argv[1:] if arg not in ("--report_only", "--report_only=true")]
    path = report.write(plan.output_dir, order, title,
                        "python -m mgloop.sweep " + " ".join(map(shlex.quote, command)),
                        panel_key=options.panels, target=plan.target)
    logging.info("sweep: report in %s", path)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
