"""Measured, not only computed: the host update the plan predicts, run through the native
kernel here (``plan --check``), and the step times and GPU memory of bench_step.py set
against the plan's (``plan --bench-json``, which scripts/gpu_check.sh runs on a GPU).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import arithmetic as ar
from .errors import invalid

CHECK_ELEMENTS = 16_000_000   # 256 MB of fp32 master and moments: past the last-level cache
AGREEMENT = 0.25           # predicted and measured within 25% count as agreeing
GIB = 2 ** 30


@dataclass(frozen=True)
class CheckRow:
    precision: str
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


@dataclass(frozen=True)
class Check:
    """Predicted vs measured host update of ``numel`` elements, with the load it ran under."""
    numel: int
    threads: int
    bw_gbps: float
    bw_source: str
    load: tuple
    rows: tuple

    def lines(self) -> list:
        from .advise import count
        head = (f"check: host update of {count(self.numel)} elements, native kernel, "
                f"{self.threads} threads, load average {self.load[0]:.2f} (1 min) on "
                f"{os.cpu_count()} CPUs; predicted from {self.bw_gbps:.1f} GB/s and the "
                f"update's arithmetic ceiling, {self.bw_source}")
        out = [head]
        for r in self.rows:
            verdict = "within" if abs(r.ratio - 1) <= AGREEMENT else "outside"
            out.append(f"  {r.precision}: predicted {r.predicted_s * 1e3:.1f} ms, measured "
                       f"{r.measured_s * 1e3:.1f} ms ({r.ratio:.2f}x measured/predicted: "
                       f"{verdict} {AGREEMENT:.0%})")
        return out

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rows"] = [dict(asdict(r), ratio=r.ratio) for r in self.rows]
        return data


def run_check(bw_gbps: float, bw_source: str, precisions: Sequence[str] = ar.PRECISIONS,
              numel: int = CHECK_ELEMENTS, repeats: int = 5) -> Check:
    """Time the native host update of ``numel`` elements for each precision and set it
    against arithmetic.host_update_seconds.

    NOTE: this host's bandwidth and arithmetic speed move by up to 2x for seconds at a time
    (with where its CPUs are placed), so each round re-measures both beside the updates it
    times: one probe pass, then per precision one ceiling call and the update. The
    prediction of a round uses that round's figures; the medians of the rounds are compared.
    ``bw_gbps`` and ``bw_source`` (the plan's own, measured earlier) are reported beside them.
    """
    from .._native import loader
    from ..update.functional import adamw_update
    from . import buffers, probes
    reason = probes.native_unavailable()
    if reason is not None:
        raise RuntimeError(f"plan --check needs the native kernel, which cannot be had here: {reason}")
    items = {p: buffers.update_items(numel, p) for p in precisions}
    ceilings = {p: probes.ceiling_batch(p) for p in precisions}
    probe = probes.bandwidth_buffers(numel)
    predicted: dict = {p: [] for p in precisions}
    measured: dict = {p: [] for p in precisions}
    bandwidths = []
    for step in range(1, repeats + 2):
        gbps = probes.bandwidth_gbps(probe)
        for p in precisions:
            ceiling = probes.ceiling_ns(ceilings[p], step)
            batch = buffers.next_step(items[p], step)
            start = time.perf_counter()
            adamw_update(batch, backend="native")
            elapsed = time.perf_counter() - start
            if step > 1:  # the first round pays page faults and the pool's start
                measured[p].append(elapsed)
                predicted[p].append(ar.host_update_seconds(numel, p, gbps, ceiling))
        if step > 1:
            bandwidths.append(gbps)
    rows = tuple(CheckRow(p, statistics.median(predicted[p]), statistics.median(measured[p]))
                 for p in precisions)
    return Check(numel, loader.num_threads(), statistics.median(bandwidths),
                 f"re-measured beside each update (the plan's: {bw_gbps:.1f} GB/s, {bw_source})",
                 tuple(os.getloadavg()), rows)


# ---------------------------------------------------------------------------- GPU benchmark

def read_bench(path: str) -> dict:
    """A bench_step.py --json file with what the comparison needs."""
    try:
        bench = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise invalid("bench_json", path, f"cannot read it as JSON: {exc}") from None
    missing = [k for k in ("params", "tokens_per_step", "rows") if k not in bench]
    if missing:
        raise invalid("bench_json", path, f"no {', '.join(missing)}: not a bench_step.py --json file")
    return bench


def _bench_rows(bench: dict) -> list:
    """(bench variant, plan row name) pairs: the all-GPU baseline and the async variants."""
    pairs = []
    for row in bench["rows"]:
        name = row["variant"]
        if name == "torch AdamW":
            pairs.append((row, "all-GPU AdamW"))
        elif name.startswith("adambridge async ") and " clip=" not in name:
            pairs.append((row, f"AdamBridge {name.split()[-1]} moments"))
    return pairs


def compare_bench(bench: dict, plan_for: Callable[[int, int], object]) -> list:
    """Lines setting bench_step.py's measured step times and GPU peaks beside the plan's
    predictions for the same parameters and tokens (``plan_for(params, tokens)``)."""
    planned = plan_for(int(bench["params"]), int(bench["tokens_per_step"]))
    out = [f"bench_step.py beside the plan: {bench['params']:,} parameters, "
           f"{bench['tokens_per_step']:,} tokens per step ({bench.get('setup', '')})",
           "variant | step ms planned | step ms measured | measured/planned | GPU GB planned "
           "(p+g+s, no activations) | GPU peak GB measured"]
    for measured, name in _bench_rows(bench):
        row = planned.row(name)
        peak = measured.get("peak_gib")
        peak_gb = "-" if peak is None else f"{peak * GIB / ar.GB:.2f}"
        planned_gb = row.gpu_params_gb + row.gpu_grads_gb + row.gpu_state_gb
        out.append(f"{measured['variant']} | {row.step_s * 1e3:.1f} | {measured['median_ms']:.1f} | "
                   f"{measured['median_ms'] / (row.step_s * 1e3):.2f}x | {planned_gb:.2f} | {peak_gb}")
    sweep = bench.get("sweep")
    if sweep:
        name = f"AdamBridge {sweep['precision']} moments"
        out.append(f"sweep ({sweep['precision']} moments): tokens | async/AdamW planned | measured")
        for point in sweep["points"]:
            again = plan_for(int(bench["params"]), int(point["tokens"])).row(name)
            out.append(f"{point['tokens']} | {again.vs_all_gpu:.3f}x | {point['ratio']:.3f}x")
    return out
