"""Whether a benchmark's timings can be trusted: CPUs oversubscribed while it ran, or repeats spread wider than their noise.

A benchmark keeps a `LoadMonitor` that it samples between its timed runs, then asks `judge`
about its samples. Either finding makes the timings untrustworthy, and the benchmark must say
so where it prints them (`Trust.line`); the lab puts the same line into its report and page.
Standard library only, so the scripts under benchmarks/ can use it without the lab's extras.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

# NOTE: the interquartile range of one variant's repeats over their median. Repeats on a quiet
# machine agree within a few percent; past 10% the machine's load changed while it ran, and
# ratios between variants timed at different moments (165x, then 14x, then 4x) mean nothing.
SPREAD_LIMIT = 0.10


def allowed_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _own_runnable(tasks: Path = Path("/proc/self/task")) -> int:
    """Threads of this process in state R (running or runnable), the reading thread included."""
    count = 0
    for stat in tasks.glob("*/stat"):
        try:
            state = stat.read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        count += state == "R"
    return count


def read_others(threads: int, *, loadavg: Path = Path("/proc/loadavg"),
                tasks: Path = Path("/proc/self/task")) -> Optional[float]:
    """Threads runnable now besides this process's own; None where the system cannot tell.

    Linux: the running count of /proc/loadavg (an instant) less this process's runnable
    threads. Elsewhere: the 1-minute os.getloadavg() less the benchmark's `threads`, an
    average that lags but still shows a machine busy with other work.
    """
    try:
        running = int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        try:
            return max(0.0, os.getloadavg()[0] - threads)
        except (AttributeError, OSError):
            return None
    return float(max(0, running - _own_runnable(tasks)))


class LoadMonitor:
    """Samples, between a benchmark's timed runs, how many other threads want the CPUs."""

    def __init__(self, threads: int, *, reader: Optional[Callable[[int], Optional[float]]] = None,
                 cpus: Optional[int] = None) -> None:
        self.threads, self.cpus = threads, cpus or allowed_cpus()
        self._read = reader or read_others
        self.samples: list = []

    def sample(self) -> None:
        found = self._read(self.threads)
        if found is not None:
            self.samples.append(found)


@dataclasses.dataclass(frozen=True)
class Trust:
    """The verdict on one benchmark's timings: the reasons not to trust them (none: trusted)."""
    reasons: tuple
    figures: dict

    @property
    def trusted(self) -> bool:
        return not self.reasons

    @property
    def line(self) -> str:
        if self.trusted:
            return f"timings look trustworthy: {self.figures['checked']}"
        return "WARNING: these timings are not to be trusted: " + "; ".join(self.reasons)


def spread(seconds: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two repeats)."""
    if len(seconds) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


def judge(samples: Mapping[str, Sequence[float]], monitor: Optional[LoadMonitor], *,
          spread_limit: float = SPREAD_LIMIT) -> Trust:
    """Untrusted when the CPUs were oversubscribed (the median reading: other runnable threads
    plus the benchmark's own exceed the CPUs it may use) or a variant's repeats spread past
    `spread_limit`."""
    reasons, figures = [], dict(spread_limit=spread_limit)
    spreads = {name: spread(s) for name, s in samples.items()}
    figures["spread"] = spreads
    wide = {n: s for n, s in spreads.items() if s > spread_limit}
    if wide:
        worst = max(wide, key=wide.get)
        reasons.append(f"the repeats of {len(wide)} of {len(spreads)} variants spread wider than "
                       f"{spread_limit:.0%} of their median (worst: {worst}, {wide[worst]:.0%})")
    checked = f"repeats within {spread_limit:.0%} of their median"
    if monitor is not None and monitor.samples:
        others = statistics.median(monitor.samples)
        figures.update(other_runnable=others, threads=monitor.threads, cpus=monitor.cpus,
                       load_samples=len(monitor.samples))
        if others + monitor.threads > monitor.cpus:
            reasons.append(f"{others:g} other runnable threads (median of {len(monitor.samples)} "
                           f"readings) competed with its {monitor.threads} on {monitor.cpus} CPUs")
        checked += f", {others:g} other runnable threads beside its {monitor.threads} on {monitor.cpus} CPUs"
    else:
        checked += " (the machine's load could not be read)"
    figures.update(trusted=not reasons, reasons=reasons, checked=checked)
    return Trust(tuple(reasons), figures)


# --------------------------------------------------------------------------- interleaved timing


def time_samples(variants: dict, repeats: int, monitor: Optional[LoadMonitor] = None) -> dict:
    """Every variant's seconds per repeat, interleaved (A B C ... A B C ...) after a warm-up run
    of each; the machine's load is read before each timed run (outside it)."""
    for run in variants.values():  # warm up: page faults, pool start, JIT
        run()
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            if monitor is not None:
                monitor.sample()
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return samples


def medians(samples: dict) -> dict:
    return {name: statistics.median(s) for name, s in samples.items()}


def time_interleaved(variants: dict, repeats: int, threads: int) -> tuple:
    """The median seconds of each variant, and whether the timings can be trusted."""
    monitor = LoadMonitor(threads)
    samples = time_samples(variants, repeats, monitor)
    return medians(samples), judge(samples, monitor)
