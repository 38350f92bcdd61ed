"""What experiments/variants.py measures beside the step time (`--measure=...`).

    input_wait  seconds per step the towers waited for input, as mgloop measures it on
                every step (LoopResult.input_wait), median over the timed loops
    exchange    the gradient exchange alone (Trainer.time_exchange: stand-in gradients,
                20 exchanges per compiled call, median of call time / 20)
    traffic     bytes each device sends and receives per step, counted from the
                algorithm while the step is traced (max over devices; all in the JSON,
                with the messages)
    memory      the host allocator's peak during one more loop of `--steps` steps above
                what it held when the loop started (tf.config.experimental memory stats on
                TensorFlow's BFC allocator, which devices.configure_logical_cpus turns
                on): what the steps allocate beyond the variables, slots and staged
                input; and how many variables the traced step summed in tower order or
                from their sufficient factors (Trainer.large_gradients)
    eval        loss and accuracy on the dataset's held-out split after the timed loops
    summary     every timed loop also does what the Monitor does at a summary
                (Monitor.scalars: memory, loss scale), as a run with --summary_every =
                --steps does
    breakdown   one step alone under the profiler (breakdown.profile_phases) against one
                step alone without it, `--repeats` pairs interleaved: the phases'
                busy milliseconds and what one profiled step costs
    ideal       the ideal of the input: t_compute, the baseline's settings with device
                staging on one constant batch (input costs next to nothing), and
                t_input, the input pipeline alone (with --input_delay_ms), pulled in
                a compiled loop; each variant's ratio to 1 / max(t_input, t_compute)
                (1.0: input fully hidden)

With `--link=BANDWIDTH,LATENCY` (repeatable; mgloop/observe/link_model.py), every variant also
gets the link model of its counted traffic: the busiest device's bytes per step and its
messages, the compression ratio (the baseline's bytes per device over the variant's),
the compute time (median step less the exchange alone, measured as by `exchange`) and
per link the modelled exchange time and step time without and with overlap.

A slow input (`--input_delay_ms`): every global batch waits that long on the
host (a tf.py_function that sleeps, like a read or decode that does not use
these cores); `auto` calibrates it so that t_input = t_compute (needs `ideal`).
"""

from __future__ import annotations

import time

import numpy as np

MEASURES = ("input_wait", "exchange", "traffic", "memory", "eval", "summary", "breakdown",
            "ideal")


def slow_stream(batches, delay: float):
    """`batches` with `delay` seconds of host-side waiting per global batch."""
    import tensorflow as tf
    if not delay:
        return batches

    def wait(x):
        time.sleep(delay)
        return x
    return batches.map(
        lambda x, y: (tf.ensure_shape(tf.py_function(wait, [x], x.dtype), x.shape), y))


def make_input_timer():
    """time_input(iterator, steps) -> seconds per batch pulled in a compiled loop."""
    import tensorflow as tf

    @tf.function
    def pull(iterator, steps):
        total = tf.constant(0.0)
        for _ in tf.range(steps):
            x, _ = next(iterator)
            total += tf.cast(tf.reshape(x, [-1])[0], tf.float32)
        return total

    def time_input(iterator, steps: int) -> float:
        began = time.perf_counter()
        float(pull(iterator, tf.constant(steps)))
        return (time.perf_counter() - began) / steps
    return time_input


def loop_peak_mib(trainer, iterator, steps: int) -> float:
    """MiB the host allocator holds at the peak of one loop beyond what it held before."""
    import tensorflow as tf
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    trainer.train_loop(iterator, steps)
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2 ** 20


def traffic(trainer) -> dict:
    counts = trainer.aggregation.traffic.as_dict()
    return {"max_sent_kib": max((c["sent"] for c in counts.values()), default=0) / 1024,
            "max_received_kib": max((c["received"] for c in counts.values()), default=0) / 1024,
            "traffic": counts, "messages": trainer.aggregation.traffic.messages_as_dict()}


def link(trainer, links, step_seconds: float, exchange_ms: float | None) -> dict:
    """The link report (mgloop/observe/link_report.py) of the variant's traffic over the
    steps it trained, per link."""
    from mgloop.observe import link_model, link_report
    compute = link_model.compute_seconds(
        step_seconds, None if exchange_ms is None else exchange_ms / 1e3)
    report = link_report.report(link_report.Schedule(
        trainer.aggregation.traffic, max(int(trainer.global_step.numpy()), 1)), links, compute)
    out = {"bytes_per_device_kib": report["bytes_per_device"] / 1024,
           "messages_per_device": report["messages_per_device"], "compute_ms": 1e3 * compute}
    for tag, figures in report["links"].items():
        out[f"link_{tag}_exchange_ms"] = 1e3 * figures["exchange_seconds"]
        out[f"link_{tag}_step_ms"] = 1e3 * figures["step_seconds_no_overlap"]
        out[f"link_{tag}_step_overlap_ms"] = 1e3 * figures["step_seconds_overlap"]
    return out


def exchange(trainer, repeats: int) -> dict:
    seconds = trainer.time_exchange(repeats=repeats)
    return {"exchange_ms": None if seconds is None else 1e3 * seconds}


def memory(trainer, iterator, steps: int) -> dict:
    out = {"loop_peak_mib": loop_peak_mib(trainer, iterator, steps)}
    large = getattr(trainer, "large_gradients", None)  # as the traced step did
    if large is not None:
        out.update(factored=len(large.get("factored", ())), ordered=len(large.get("ordered", ())))
    return out


def evaluate(trainer, dataset, global_batch: int) -> dict:
    metrics = trainer.evaluate(dataset.eval_batches(global_batch))
    return {f"eval_{name}": value for name, value in metrics.items()}


def breakdown(trainer, iterator, repeats: int) -> dict:
    """Phases of one profiled step (median ms) and what one profiled step costs (ms)."""
    from mgloop.observe import breakdown as breakdown_lib
    plain, profiled, phases = [], [], []

    def one_step():
        trainer.train_loop(iterator, 1)
    for _ in range(repeats):
        began = time.perf_counter()
        one_step()
        plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        phases.append(breakdown_lib.profile_phases(one_step))
        profiled.append(time.perf_counter() - began)
    out = {f"breakdown_{name}_ms": 1e3 * float(np.median([p[name] for p in phases]))
           for name in phases[0]}
    out["breakdown_cost_ms"] = 1e3 * float(np.median(profiled) - np.median(plain))
    return out


def summary_scalars(trainer, steps: int) -> None:
    """What the Monitor does at one summary (its scalars; nothing is written)."""
    from mgloop.runs import monitor
    monitor.Monitor(trainer, None, None, None).scalars(steps)
