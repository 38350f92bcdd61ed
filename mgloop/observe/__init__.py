"""What a run shows: TensorBoard summaries, diagnostics, the time breakdown, the link model.

    options.py      the observe part of the settings (`config.observe`); checks.py its check
    summaries.py    scalars and histograms written with tf.summary (what TensorBoard reads)
    diagnostics.py  per-tower norms, RSS and thread counts sampled in the step
    breakdown.py    where a step's time went (compute, aggregation, apply) from traces
    link_model.py   bytes counted by the methods turned into seconds on a modelled link
                    (tiers between devices, nodes and workers)
    link_report.py  a run's traffic per step averaged over its steps (the occasions each
                    part is sent on), per sync, the gradient compression ratio, per link
    link_scalars.py the link report as TensorBoard scalars and HParams final metrics
    hardware.py     --compute, --node_speeds: compute per step for accelerator profiles
    flops.py        the FLOPs of a traced graph's matrix products and convolutions
    stats.py, plots.py  mean ± sample sd over seeds; a study's plots as small multiples,
                    mean and min-max band over seeds (matplotlib, Agg)

May import: ground modules, cluster/, training/, data/, aggregation/ (for their byte counts).
Never step/ or runs/: the step and the run hand their results here.
"""
