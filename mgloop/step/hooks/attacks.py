"""Fault injection for robustness studies: `--byzantine_towers=k --attack=NAME[:key=value]
--byzantine_choice=fixed|random`.

Before the exchange, k of the n units of the job (the W*T towers of W workers of T towers;
with the method between nodes, the nodes) hand the exchange an altered gradient g' instead
of their own g, per variable. Per tower, from its own gradient alone:

    signflip:factor=F   g' = -F g             (F > 0, default 1; factor=10: "sign-flipped x10")
    scaled:factor=F     g' = F g              (default 10)
    gaussian:std=S      g' ~ N(0, S^2) elementwise, replacing g (default S = 1), drawn
                        from a stateless stream keyed by (--seed, step, tower, variable)
    zero                g' = 0

Data poisoning (the attacker computes its gradient honestly, on poisoned data):

    labelflip           g' = d loss(x, y') / dv on the flipped labels y' = C - 1 - y (ByzFL's
                        LabelFlipping; one-hot rows reversed, the same map), C the classes the
                        loss reads: the model's output width K (2 for one sigmoid unit or
                        logit), which for a built-in --model is the --dataset's num_classes.
                        Only with mgloop's class cross-entropy (the default loss) on a model
                        of one output of single-label classes; anything else (a user's loss,
                        a multi-label sigmoid) is refused in one line when the Trainer is
                        built, the first moment its model and loss are known, before any
                        copy. The step's loss is what the towers differentiated (an attacker's
                        on y'); the metrics read the true labels.

Omniscient (the attackers see every honest unit's gradient of the step; g_h for the n - f
honest units, per coordinate j, f = k attackers):

    alie:z=Z,ddof=D     g' = mu - z sigma ("A little is enough", Baruch et al., NeurIPS 2019),
                        mu_j = mean_h g_h,j, sigma_j = sqrt(sum_h (g_h,j - mu_j)^2 / (m - D)),
                        m = n - f honest units. D = 0 (the default): the population standard
                        deviation of the honest vectors (the attacker describes what it sees,
                        it estimates nothing; defined for one honest unit). D = 1: the sample
                        standard deviation, as ByzFL 0.0.11's ALittleIsEnough computes it
                        (var with ddof=1; needs m >= 2). ByzFL writes the attack mu + tau sigma
                        (tau = 1.5 by default): its tau is -z here, so ByzFL's default is
                        alie:z=-1.5,ddof=1. z = 0 or unset: the paper's
                        z_max = Phi^-1((n - s) / n), s = floor(n/2 + 1) - f (`alie_z`; 0 for
                        n = 4, f = 1: g' = mu); s < 1 is refused (z_max infinite).
    ipm:epsilon=E       g' = -E mu (inner-product manipulation, Xie et al., UAI 2020, "Fall of
                        empires"); default E = 0.1, mgloop's own (ByzFL 0.0.11's
                        InnerProductManipulation sends -tau mu with tau = 2.0 by default:
                        ipm:epsilon=2)

Which units: `fixed`, units 0..k-1 (global indices) every step; `random`, each step k units
drawn uniformly without replacement from a stateless stream keyed by (--seed, step), the
same draw on every tower and worker. A node attacks as a whole: every tower of an attacking
node sends alike, so the node's mean is the attack (for alie and ipm, mu and sigma are over
the honest nodes' means). Where (hooks/attack_hook.py): the per-tower attacks are tower t's
`unscale` hook, applied last (after loss unscaling; with accumulation, to each micro-batch's
gradient, which for them gives the same altered mean, the noise and the draw being functions
of the step alone); labelflip is its `labels` hook (the labels its loss reads); alie and ipm
its `alter_towers` hook, once every tower's gradient exists (with accumulation, the means over
the micro-batches), before the diagnostics and the exchange. An Embedding's sparse gradient
(IndexedSlices) is made dense for every tower under alie and ipm (as --sparse_as_dense
would), since the attack vector is dense. The large-gradient hooks that would sum a tower's
gradient at home before every tower's exists (ordered sum, sufficient factors) are left out
with alie and ipm (assemble.py; the sums are exact either way). alie and ipm are refused
across worker processes: an attacker here sees its own worker's gradients only.

Every setting is recorded in HParams; with --diagnostics, `tower_<t>/byzantine` is 1 on the
sampled step for an altered tower (and `tower_<t>/grad_norm` is the norm of what it sent).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import keras

from mgloop import aggregation
from mgloop.errors import ConfigError
from mgloop.settings import choice, in_range
from mgloop.training import losses

from mgloop.step.options import BYZANTINE_CHOICES as CHOICES
from mgloop.step.options import StepOptions

# name -> {option: (default, low, low_open)}; every option is a float
ATTACKS = {
    "signflip": {"factor": (1.0, 0.0, True)},
    "scaled": {"factor": (10.0, None, False)},
    "gaussian": {"std": (1.0, 0.0, False)},
    "zero": {},
    "labelflip": {},
    # z 0: the paper's z_max (alie_z); ddof 0: population sd, 1: sample sd (ByzFL's)
    "alie": {"z": (0.0, None, False), "ddof": (0.0, 0.0, False)},
    "ipm": {"epsilon": (0.1, 0.0, True)},
}
DEFAULT_ATTACK = "signflip"
PER_TOWER = ("signflip", "scaled", "gaussian", "zero")  # the tower's `unscale`
OMNISCIENT = ("alie", "ipm")  # `alter_towers`: they read every honest unit's gradient


@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    options: dict  # option -> float value (defaults filled in)


def parse_attack(spec: str) -> Attack:
    """`NAME` or `NAME:key=value,...` -> Attack; one ConfigError line for every mistake."""
    name, _, text = str(spec).strip().partition(":")
    name = name.strip()
    if name not in ATTACKS:
        raise ConfigError(f"--attack={spec!r}: {name!r} is not one of: "
                          f"{', '.join(ATTACKS)} (e.g. signflip:factor=10, gaussian:std=1)")
    fields = ATTACKS[name]
    values = {key: default for key, (default, _, _) in fields.items()}
    given = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, raw = (s.strip() for s in item.partition("="))
        if not equals or key not in fields or key in given:
            valid = ", ".join(fields) or "none"
            raise ConfigError(f"--attack={spec}: {item!r} is not one of {name}'s options "
                              f"key=value, each once (its options: {valid})")
        given.add(key)
        try:
            values[key] = float(raw)
        except ValueError:
            raise ConfigError(f"--attack={spec}: {key}={raw!r} is not a number; give "
                              f"{key}=NUMBER") from None
        _, low, low_open = fields[key]
        in_range(f"attack={name}:{key}", values[key], low=low, low_open=low_open)
    if values.get("ddof", 0.0) not in (0.0, 1.0):
        raise ConfigError(f"--attack={spec}: ddof={values['ddof']:g} is not 0 or 1; give "
                          "ddof=0 (population sd, the default) or ddof=1 (sample sd, ByzFL's)")
    return Attack(name, values)


def alie_z(n: int, f: int) -> float:
    """ALIE's z_max (Baruch et al. 2019): Phi^-1((n - s) / n), s = floor(n/2 + 1) - f, the
    standard normal quantile for n units of which f attack; ConfigError if s < 1 (then
    (n - s) / n >= 1 and z_max is infinite)."""
    s = math.floor(n / 2 + 1) - f
    if s < 1:
        raise ConfigError(f"--attack=alie with {f} attackers of {n}: its default z = "
                          f"Phi^-1((n - s)/n), s = floor(n/2 + 1) - f = {s} < 1, is infinite; "
                          "give alie:z=Z (Z > 0) or fewer --byzantine_towers")
    return statistics.NormalDist().inv_cdf((n - s) / n)


def omniscient(options: StepOptions) -> bool:
    """Whether the run's attack reads every honest unit's gradient (alie, ipm)."""
    return bool(options.byzantine_towers) and parse_attack(options.attack).name in OMNISCIENT


def label_classes(loss_fn, model, input_shape=None) -> int:
    """C of --attack=labelflip: the classes mgloop's class cross-entropy reads from the
    model's one output of width K (K > 1: softmax or logits; K = 1: one sigmoid unit or
    logit, C = 2); one ConfigError line where labels are not class ids of a known C."""
    if not isinstance(loss_fn, losses.CrossEntropy):
        raise ConfigError(f"--attack=labelflip with the loss {loss_fn!r}: labels are flipped "
                          "as class ids (y' = C - 1 - y), which only mgloop's class "
                          "cross-entropy (the default loss) reads as such; use the default "
                          "loss or another --attack")
    width = _output_width(model, input_shape)
    if width is None:
        raise ConfigError("--attack=labelflip: the model's classes C cannot be read (not one "
                          "output tensor with a known last axis); give a model with one "
                          "class output or another --attack")
    if width > 1 and loss_fn.outputs == "sigmoid":
        raise ConfigError(f"--attack=labelflip: the model ends in {width} sigmoid units, "
                          "labels that are {0, 1} per unit (multi-label), not class ids; use "
                          "another --attack")
    return max(width, 2)


def _output_width(model, input_shape) -> int | None:
    """The last axis of the model's one output, or None."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # a subclassed model has no symbolic outputs
        outputs = None
    if not outputs and input_shape is not None:
        try:
            outputs = model.compute_output_spec(keras.KerasTensor((1, *input_shape)))
        except Exception:  # noqa: BLE001 -- any failure: the width is unknown
            return None
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    if len(outputs) != 1 or not outputs[0].shape or outputs[0].shape[-1] is None:
        return None
    return int(outputs[0].shape[-1])


def check_options(options: StepOptions) -> None:
    """Refuses fault-injection settings that cannot apply whatever the run: a choice or an
    attack that does not parse, an option that is not finite, an attack or a choice given
    without towers to alter."""
    choice("byzantine_choice", options.byzantine_choice, CHOICES)
    attack = parse_attack(options.attack)
    for key, value in attack.options.items():
        if not math.isfinite(value):
            raise ConfigError(f"--attack={options.attack}: {key}={value} is not a finite "
                              "number; give a finite one")
    if options.byzantine_towers == 0:
        given = [f"--attack={options.attack}"] if options.attack != DEFAULT_ATTACK else []
        given += ([f"--byzantine_choice={options.byzantine_choice}"]
                  if options.byzantine_choice != CHOICES[0] else [])
        if given:
            raise ConfigError(f"{' and '.join(given)} with --byzantine_towers=0 alters no "
                              "tower; set --byzantine_towers=k (1 <= k < towers)")


def check_units(options: StepOptions, num_units: int, unit: str, aggregation_flag: str,
                num_workers: int) -> None:
    """Refuses k attackers (--byzantine_towers) that cannot apply to the run: k outside
    1..units-1, a method (--aggregation) with no per-tower gradients, an omniscient attack
    across worker processes or with an infinite default z. `num_units`: the units (towers,
    or nodes with the method between nodes) named `unit`; `check_options` first."""
    k = options.byzantine_towers
    if k == 0:
        return
    if not 0 < k < num_units:
        raise ConfigError(f"--byzantine_towers={k} is out of range: must be 0 (off) or "
                          f"1 <= k < {num_units}, the {unit} of the run, so that one stays "
                          "honest")
    if aggregation.get(aggregation_flag).capabilities.single_loss:
        raise ConfigError(f"--byzantine_towers={k} with --aggregation={aggregation_flag}, "
                          "which computes one loss and gradient for every tower, none per "
                          "tower to alter; use a tower-loop method")
    attack = parse_attack(options.attack)
    if attack.name in OMNISCIENT:
        if num_workers > 1:
            raise ConfigError(f"--attack={options.attack} across {num_workers} workers: "
                              "its attackers need every honest gradient, and here a worker "
                              "sees only its own towers'; use one worker (--nodes=N simulates "
                              "N nodes) or a per-tower --attack")
        if attack.name == "alie" and attack.options["z"] == 0.0:
            alie_z(num_units, k)  # the default z must be finite
        if attack.name == "alie" and attack.options["ddof"] == 1.0 and num_units - k < 2:
            raise ConfigError(f"--attack={options.attack} with --byzantine_towers={k} of "
                              f"{num_units} {unit}: the sample sd (ddof=1) needs 2 honest "
                              f"ones; use ddof=0 or --byzantine_towers <= {num_units - 2}")
