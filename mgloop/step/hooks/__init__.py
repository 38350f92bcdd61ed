"""The hook protocol: how an option changes the training step without a branch in it.

The step (step/training_step.py) calls, in data-path order, for every hook of its `Hooks`:

    step_scope()             context around the tracing of one step (e.g. fresh collective
                             keys, the loss scales read onto the towers)
    tower_scope(t)           context around tower t's forward pass and loss (e.g. batch-norm
                             moments over the global batch; the forward whose large products
                             are factored)
    labels(t, y, outputs)    the labels tower t's loss reads, given its model outputs (a
                             data-poisoning attacker flips them); its metrics keep the true y
    scale_loss(t, loss)      what tower t differentiates: S * loss_t with a loss scale S
    before_backward(t)       tensors tower t's backward pass waits for (the ordered sum)
    unscale(t, grads)        tower t's gradients as the exchange sees them: g / S
    after_tower(t, out)      tower t is done (`TowerOutput`: grads, factors, on its device);
                             e.g. its large gradients sent to their homes and added there
    home_sums()              {variable index: sum over towers of its gradient, already formed
                             at its home}: those variables are only scaled by the exchange
    alter_towers(grads)      every tower's gradients [T][V] once all exist (with accumulation,
                             their means over the micro-batches), as the exchange will get them
                             (omniscient attacks: what an attacker sends depends on the honest
                             towers' gradients); not the home sums, formed before it
    observe(losses, grads)   every tower's mean loss and gradients, before the exchange
    may_apply(grads)         a guard `(copy index, update) -> None` that runs `update` or not
                             (loss scaling: only if every tower's gradients are finite); the
                             guard runs after `from_all_workers`
    to_all_workers()         float32 scalars on the host that travel with the step's metrics
                             in the exchange, summed over every worker (loss scaling: this
                             worker's count of towers whose gradients are not finite)
    from_all_workers(sums)   those scalars summed over every worker (one process: as given),
                             once the exchange has run
    after_exchange(grads)    the exchanged gradients per copy; returns ops the step's end
                             waits for (the gradients histograms keep)
    report(done)             {name: tensor} the step returns besides loss and metrics, once
                             `done` (every copy updated) has run (the diagnostics' statistics)

and its backward pass is `Hooks.gradients(t, tape, target, values)`, the tape's gradients
unless one hook was given to replace it (sufficient factors). A `Hook` does nothing in
each of them; a mechanism overrides only what it changes. A mechanism that is off is
not in the list: whether it applies (the ordered sum and sufficient factors only on a
shared layout summed at home on logical CPU towers, without accumulation, loss
scaling or synchronised batch norm; they take precedence over packing, and the
diagnostics' sampled step keeps them, its statistics leaving those variables out) is
decided once when the hooks are assembled (runs/assemble.py), never in the step.

Mechanisms: attack_hook.py (fault injection), loss_scaling.py, synced_moments.py (sync batch
norm), sampled_stats.py (diagnostics), histograms.py, large_gradients.py (ordered sum,
sufficient factors); the guards node_failures.py (a down node's copies take no update) and
inner_turns.py (`async_diloco`: a node's inner update only on its own clock's steps).
Accumulation is not a hook but a pass wrapper (step/accumulation.py): it runs the whole
towers' pass K times in a `tf.while_loop` and keeps running sums, a change of control flow
around the towers that no per-tower callback can make.

Here too: attacks.py (what each Byzantine attack does to a gradient) beside
attack_hook.py (the hook that applies it), and byzantine.py, the old name of attack_hook.py
(warning until mgloop 0.2). May import what step/ may.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import tensorflow as tf

Guard = Callable[[int, Callable[[], None]], None]  # (copy index, update) -> runs it or not


def tape_gradients(t: int, tape: tf.GradientTape, target: tf.Tensor, values):
    """The plain backward pass: (d target / d value for every value, no factors)."""
    return tape.gradient(target, values, unconnected_gradients=tf.UnconnectedGradients.ZERO), {}


def _always(copy: int, update: Callable[[], None]) -> None:
    update()


# The callbacks that act inside tower t's forward and backward pass by its static index
# (--towers_per_device > 1 computes a device's towers as one pass: vectorized_towers.py).
IN_TOWER_PASS = ("tower_scope", "labels", "scale_loss", "before_backward")


class Hook:
    """A hook that changes nothing: subclass and override what a mechanism changes."""

    def acts_in_tower_pass(self) -> bool:
        """True: it changes a tower's own pass (one of IN_TOWER_PASS). Default: whether
        the class overrides one; a hook that overrides one but does not act with its
        settings says so."""
        return any(getattr(type(self), name) is not getattr(Hook, name)
                   for name in IN_TOWER_PASS)

    def step_scope(self):
        return contextlib.nullcontext()

    def tower_scope(self, t: int):
        return contextlib.nullcontext()

    def labels(self, t: int, y, outputs):
        return y

    def scale_loss(self, t: int, loss: tf.Tensor) -> tf.Tensor:
        return loss

    def before_backward(self, t: int) -> list[tf.Tensor]:
        return []

    def unscale(self, t: int, grads: list) -> list:
        return grads

    def after_tower(self, t: int, out) -> None:
        pass

    def home_sums(self) -> dict[int, tf.Tensor]:
        return {}

    def alter_towers(self, grads: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
        return grads

    def observe(self, losses: list[tf.Tensor], grads: list[list[tf.Tensor]]) -> None:
        pass

    def may_apply(self, grads: list[list[tf.Tensor]]) -> Guard:
        return _always

    def to_all_workers(self) -> list[tf.Tensor]:
        return []

    def from_all_workers(self, sums: list[tf.Tensor]) -> None:
        pass

    def after_exchange(self, grads: list[list[tf.Tensor]]) -> list:
        return []

    def report(self, done: tf.Operation) -> dict[str, tf.Tensor]:
        return {}


class Hooks:
    """The step's hooks in order, called as one; `gradients` the backward pass (default:
    the tape's)."""

    def __init__(self, hooks: Sequence[Hook] = (), gradients=tape_gradients):
        self.hooks = list(hooks)
        self.gradients = gradients
        self._shared: list[list[tf.Tensor]] = []  # what each hook gave `to_all_workers`

    def find(self, kind: type) -> Hook | None:
        """The hook of class `kind`, or None (for reporting and tests, not for the step)."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    @contextlib.contextmanager
    def step_scope(self):
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.step_scope())
            yield

    @contextlib.contextmanager
    def tower_scope(self, t: int):
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.tower_scope(t))
            yield

    def labels(self, t, y, outputs):
        for hook in self.hooks:
            y = hook.labels(t, y, outputs)
        return y

    def scale_loss(self, t, loss):
        for hook in self.hooks:
            loss = hook.scale_loss(t, loss)
        return loss

    def before_backward(self, t):
        return [x for hook in self.hooks for x in hook.before_backward(t)]

    def unscale(self, t, grads):
        for hook in reversed(self.hooks):
            grads = hook.unscale(t, grads)
        return grads

    def after_tower(self, t, out) -> None:
        for hook in self.hooks:
            hook.after_tower(t, out)

    def home_sums(self) -> dict[int, tf.Tensor]:
        return {i: s for hook in self.hooks for i, s in hook.home_sums().items()}

    def alter_towers(self, grads):
        for hook in self.hooks:
            grads = hook.alter_towers(grads)
        return grads

    def observe(self, losses, grads) -> None:
        for hook in self.hooks:
            hook.observe(losses, grads)

    def may_apply(self, grads) -> Guard:
        guards = [hook.may_apply(grads) for hook in self.hooks]

        def guard(copy: int, update) -> None:
            """Runs `update` inside every hook's guard, the first hook's outermost."""
            for g in reversed(guards):
                update = (lambda g=g, inner=update: g(copy, inner))
            update()
        return guard

    def to_all_workers(self) -> list[tf.Tensor]:
        self._shared = [hook.to_all_workers() for hook in self.hooks]
        return [x for values in self._shared for x in values]

    def from_all_workers(self, sums: list[tf.Tensor]) -> None:
        """Each hook gets back the sums of the values it gave `to_all_workers`."""
        start = 0
        for hook, values in zip(self.hooks, self._shared):
            hook.from_all_workers(list(sums[start:start + len(values)]))
            start += len(values)

    def after_exchange(self, grads) -> list:
        return [x for hook in self.hooks for x in hook.after_exchange(grads)]

    def report(self, done) -> dict[str, tf.Tensor]:
        return {k: v for hook in self.hooks for k, v in hook.report(done).items()}
