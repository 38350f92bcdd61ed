"""The aggregation interface: where variable copies live and how gradients meet.

Notation: T towers; tower t computes g[t][v], the gradient of the mean loss over its shard
(B/T examples of the global batch B) with respect to variable v. With equal shards, the
gradient of the mean loss over the global batch is

    g[v] = (1/T) * sum_t g[t][v]

and every aggregation returns exactly that (mean semantics), placed where each variable copy
lives, so the update is the one a single device would make. With `--grad_reduce=sum` the 1/T
is left out (the sum over towers).

Every tensor that crosses from one device to another goes through `send`, which (a) casts it
to `--transport_dtype` on the sending device and back to its own dtype on the receiving one,
so sums are always accumulated in the gradient's dtype, and (b) counts the bytes each device
sends and receives, while the step is traced: exactly what the algorithm moves per step.

One class, the contract every method subclasses, each hook documented where declared (what a
method can do: its `capabilities` record, capabilities.py; its model: global_models.py; where
it runs: placement/queries.py).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import ClassVar, Sequence

import tensorflow as tf

from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.global_models import ProducedModel
from mgloop.aggregation.placement.peers import Peers
from mgloop.aggregation.placement.queries import PlacementQueries
from mgloop.aggregation.traffic import Traffic
from mgloop.cluster.devices import DeviceRequest, DeviceSet, canonical  # noqa: F401 (re-exported)

SHARED, REPLICATED = "shared", "replicated"
Gradients = list[tf.Tensor]


@dataclasses.dataclass(frozen=True)
class Options:
    """A method's own options: subclass it (frozen), one field per option made with `option`
    (its help line and valid range); the method's `options_type` is the subclass. Given as
    `--aggregation=NAME:key=value,...` (options.py parses, checks). The base has none."""


def option(default, help: str, low=None, high=None, low_open: bool = False,
           high_open: bool = False, choices: Sequence | None = None):
    """A field of an options dataclass: its default, help line, and valid values
    (`low`/`high` bounds, open or closed, or `choices`), checked when a spec is parsed."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, low=low, high=high, low_open=low_open, high_open=high_open,
        choices=tuple(choices) if choices is not None else None))


class Aggregation(ProducedModel, PlacementQueries, abc.ABC):
    """One gradient-aggregation method. Subclass, set `name` and `capabilities`, register.

    The contract (docs/concepts/aggregation-contract.md): `reduce` is handed the towers'
    gradients and nothing else; the method's own options are `self.options` (an
    instance of `options_type`); its state is made by `build` and listed by
    `state_variables` (checkpointed, restored on resume, broadcast from the chief,
    changed by the training step alone). What it can do is its `capabilities` record
    (capabilities.py); validation and the contract test read it, never names.
    """

    name: ClassVar[str]
    options_type: ClassVar[type[Options]] = Options  # the method's options dataclass

    # What it can do (capabilities.py): one record, no default; a registered method declares
    # one, `Capabilities(layout=..., ...)`, or inherits (or derives, `.but(...)`) its parent's.
    capabilities: ClassVar[Capabilities]
    # The workers whose towers it also combines (cross_worker.py); None: one process.
    cluster = None
    # The other workers' copies of it at the nodes (peers.py): its transports' collectives.
    peers = None

    @classmethod
    def error_bound(cls, options: Options, num_towers: int) -> float | None:
        """A lossy method's bound rho: after every exchange since `build`, for every
        variable v and copy c, ||out[c][v] - (1/T) sum_t g[t][v]||_2 <= rho * G_v, with G_v
        the largest ||g[t][v]||_2 any tower has sent so far. None: exact, or no exchange."""
        return None

    @classmethod
    def applies_momentum(cls, options: Options) -> bool:
        """True: with these options it applies momentum itself (DGC's momentum correction), so
        validation refuses any optimizer but plain SGD (a second momentum on top)."""
        return False

    @classmethod
    def error_bound_for(cls, options: Options, num_towers: int, num_elements: int) -> float | None:
        """`error_bound` for a variable of `num_elements` entries, for methods whose bound
        grows with n (e.g. quantisers); default: `error_bound`, the same for every n."""
        return cls.error_bound(options, num_towers)

    def __init__(self, devices: DeviceSet, options: Options | None = None,
                 transport_dtype: str = "float32", *, cluster=None, between_workers=None,
                 traffic: Traffic | None = None, step_counter: tf.Variable | None = None):
        self.devices, self._step_counter = devices, step_counter  # global_step_on's
        self.options = self.options_type() if options is None else options
        if not isinstance(self.options, self.options_type):
            raise TypeError(f"aggregation {self.name!r} takes {self.options_type.__name__}, "
                            f"not {type(self.options).__name__}")
        self.transport_dtype = tf.as_dtype(transport_dtype)
        self.traffic = Traffic() if traffic is None else traffic  # a wrapper's: shared
        self.cluster = cluster
        self.peers = between_workers and Peers.make(between_workers, self.parameter_devices()[0])

    @property
    def step_counter(self) -> tf.Variable:
        """The global step (training/variables.py's `global_step_on`), given at construction:
        a method reads it, never writes it (the replicas advance it). A method made without
        one (a plugin's `__init__` that takes no counter, a test's) makes it here."""
        if self._step_counter is None:
            from mgloop.training.variables import global_step_on
            with tf.init_scope():  # once, outside any function being traced
                self._step_counter = global_step_on(self.devices.host)
        return self._step_counter

    @property
    def num_towers(self) -> int:
        """T: this process's towers, times the workers when the method has peers."""
        return self.devices.num_towers * (self.peers.num_workers if self.peers else 1)

    @property
    def tower_offset(self) -> int:
        """The global index of this process's tower 0 among the method's towers."""
        return self.peers.index * self.devices.num_towers if self.peers else 0

    @classmethod
    def reproducible(cls, options: Options) -> bool:
        """False: with these options the method reads a clock (e.g. drop's measured arrival
        order), so --deterministic refuses it (validation.py). Default: True."""
        return True

    @classmethod
    def check(cls, request: DeviceRequest, options: Options) -> None:
        """Refuses (ConfigError, one line) devices it cannot run on with these options (e.g.
        groups that do not divide the towers); ranges are checked before, from metadata."""

    def check_model(self, variables: Sequence[tf.Variable]) -> None:
        """Refuses (ConfigError, one line) a model it cannot run, from the template's trainable
        `variables`, once built and before any copy (assemble.py). Default: any model."""

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Creates the method's own state once, after the variable copies exist and before any
        restore: `variables` are copy 0's trainable variables (shapes, dtypes, homes). Make
        tf.Variables (trainable=False) where it chooses, in `state_variables`. Default: none."""

    @property
    def state_variables(self) -> list[tf.Variable]:
        """The method's state (made by `build`): checkpointed, restored, broadcast from the
        chief; changed by the training step alone. Default: none."""
        return []

    def rejoined(self, copies) -> None:
        """On a node joining a resumed run with node 0's state (runs/node_checkpoint.py):
        resets node 0's own memory (error feedback), not to count it twice. Default: none."""

    @abc.abstractmethod
    def parameter_devices(self) -> list[str]:
        """Devices of the variable copies: one for SHARED, one per tower for REPLICATED."""

    def tower_values(self, tower: int, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """The trainable values tower `tower` computes with, given copy `values` it reads (on
        the copy's devices, before any send). Default: those (stale reads: stale.py's `delay`)."""
        return values

    def after_update(self, copies) -> list:
        """Runs in every step once every copy has applied its update, before the step counter
        advances (`step_counter` holds this step's index s); may assign the copies (averaging
        every H steps: local_steps.py). Returns ops the step's end waits for. Default: none."""
        return []

    def syncs(self) -> list:
        """What `after_update` synchronises, as `Sync`s (traffic.py: its occasion, its due tensor,
        the trainable variables it changes), for a wrapper that hands them on. Default: none."""
        return []

    def variable_scope(self):
        """Context in which variable copy 0 (the template model) is created."""
        return tf.device(self.parameter_devices()[0])

    @abc.abstractmethod
    def reduce(self, tower_values: Sequence[Gradients], variables: Sequence[tf.Variable],
               average: bool = True) -> list[Gradients]:
        """Averages (or, with average=False, sums) per-tower values.

        Args:
          tower_values: tower_values[t][v], tower t's value for variable v, on its device.
          variables: variable copy 0's variables the values belong to (methods that place
            by variable read their devices).
        Only trainable gradients arrive here. A `summable` method may receive them packed
        (`--pack_bytes`, on by default; exchange.py): value i is then the 1-D concatenation
        of the gradients of bucket i (packing.py) and variables[i] the bucket's first
        variable; a method with state per variable declares `summable=False` and always
        receives one gradient per variable.
        Returns:
          out[c][v] = (1/T) * sum_t tower_values[t][v], placed on the device of variable
          copy c (len(out) == len(parameter_devices())).
        """

    def reduce_with_metrics(self, tower_values: Sequence[Gradients],
                            variables: Sequence[tf.Variable], average: bool,
                            metrics: Sequence[tf.Tensor]
                            ) -> tuple[list[Gradients], list[tf.Tensor]]:
        """(`reduce(...)`, `metrics` summed over every process of the job). `metrics` are
        this process's values (e.g. the step's mean loss and accuracy counts [correct,
        compared]): in one process as given; cross_worker.py sums them in the gradients'
        own collective."""
        return self.reduce(tower_values, variables, average), list(metrics)

    def scale(self, total: tf.Tensor, average: bool) -> tf.Tensor:
        return total * (1.0 / self.num_towers) if average else total

    def send(self, value: tf.Tensor, src: str, dst: str, exact: bool = False) -> tf.Tensor:
        """`value` (on `src`) as a tensor on `dst`, compressed to the transport dtype on the way
        (`exact`: sent at its own dtype, e.g. non-trainable state; counted all the same)."""
        if canonical(src) == canonical(dst):
            return value
        if isinstance(value, tf.IndexedSlices):  # rows (sparse_gradients.py): values, indices
            return self._send_rows(value, src, dst, exact)
        wire = (self.transport_dtype if value.dtype.is_floating and not exact
                else value.dtype)
        self.traffic.record(canonical(src), canonical(dst),
                            value.shape.num_elements() * wire.size)
        if wire == value.dtype:
            with tf.device(dst):
                return tf.identity(value)
        with tf.device(src):
            packed = tf.cast(value, wire)
        with tf.device(dst):
            return tf.cast(packed, value.dtype)

    def _send_rows(self, rows: tf.IndexedSlices, src: str, dst: str,
                   exact: bool) -> tf.IndexedSlices:
        """`rows` on `dst`: its values as `send` sends a tensor (in the transport dtype), its
        indices at their own dtype; recorded as one transfer of both."""
        values, indices = rows.values, rows.indices
        wire = (self.transport_dtype if values.dtype.is_floating and not exact
                else values.dtype)
        self.traffic.record(canonical(src), canonical(dst),
                            values.shape.num_elements() * wire.size
                            + indices.shape.num_elements() * indices.dtype.size)
        with tf.device(src):
            packed = tf.cast(values, wire)
        with tf.device(dst):
            return tf.IndexedSlices(tf.cast(tf.identity(packed), values.dtype),
                                    tf.identity(indices), rows.dense_shape)

    def sum_on(self, device: str, values: Sequence[tf.Tensor], sources: Sequence[str]) -> tf.Tensor:
        """sum_i values[i] (values[i] on sources[i]), each sent to `device` and added there."""
        received = [self.send(v, s, device) for v, s in zip(values, sources)]
        with tf.device(device):
            if isinstance(received[0], tf.IndexedSlices):  # rows: added in order, made dense
                rows = tf.concat([r.values for r in received], 0)
                num_rows = tf.get_static_value(received[0].dense_shape[0])
                return tf.math.unsorted_segment_sum(
                    rows, tf.concat([r.indices for r in received], 0),
                    received[0].dense_shape[0] if num_rows is None else int(num_rows))
            return received[0] if len(received) == 1 else tf.add_n(received)

    @contextlib.contextmanager
    def step(self):
        """Wraps the tracing of one training step: the traffic is counted afresh."""
        self.traffic.clear()
        yield
