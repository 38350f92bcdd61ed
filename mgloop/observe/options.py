"""What a run shows beyond its result: the observe part of the settings
(`config.observe`): TensorBoard, logs, profiles and the link model. Each of these reads
the towers' losses, gradients or variables and changes none.

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

_WRITES = "only what is written and how often, not what is computed"


@dataclasses.dataclass(frozen=True)
class ObserveOptions:
    """What a run shows beyond its result (`config.observe`)."""

    summary_every: int = setting(20, "steps between TensorBoard scalar summaries (0: none)",
                                 neutral=_WRITES)
    log_every: int = setting(100, "steps between progress log lines (0: none)", neutral=_WRITES)
    diagnostics: bool = setting(
        True, "per-tower loss and gradient norm, gradient agreement (cosine, norm ratio) and "
        "replica divergence in TensorBoard, every --summary_every steps", neutral=_WRITES)
    eval_every: int = setting(
        0, "steps between evaluations on the held-out split (0: only at the end)",
        neutral=_WRITES)
    eval_each_node: bool = setting(
        False, "at every evaluation also score each node's own copy, beside the model the "
        "method produces (local SGD, the DiLoCo family, SPARTA: their copies differ between "
        "syncs): eval/node_N/... and the spread between replicas eval/node_spread/loss "
        "(max - min of the nodes' losses) in TensorBoard; nothing for a method whose copies "
        "are equal", neutral="evaluations only: no training variable is read differently")
    histogram_every: int = setting(
        0, "steps between weight and gradient histograms (0: none)", neutral=_WRITES)
    profile_steps: str | None = setting(
        None, "A,B: write a profiler trace of steps A+1 .. B into <logdir>/plugins/profile",
        neutral=_WRITES)
    breakdown_every: int = setting(
        0, "steps between profiled steps whose time is split into input, compute, "
        "aggregation and apply (breakdown/... scalars; 0: none)", neutral=_WRITES)
    links: tuple[str, ...] = setting(
        (), "BANDWIDTH,LATENCY, e.g. 10gbit,10us (repeatable): model the step's exchange on "
        "such a network from its exact traffic (observe/link_model.py) and report the modelled "
        "exchange and step times beside the measured compute time (summary.json link_model, "
        "link/... scalars); bandwidth in bit, kbit, mbit, gbit, tbit per second, latency in "
        "ns, us, ms, s", flag="link",
        neutral="a model computed after training from the traffic counts")
    compute: str = setting(
        "measured", "the compute per step the link model sets beside the exchange: measured "
        "(this machine's median step less the exchange timed alone) | PROFILE[:efficiency=E] "
        "(FLOPs of one tower's step, counted from the traced training step, over the peak "
        "dense 16-bit FLOP/s of a100, h100, v100, t4 or cpu times E, the model FLOPs "
        "utilisation, 0 < E <= 1, default 0.4) | seconds=X (one tower's step, given); "
        "observe/hardware.py", neutral="a model computed after training; the step is traced "
        "for its FLOPs, never run")
    time_exchange: bool = setting(
        True, "after training, time the exchange alone (traced apart: seconds for a "
        "compressor) for summary.json's exchange_seconds and the measured compute (the median "
        "step less it); false: exchange_seconds is null and the measured compute keeps the "
        "exchange", neutral="a measurement after training")
    node_speeds: str | None = setting(
        None, "S1,S2,...: one speed factor per node (--nodes, or the workers), e.g. 1,1,0.5,1; "
        "every step waits for the slowest node, so the modelled compute per step is "
        "C / min(speed); async_diloco also takes its nodes' inner steps on these clocks",
        hparam=True)

