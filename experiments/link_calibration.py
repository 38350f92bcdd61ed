"""The link model calibrated on measured shaped links: an efficiency, a processing rate and a
per-message cost, fitted to experiments/link_check.py's cells and checked on cells it did
not see.

    python -m experiments.link_check --json_out=/tmp/link_check.json   (calibrates at its end)
    python -m experiments.link_check --from_json=/tmp/link_check.json  (again, no job run)

The link model (mgloop/observe/link_model.py) charges a step's exchange on a link of B
bytes/s and latency a as X = S / B + a m, S the busiest device's bytes and m its messages
per step (averaged over the run). A tbf-shaped link between network namespaces on a busy
machine carries less than B and each message costs more than the wire. The calibration
fits, by least squares over every cell c (a method, a worker count, a bandwidth B_c) of
link_check's table,

    step_c - C_c  =  S_c / (eta B_c)  +  S_c / P  +  alpha m_c

with C_c the cell's compute (its unshaped job's step less its exchange timed alone),
step_c its measured step averaged as the model averages (link_check's `step`), and three
unknowns: eta, the share of the shaped rate that carries payload (TCP/IP and Ethernet
headers, tbf counting whole frames: about 0.95 expected); P, a rate in bytes/s at which the
machine moves any byte through the namespaces' veth, bridge and queues, whatever the
shaping (a second link in series, its cost per byte paid by the CPU); and alpha, the cost
of one message beyond its bytes (a gRPC call's round trip, the receiver's wake-up). The
calibrated link of a shaped bandwidth B is then an ordinary link-model link,

    --link=between:B',alpha      B' = 1 / (1 / (eta B) + 1 / P)

so that every study's modelled seconds can use it as given. Held out: the calibration is
fitted again on the cells of all worker counts but one, and the left-out count's cells are
modelled with it (their ratios say whether the calibration predicts or only describes).
For the methods whose exchange overlaps the compute, and for the sync steps, the
calibrated link goes through link_check's own composition (link_check.modelled_step).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mgloop.observe import link_model  # imports no TensorFlow

MBIT = 1e6 / 8  # bytes/s of one Mbit/s


@dataclasses.dataclass(frozen=True)
class Calibration:
    """eta (payload share of the shaped rate), processing rate P (bytes/s), alpha (s per
    message), fitted on `cells` cells."""

    efficiency: float
    processing_bytes_per_second: float
    per_message_seconds: float
    cells: int

    def link(self, bandwidth_bytes_per_second: float) -> link_model.Link:
        """The calibrated link of a shaped bandwidth: B' = 1 / (1 / (eta B) + 1 / P), alpha."""
        seconds_per_byte = 1.0 / (self.efficiency * bandwidth_bytes_per_second)
        if np.isfinite(self.processing_bytes_per_second):
            seconds_per_byte += 1.0 / self.processing_bytes_per_second
        rate = 1.0 / seconds_per_byte
        return link_model.Link(f"{rate * 8 / 1e6:.4g}mbit,{self.per_message_seconds * 1e6:.4g}us",
                               rate, self.per_message_seconds, tier="between")

    def describe(self) -> str:
        processing = self.processing_bytes_per_second / MBIT
        return (f"eta {self.efficiency:.3f} of the shaped rate, a processing rate P of "
                f"{processing:.0f} Mbit/s in series, {self.per_message_seconds * 1e3:.3f} ms "
                f"per message (fitted on {self.cells} cells)")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def rate(bandwidth: str) -> float:
    """A shaped bandwidth (link_check's `bandwidth`, e.g. "50mbit") in bytes/s."""
    return link_model.parse(f"between:{bandwidth},0us").bytes_per_second


def features(row: dict) -> tuple[list[float], float]:
    """([S / B, S, m], step - C) of a measured cell: S and m the busiest device's bytes and
    messages per step (the shaped job's summary.json link_model), C the cell's compute."""
    traffic = row["shaped_link_model"]
    sent, messages = traffic["bytes_per_device"], traffic["messages_per_device"]
    return ([sent / rate(row['bandwidth']), float(sent), float(messages)],
            row["step"] - row["modelled"]["compute"])


def usable(row: dict) -> bool:
    """A cell with a measured step, a compute and its shaped job's traffic."""
    return (row.get("step") is not None and row.get("shaped_link_model") is not None
            and (row.get("modelled") or {}).get("compute") is not None)


def fit(rows: list[dict]) -> Calibration:
    """The least-squares (1 / eta, 1 / P, alpha) over `rows`' usable cells. A coefficient
    the data drive below 0 is held at 0 (P infinite, or no per-message cost) and the rest
    refitted; ValueError without three usable cells."""
    cells = [features(row) for row in rows if usable(row)]
    if len(cells) < 3:
        raise ValueError(f"{len(cells)} usable cells: the calibration needs 3 or more")
    design = np.array([x for x, _ in cells])
    target = np.array([y for _, y in cells])
    free = [0, 1, 2]
    while True:
        solved = np.linalg.lstsq(design[:, free], target, rcond=None)[0]
        coefficients = np.zeros(3)
        coefficients[free] = solved
        negative = [i for i in free if coefficients[i] < 0 and i != 0]
        if not negative:
            break
        free.remove(negative[0])
    inverse_eta, inverse_rate, alpha = coefficients
    return Calibration(1.0 / inverse_eta, 1.0 / inverse_rate if inverse_rate else np.inf,
                       float(alpha), len(cells))


def held_out(rows: list[dict]) -> dict[int, Calibration]:
    """{worker count: the calibration fitted on the other worker counts' cells}."""
    counts = sorted({row["workers"] for row in rows})
    if len(counts) < 2:
        return {}
    return {count: fit([row for row in rows if row["workers"] != count]) for count in counts}
