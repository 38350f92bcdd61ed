"""`--towers_per_device=K`: the K towers of one device computed as one vectorized computation.

With D devices and K towers per device there are T = D K towers; tower t = d K + k is on
device d (tower-major, as the shards: tower t holds rows [t B/T, (t+1) B/T) of the global
batch, staged once per device and split there: staging.PerDevice). On device d, instead
of K traced copies of the tower's pass (per_tower.tower_pass), one function of ONE tower's
shard,

    f(x_t, y_t, s_t) = (loss_t, metric state_t, g[t] = d loss_t / d v, new state_t),

is traced once and mapped over the K stacked shards by `tf.vectorized_map` (pfor;
pfor.py): every op of f becomes one op over a leading axis of K (a matmul of the K
shards with the shared weights, a batched matmul for the K weight gradients), so the
graph does not grow with K. The towers read the same trainable values v (their device's
copy), which are not mapped; what is mapped is each tower's own:

    x_t, y_t   its shard                (its batch norm's batch statistics are its shard's)
    s_t        its non-trainable values (with accumulation each tower carries its own
               between micro-batches), its random streams' seed states set to [a_g, c]
               of its global index g (random_streams.py), as the tower loop gives it

so tower t computes the same function of the same inputs as in the tower loop; the results
differ only by the rounding of the vectorized kernels' sums (a batched matmul adds in
another order), within the float32 bound of any reordered sum
(tests/test_vectorized_towers.py derives its tolerances so). After the map, each tower's
loss, metric state, gradients and state are rows of the outputs, handed on per tower as in
the loop (`hooks.unscale(t, ...)`, `after_tower(t, ...)`: a per-tower attack alters its
row), and the exchange and every method see T towers (aggregation/placement/device_groups.py).

Ops with no vectorized form run in a loop over the K towers inside the computation
(Keras's stateless random draws), logged once; a layer that cannot be vectorized at all
is refused before any variable copy exists, named (pfor.probe, from assemble.py).
What cannot run per tower inside one vectorized computation is refused before building:
hooks that act inside a tower's pass by its index (`check_step`: label flipping, loss
scaling, synchronised batch norm; `check_hooks` for a user's) and (`check_method`)
methods whose towers read values of their own (stale reads), keep a copy each at the
towers (local SGD and DiLoCo, the independent baseline), time the towers' arrival, or
compute one loss over every tower (colocate), nodes that split a device, and compressors
at the towers of several devices.

Several worker processes (TF_CONFIG): each worker vectorizes its own T = D K towers
(global tower w T + t on worker w, its shard and random streams so numbered), and the
rest is as with K = 1. At the nodes (each worker a node: aggregation/placement/between_nodes.py) the
worker's node mean m_w = (1/T) sum_t g[t] is formed on its leader (tower 0) exactly as a
simulated node's, and the method moves it between the workers (peers.py), so W workers
of D devices x K towers give the bits of `--nodes=W` over W D devices x K towers in one
process wherever the same ops run (tests/test_nodes_workers.py). At the towers (an exact
method, cross_worker.py) each worker's local stage is its devices' means
(device_groups.py) summed, then added between the workers.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation import Aggregation
from mgloop.aggregation.kernels import stacked_rows
from mgloop.aggregation.placement import between_nodes
from mgloop.errors import ConfigError
from mgloop.step import precision
from mgloop.step import per_tower
from mgloop.step import pfor
from mgloop.step.hooks import IN_TOWER_PASS
from mgloop.step.hooks import attacks
from mgloop.step.options import StepOptions

def check_step(options: StepOptions, towers_per_device: int) -> None:
    """With K = `towers_per_device` > 1 (its range checked before), refuses (one line) the
    step settings that act inside a tower's pass by its index, which one vectorized
    computation of a device's towers cannot give it (module docstring)."""
    if towers_per_device == 1:
        return
    flag = f"--towers_per_device={towers_per_device}"
    if options.byzantine_towers and attacks.parse_attack(options.attack).name == "labelflip":
        _refuse(flag, "--attack=labelflip flips a tower's labels inside its forward pass")
    if precision.uses_loss_scaling(options.mixed_precision):
        _refuse(flag, f"--mixed_precision={options.mixed_precision} scales each tower's loss "
                "by its copy's loss scale inside its pass (use mixed_bfloat16 or none)")
    if options.batch_norm == "sync":
        _refuse(flag, "--batch_norm=sync synchronises batch statistics between the towers' "
                "passes (use --batch_norm=per_tower)")


def check_method(aggregation_flag: str, request, at_nodes: bool, nodes: int,
                 within_node: str) -> None:
    """With K = request.towers_per_device > 1, refuses (one line) a method (--aggregation,
    between nodes when `at_nodes`, with --nodes and --within_node) that a device's towers
    cannot run as one vectorized computation sharing one variable copy (module docstring)."""
    k = request.towers_per_device
    if k == 1:
        return
    flag = f"--towers_per_device={k}"
    method, options = aggregation.parse(aggregation_flag)
    if not method.reproducible(options):
        _refuse(flag, f"--aggregation={aggregation_flag} reads when each tower finished "
                "(a clock), and a device's towers finish together, as one computation")
    caps = method.capabilities
    if caps.single_loss:
        _refuse(flag, f"--aggregation={aggregation_flag} computes one loss over every "
                "tower, no per-tower pass to vectorize")
    if at_nodes:  # several workers: each a node
        per_node = request.num_towers // nodes
        if per_node % k:
            devices = request.num_devices
            raise ConfigError(
                f"{flag} with --nodes={nodes}: a node must hold whole devices (its "
                f"bytes between nodes are counted per device), but {per_node} towers per node "
                f"is not a multiple of {k}; use --nodes dividing the {devices} devices (one "
                f"of: {', '.join(str(n) for n in range(1, devices + 1) if devices % n == 0)})")
        if within_node != between_nodes.DIRECT:
            _refuse(flag, f"--within_node={within_node} runs a method on a node's "
                    f"towers, which share devices (use --within_node={between_nodes.DIRECT})")
        return
    at = f"--aggregation={aggregation_flag} at the towers"
    if caps.summable and caps.exchanges:  # made on the devices, on their means
        try:
            method.check(dataclasses.replace(request, towers_per_device=1), options)
        except ConfigError as error:
            raise ConfigError(f"{flag}: {at} runs between the {request.num_devices} devices "
                              f"(on each device's mean of its towers): {error}") from None
    if caps.copies_differ:
        _refuse(flag, f"{at} keeps one variable copy per tower, and a device's towers share "
                "one (give --nodes=N to run it between nodes)")
    if method.tower_values is not Aggregation.tower_values:
        _refuse(flag, f"{at} gives each tower values of its own to read (stale reads), and a "
                "device's towers read one copy (give --nodes=N to run it between nodes)")
    if not caps.averages_non_trainable:
        _refuse(flag, f"{at} keeps each tower's own non-trainable state, and a device's "
                "towers share one copy")
    if (request.num_devices > 1 and not (caps.summable and caps.exchanges)
            and not caps.copies_per_device):
        _refuse(flag, f"{at} on {request.num_devices} devices sends to every tower, so its "
                "bytes would be counted once per receiving tower, not per device (use one "
                "device, --devices=cpu:1, or --nodes=N with the method between nodes)")


def _refuse(flag: str, why: str) -> None:
    raise ConfigError(f"{flag}: {why}; use --towers_per_device=1")


def check_hooks(hooks) -> None:
    """Refuses (one line) a hook that changes a tower's forward or backward pass by its
    index, which one vectorized computation of K towers cannot give it."""
    for hook in hooks:
        if hook.acts_in_tower_pass():
            raise ConfigError(
                f"--towers_per_device > 1: the hook {type(hook).__name__} acts inside a "
                f"tower's pass by its index (one of {', '.join(IN_TOWER_PASS)}), and a "
                "device's towers are computed as one vectorized pass; use "
                "--towers_per_device=1")


def stack(values: list):
    """The towers' nested values stacked leaf by leaf along a new leading axis."""
    return tf.nest.map_structure(lambda *leaves: tf.stack(leaves), *values)


def unstack(value, count: int) -> list:
    """`stack`'s inverse: `count` nested values, row k of every leaf (remembered, so that
    a method stacking them again gets the leaf itself: aggregation/kernels/stacked_rows.py)."""
    rows = [stacked_rows.unstack(leaf, count) for leaf in tf.nest.flatten(value)]
    return [tf.nest.pack_sequence_as(value, [r[k] for r in rows]) for k in range(count)]


def device_pass(step, group: range, trainable, states, xs, ys) -> list[per_tower.TowerOutput]:
    """Forward, loss and gradients of the towers `group` (all on one device, reading the
    same `trainable` values) on their shards xs[k], ys[k] from their non-trainable values
    states[k], as one vectorized computation (module docstring); returns one TowerOutput
    per tower, in order, each unscaled by the hooks as tower_pass does."""
    template, hooks, streams = step.replicas.model, step.hooks, step.random_streams
    device = step.replicas.tower_devices[group[0]]
    kwargs = per_tower.call_kwargs(template, True)
    with tf.device(device):
        x, y = stack(list(xs)), stack(list(ys))
        # each tower's own values, its random streams' keys [a_g, c] among them
        given = stack([streams.for_tower(state, t, device) for t, state in zip(group, states)])

        def one_tower(args):
            x_t, y_t, state = args
            loss, outputs, grads, new_state = per_tower.pure_pass(step, trainable, state,
                                                                  x_t, y_t, kwargs)
            return loss, per_tower.metric_state(step.metrics, y_t, outputs), grads, new_state

        losses, metric_states, grads, new_states = pfor.vectorized_map(
            one_tower, (x, y, given), f"the towers' pass of {template.name!r}")
        count = len(group)
        losses, metric_states = tf.unstack(losses, count), tf.unstack(metric_states, count)
        grads, new_states = unstack(grads, count), unstack(new_states, count)
    return [per_tower.TowerOutput(losses[k], metric_states[k], hooks.unscale(t, grads[k]),
                                  streams.after_tower(states[k], new_states[k]))
            for k, t in enumerate(group)]


