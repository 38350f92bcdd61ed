"""Studies: a grid of runs (methods x settings x seeds) to a budget or a target, and its
report (`python -m mgloop.sweep`, mgloop/sweep.py).

    grid.py     --vary/--set as typed Config settings (the variants)
    plan.py     the cells (variants x seeds), each cell's Config, budget and target
    runner.py   runs the cells one build at a time, resumable, on one or more processes
    record.py   one JSON record per finished cell: eval curve, bytes, modelled seconds
    report.py   report.md (tables); the plots and the mean ± sd are observe/plots.py
                and observe/stats.py

May import: ground modules, observe/ (stats, plots) and runs/ (config). Imports no
TensorFlow itself (the runner's cells do).
The CLI is `python -m mgloop.sweep` (mgloop/sweep.py).
"""
