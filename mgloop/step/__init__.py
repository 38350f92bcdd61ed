"""The training step, top to bottom: towers, exchange, update. The data path.

    options.py, checks.py  the step part of the settings (`config.step`); its check, which
                         the gate (runs/config_checks.py) calls before anything is built
    training_step.py     the step: one synchronous update of every copy on a global batch
    single_loss_step.py  the `colocate` baseline's step: one loss over every tower
    per_tower.py         variable layouts and one tower's pass: forward, loss, gradients
    vectorized_towers.py, pfor.py   K towers of a device as one vectorized pass (pfor, its
                         loop fallbacks named)
    compiled_towers.py   `--xla_towers`: each tower's pass compiled by XLA, per device
    replicas.py          which variable copy each tower reads (shared or replicated)
    sharded_update.py, whole_state.py   `--shard_update` (ZeRO-1): each copy updates its
                         chunk; the whole optimizer state built for a checkpoint
    exchange.py, exchange_timing.py      handing the towers' gradients to the method
    accumulation.py      K micro-batches per step
    ordered_sum.py, precision.py, random_streams.py   the step's numerics
    sufficient_factors.py, sparse_gradients.py        gradients in factored/sparse form
    non_trainable.py, sync_batch_norm.py              state besides the gradients
    hooks/               options that change the step without a branch in it

Old names, each warning (DeprecationWarning) until mgloop 0.2: tower_step.py
(training_step.py), towers.py (per_tower.py), vectorize.py (pfor.py).

May import: ground modules, cluster/, training/, data/, aggregation/, models/, observe/.
Never runs/: a step knows nothing of the loop, checkpoints or flags that drive it.
"""
