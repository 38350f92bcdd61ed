"""Studies: a grid of runs (methods x settings x seeds) to a budget or a target, and its
report (`python -m mgloop.sweep`, mgloop/sweep.py).

    options.py  the sweep's own settings: SweepOptions, its flags made from the fields;
                checks.py its check (counts, --tune_search, --output_dir)
    grid.py     --vary/--set as typed Config settings (the variants)
    plan.py     the cells (variants x seeds), each cell's Config, budget and target
    target.py   --target=METRIC>=VALUE: the eval metric and the value a cell must reach
    runner.py   runs the cells one build at a time, resumable, stopped by SIGINT/SIGTERM
    kept_evals.py  a cell's evals kept in its logdir: a stopped cell resumes to its whole curve
    processes.py   the cells in worker processes; the parent forwards signals, waits for them
    tune.py     --tune: per variant a tuning grid on its own seeds, each point's score
    search.py   which points run (--tune_search: the grid, or one axis at a time;
                --tune_widen past an edge) and the point chosen, from the records on disk
    record.py   one JSON record per finished cell: eval curve, bytes, modelled seconds
    report.py   report.md (tables) and its plots; the plots and the mean ± sd are
                observe/plots.py and observe/stats.py
    plot_panels.py  which curves share a panel (method families, the baseline), their
                styles, the links written out
    tuning_report.py  the report's Tuning section

May import: ground modules, observe/ (stats, plots, link_model, link_report) and runs/
(config, callbacks, preemption, quiet_start, collector), none of which loads TensorFlow; and only
inside the functions that need them: runs/ (checkpoint_files, failures, run_dir and
`mgloop.run`: a cell's run; experiment: its default loss), training/ (the default
metrics: the eval metrics a cell reports, plan.eval_metrics), observe/ (summaries: its
record written), cluster/ (devices: the logical CPUs of a process), data/ (a dataset's
size: --epochs; whether it has eval data and sequences) and aggregation/ (a method's
options: --tune). So no module here loads TensorFlow when imported (the cells'
runs and their Configs' checks do; a worker process loads it quietly first), and a plan
unpickles in a fresh worker before TensorFlow loads.
The CLI is `python -m mgloop.sweep` (mgloop/sweep.py).
"""
