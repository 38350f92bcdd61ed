"""A run from settings to result: config, assembly, the loop, checkpoints, preemption,
run folders, and sweeps of runs.

    config.py, flags.py      Config (every setting, validated before building) and its flags
    config_checks.py         the gate a Config passes: each module's checks, the combinations
    loop_options.py          the runs part of the settings (`config.loop`): steps, logdir, seed;
                             loop_checks.py its check
    experiment.py            `mgloop.run`: build, train, evaluate, export
    run_inputs.py            the run's training and eval inputs (data.as_input) from a Config
    run_end.py               a run's end: final measures, summary.json, stopped or finished runs
    elastic_summary.py       the rounds of an elastic job in summary.json: workers, steps, bytes
    step_flops.py            the compute per step of --compute (the step traced for its FLOPs)
    assemble.py, trainer.py  the step and its hooks put together from a Config
    loop.py, controller.py, windows.py, monitor.py, callbacks.py   the outer loop and what
                             it reports
    tracing_log.py           log lines while the compiled loop is first traced
    checkpoint.py, node_checkpoint.py   tf.train checkpoints, never half-written
    checkpoint_files.py      the checkpoints folder's files: steps, damage, state file, leftovers
    export.py                the template model as one Keras file, never half-written
    preemption.py, failures.py, logdir_lock.py, run_dir.py   runs that stop and resume
    inference.py, run_result.py, thinned.py, quiet_start.py
    collector.py             Python's garbage collector set for tracing (entry points, tests)
    prepare.py               a run's Config and trainer without the loop (tests, experiments/)
    sweep/                   grids of runs over methods, settings and seeds, and reports

Named `runs`, not `run`: `mgloop.run` is the public function that starts one.
May import every other package; only the entry points (train, launch, sweep) import it.
"""
