"""Lossy compressed exchanges with error feedback (docs/methods/compression.md).

`base.py`: the shared machinery (the `memory` option, per-tower state, the choice
between the two transports, per-step seeds, exact byte counts); `sites.py`: where one
compression happens (`Site`) and what it made (`Encoded`); `transport.py`: how
payloads travel (the ring all-gather, buckets) and what every tower forms from them
(the ring's sums, the gathered sums); `sizes_first.py`: payloads whose length the data
decides (threshold), counts gathered first; `scales.py`: the scales the towers agree on
before quantising. One module per method, each in aggregation/registry.py's built-ins:

    topk.py, randomk.py, threshold.py   sparse: the k largest, k seeded random, |x| >= v
    dgc.py            Deep Gradient Compression (momentum correction, masking, clipping)
    onebit.py, signs.py  1-bit SGD; `signsgd` (majority vote) and `efsignsgd`
    qsgd.py           `qsgd` and `terngrad`: stochastic quantisers on shared scales
    powersgd.py       rank-r gradients by one power iteration
    demo.py, dct.py   DeMo (decoupled momentum) and its chunked DCT-II

May import what aggregation/ may, and aggregation's base modules.
"""
