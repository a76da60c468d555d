"""A noise guard for measurements on a machine that may be shared or throttled: a fixed
yardstick (a GEMM and a copy) is timed around every measured row, and a row counts only when
the yardstick sat within a band of its run median on both sides. Otherwise the row is measured
again, up to a bound, and then reported as unstable rather than silently used.

    guard = Yardstick()
    row = guard.measure(lambda: time_something(), "matmul fp32")
    row.value, row.stable      # the measurement, and whether the machine held still around it
    guard.summary()            # the swing over the run: yardstick min / median / max, rows redone

A VM whose neighbour starts a job halves its speed within seconds (2x swings were seen on this
project's CI kind); a cost model checked against such rows learns the neighbour, not the machine."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

BAND = 0.07  # a row counts when the yardstick is within +-7% of its run median
TRIES = 3  # measurements of a row before it is reported unstable


@dataclass
class Row:
    value: Any
    stable: bool
    tries: int  # measurements taken (1: the first held)
    yardstick_s: tuple[tuple[float, float], tuple[float, float]]  # readings just before and after the kept value
    label: str = ""


JOBS = ("gemm", "copy")  # the yardstick's parts, each judged against its own run median


@dataclass
class Yardstick:
    """Times a fixed job, a 384^3 fp32 GEMM (the median of `repeat` runs, ~27 ms) and a 128 MiB
    copy (the median of 5, ~55 ms), and judges rows by both: a reading is within the band when
    each part is within it of that part's run median. `warm` readings set the medians before
    the first row. Measured on this project's 2-core VM, idle: 25 readings of each part stayed
    within -8..+8% (GEMM) and -3..+8% (copy) of their medians; a 16 MiB copy, which fits the
    last-level cache the host's other tenants share, swung -41..+42% and could judge nothing."""

    band: float = BAND
    tries: int = TRIES
    repeat: int = 40
    warm: int = 5
    readings: list[tuple[float, float]] = field(default_factory=list)  # (GEMM s, copy s)
    rows: int = 0  # rows judged
    remeasured: int = 0  # rows that needed more than one measurement
    unstable: list[str] = field(default_factory=list)  # labels of rows that never held still
    at: list[float] = field(default_factory=list)  # seconds since the first reading, per reading

    def __post_init__(self):
        if not 0 < self.band < 1:
            raise ValueError(f"band must be in (0, 1), got {self.band}")
        if self.tries < 1:
            raise ValueError(f"tries must be at least 1, got {self.tries}")
        self._job = None
        self._t0 = None

    def _build(self):
        import torch

        a = torch.full((384, 384), 0.5)
        src, dst = torch.full((32 << 20,), 0.5), torch.empty(32 << 20)  # 128 MiB each: past any cache
        a @ a, dst.copy_(src)  # first-touch pages and pick kernels outside any reading
        self._job = ((lambda: a @ a, self.repeat), (lambda: dst.copy_(src), 5))

    def read(self) -> tuple[float, float]:
        """One reading: (the GEMM's median seconds, the copy's)."""
        if self._job is None:
            self._build()
            for _ in range(self.warm):
                self.readings.append(self._read())
        self._t0 = self._t0 if self._t0 is not None else time.perf_counter()
        reading = self._read()
        self.readings.append(reading)
        self.at.append(time.perf_counter() - self._t0)
        return reading

    def _read(self) -> tuple[float, float]:
        out = []
        for job, repeat in self._job:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                job()
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times))
        return tuple(out)

    def median(self) -> tuple[float, float]:
        return tuple(statistics.median(r[i] for r in self.readings) for i in range(len(JOBS)))

    def off_by(self, reading: tuple[float, float]) -> float:
        """How far a reading is from the run medians, as a fraction: its worse part's."""
        return max(abs(r / m - 1) for r, m in zip(reading, self.median()))

    def measure(self, fn: Callable[[], Any], label: str = "") -> Row:
        """fn() between two readings, again while either is outside the band (at most `tries`
        times); the kept value is the one whose readings sat closest to the medians."""
        self.rows += 1
        best = None
        for attempt in range(1, self.tries + 1):
            before = self.read()
            value = fn()
            after = self.read()
            worst = max(self.off_by(before), self.off_by(after))
            if best is None or worst < best[0]:
                best = (worst, value, (before, after))
            if worst <= self.band:
                break
        stable = best[0] <= self.band
        if attempt > 1:
            self.remeasured += 1
        if not stable:
            self.unstable.append(label or f"row {self.rows}")
        return Row(best[1], stable, attempt, best[2], label)

    def summary(self) -> dict:
        """The swing over the run and what it cost, for every output that used the guard."""
        out = {}
        for i, job in enumerate(JOBS):
            r = [x[i] for x in self.readings] or [float("nan")]
            out[job] = {"min_ms": min(r) * 1e3, "median_ms": statistics.median(r) * 1e3, "max_ms": max(r) * 1e3,
                        "swing": max(r) / min(r) - 1}
        return {**out, "band": self.band, "readings": len(self.readings), "rows": self.rows,
                "rows_remeasured": self.remeasured, "rows_unstable": len(self.unstable), "unstable": list(self.unstable)}

    def line(self) -> str:
        return swing_words(self.summary())

    def timeline(self) -> list[tuple[float, float, float]]:
        """(seconds since the first row's readings began, GEMM ms, copy ms) of each reading taken
        around a row (the warm readings are left out)."""
        rows = self.readings[len(self.readings) - len(self.at):]
        return [(round(t, 1), round(g * 1e3, 3), round(c * 1e3, 3)) for t, (g, c) in zip(self.at, rows)]


def swing_words(s: dict) -> str:
    """A Yardstick summary in words."""
    parts = "; ".join(f"{job} {s[job]['min_ms']:.2f} / {s[job]['median_ms']:.2f} / {s[job]['max_ms']:.2f} ms "
                      f"({s[job]['swing']:.0%})" for job in JOBS)
    return (f"machine swing over the run (yardstick min / median / max): {parts}; {s['rows']} rows, "
            f"{s['rows_remeasured']} re-measured, {s['rows_unstable']} unstable outside +-{s['band']:.0%}"
            + (f" ({', '.join(s['unstable'])})" if s["unstable"] else ""))


def decision_noise(ons: list[float], offs: list[float], readings: list[tuple[float, ...]]) -> float:
    """The noise band of a measured comparison, as a fraction: the largest of the repeats' own
    spread (each side's (max - min) / min) and each yardstick part's spread over the readings
    taken around those measurements. A difference smaller than it has no verdict."""
    def rel(xs):
        xs = [x for x in xs if x > 0]
        return max(xs) / min(xs) - 1 if len(xs) > 1 else 0.0

    parts = [rel([r[i] for r in readings]) for i in range(len(readings[0]))] if readings else []
    return max([rel(ons), rel(offs), *parts])


def verdict(on: float, off: float, noise: float) -> str:
    """'apply' (with is faster), 'decline', or 'either' where the difference is inside the noise."""
    if abs(on - off) / min(on, off) <= noise:
        return "either"
    return "apply" if on < off else "decline"
