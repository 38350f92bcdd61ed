"""The training step, top to bottom: towers, exchange, update. The data path.

    tower_step.py        TowerStep: one synchronous update of every copy on a global batch
    single_loss_step.py  the `colocate` baseline's step: one loss over every tower
    towers.py            one tower's pass: forward, loss, gradients on its own shard
    vectorized_towers.py, vectorize.py   K towers of a device as one vectorized pass
    replicas.py          which variable copy each tower reads (shared or replicated)
    exchange.py, exchange_timing.py      handing the towers' gradients to the method
    accumulation.py      K micro-batches per step
    ordered_sum.py, precision.py, random_streams.py   the step's numerics
    sufficient_factors.py, sparse_gradients.py        gradients in factored/sparse form
    non_trainable.py, sync_batch_norm.py              state besides the gradients
    hooks/               options that change the step without a branch in it

May import: ground modules, cluster/, training/, data/, aggregation/, models/, observe/.
Never runs/: a step knows nothing of the loop, checkpoints or flags that drive it.
"""
