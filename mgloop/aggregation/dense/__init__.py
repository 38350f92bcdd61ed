"""Dense exchanges: every tower's whole gradient meets every step (docs/methods/).

One module per method family, each in aggregation/registry.py's built-ins:

    parameter_server.py  one shared copy of the variables (`ps`, `ps_cpu`, ...)
    stale.py          `delay` and `drop`: stale and dropped towers on a parameter server
    colocate.py       the single-loss baseline of Keras `multi_gpu_model`
    ring.py           a hand-written chunked ring all-reduce
    collective.py     TensorFlow's own all-reduce kernels (`collective`, `nccl`)
    reduce_broadcast.py, hierarchical.py  reduce on one device; in groups, then leaders
    adasum.py         adaptive summation
    independent.py    replicated variables, no exchange

May import what aggregation/ may, and aggregation's own modules.
"""
