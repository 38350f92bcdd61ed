"""`--xla_towers`: each tower's forward, loss and backward compiled by XLA, per device.

The tower loop's pass (per_tower.tower_pass) runs its ops one by one through TensorFlow's
executor. On small shards the executor's per-op cost is most of a tower's time; XLA fuses
the elementwise ops around the matmuls into a few kernels and launches one cluster per
tower. Here the pure part of the pass,

    (v, s, x_t, y_t) -> (loss_t, outputs_t, g[t] = d loss_t / d v, s'_t)

(the same computation as per_tower.tower_pass, and as vectorized_towers's per-tower body)
is one `tf.function(jit_compile=True)`, traced once and called on every tower's device
inside the step; XLA compiles it once per device. What reads the tower's index stays
outside it: the shard's copy onto the device, the random streams' keys
(random_streams.py), the metrics of the real examples (a short padded batch selects its
rows, a shape XLA cannot fix) and the hooks' `unscale`. So a hook acting inside the
pass by the tower's index (hooks.IN_TOWER_PASS: label flipping, loss scaling, sync batch
norm) is refused in one line, as are the settings that need such a hook.

Numerics: XLA may fuse and reorder float32 sums (e.g. a bias gradient's sum over the
shard), so g[t] differs from the uncompiled pass by rounding only: at most
gamma_n * sum |terms| per element, n the shard's length (tests/tolerance.py).
"""

from __future__ import annotations

import tensorflow as tf

from mgloop import aggregation
from mgloop.errors import ConfigError
from mgloop.step import precision
from mgloop.step import per_tower
from mgloop.step.hooks import IN_TOWER_PASS, attacks
from mgloop.step.options import StepOptions


def _refusal(why: str) -> ConfigError:
    return ConfigError(f"--xla_towers: {why}; use --noxla_towers")


def check_step(options: StepOptions, towers_per_device: int) -> None:
    """With --xla_towers, refuses (one line) the step settings that act inside a tower's
    pass by its index, which one compiled pass shared by every tower cannot give it."""
    if not options.xla_towers:
        return
    if options.byzantine_towers and attacks.parse_attack(options.attack).name == "labelflip":
        raise _refusal("--attack=labelflip flips a tower's labels inside its pass")
    if towers_per_device > 1:
        raise _refusal(f"--towers_per_device={towers_per_device} already computes a "
                       "device's towers as one vectorized pass")
    if precision.uses_loss_scaling(options.mixed_precision):
        raise _refusal(f"--mixed_precision={options.mixed_precision} scales each tower's "
                       "loss by its copy's loss scale inside its pass (use mixed_bfloat16 or "
                       "none)")
    if options.batch_norm == "sync":
        raise _refusal("--batch_norm=sync synchronises batch statistics between the towers' "
                       "passes (use --batch_norm=per_tower)")


def check_method(options: StepOptions, aggregation_flag: str) -> None:
    """With --xla_towers, refuses (one line) a method with no per-tower pass to compile."""
    if options.xla_towers and aggregation.parse(aggregation_flag)[0].capabilities.single_loss:
        raise _refusal(f"--aggregation={aggregation_flag} computes one loss over every tower, "
                       "no per-tower pass to compile")


def check_hooks(hooks) -> None:
    """Refuses (one line) a hook acting inside a tower's pass by its index."""
    for hook in hooks:
        if hook.acts_in_tower_pass():
            raise ConfigError(
                f"--xla_towers: the hook {type(hook).__name__} acts inside a tower's pass "
                f"by its index (one of {', '.join(IN_TOWER_PASS)}), and the pass is one "
                "compiled function shared by every tower; use --noxla_towers")


class CompiledPass:
    """The step's group pass (training_step.TowerStep.group_pass) with one compiled body."""

    def __init__(self):
        self._body = None

    def _compiled(self, step):
        if self._body is None:
            kwargs = per_tower.call_kwargs(step.replicas.model, True)

            def body(trainable, state, x, y):
                return per_tower.pure_pass(step, trainable, state, x, y, kwargs)

            self._body = tf.function(body, jit_compile=True, autograph=False)
        return self._body

    def __call__(self, step, group: range, trainable, states, xs, ys):
        """Tower t = group[0] (one tower per device) on its shard: the compiled body on its
        device, then its metrics and the hooks' `unscale` as per_tower.tower_pass gives them."""
        (t,) = group
        streams, hooks = step.random_streams, step.hooks
        device = step.replicas.tower_devices[t]
        with tf.device(device):
            x, y = tf.nest.map_structure(tf.identity, (xs[0], ys[0]))
            state = streams.for_tower(states[0], t, device)
            loss, outputs, grads, new_state = self._compiled(step)(trainable, state, x, y)
            return [per_tower.TowerOutput(
                loss, per_tower.metric_state(step.metrics, y, outputs),
                hooks.unscale(t, grads), streams.after_tower(states[0], new_state))]
