"""`mgloop.step.hooks.byzantine`, the old name of step/hooks/attack_hook.py
(ByzantineTowers, the hook of --byzantine_towers): its names, kept until mgloop 0.2 with a
DeprecationWarning."""

import warnings

from mgloop.step.hooks import attack_hook

warnings.warn("mgloop.step.hooks.byzantine is now mgloop.step.hooks.attack_hook; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(attack_hook, name)
