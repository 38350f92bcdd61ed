"""Local updates: replicas that step alone and meet every H steps (docs/methods/local-updates.md).

    local_steps.py    `localsgd`, `diloco`; outer_schedule.py their outer momentum schedule
                      (Pier's warmup and decay)
    streaming_diloco.py  DiLoCo on one fragment at a time; overlap.py when a fragment's
                      outer step is used, outer_formats.py how its outer gradients travel
    async_diloco.py   DiLoCo for nodes of different speeds; async_clock.py its schedule,
                      async_run.py its run glue (--node_speeds, its staleness reported)
    des_loc.py        local Adam whose parameters and moments meet on their own periods
    noloco.py         no all-reduce: each replica averages with one random peer
    sparta.py         `sparta`, `sparta_diloco`: a small random part averaged every step
    sparseloco.py     DiLoCo with sparse 2-bit outer gradients (kernels/chunked_topk.py)

May import what aggregation/ may, and aggregation's own modules.
"""
