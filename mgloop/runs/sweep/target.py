"""A sweep's target, `--target=METRIC>=VALUE` or `METRIC<=VALUE`: an eval metric and the
value at which a cell has reached it (plan.py says what the sweep does with it; record.py
counts the time to it; tune.py scores a tuning point by its metric and direction).
"""

from __future__ import annotations

import dataclasses
import math
import re

from mgloop.runs.sweep import grid

_TARGET = re.compile(r"\s*([A-Za-z_][\w/]*)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")
HIGHER = ">="


@dataclasses.dataclass(frozen=True)
class Target:
    metric: str  # "accuracy": the eval metric compared (eval/accuracy in the history)
    comparison: str  # ">=" or "<="
    value: float

    @property
    def key(self) -> str:
        return f"eval/{self.metric}"

    def met(self, value) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.value if self.comparison == HIGHER else value <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.comparison}{self.value:g}"


def parse_target(text: str | None) -> Target | None:
    """`accuracy>=0.9`, `loss<=1.5` -> Target; None or "" -> None (no target)."""
    if not text:
        return None
    match = _TARGET.match(text)
    if not match:
        raise grid.SpecError(f"--target={text!r}: give METRIC>=VALUE or METRIC<=VALUE, an "
                             "eval metric and a number (e.g. --target=accuracy>=0.9)")
    name = match.group(1).removeprefix("eval/")
    try:
        value = float(match.group(3))
    except ValueError:
        raise grid.SpecError(f"--target={text!r}: {match.group(3)!r} is not a number") from None
    return Target(name, match.group(2), value)
