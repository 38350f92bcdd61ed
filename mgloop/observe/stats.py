"""Mean and spread over seeds, as the report prints them.

For n values x_1 .. x_n (None and non-finite values left out):

    mean = (1/n) sum_i x_i
    sd   = sqrt( (1/(n-1)) sum_i (x_i - mean)^2 )     (the sample standard deviation,
                                                       Bessel's n - 1; None for n < 2)

`text` prints "mean ± sd" with the digits the spread justifies: the sd to 2 significant
figures and the mean to the same decimal place (e.g. 0.9123 ± 0.0047, 812 ± 37; "40 ± 0"
where every seed gave the same value).
"""

from __future__ import annotations

import math
import sys


def finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_sd(values) -> tuple[float | None, float | None, int]:
    """(mean, sd, n) of the finite values (the module's top); (None, None, 0) for none."""
    xs = finite(values)
    n = len(xs)
    if n == 0:
        return None, None, 0
    mean = math.fsum(xs) / n
    if n < 2:
        return mean, None, n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    # values equal up to float64 rounding (a few ulps apart, or the mean's own rounding):
    # a spread of 0, not 1e-17 printed to 18 decimals
    return mean, (0.0 if sd <= 8 * sys.float_info.epsilon * abs(mean) else sd), n


def decimals_for(sd: float | None, mean: float) -> int:
    """Decimal places: the sd's 2 significant figures (4 significant figures of the mean
    when there is no spread to go by)."""
    scale = sd if sd else abs(mean)
    if not scale:
        return 0
    figures = 2 if sd else 4
    return max(0, figures - 1 - math.floor(math.log10(scale)))


def text(values, scale: float = 1.0) -> str:
    """"mean ± sd" of values / scale; "mean" for one value; "—" for none."""
    mean, sd, n = mean_sd(values)
    if n == 0:
        return "—"
    mean /= scale
    sd = None if sd is None else sd / scale
    places = decimals_for(sd, mean)
    if sd is None:
        return f"{mean:.{places}f}"
    if sd == 0:  # every seed alike (e.g. bytes, or steps at one eval point)
        return f"{mean:.4g} ± 0"
    return f"{mean:.{places}f} ± {sd:.{places}f}"
