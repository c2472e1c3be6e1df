"""The recommendation, in the offload article's order: trainable parameters first, then more
GPUs, then the offload precision, then tokens per step (accumulation) to reach the hiding
batch, the NVMe tier last; each step says the numbers that decided it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from . import arithmetic as ar
from . import setups
from .setups import Inputs, Row

OVERHEAD_TARGET = 0.05    # a step within 5% of all-GPU AdamW's counts as hidden
PRECISION_TIE = 0.02      # more moment bits win when within 2% of the fastest precision


@dataclass(frozen=True)
class Advice:
    summary: str                      # the recommendation, one line
    reasons: tuple                    # one line per step of the article's order
    setup: Optional[str] = None       # the row recommended, by name
    accumulation: Optional[int] = None
    numbers: Mapping = field(default_factory=dict)


def count(n: float) -> str:
    """7e9 -> "7.00B", 4.94e8 -> "494M": a parameter count a person reads at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 100 * scale else f"{n / scale:,.0f}{suffix}"
    return f"{n:,.0f}"


def choose_precision(rows: Mapping[str, Row]) -> Optional[str]:
    """The fastest precision whose row fits, preferring more moment bits within PRECISION_TIE."""
    fitting = [p for p in ar.PRECISIONS if p in rows and rows[p].fits]
    if not fitting:
        return None
    best = min(rows[p].step_s for p in fitting)
    return next(p for p in fitting if rows[p].step_s <= best * (1 + PRECISION_TIE))


def max_trainable_all_gpu(inp: Inputs) -> float:
    """Trainable parameters at which all-GPU AdamW still fits: 2 B of weight per parameter,
    2 + 12 B per trainable one, over the GPU's usable memory (FSDP2: times the shards)."""
    shards = inp.work.gpus if inp.work.parallel == "fsdp2" else 1
    room = (inp.gpu_usable - inp.work.activations_gb * ar.GB) * shards - inp.model.total * ar.BF16_BYTES
    return max(0.0, room / (ar.BF16_BYTES + ar.ALL_GPU_STATE_BYTES))


def gpus_to_fit(inp: Inputs, bytes_per_trainable: float) -> Optional[int]:
    """GPUs over which FSDP2 fits the bf16 weights and ``bytes_per_trainable`` per trainable
    parameter (14 for all-GPU AdamW, 2 for the gradients alone); None when activations alone
    fill a GPU."""
    room = inp.gpu_usable - inp.work.activations_gb * ar.GB
    if room <= 0:
        return None
    m = inp.model
    return max(1, math.ceil((m.total * ar.BF16_BYTES + m.trainable * bytes_per_trainable) / room))


def advise(inp: Inputs, base: Row, singles: Mapping[str, Row], sharded: Mapping[str, Row],
           nvme_row: Row, chosen: Optional[str]) -> Advice:
    work = inp.work
    numbers = dict(all_gpu_gb=base.gpu_total_gb, gpu_usable_gb=inp.gpu_usable / ar.GB,
                   host_usable_gb=inp.host_usable / ar.GB)
    reasons = [_trainable_reason(inp, base, numbers)]
    if base.fits:
        fastest = choose_precision(singles)
        best = singles[fastest] if fastest else None
        freed = f"; {best.name} would free {base.gpu_total_gb - best.gpu_total_gb:,.1f} GB " \
                f"for activations at {best.vs_all_gpu:.2f}x the step time" if best else ""
        return Advice(f"all-GPU AdamW: it fits ({base.gpu_total_gb:,.1f} of "
                      f"{inp.gpu_usable / ar.GB:,.1f} GB usable); offload would only trade step "
                      f"time for memory you do not need{freed}", tuple(reasons), base.name,
                      numbers=numbers)
    need = gpus_to_fit(inp, ar.BF16_BYTES + ar.ALL_GPU_STATE_BYTES)
    numbers["gpus_for_all_gpu"] = need
    if work.parallel == "ddp" and need is not None and need <= work.gpus:
        each = (base.gpu_total_gb - work.activations_gb) / work.gpus + work.activations_gb
        reasons.append(f"2. GPUs: FSDP2 shards all-GPU AdamW over {need} GPUs, and you have "
                       f"{work.gpus}: nothing needs to cross PCIe")
        return Advice(f"all-GPU AdamW with FSDP2 over your {work.gpus} GPUs: sharded, it fits "
                      f"({each:,.1f} GB each)", tuple(reasons), numbers=numbers)
    reasons.append(_gpus_reason(inp, need))
    pool = sharded or singles
    if chosen is None:
        return _no_precision(inp, base, pool, nvme_row, reasons, numbers)
    row = pool[chosen]
    reasons.append(_precision_reason(inp, pool, chosen))
    accumulation, row = _tokens(inp, base, row, reasons)
    reasons.append(f"5. NVMe: not needed: the state fits in RAM ({row.host_ram_gb:,.1f} of "
                   f"{inp.host_usable / ar.GB:,.1f} GB usable)")
    numbers.update(precision=chosen, accumulation=accumulation, step_s=row.step_s,
                   vs_all_gpu=row.vs_all_gpu, hiding_tokens=row.hiding_tokens)
    passes = f", {accumulation} passes per step" if accumulation and accumulation != work.accumulation else ""
    return Advice(f"{row.name}{passes}: predicted {row.step_s:.3g} s per step, "
                  f"{row.vs_all_gpu:.2f}x all-GPU AdamW's {row.step_s / row.vs_all_gpu:.3g} s "
                  f"(which needs {base.gpu_total_gb:,.1f} GB of {inp.gpu_usable / ar.GB:,.1f})",
                  tuple(reasons), row.name, accumulation, numbers)


def _trainable_reason(inp: Inputs, base: Row, numbers: dict) -> str:
    m = inp.model
    limit = max_trainable_all_gpu(inp)
    numbers["max_trainable_all_gpu"] = limit
    head = f"1. trainable: {count(m.trainable)} of {count(m.total)} ({m.trainable_source}); all-GPU " \
           f"AdamW needs {base.gpu_total_gb:,.1f} of {inp.gpu_usable / ar.GB:,.1f} GB usable"
    if base.fits:
        return head + ": it fits"
    if limit < 1:
        return head + "; the bf16 weights alone do not leave room for any trainable parameter"
    return head + f"; it would fit with at most {count(limit)} trainable ({limit / m.total:.1%}): " \
                  f"if LoRA or a fraction does the job, train fewer parameters first"


def _gpus_reason(inp: Inputs, need: Optional[int]) -> str:
    work = inp.work
    if need is None:
        return "2. GPUs: the activations alone fill a GPU; more GPUs or recomputation first"
    text = (f"2. GPUs: all-GPU AdamW fits with FSDP2 over {need} GPUs: if you can add GPUs, do "
            f"that instead (nothing crosses PCIe)")
    if work.parallel == "ddp" and work.gpus > 1:
        text += f"; on your {work.gpus} shard the host state over the ranks (shard_state=True)"
    return text


def _precision_reason(inp: Inputs, pool: Mapping[str, Row], chosen: str) -> str:
    times = ", ".join(f"{p} {pool[p].step_s:.3g} s{'' if pool[p].fits else ' (does not fit)'}"
                      for p in ar.PRECISIONS)
    row = pool[chosen]
    return (f"3. precision: {chosen} moments, the fastest that fits (more bits within "
            f"{PRECISION_TIE:.0%}): host {row.host_ram_gb:,.1f} of {inp.host_usable / ar.GB:,.1f} GB, "
            f"update {row.host_update_s:.3g} s; step {times}")


def _tokens(inp: Inputs, base: Row, row: Row, reasons: list) -> tuple[Optional[int], Row]:
    """Step 4: is the host work hidden? If not, the passes per step that bring the step
    within OVERHEAD_TARGET of all-GPU AdamW, and the row recomputed at that many passes."""
    work = inp.work
    if row.vs_all_gpu <= 1 + OVERHEAD_TARGET:
        reasons.append(f"4. tokens: {work.tokens_per_pass:,.0f} per backward already hide the host "
                       f"work: {row.vs_all_gpu:.2f}x all-GPU")
        return None, row
    gpu_adam = base.step_s - inp.compute_s
    passes = ar.accumulation_for(row.exposed_s, inp.compute_s / work.accumulation, gpu_adam,
                                 target=OVERHEAD_TARGET, at_least=work.accumulation + 1)
    hide = ("" if row.hiding_tokens is None else
            f"{row.hiding_tokens:,.0f} tokens per backward would hide it (a larger batch, if "
            f"activations allow); else ")
    what = (f"4. tokens: {work.tokens_per_pass:,.0f} per backward leave {row.exposed_s:.3g} s "
            f"exposed ({row.vs_all_gpu:.2f}x); {hide}")
    if passes is None:
        reasons.append(what + "no accumulation within reach brings it to "
                              f"{1 + OVERHEAD_TARGET:.2f}x")
        return None, row
    longer = replace(inp, work=replace(work, tokens_per_step=int(work.tokens_per_pass * passes),
                                       accumulation=passes))
    again = _same_setup(longer, row)
    reasons.append(what + f"accumulate {passes} passes of {work.tokens_per_pass:,.0f} tokens: the "
                          f"exposed part is paid once per step, {again.vs_all_gpu:.2f}x")
    return passes, again


def _same_setup(inp: Inputs, row: Row) -> Row:
    base = setups.all_gpu(inp)
    if row.kind == "nvme":
        return setups.nvme(inp, row.precision, base)
    return setups.offload(inp, row.precision, base, sharded=row.kind == "sharded")


def _no_precision(inp: Inputs, base: Row, pool: Mapping[str, Row], nvme_row: Row,
                  reasons: list, numbers: dict) -> Advice:
    fp8 = pool["fp8"]
    if not fp8.gpu_fits:
        need = gpus_to_fit(inp, ar.BF16_BYTES)
        numbers["gpus_for_offload"] = need
        where = f"shard them with FSDP2 over at least {need} GPUs" if need else "recompute activations"
        reasons.append(f"3. precision: none helps: the bf16 weights and gradients need "
                       f"{fp8.gpu_total_gb:,.1f} GB of {inp.gpu_usable / ar.GB:,.1f} on the GPU")
        return Advice(f"nothing fits this GPU: {where}, or train fewer parameters",
                      tuple(reasons), numbers=numbers)
    reasons.append(f"3. precision: even fp8 moments need {fp8.host_ram_gb:,.1f} GB of host RAM, "
                   f"{inp.host_usable / ar.GB:,.1f} usable")
    if nvme_row.note.startswith("refused") or not nvme_row.fits:
        reasons.append("5. NVMe: " + (nvme_row.note or f"its pinned buffers and page ring alone need "
                                                      f"{nvme_row.host_ram_gb:,.1f} GB of host RAM"))
        return Advice("nothing fits this host: train fewer parameters or add hosts",
                      tuple(reasons), numbers=numbers)
    accumulation, row = _tokens(inp, base, nvme_row, reasons)
    reasons.append(f"5. NVMe: {row.nvme_gb:,.1f} GB in files, {row.nvme_s:.3g} s of drive "
                   f"traffic per step, {row.drive_writes_per_day:,.1f} drive writes per day: a "
                   f"{inp.nvme.dwpd:g}-DWPD drive lasts {row.drive_life_months:,.1f} months")
    numbers.update(precision=row.precision, accumulation=accumulation, step_s=row.step_s,
                   vs_all_gpu=row.vs_all_gpu)
    return Advice(f"{row.name}: it fits at all, not fast: {row.vs_all_gpu:.2f}x all-GPU AdamW, "
                  f"a drive every {row.drive_life_months:,.1f} months", tuple(reasons), row.name,
                  accumulation, numbers)
