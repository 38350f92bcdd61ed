"""Every setting of a run, in one frozen dataclass, and the gate it must pass.

Each field is a `settings.setting`: its help line (the flag's), its choices and whether it
can change a result (HParams) live beside it; flags.py makes the flags from the fields.
`Config.validated()` is the only gate between settings and TensorFlow (config_checks.py):
it asks each module to check its own settings, checks the combinations, resolves the
defaults that depend on the machine, and raises `ConfigError` with one line naming the
flag and what would be valid; it creates no device and no variable.
"""

from __future__ import annotations

import dataclasses

from mgloop import aggregation
from mgloop import data
from mgloop import models
from mgloop.aggregation import nodes as node_level
from mgloop.aggregation import packing
from mgloop.data import staging
from mgloop.runs import config_checks  # validated(): loads each module that checks a setting
from mgloop.settings import setting
from mgloop.spec import optim
from mgloop.step import ordered_sum
from mgloop.step import precision
from mgloop.step import sufficient_factors
from mgloop.step import sync_batch_norm
from mgloop.step.hooks import attacks as byzantine

GRAD_REDUCE = aggregation.validation.GRAD_REDUCE
TRANSPORT_DTYPES = aggregation.validation.TRANSPORT_DTYPES
_WHERE = "only where files go"  # reasons why a setting changes no result (HParams)
_WRITES = "only what is written and how often, not what is computed"
_WAITS = "only how long to wait for peers"


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one training run. Field names are the flag names (but `plugins`, whose
    repeatable flag is `--plugin`)."""

    # Devices and aggregation.
    devices: str = setting(
        "auto", "auto | cpu:N | gpu | gpu:I,J,... (auto: all GPUs, else 2 simulated CPU towers)",
        hparam=True)
    towers_per_device: int = setting(
        1, "K: towers on each device, computed together as one vectorized pass "
        "(tf.vectorized_map: each tower its own shard, random stream and batch-norm "
        "statistics) and reading one variable copy per device; towers = devices x K",
        hparam=True)
    xla_towers: bool = setting(
        False, "compile each tower's forward, loss and backward with XLA (one "
        "tf.function(jit_compile=True), traced once, compiled per device: "
        "step/compiled_towers.py): fewer, fused kernels per tower; the exchange and the "
        "update stay uncompiled",
        hparam=True)
    aggregation: str = setting(
        "reduce_broadcast", "how gradients meet: NAME or NAME:key=value,... with the method's "
        "own options (e.g. ring:shards=2, hierarchical:groups=2); NAME one of: {choices}, or "
        "a method a --plugin registers", choices=aggregation.names, hparam=True)
    grad_reduce: str = setting(
        "mean", "mean (default: gradient of the mean loss over the global batch) | sum (the "
        "sum over towers, T times larger)", choices=GRAD_REDUCE, hparam=True)
    pack_bytes: int = setting(
        packing.DEFAULT_BUCKET_BYTES, "fuse gradients into buckets of at most this many bytes "
        "before the exchange inside a process (0: off; the default packs for summable methods; "
        "large gradients summed at their home are not packed); a compressor's gathered "
        "payloads travel in buckets of this many bytes, one message each (DDP's "
        "bucket_cap_mb); between workers summed gradients always travel as one buffer per "
        "dtype", hparam=True)
    transport_dtype: str = setting(
        "float32", "float32 | float16 | bfloat16: dtype of gradients in flight; sums are "
        "accumulated in float32", choices=TRANSPORT_DTYPES, hparam=True)
    nodes: int = setting(
        1, "N: split one process's towers into N simulated nodes (contiguous, node-major; "
        "must divide the towers); with several workers each worker is a node",
        hparam=True)
    method_at: str = setting(
        "auto", "{choices}: whether --aggregation sees one gradient per node (each node's "
        "exact mean, summed by --within_node) or one per tower; auto: nodes when --nodes > 1",
        choices=node_level.METHOD_AT, hparam=True)
    within_node: str = setting(
        node_level.DIRECT, "how a node sums its towers before the method between "
        "nodes: reduce (every tower sends to the node's first, which adds in tower order) or "
        "an exact replicated method's name (e.g. ring, collective)", hparam=True)
    node_failures: str | None = setting(
        None, "simulated nodes that fail (--nodes=N, the method at the nodes): n@a-b (node n "
        "down for steps a <= s < b, back at b with a live node's state) or n@a (gone from "
        "step a), comma-separated, e.g. 2@30-60,1@80; a down node's part is left out of the "
        "mean, its copies frozen (torchft's quorum; aggregation/node_failures.py)",
        hparam=True)
    ordered_sum_bytes: int = setting(
        ordered_sum.DEFAULT_MIN_BYTES, "shared layout (ps_*) on logical CPU towers: the "
        "gradients of each variable of at least this many bytes are summed tower by tower, "
        "tower t's backward pass starting once tower t-1's were added, so two copies of them "
        "are alive instead of T + 1 (the towers' backward passes no longer overlap); 0: off",
        hparam=True)
    sufficient_factor_bytes: int = setting(
        sufficient_factors.DEFAULT_MIN_BYTES, "shared layout (ps_*) on logical CPU towers: a "
        "variable of at least this many bytes used by one plain matmul z = x W per tower (a "
        "float32 Dense kernel) gets its summed gradient as one product X^T dZ of the towers' "
        "inputs and output gradients at its home, instead of one full-size gradient per "
        "tower; 0: off", hparam=True)
    sparse_as_dense: bool = setting(
        False, "send an Embedding's sparse gradient (IndexedSlices) as a dense tensor "
        "everywhere; false: as rows (values and indices) where that moves fewer bytes: to "
        "the home of a ps_* variable, or all-gathered for a replicated exact method in one "
        "process (sparse_gradients.py)", hparam=True)
    plugins: tuple[str, ...] = setting(
        (), "import this module (a name on the Python path, or a .py file path) before "
        "validation (repeatable): it may register aggregation methods", flag="plugin",
        hparam=True)
    # Fault injection (byzantine.py): towers whose gradients are altered before the exchange.
    byzantine_towers: int = setting(
        0, "k: towers whose gradients --attack alters before the exchange, for robustness "
        "studies (0: none; 1 <= k < towers)", hparam=True)
    attack: str = setting(
        "signflip", "what a --byzantine_towers tower sends instead of its gradient g: "
        "signflip[:factor=F] (-F g), scaled:factor=F (F g), gaussian:std=S (N(0, S^2) "
        "noise instead of g), zero, labelflip (trains on labels C-1-y), alie[:z=Z] (honest "
        "mean - Z sd, Baruch et al. 2019), ipm[:epsilon=E] (-E honest mean, Xie et al. 2020)",
        hparam=True)
    byzantine_choice: str = setting(
        "fixed", "which towers: fixed (towers 0..k-1 every step) | random (k drawn each "
        "step, seeded by --seed)", choices=byzantine.CHOICES, hparam=True)
    # Accumulation, precision and batch norm (apply across modes).
    accumulation_steps: int = setting(
        1, "micro-batches per update: each tower sums its gradients over K consecutive global "
        "batches before one exchange and one update (effective batch K x global batch; "
        "--train_steps counts updates)", hparam=True)
    mixed_precision: str = setting(
        "none", "none | mixed_float16 | mixed_bfloat16: Keras dtype policy of the model "
        "(float32 variables, 16-bit compute); mixed_float16 adds dynamic loss scaling, an "
        "overflow on any tower skipping the update on all", choices=precision.POLICIES,
        hparam=True)
    batch_norm: str = setting(
        "per_tower", "per_tower (each tower's shard statistics, moving statistics averaged "
        "over towers) | sync (batch statistics over the global batch across towers)",
        choices=sync_batch_norm.MODES, hparam=True)
    # Data and model. Exactly one of the two batch sizes may be set; the global batch is the
    # unit (default 128 when neither is set).
    dataset: str = setting("synthetic", "one of: {choices} (cifar10, mnist, text: files in "
                           "--data_dir; digits: the bundled UCI 8x8 digits, python_text: the "
                           "standard library's modules as bytes, installed with Python)",
                           choices=data.names, hparam=True)
    data_dir: str | None = setting(
        None, "folder of the --dataset files: cifar10 reads data_batch_1.bin .. "
        "data_batch_5.bin and test_batch.bin (binary version); mnist reads "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        "t10k-labels-idx1-ubyte (each may be .gz); text reads every UTF-8 file under it",
        neutral="where the files of --dataset are (recorded: dataset); data.check verifies them")
    partition: str = setting(
        "iid", "how the training examples are dealt to the clients (the nodes when the "
        "method is between nodes, else the towers): iid (every batch from the whole set, as "
        "before) | dirichlet:alpha=A (label-Dirichlet non-IID parts, class c split by "
        "p_c ~ Dir(A 1_n) drawn with --seed; each client's shard of every batch comes from "
        "its own part; mgloop/data/partition.py)", hparam=True)
    sequence_length: int | None = setting(
        None, "--dataset=text or python_text: tokens (bytes) per sequence (default 64)",
        hparam=True)
    model: str = setting("mlp", "one of: {choices}", choices=models.names, hparam=True)
    lm_layers: int | None = setting(
        None, "--model=transformer_lm: decoder blocks (default 2)", hparam=True)
    lm_width: int | None = setting(
        None, "--model=transformer_lm: model width, a multiple of --lm_heads (default 64)",
        hparam=True)
    lm_heads: int | None = setting(
        None, "--model=transformer_lm: attention heads (default 4)", hparam=True)
    global_batch_size: int | None = setting(
        None, "examples per step over all towers (default 128); or set --batch_size_per_tower",
        hparam=True)
    batch_size_per_tower: int | None = setting(
        None, "examples per tower per step; global = this x towers", hparam=True)
    drop_remainder: bool = setting(
        True, "true: each epoch gives floor(N/B) full batches, its last N mod B examples "
        "unused; false: epochs run on into one another, so the last batch of an epoch is "
        "completed from the next (every batch is full); for a user's data (tf.data, arrays, "
        "a --plugin dataset) false pads the short batch and weighs it to the mean over its "
        "real examples (mgloop/data/padding.py)", hparam=True)
    # Input staging (staging.py): every mode hands the towers the same shards; recorded in
    # HParams all the same, as the speed of runs is compared by it.
    staging: str = setting(
        "device", "how batches reach the towers: {choices} (none: synchronous feed; host: "
        "tf.data prefetch; device: host prefetch plus per-tower staging areas)",
        choices=staging.MODES, hparam=True)
    staging_depth: int = setting(
        2, "K: batches prefetched on the host (host, device) and staged on every tower "
        "(device); >= 1", hparam=True)
    # Updates.
    optimizer: str = setting("momentum", "one of: {choices} (momentum: SGD with --momentum)",
                             choices=optim.OPTIMIZERS, hparam=True)
    learning_rate: float = setting(0.05, "peak learning rate", hparam=True)
    momentum: float = setting(0.9, "momentum of --optimizer=momentum", hparam=True)
    lr_schedule: str = setting("constant", "one of: {choices} (poly: Caffe's polynomial decay)",
                               choices=optim.LR_SCHEDULES, hparam=True)
    lr_power: float = setting(1.0, "power of the poly schedule", hparam=True)
    warmup_steps: int = setting(0, "steps of linear warm-up before the schedule", hparam=True)
    weight_decay: float = setting(0.0, "decoupled weight decay (v -= lr * wd * v each update)",
                                  hparam=True)
    # Loop.
    train_steps: int = setting(400, "train until the global step reaches this (resumes count)",
                               hparam=True)
    steps_per_loop: int = setting(
        20, "steps run inside one compiled tf.function call",
        neutral="the same steps run, only fewer or more per compiled call")
    # Outputs.
    logdir: str | None = setting(
        None, "run folder for events, checkpoints, summary.json (default: a fresh timestamped "
        "folder under the temp dir)", neutral=_WHERE)
    summary_every: int = setting(20, "steps between TensorBoard scalar summaries (0: none)",
                                 neutral=_WRITES)
    log_every: int = setting(100, "steps between progress log lines (0: none)", neutral=_WRITES)
    checkpoint_every: int = setting(
        200, "steps between checkpoints (0: only at the end of training)",
        neutral="a save reads the variables; a resume continues bit-identically")
    keep_checkpoints: int = setting(3, "how many recent checkpoints to keep", neutral=_WRITES)
    export_dir: str | None = setting(
        None, "save the template model here as model.keras (Keras native format)",
        neutral=_WHERE)
    # Inspection (monitor.py, diagnostics.py): TensorBoard beyond the basic scalars; each
    # reads the towers' losses, gradients or variables and changes none.
    diagnostics: bool = setting(
        True, "per-tower loss and gradient norm, gradient agreement (cosine, norm ratio) and "
        "replica divergence in TensorBoard, every --summary_every steps", neutral=_WRITES)
    eval_every: int = setting(
        0, "steps between evaluations on the held-out split (0: only at the end)",
        neutral=_WRITES)
    histogram_every: int = setting(
        0, "steps between weight and gradient histograms (0: none)", neutral=_WRITES)
    profile_steps: str | None = setting(
        None, "A,B: write a profiler trace of steps A+1 .. B into <logdir>/plugins/profile",
        neutral=_WRITES)
    breakdown_every: int = setting(
        0, "steps between profiled steps whose time is split into input, compute, "
        "aggregation and apply (breakdown/... scalars; 0: none)", neutral=_WRITES)
    links: tuple[str, ...] = setting(
        (), "BANDWIDTH,LATENCY, e.g. 10gbit,10us (repeatable): model the step's exchange on "
        "such a network from its exact traffic (observe/link_model.py) and report the modelled "
        "exchange and step times beside the measured compute time (summary.json link_model, "
        "link/... scalars); bandwidth in bit, kbit, mbit, gbit, tbit per second, latency in "
        "ns, us, ms, s", flag="link",
        neutral="a model computed after training from the traffic counts")
    compute: str = setting(
        "measured", "the compute per step the link model sets beside the exchange: measured "
        "(this machine's median step less the exchange timed alone) | PROFILE[:efficiency=E] "
        "(FLOPs of one tower's step, counted from the traced training step, over the peak "
        "dense 16-bit FLOP/s of a100, h100, v100, t4 or cpu times E, the model FLOPs "
        "utilisation, 0 < E <= 1, default 0.4) | seconds=X (one tower's step, given); "
        "observe/hardware.py", neutral="a model computed after training; the step is traced "
        "for its FLOPs, never run")
    node_speeds: str | None = setting(
        None, "S1,S2,...: one speed factor per node (--nodes, or the workers), e.g. 1,1,0.5,1; "
        "every step waits for the slowest node, so the modelled compute per step is "
        "C / min(speed)", neutral="a model computed after training")
    # Repeatability.
    seed: int = setting(0, "seed of data, initialisation and shuffling", hparam=True)
    deterministic: bool = setting(False, "TensorFlow op determinism: bit-repeatable runs",
                                  hparam=True)
    # Several processes (TF_CONFIG): how long to wait for peers.
    startup_timeout: float = setting(
        60.0, "several processes (TF_CONFIG): seconds to wait for every peer at start",
        neutral=_WAITS)
    collective_timeout: float = setting(
        30.0, "several processes: the peer health timeout: a peer that answers no health "
        "check for this many seconds (dead, stopped, hung) is declared lost within 10s more, "
        "the collectives are aborted and the run fails (exit code 3 naming it), not hangs; "
        ">= 5", neutral=_WAITS)

    @property
    def num_towers(self) -> int:
        """Tower count of a validated config (global batch / per-tower batch)."""
        return self.global_batch_size // self.batch_size_per_tower

    def validated(self, on_disk: bool = True) -> "Config":
        """Checks every setting; returns a copy with machine-dependent defaults resolved.

        Each module checks its own settings, in this order; then the combinations that
        involve the aggregation method and several workers; then the folders on disk
        (config_checks.py). `on_disk` False: the folders are checked creatable but not
        made, and no checkpoints are compared (a check ahead of the run, as a sweep's)."""
        return config_checks.validated(self, on_disk)
