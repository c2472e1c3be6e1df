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
    room = (inp.gpu_usable - inp.activation_bytes) * shards - inp.model.total * ar.BF16_BYTES
    return max(0.0, room / (ar.BF16_BYTES + ar.ALL_GPU_STATE_BYTES))


def gpus_to_fit(inp: Inputs, bytes_per_trainable: float) -> Optional[int]:
    """GPUs over which FSDP2 fits the bf16 weights and ``bytes_per_trainable`` per trainable
    parameter (14 for all-GPU AdamW, 2 for the gradients alone); None when activations alone
    fill a GPU."""
    room = inp.gpu_usable - inp.activation_bytes
    if room <= 0:
        return None
    m = inp.model
    return max(1, math.ceil((m.total * ar.BF16_BYTES + m.trainable * bytes_per_trainable) / room))


def _numbered(reasons: list) -> tuple:
    """The reasons numbered 1, 2, 3, ... in the order given (no step is ever skipped)."""
    return tuple(f"{i}. {reason}" for i, reason in enumerate(reasons, 1))


def advise(inp: Inputs, base: Row, singles: Mapping[str, Row], sharded: Mapping[str, Row],
           nvme_row: Optional[Row], chosen: Optional[str]) -> Advice:
    work, usable = inp.work, inp.gpu_usable / ar.GB
    numbers = dict(all_gpu_gb=base.gpu_total_gb, gpu_usable_gb=usable,
                   host_usable_gb=inp.host_usable / ar.GB)
    reasons = [_trainable_reason(inp, base, numbers)]
    if base.fits:
        fastest = choose_precision(singles)
        best = singles[fastest] if fastest else None
        freed = f"; {best.name} would free {base.gpu_total_gb - best.gpu_total_gb:,.1f} GB " \
                f"for activations at {best.vs_all_gpu:.2f}x the step time" if best else ""
        return Advice(f"all-GPU AdamW: it fits ({base.gpu_total_gb:,.1f} of {usable:,.1f} GB "
                      f"usable); offload would only trade step time for memory you do not "
                      f"need{freed}", _numbered(reasons), base.name, numbers=numbers)
    need = gpus_to_fit(inp, ar.BF16_BYTES + ar.ALL_GPU_STATE_BYTES)
    numbers["gpus_for_all_gpu"] = need
    if work.parallel == "ddp" and need is not None and need <= work.gpus:
        act = inp.activation_bytes / ar.GB
        each = (base.gpu_total_gb - act) / work.gpus + act
        reasons.append(f"GPUs: FSDP2 shards all-GPU AdamW over {need} GPUs, and you have "
                       f"{work.gpus}: nothing needs to cross PCIe")
        return Advice(f"all-GPU AdamW with FSDP2 over your {work.gpus} GPUs: sharded, it fits "
                      f"({each:,.1f} GB each)", _numbered(reasons), numbers=numbers)
    pool = sharded or singles
    reasons.append(_gpus_reason(inp, need, pool))
    if chosen is None:
        return _no_precision(inp, base, pool, nvme_row, reasons, numbers)
    row = pool[chosen]
    reasons.append(_precision_reason(inp, pool, chosen))
    accumulation, row = _tokens(inp, base, row, reasons)
    reasons.append(f"NVMe: not needed: the state fits in RAM ({row.host_ram_gb:,.1f} of "
                   f"{inp.host_usable / ar.GB:,.1f} GB usable)")
    loses = _design_reason(inp, row, accumulation, reasons)
    numbers.update(precision=chosen, accumulation=accumulation, step_s=row.step_s,
                   vs_all_gpu=row.vs_all_gpu, hiding_tokens=row.hiding_tokens)
    passes = f", {accumulation} passes per step" if accumulation and accumulation != work.accumulation else ""
    return Advice(f"{row.name}{passes}: predicted {row.step_s:.3g} s per step, "
                  f"{row.vs_all_gpu:.2f}x all-GPU AdamW's {row.step_s / row.vs_all_gpu:.3g} s "
                  f"(which needs {base.gpu_total_gb:,.1f} GB of {usable:,.1f}){loses}",
                  _numbered(reasons), row.name, accumulation, numbers)


def _checkpointed(inp: Inputs, pool: Mapping[str, Row], reasons: list) -> Optional[str]:
    """Where estimated activations are what does not fit: the setup activation checkpointing
    would make fit (a reason, and the summary), else None."""
    work = inp.work
    if work.activations_gb is not None or work.checkpointing or inp.model.shape is None:
        return None
    again = replace(inp, work=replace(work, checkpointing=True))
    base = setups.all_gpu(again)
    sharded = any(r.kind == "sharded" for r in pool.values())
    rows = {p: setups.offload(again, p, base, sharded=sharded) for p in ar.PRECISIONS}
    chosen = choose_precision(rows)
    if chosen is None:
        return None
    row = rows[chosen]
    reasons.append(f"activations: with activation checkpointing (--activation-checkpointing) "
                   f"they fall from {inp.activation_bytes / ar.GB:,.1f} to "
                   f"{again.activation_bytes / ar.GB:,.1f} GB, and {row.name} needs "
                   f"{row.gpu_total_gb:,.1f} of {inp.gpu_usable / ar.GB:,.1f} GB: predicted "
                   f"{row.step_s:.3g} s per step (backward runs the forward again)")
    return (f"{row.name} with activation checkpointing (--activation-checkpointing): predicted "
            f"{row.step_s:.3g} s per step, {row.vs_all_gpu:.2f}x all-GPU AdamW's "
            f"{base.step_s:.3g} s (which needs {base.gpu_total_gb:,.1f} GB of "
            f"{inp.gpu_usable / ar.GB:,.1f})")


def _trainable_reason(inp: Inputs, base: Row, numbers: dict) -> str:
    m = inp.model
    limit = max_trainable_all_gpu(inp)
    numbers["max_trainable_all_gpu"] = limit
    head = f"trainable: {count(m.trainable)} of {count(m.total)} ({m.trainable_source}); all-GPU " \
           f"AdamW needs {base.gpu_total_gb:,.1f} of {inp.gpu_usable / ar.GB:,.1f} GB usable"
    if base.fits:
        return head + ": it fits"
    if limit < 1:
        return head + "; " + _no_room(inp)
    return head + f"; it would fit with at most {count(limit)} trainable ({limit / m.total:.1%}): " \
                  f"if LoRA or a fraction does the job, train fewer parameters first"


def _no_room(inp: Inputs) -> str:
    """What leaves no room for a trainable parameter: the activations, or the weights."""
    usable, weights = inp.gpu_usable, inp.model.total * ar.BF16_BYTES
    acts = inp.activation_bytes
    if acts >= usable:
        return (f"the activations alone ({acts / ar.GB:,.1f} GB at {inp.work.tokens_per_pass:,.0f} "
                f"tokens per backward) fill the {usable / ar.GB:,.1f} GB usable: fewer tokens per "
                "backward or activation checkpointing first")
    if weights < usable:
        return (f"the activations ({acts / ar.GB:,.1f} GB at {inp.work.tokens_per_pass:,.0f} tokens "
                f"per backward) with the bf16 weights ({weights / ar.GB:,.2f} GB) leave no room for "
                "any trainable parameter: fewer tokens per backward or activation checkpointing first")
    return "the bf16 weights alone do not leave room for any trainable parameter"


def _gpus_reason(inp: Inputs, need: Optional[int], pool: Mapping[str, Row]) -> str:
    work = inp.work
    if need is None:
        return ("GPUs: the activations alone fill a GPU; activation checkpointing or fewer "
                "tokens per pass first")
    text = (f"GPUs: all-GPU AdamW fits with FSDP2 over {need} GPUs: if you can add GPUs, do "
            f"that instead (nothing crosses PCIe)")
    # NOTE: sharding the host state helps only a setup whose GPU side fits; suggesting it
    # beside "the weights and gradients do not fit" would contradict the next line.
    if work.parallel == "ddp" and work.gpus > 1 and any(r.gpu_fits for r in pool.values()):
        text += f"; on your {work.gpus} shard the host state over the ranks (shard_state=True)"
    return text


def _precision_reason(inp: Inputs, pool: Mapping[str, Row], chosen: str) -> str:
    times = ", ".join(f"{p} {pool[p].step_s:.3g} s{'' if pool[p].fits else ' (does not fit)'}"
                      for p in ar.PRECISIONS)
    row = pool[chosen]
    return (f"precision: {chosen} moments, the fastest that fits (more bits within "
            f"{PRECISION_TIE:.0%}): host {row.host_ram_gb:,.1f} of {inp.host_usable / ar.GB:,.1f} GB, "
            f"update {row.host_update_s:.3g} s; step {times}")


def _tokens(inp: Inputs, base: Row, row: Row, reasons: list) -> tuple[Optional[int], Row]:
    """Step 4: is the host work hidden? If not, the passes per step that bring the step
    within OVERHEAD_TARGET of all-GPU AdamW, and the row recomputed at that many passes."""
    work = inp.work
    if row.vs_all_gpu <= 1 + OVERHEAD_TARGET:
        reasons.append(f"tokens: {work.tokens_per_pass:,.0f} per backward already hide the host "
                       f"work: {row.vs_all_gpu:.2f}x all-GPU")
        return None, row
    gpu_adam = base.step_s - inp.compute_s
    passes = ar.accumulation_for(row.exposed_s, inp.compute_s / work.accumulation, gpu_adam,
                                 target=OVERHEAD_TARGET, at_least=work.accumulation + 1)
    hide = ("" if row.hiding_tokens is None else
            f"{row.hiding_tokens:,.0f} tokens per backward would hide it (a larger batch, if "
            f"activations allow); else ")
    what = (f"tokens: {work.tokens_per_pass:,.0f} per backward leave {row.exposed_s:.3g} s "
            f"exposed ({row.vs_all_gpu:.2f}x); {hide}")
    if passes is None:
        reasons.append(what + "no accumulation within reach brings it to "
                              f"{1 + OVERHEAD_TARGET:.2f}x")
        return None, row
    longer = replace(inp, work=replace(work, tokens_per_step=int(work.tokens_per_pass * passes),
                                       accumulation=passes))
    again = _same_setup(longer, row)
    if not again.gpu_fits:
        reasons.append(what + f"accumulating {passes} passes would keep every gradient on the GPU "
                              f"until the last ({again.gpu_total_gb:,.1f} of "
                              f"{inp.gpu_usable / ar.GB:,.1f} GB): it does not fit")
        return None, row
    reasons.append(what + f"accumulate {passes} passes of {work.tokens_per_pass:,.0f} tokens: the "
                          f"exposed part is paid once per step, {again.vs_all_gpu:.2f}x")
    return passes, again


def _same_setup(inp: Inputs, row: Row) -> Row:
    base = setups.all_gpu(inp)
    if row.kind == "nvme":
        return setups.nvme(inp, row.precision, base)
    return setups.offload(inp, row.precision, base, sharded=row.kind == "sharded")


def _design_reason(inp: Inputs, ours: Row, accumulation: Optional[int], reasons: list) -> str:
    """The last step: a GPU-side AdamW over the same state streamed over the link, at the
    same tokens and passes, against the host step on this box; returns what the summary
    adds when ours loses."""
    if accumulation:
        work = inp.work
        inp = replace(inp, work=replace(work, tokens_per_step=int(work.tokens_per_pass * accumulation),
                                        accumulation=accumulation))
    streamed = setups.streamed(inp, ours.precision, setups.all_gpu(inp), sharded=ours.kind == "sharded")
    per_gpu = inp.host_bw / inp.work.gpus
    ratio, cross = per_gpu / inp.gpu.link_gbps, ar.streamed_crossover(streamed.precision)
    head = (f"design: host memory gives {per_gpu:,.0f} GB/s per GPU, {ratio:.2f}x the link's "
            f"{inp.gpu.link_gbps:g} GB/s per direction (a GPU-side AdamW streaming its "
            f"{streamed.precision} state over the link wins under about {cross:.2f}x): ")
    versus = f"{ours.step_s:.3g} s per step against {streamed.step_s:.3g} s for {streamed.name}"
    if streamed.step_s >= ours.step_s:
        reasons.append(head + f"the host step wins here, {versus}")
        return ""
    if not streamed.gpu_fits:
        reasons.append(head + f"the streamed step would be faster, {versus}, but it does not fit "
                              f"the GPU ({streamed.gpu_total_gb:,.1f} of "
                              f"{inp.gpu_usable / ar.GB:,.1f} GB)")
        return ""
    reasons.append(head + f"our design loses here: {versus}")
    return f"; on this box a GPU-side AdamW streaming its state is faster ({streamed.step_s:.3g} s)"


def _no_precision(inp: Inputs, base: Row, pool: Mapping[str, Row], nvme_row: Optional[Row],
                  reasons: list, numbers: dict) -> Advice:
    fp8 = pool["fp8"]
    if not fp8.gpu_fits:
        need = gpus_to_fit(inp, ar.BF16_BYTES)
        numbers["gpus_for_offload"] = need
        parts = "+".join(f"{v:,.1f}" for v in (fp8.gpu_params_gb, fp8.gpu_grads_gb, fp8.gpu_activations_gb))
        reasons.append(f"precision: none helps: the weights, gradients and activations need "
                       f"{fp8.gpu_total_gb:,.1f} GB ({parts}) of {inp.gpu_usable / ar.GB:,.1f} on the GPU")
        recomputed = _checkpointed(inp, pool, reasons)
        if recomputed is not None:
            return Advice(recomputed, _numbered(reasons), numbers=numbers)
        where = f"shard them with FSDP2 over at least {need} GPUs" if need else "recompute activations"
        return Advice(f"nothing fits this GPU: {where}, or train fewer parameters",
                      _numbered(reasons), numbers=numbers)
    reasons.append(f"precision: even fp8 moments need {fp8.host_ram_gb:,.1f} GB of host RAM, "
                   f"{inp.host_usable / ar.GB:,.1f} usable")
    if nvme_row is None or not nvme_row.fits:
        reasons.append("NVMe: " + ("refused: the NVMe tier does not take FSDP2 parameters"
                                   if nvme_row is None else
                                   f"its pinned buffers and page ring alone need "
                                   f"{nvme_row.host_ram_gb:,.1f} GB of host RAM"))
        return Advice("nothing fits this host: train fewer parameters or add hosts",
                      _numbered(reasons), numbers=numbers)
    accumulation, row = _tokens(inp, base, nvme_row, reasons)
    reasons.append(f"NVMe: {row.nvme_gb:,.1f} GB in files, {row.nvme_s:.3g} s of drive "
                   f"traffic per step, {row.drive_writes_per_day:,.1f} drive writes per day: a "
                   f"{inp.nvme.dwpd:g}-DWPD drive lasts {row.drive_life_months:,.1f} months")
    numbers.update(precision=row.precision, accumulation=accumulation, step_s=row.step_s,
                   vs_all_gpu=row.vs_all_gpu)
    return Advice(f"{row.name}: it fits at all, not fast: {row.vs_all_gpu:.2f}x all-GPU AdamW, "
                  f"a drive every {row.drive_life_months:,.1f} months", _numbered(reasons), row.name,
                  accumulation, numbers)
