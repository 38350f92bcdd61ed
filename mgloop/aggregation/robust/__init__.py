"""Robust rules against Byzantine towers (docs/methods/robust.md), each gathering every
tower's whole gradient at one root (placement/gather_at_root.py):

    median.py, trimmed_mean.py   coordinate-wise median and trimmed mean
    krum.py, bulyan.py    `krum`, `multikrum` and `bulyan`: the closest gradients
    geomedian.py          the geometric median (smoothed Weiszfeld)
    centered_clipping.py  clipping around a centre, iterated
    nnm.py                nearest-neighbour mixing, their pre-aggregation

May import what aggregation/ may, and aggregation's own modules.
"""
