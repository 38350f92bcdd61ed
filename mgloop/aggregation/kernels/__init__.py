"""The kernels the methods share: how tensors are packed, sorted and cut.

    packing.py        small tensors fused into buckets (`--pack_bytes`)
    bitpacking.py     compressed payloads packed into uint8 tensors
    stacked_rows.py   rows of a stacked tensor, stacked again without a copy
    sorting_network.py  order statistics along the towers' axis, compiled with XLA
    chunked_topk.py   chunk-wise top-k on a per-tensor codebook (SparseLoCo's compressor)

May import what aggregation/ may, and aggregation's base modules.
"""
