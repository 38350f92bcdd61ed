"""Where a method runs: towers, nodes, workers, peers, live sets and shards.

    wrapper.py        a method around another one, presenting it on more towers
    device_groups.py  several towers per device, one copy per device
    between_nodes.py  the method between simulated nodes, an exact sum within each
    node_failures.py  simulated nodes that leave and return (torchft's quorum);
                      live_exchange.py the exchange over the live nodes only
    cross_worker.py   the local method inside each worker, then a collective between them
    peers.py          the method between worker processes, one node leader per worker
    collective_keys.py  the group and instance keys of TensorFlow's collectives, one place
    gather_at_root.py the transport of methods that need every tower's whole gradient
    shard_exchange.py the exchange of a sharded update: reduce-scatter, then all-gather
    queries.py        what runs/ asks a method about where it runs (towers per node, the
                      nodes' failures, a worker's own node state)

May import what aggregation/ may, and aggregation's own modules.
"""
