"""`mgloop.step.hooks.byzantine`, the old name of step/hooks/attack_hook.py
(ByzantineTowers, the hook of --byzantine_towers): its names, kept until mgloop 0.2 with a
DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.step.hooks.attack_hook")
