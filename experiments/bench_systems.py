"""The systems of the side-by-side benchmark, each built in its own process, timed loop by loop.

A system is built from a `Spec` (model, dataset, towers, global batch, loop
length) and offers `run()`: one timed loop of `spec.steps` training steps,
returning its wall-clock seconds (the loop's last result is read back, so
the time covers the whole loop). Every system reads the same host input
pipeline (the dataset's `train_batches` for the seed, prefetch 2), starts
from the seed's initial weights and trains with the same optimizer, schedule
and loss (mgloop.training.optim.make_optimizer, mgloop.training.losses.cross_entropy).

    mgloop:<mode>   mgloop's Trainer with --aggregation=<mode>: train_loop, one compiled
                    call of `steps` steps (a tf.range loop)
    single_device   third_party.single_device.make_train_loop on CPU:0, the whole global
                    batch, `steps` steps per compiled call
    mirrored_ctl    third_party.mirrored_strategy.CustomLoop: strategy.run inside a
                    tf.function, `steps` steps per call (a tf.range loop)
    mirrored_fit    Keras fit under MirroredStrategy, steps_per_execution = steps: one
                    epoch of `steps` steps is one execution, timed from the epoch's start
                    to its end (fit is called once; an epoch waits for the harness)
    split_concat    Keras fit of third_party.keras_fit.SplitConcat (multi_gpu_model),
                    timed the same way
    plain_towers    third_party.plain_towers.PlainTowers: the hand-written parameter-server
                    tower loop of tf_cnn_benchmarks and make_parallel (variables and one
                    optimizer on the host, T towers, nothing else): the floor of a tower
                    loop on these devices, `steps` steps per compiled call
    multi_worker_mirrored
                    third_party.multi_worker_mirrored.CustomLoop in each of the
                    `workers` processes: MultiWorkerMirroredStrategy, strategy.run inside
                    a tf.function, `steps` steps per call (a tf.range loop)

With `workers` > 1 the system is one process per worker, each with its own
TF_CONFIG (experiments/bench_processes.py): `start` then starts the worker's
gRPC server before anything else touches TensorFlow (mgloop: mgloop.cluster.workers via
devices.setup; the baseline: by creating the strategy, which must come first),
and mgloop's workers are built as `mgloop.train` builds them (cross-worker
aggregation, variables broadcast from worker 0, each worker's contiguous part of
every global batch). `devices` of a built system lists the devices it computes
on in this process; `last_loss` is the mean over its last loop's steps of the
step's loss over the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time

BASELINES = ("single_device", "mirrored_ctl", "mirrored_fit", "split_concat",
             "plain_towers")  # one process
MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
XLA_SUFFIX = "+xla"  # a system's forward and backward compiled by XLA (bench_plan.py)
MULTI_WORKER_BASELINES = (MULTI_WORKER_MIRRORED,)  # one process per worker
MGLOOP_PREFIX = "mgloop:"
STARTUP_TIMEOUT = 120.0  # seconds a worker waits for its peers at start
# MultiWorkerMirroredStrategy: seconds a collective waits (a peer died: an error); mgloop's
# collectives have none (its --collective_timeout is the health-check timeout of mgloop.train,
# which the harness does not run: bench_processes notices a failed worker itself)
COLLECTIVE_TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class Spec:
    system: str  # "mgloop:<mode>" or one of BASELINES
    model: str
    dataset: str
    towers: int
    global_batch: int
    steps: int  # steps per timed loop
    seed: int = 0
    optimizer: str = "momentum"
    learning_rate: float = 0.01
    cross_device_ops: str = "reduce_to_one"  # MirroredStrategy baselines
    workers: int = 1  # processes; `towers` devices each
    pack_bytes: int | None = None  # mgloop's --pack_bytes (mgloop systems; None: its default)
    ordered_sum_bytes: int | None = None  # mgloop's --ordered_sum_bytes (None: its default)
    sufficient_factor_bytes: int | None = None  # mgloop's --sufficient_factor_bytes (None: default)
    device_kind: str = "cpu"  # "cpu": logical CPU devices; "gpu": gpu:0..towers-1
    plugins: tuple[str, ...] = ()  # modules imported before the system is built (--plugin)


def devices_flag(spec: Spec) -> str:
    """mgloop's --devices for the spec's devices of one process."""
    if spec.device_kind == "gpu":
        return "gpu:" + ",".join(str(i) for i in range(spec.towers))
    return f"cpu:{spec.towers}"


def _config(spec: Spec, aggregation: str = "ps_cpu"):
    from mgloop.runs.config import Config
    return Config(model=spec.model, dataset=spec.dataset, devices=devices_flag(spec),
                  aggregation=aggregation, global_batch_size=spec.global_batch,
                  optimizer=spec.optimizer, learning_rate=spec.learning_rate,
                  train_steps=10 ** 9, seed=spec.seed,
                  logdir=os.path.join("/tmp", "mgloop-bench")).validated()


class _Parts:
    """What every baseline shares: devices, dataset, model/optimizer functions, input stream."""

    def __init__(self, spec: Spec, dataset=None):
        from mgloop import data, models
        from mgloop.cluster import devices
        from mgloop.runs import experiment
        from mgloop.training import optim
        self.config = _config(spec)
        self.devices = list(devices.setup(devices.parse(self.config.devices)).towers)
        self.dataset = dataset or data.load(spec.dataset, spec.seed)
        self.loss_fn = experiment.default_loss()
        self.optimizer_fn = functools.partial(optim.make_optimizer, self.config.optim,
                                              self.config.train_steps)
        builder = models.get(spec.model)
        self.model_fn = functools.partial(builder, self.dataset.input_shape,
                                          self.dataset.num_classes)
        self.seed = functools.partial(experiment.seed_everything, spec.seed, False)

    def batches(self, spec: Spec):
        return self.dataset.train_batches(spec.global_batch, spec.seed).prefetch(2)


class CompiledLoop:
    """A system whose loop is one tf.function call: loop(iterator, steps) -> a tensor."""

    def __init__(self, loop, iterator, steps: int, model=None, owner=None, devices=()):
        import tensorflow as tf
        self.loop, self.iterator, self.model = loop, iterator, model
        self.owner = owner  # keeps the object of a bound tf.function method alive
        self.devices = list(devices)
        self.num_steps = steps
        self.steps = tf.constant(steps, tf.int32)
        self.last_loss_sum = None

    @property
    def last_loss(self) -> float:
        return self.last_loss_sum / self.num_steps

    def run(self) -> float:
        began = time.perf_counter()
        self.last_loss_sum = self._loop(self.steps)
        return time.perf_counter() - began

    def first_step(self) -> float:
        """One step, before any loop: its loss is the initial weights' on the first batch (a
        loop then goes on from the second)."""
        import tensorflow as tf
        return self._loop(tf.constant(1, tf.int32))

    def _loop(self, steps) -> float:
        result = self.loop(self.iterator, steps)
        if hasattr(result, "loss_sum"):  # mgloop's Trainer.train_loop: a LoopResult
            result = result.loss_sum
        result = result[0] if isinstance(result, (tuple, list)) else result
        return float(result)  # waits for the loop to finish

    def close(self) -> None:
        pass


class _StopFit(Exception):
    pass


FIRST_STEP = "first step"  # FitLoop's request for its first step alone


class FitLoop:
    """Keras `fit` called once, paced by the harness: each epoch (= one timed loop) waits to start.

    fit runs in a thread; a callback blocks at the start of every epoch until
    `run()` asks for one, and reports the time from the epoch's start to its
    end, so fit's once-per-call set-up (iterator, callbacks, tracing) is
    outside the timing, as a long training run amortises it. `first_step()`, asked
    before any `run()`, is a fit of one epoch on the first batch alone (same model,
    same compiled train function) whose loss is the initial weights' on that batch;
    the paced fit then reads the batches from the second on.
    """

    def __init__(self, model, batches, steps: int, devices=()):
        import keras
        self.model = model
        self.devices = list(devices)
        self._go, self._done = queue.Queue(), queue.Queue()
        self.last_logs = None
        runner = self

        class Pace(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if not runner._go.get():
                    raise _StopFit
                runner._began = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                runner._done.put((time.perf_counter() - runner._began, dict(logs or {})))

        def fit():
            try:
                rest = batches
                first = self._go.get()
                if first is False:  # closed before any loop
                    return
                if first == FIRST_STEP:
                    history = model.fit(batches.take(1), epochs=1, verbose=0, shuffle=False)
                    self._done.put((0.0, {"loss": history.history["loss"][0]}))
                    rest = batches.skip(1)
                else:
                    self._go.put(first)  # for Pace's first epoch
                model.fit(rest, epochs=10 ** 9, steps_per_epoch=steps, verbose=0,
                          shuffle=False, callbacks=[Pace()])
            except _StopFit:
                pass
            except BaseException as error:  # surfaces in run()
                self._done.put((error, None))

        self._thread = threading.Thread(target=fit, daemon=True)
        self._thread.start()

    def run(self) -> float:
        self._go.put(True)
        seconds, logs = self._done.get()
        if isinstance(seconds, BaseException):
            raise seconds
        self.last_logs = logs
        return seconds

    def first_step(self) -> float:
        self._go.put(FIRST_STEP)
        error, logs = self._done.get()
        if isinstance(error, BaseException):
            raise error
        return float(logs["loss"])

    @property
    def last_loss(self) -> float:
        return float(self.last_logs["loss"])  # fit's mean over the epoch's steps

    def close(self) -> None:
        self._go.put(False)
        self._thread.join(timeout=60)


def loss_terms(model, dataset, global_batch: int) -> int:
    """n of the tolerance of the first step's loss (bench.check_first_steps): the most terms
    any float32 sum on the way from the weights to the mean loss over a global batch adds, as
    tests/tolerance.py's path_sums counts them for the step (forward part): the loss's E
    values per example (E = L tokens of a sequence, else 1) times the B examples, every
    kernel's fan-in, 2 E per attention layer (its softmax over the keys and its sum of
    values) and the K logits of the softmax."""
    import keras
    labels = dataset.train_batches(global_batch, 0).element_spec[1]
    per_example = 1
    for size in labels.shape[1:]:
        per_example *= size or 1
    n = global_batch * per_example + int(dataset.num_classes)
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001 (Keras's walk)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            n += 2 * per_example
    for weight in model.weights:
        if len(weight.shape) >= 2:  # a kernel (or an embedding's table: more than a lookup)
            fan_in = 1
            for size in weight.shape[:-1]:
                fan_in *= int(size)
            n += fan_in
    return n


def batch_statistics(model) -> bool:
    """The model normalises with the statistics of the batch it is given (batch norm): each
    tower's (replica's) its own shard's, so the loss depends on how the batch is split."""
    import keras
    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers(include_self=False))  # noqa: SLF001


def start(spec: Spec):
    """What must come before any other TensorFlow work in this process (None for most).

    Multi-worker systems (TF_CONFIG set by the harness): mgloop's cluster and
    devices, with its gRPC server started and its peers reached; or the
    MultiWorkerMirroredStrategy, whose creation starts the server.
    """
    if spec.workers == 1:
        return None
    if spec.system == MULTI_WORKER_MIRRORED:
        from third_party import multi_worker_mirrored
        return multi_worker_mirrored.make_strategy(COLLECTIVE_TIMEOUT)
    if spec.system.startswith(MGLOOP_PREFIX):
        from mgloop.cluster import workers as cluster, devices
        workers = cluster.from_environment()
        if workers is None or workers.num_workers != spec.workers:
            raise ValueError(f"{spec.system} with {spec.workers} workers needs a TF_CONFIG of "
                             f"{spec.workers} workers")
        return workers, devices.setup(devices.parse(devices_flag(spec)), workers,
                                      STARTUP_TIMEOUT)
    raise ValueError(f"{spec.system} runs in one process, not {spec.workers}")


# mgloop settings a Spec may leave at None (mgloop's default)
MGLOOP_THRESHOLDS = ("pack_bytes", "ordered_sum_bytes", "sufficient_factor_bytes")


def build(spec: Spec, dataset=None, runtime=None):
    """The system of `spec`, built (not yet traced) in this process; `runtime` from `start`."""
    import tensorflow as tf
    system, _, option = spec.system.partition("+")
    xla = "+" + option == XLA_SUFFIX
    towers_per_device = int(option[1:]) if option.startswith("k") else 1
    if system.startswith(MGLOOP_PREFIX):
        from experiments import benchlib
        workers, device_set = runtime if runtime is not None else (None, None)
        trainer, iterator = benchlib.build(
            spec.model, spec.global_batch, dataset_object=dataset, dataset=spec.dataset,
            devices=devices_flag(spec), aggregation=system[len(MGLOOP_PREFIX):], xla_towers=xla,
            towers_per_device=towers_per_device, shard_update=option == "shard",
            optimizer=spec.optimizer, learning_rate=spec.learning_rate, seed=spec.seed,
            collective_timeout=COLLECTIVE_TIMEOUT, workers=workers, device_set=device_set,
            **{name: getattr(spec, name) for name in MGLOOP_THRESHOLDS
               if getattr(spec, name) is not None})
        # the training step alone, as the other systems run it: the diagnostics' sampled step
        # (one per summary window, on by default) is measured apart (variants.py, docs/results/observability.md)
        return CompiledLoop(functools.partial(trainer.train_loop, sample_stats=False), iterator, spec.steps, trainer.model, trainer,
                            trainer.aggregation.devices.copy_devices)
    parts = _Parts(spec, dataset)
    parts.seed()
    if spec.system == MULTI_WORKER_MIRRORED:
        from third_party import multi_worker_mirrored
        custom = multi_worker_mirrored.CustomLoop(runtime, parts.model_fn, parts.loss_fn,
                                                  parts.optimizer_fn, spec.global_batch)
        return CompiledLoop(custom.train_loop, custom.distribute(parts.batches(spec)),
                            spec.steps, custom.model, custom, custom.local_devices)
    if system == "single_device":
        from third_party import single_device
        with tf.device(parts.devices[0]):
            model = parts.model_fn()
            loop = single_device.make_train_loop(model, parts.loss_fn, parts.optimizer_fn(), xla)
        return CompiledLoop(loop, iter(parts.batches(spec)), spec.steps, model,
                            devices=parts.devices[:1])
    from third_party import keras_fit, mirrored_strategy
    if system == "mirrored_ctl":
        strategy = mirrored_strategy.make_strategy(parts.devices, spec.cross_device_ops)
        custom = mirrored_strategy.CustomLoop(strategy, parts.model_fn, parts.loss_fn,
                                              parts.optimizer_fn, spec.global_batch, xla)
        return CompiledLoop(custom.train_loop, custom.distribute(parts.batches(spec)),
                            spec.steps, custom.model, custom, strategy.extended.worker_devices)
    if spec.system == "mirrored_fit":
        strategy = mirrored_strategy.make_strategy(parts.devices, spec.cross_device_ops)
        model = keras_fit.mirrored_fit_model(strategy, parts.model_fn, parts.loss_fn,
                                             parts.optimizer_fn, steps_per_execution=spec.steps)
        return FitLoop(model, parts.batches(spec), spec.steps, strategy.extended.worker_devices)
    if spec.system == "plain_towers":
        from third_party import plain_towers
        towers = plain_towers.PlainTowers(parts.devices, parts.model_fn, parts.loss_fn,
                                          parts.optimizer_fn)
        return CompiledLoop(towers.train_loop, iter(parts.batches(spec)), spec.steps,
                            towers.model, towers, parts.devices)
    if spec.system == "split_concat":
        model = keras_fit.split_concat_model(parts.model_fn, parts.loss_fn, parts.optimizer_fn,
                                             parts.devices, steps_per_execution=spec.steps)
        return FitLoop(model, parts.batches(spec), spec.steps, parts.devices)
    raise ValueError(f"unknown system {spec.system!r}: use mgloop:<mode> or one of "
                     f"{', '.join(BASELINES + MULTI_WORKER_BASELINES)}")
