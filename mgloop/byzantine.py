"""Fault injection for robustness studies: `--byzantine_towers=k --attack=NAME[:key=value]
--byzantine_choice=fixed|random`.

Before the exchange, k of the W*T towers of the job (W workers of T towers) hand the
exchange an altered gradient g' instead of their own g, per variable:

    signflip:factor=F   g' = -F g             (F > 0, default 1; factor=10: "sign-flipped x10")
    scaled:factor=F     g' = F g              (default 10)
    gaussian:std=S      g' ~ N(0, S^2) elementwise, replacing g (default S = 1), drawn
                        from a stateless stream keyed by (--seed, step, tower, variable)
    zero                g' = 0

Which towers: `fixed`, towers 0..k-1 (global indices) every step; `random`, each step k
towers drawn uniformly without replacement from a stateless stream keyed by (--seed,
step), the same draw on every tower and worker. The alteration is tower t's `unscale`
hook, applied last (after loss unscaling; with accumulation, to each micro-batch's
gradient, which for these attacks gives the same altered mean, the noise and the draw
being functions of the step alone). Every setting is recorded in HParams; with
--diagnostics, `tower_<t>/byzantine` is 1 on the sampled step for an altered tower (and
`tower_<t>/grad_norm` is the norm of what it sent). The hook: hooks/byzantine.py.
"""

from __future__ import annotations

import dataclasses
import math

from mgloop import aggregation
from mgloop.errors import ConfigError
from mgloop.settings import choice, in_range

CHOICES = ("fixed", "random")
# name -> {option: (default, low, low_open)}; every option is a float
ATTACKS = {
    "signflip": {"factor": (1.0, 0.0, True)},
    "scaled": {"factor": (10.0, None, False)},
    "gaussian": {"std": (1.0, 0.0, False)},
    "zero": {},
}
DEFAULT_ATTACK = "signflip"


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
            raise ConfigError(f"--attack={spec}: {key}={raw!r} is not a number") from None
        _, low, low_open = fields[key]
        in_range(f"attack={name}:{key}", values[key], low=low, low_open=low_open)
    return Attack(name, values)


def check_settings(config, num_towers: int, unit: str = "towers") -> None:
    """Refuses fault-injection settings that cannot apply (k outside 0..towers-1, an attack
    or choice given without towers to alter, a method with no per-tower gradients)."""
    choice("byzantine_choice", config.byzantine_choice, CHOICES)
    for key, value in parse_attack(config.attack).options.items():
        if not math.isfinite(value):
            raise ConfigError(f"--attack={config.attack}: {key}={value} is not a finite number")
    k = config.byzantine_towers
    if k == 0:
        given = [f"--attack={config.attack}"] if config.attack != DEFAULT_ATTACK else []
        given += ([f"--byzantine_choice={config.byzantine_choice}"]
                  if config.byzantine_choice != CHOICES[0] else [])
        if given:
            raise ConfigError(f"{' and '.join(given)} with --byzantine_towers=0 alters no "
                              "tower; set --byzantine_towers=k (1 <= k < towers)")
        return
    if not 0 < k < num_towers:
        raise ConfigError(f"--byzantine_towers={k} is out of range: must be 0 (off) or "
                          f"1 <= k < {num_towers}, the {unit} of the run, so that one stays "
                          "honest")
    if aggregation.get(config.aggregation).single_loss:
        raise ConfigError(f"--byzantine_towers={k} with --aggregation={config.aggregation}, "
                          "which computes one loss and gradient for every tower, none per "
                          "tower to alter; use a tower-loop method")
