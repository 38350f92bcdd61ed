"""Pier's outer-momentum warmup and decay, one schedule for every method of the DiLoCo family.

Pier (Fan and Zhang 2025, "Pier: Efficient Large Language Model pretraining with Relaxed
Global Communication", arXiv 2511.17849) adds two things to DiLoCo's outer optimizer:
momentum warmup and momentum decay. Its reference code (github:zetsunozomi/
Pier-LLM-Pretraining, megatron/training/training.py, as of the commit that says "now it's
the same as the paper") runs, over a run of S inner steps with outer period H:

    momentum warmup   steps 0 .. 10% S: synchronous training (every step's gradients
                      averaged over every group); every H steps the outer momentum buffer
                      is filled from the synchronous progress, m <- 0.9 m + (x_prev - x),
                      and no outer step is applied ("Momentum Produce", "lazy start")
    momentum decay    then DiLoCo's Nesterov outer step with mu = 0.99 up to 15% S, 0.95
                      up to 20% S, and the usual 0.9 after

Here, as functions of the step counter s (0-based, checkpointed), t = s + 1 steps done:

    warmup (W = `momentum_warmup`, a multiple of H; 0: off)  for t <= W the towers' gradients
        are averaged by the ring every step (local_steps.py's `warmup`, as post-local SGD),
        and after each step with t mod H = 0, on every copy c, with no exchange (the copies
        are equal):   m <- mu m + (x - v_c),  x <- v_c   (mu = `outer_momentum`, Pier's
        0.9; noloco's velocity v = -b m: v <- a v - b (x - v_c)); the outer steps begin at
        t = W + H, with the m so filled.
    decay (D = `momentum_decay`; 0: off)  the outer step closing step s uses, t' = t - W,

        mu(t) = mu_1 if 2 t' <= D  (`decay_start`, 0.99);  mu_2 if t' <= D  (`decay_middle`,
                0.95);  mu (`outer_momentum`, 0.9) after.

Pier's run has W = S/10 and D = S/10. Both off (the defaults) leave every method as it was,
bit for bit (the option's own constant multiplies m; no warmup cond is traced). mu(t) and the
warmup are pure functions of the restored step counter, so a resumed run continues them
exactly. Refused (`check_run`, one line): W or W + D longer than the run (--train_steps), W
not a multiple of H, a decay's first half with no outer step (D < 2H), the warmup with
streaming_diloco's tau or eager (their merges follow the sends, not the warmup) or with
--node_failures. The options belong to the methods with an outer momentum (diloco,
streaming_diloco, sparta_diloco, noloco); any other method refuses them as options it does
not have (options.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.aggregation.base import Options, option
from mgloop.errors import ConfigError

PIER = "Pier (arXiv 2511.17849)"


@dataclasses.dataclass(frozen=True)
class OuterMomentumOptions(Options):
    """The options every method with an outer momentum shares (its options subclass this)."""
    momentum_warmup: int = option(0, "W: Pier's momentum warmup: the first W steps synchronous "
                                     "(gradients averaged every step), m filled every H steps "
                                     "from their progress, no outer step (0: off; a multiple "
                                     "of period)", low=0)
    momentum_decay: int = option(0, "D: Pier's momentum decay over the first D steps: mu = "
                                    "decay_start while 2(s+1) <= D, decay_middle while "
                                    "s+1 <= D, outer_momentum after (0: off)", low=0)
    decay_start: float = option(0.99, "mu_1: the outer momentum of the decay's first half "
                                      "(Pier's 0.99)", low=0.0, high=1.0, high_open=True)
    decay_middle: float = option(0.95, "mu_2: the outer momentum of the decay's second half "
                                       "(Pier's 0.95)", low=0.0, high=1.0, high_open=True)


def momentum_at(options: OuterMomentumOptions, step):
    """mu of the outer step that closes step `step` (module top): a Python float for an
    int step, a float32 scalar tensor for a tensor (the step counter)."""
    mu = options.outer_momentum  # each member's own option
    if not options.momentum_decay:
        return mu
    decay, warmup = options.momentum_decay, options.momentum_warmup
    if isinstance(step, int):
        done = step + 1 - warmup
        return options.decay_start if 2 * done <= decay else (
            options.decay_middle if done <= decay else mu)
    import tensorflow as tf  # only the step's trace needs it (settings load no TensorFlow)
    done = tf.cast(step, tf.int64) + 1 - warmup
    stage = (tf.cast(2 * done > decay, tf.int32) + tf.cast(done > decay, tf.int32))
    return tf.gather(tf.constant([options.decay_start, options.decay_middle, mu],
                                 tf.float32), stage)


def momentum(method):
    """mu of the outer step the method is taking now (its `step_counter`): the option
    itself while the schedule is off, so the graph is the method's as before."""
    options = method.options
    if not isinstance(options, OuterMomentumOptions) or not options.momentum_decay:
        return options.outer_momentum  # (a subclass's options without the schedule too)
    return momentum_at(options, method.step_counter)


def warmup_steps(options) -> int:
    """W of Pier's momentum warmup; 0 for options without it (sparseloco's)."""
    return options.momentum_warmup if isinstance(options, OuterMomentumOptions) else 0


def warmup_ops(method, copies) -> list:
    """The cond that fills m after each step with t mod H = 0, t <= W (module top), on
    every copy c from its own x and v_c (equal on every copy: nothing moves)."""
    warmup = warmup_steps(method.options)
    if not warmup or method.num_towers == 1:
        return []
    period = method.options.period
    import tensorflow as tf
    from mgloop.training.variables import backing
    mu, rate = method.options.outer_momentum, method.options.outer_lr
    velocity = getattr(method, "momentum_is_velocity", False)  # noloco: v = -b m
    step = method.step_counter

    def fill():
        for copy, starts, momenta in zip(copies, method._start, method._momentum):
            with tf.device(copy.device):
                for target, x, m in zip(copy.trainable, starts, momenta):
                    v = tf.cast(backing(target).read_value(), x.dtype)
                    delta = x - v
                    m.assign(mu * m - rate * delta if velocity else mu * m + delta)
                    x.assign(v)
        return tf.constant(True)
    due = ((step + 1) % period == 0) & (step + 1 <= warmup)
    return [tf.cond(due, fill, lambda: tf.constant(False))]


def check_run(exchange, train_steps: int) -> None:
    """Refuses (one line) a decay that does not fit the run of `exchange` (ExchangeOptions)
    over --train_steps; nothing for methods without the schedule."""
    from mgloop import aggregation  # the registry imports this module's users
    method, options = aggregation.parse(exchange.aggregation)
    if not isinstance(options, OuterMomentumOptions):
        return
    decay, period, warmup = options.momentum_decay, options.period, options.momentum_warmup
    where = f"--aggregation={exchange.aggregation}"
    if warmup + decay > train_steps:
        raise ConfigError(f"{where}: momentum_warmup + momentum_decay = {warmup + decay} is "
                          f"longer than the run (--train_steps={train_steps}); use at most "
                          f"{train_steps} steps")
    if warmup % period:
        raise ConfigError(f"{where}: momentum_warmup={warmup} is not a multiple of the period "
                          f"{period} (m is filled every H steps and the outer steps follow); "
                          f"use {warmup - warmup % period or period}")
    if warmup and (getattr(options, "tau", 0) or getattr(options, "eager", False)):
        raise ConfigError(f"{where}: momentum_warmup with tau or eager is not built (their "
                          f"merges follow the sends, not the warmup); use tau=0,eager=false")
    if warmup and exchange.node_failures:
        raise ConfigError(f"{where} with --node_failures: momentum_warmup is not built with "
                          f"down nodes (no rule for a down node's m); leave one of them out")
    if decay and decay < 2 * period:
        raise ConfigError(f"{where}: momentum_decay={decay} gives decay_start no outer step "
                          f"(its first half, steps 1..{decay // 2}, is shorter than the "
                          f"period {period}); use momentum_decay >= {2 * period} or 0 (off)")
