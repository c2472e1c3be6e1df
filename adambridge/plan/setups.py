"""The setups a plan compares, a row each: all-GPU AdamW, AdamBridge at each moment
precision, with its state sharded over the ranks, and with the NVMe tier.

Every number of a row comes from one named formula in arithmetic.py, fed by the plan's
inputs; rows never measure anything.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from . import arithmetic as ar
from .hardware import GpuSpec, HostSpec
from .model import ModelFacts

GPU_RESERVE = 0.10     # of GPU memory left to the CUDA context and the allocator's slack
NVME_QUEUE_DEPTH, NVME_PAGE = 8, 1 << 18   # OffloadConfig's defaults: the page ring's size


@dataclass(frozen=True)
class Work:
    """One GPU's work per optimizer step: tokens (all passes), passes, GPUs, parallelism."""
    tokens_per_step: int
    accumulation: int = 1
    gpus: int = 1
    parallel: str = "ddp"          # "ddp" (every rank the whole model) or "fsdp2" (shards)
    activations_gb: float = 0.0    # per GPU; not estimated, 0 unless given

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens_per_step / self.accumulation


@dataclass(frozen=True)
class Nvme:
    gbps: float = 7.0        # one Gen4 drive, sequential
    drive_tb: float = 3.84   # capacity the state's writes spread over
    dwpd: float = 1.0        # rated drive writes per day over ar.WARRANTY_YEARS


@dataclass(frozen=True)
class Inputs:
    model: ModelFacts
    work: Work
    gpu: GpuSpec
    host: HostSpec
    nvme: Nvme
    host_reserve: float = 0.10   # of host RAM left to the OS, the data loader and the rest

    @property
    def gpu_usable(self) -> float:
        return ar.usable_bytes(self.gpu.memory_gb, GPU_RESERVE)

    @property
    def host_usable(self) -> float:
        return ar.usable_bytes(self.host.ram_gb, self.host_reserve)

    @property
    def host_bw(self) -> float:
        return ar.effective_host_bw(self.host.bw_gbps, self.work.gpus, self.host.numa_nodes)

    @property
    def compute_s(self) -> float:
        m, t = self.model, self.work.tokens_per_step
        return ar.compute_seconds(ar.forward_flops(m.total, t) + ar.backward_flops(m.total, m.trainable, t),
                                  self.gpu.tflops)

    @property
    def overlap_s(self) -> float:
        """The backward pass the host work can hide behind: the pass that closes the step."""
        m = self.model
        return ar.compute_seconds(ar.backward_flops(m.total, m.trainable, self.work.tokens_per_pass),
                                  self.gpu.tflops)


@dataclass(frozen=True)
class Row:
    """One setup: bytes in GB, times in seconds; None where a column does not apply."""
    name: str
    kind: str                 # "all-gpu" | "offload" | "sharded" | "nvme"
    precision: Optional[str]
    gpu_params_gb: float
    gpu_grads_gb: float
    gpu_state_gb: float
    gpu_total_gb: float       # the three plus --activations-gb
    gpu_fits: bool
    host_ram_gb: float
    host_fits: bool
    link_gb: Optional[float]
    link_s: Optional[float]
    host_update_s: Optional[float]
    backward_s: float
    exposed_s: Optional[float]
    step_s: float
    vs_all_gpu: float
    hiding_tokens: Optional[float]
    nvme_gb: Optional[float] = None
    nvme_s: Optional[float] = None
    drive_writes_per_day: Optional[float] = None
    drive_life_months: Optional[float] = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits


def _gpu(inp: Inputs, *, state_on_gpu: bool) -> dict:
    shards = inp.work.gpus if inp.work.parallel == "fsdp2" else 1
    params, grads, state = ar.gpu_bytes(inp.model.total, inp.model.trainable,
                                        state_on_gpu=state_on_gpu, shards=shards)
    total = params + grads + state + inp.work.activations_gb * ar.GB
    return dict(gpu_params_gb=params / ar.GB, gpu_grads_gb=grads / ar.GB, gpu_state_gb=state / ar.GB,
                gpu_total_gb=total / ar.GB, gpu_fits=total <= inp.gpu_usable)


def all_gpu(inp: Inputs) -> Row:
    """AdamW entirely on the GPU (fused): the reference every other row is set against."""
    shards = inp.work.gpus if inp.work.parallel == "fsdp2" else 1
    step = inp.compute_s + ar.gpu_adamw_seconds(inp.model.trainable / shards, inp.gpu.hbm_gbps)
    return Row(name="all-GPU AdamW", kind="all-gpu", precision=None, **_gpu(inp, state_on_gpu=True),
               host_ram_gb=0.0, host_fits=True, link_gb=None, link_s=None, host_update_s=None,
               backward_s=inp.overlap_s, exposed_s=None, step_s=step, vs_all_gpu=1.0,
               hiding_tokens=None)


def _timing(inp: Inputs, elements: float, precision: str, base: Row, *, drive_s: float = 0.0,
            drive_tail_s: float = 0.0) -> dict:
    """Link, update, exposed and step seconds of a rank that moves and updates ``elements``,
    all G ranks of the host sharing its bandwidth."""
    gpus = inp.work.gpus
    link = ar.link_seconds(ar.link_bytes(elements), inp.gpu.link_gbps)
    # ns per element measured with every CPU of this host: G ranks update G x the elements
    # on them together, and the tail (one rank's last chunk) has 1/G of them.
    update_ns = inp.host.update_ns_of(precision)
    update = ar.host_update_seconds(gpus * elements, precision, inp.host_bw, update_ns)
    m = inp.model
    if inp.work.parallel == "fsdp2":
        # NOTE: FSDP2 shards on the GPU take the synchronous step(): AdamBridge's async path
        # on FSDP2 needs CPUOffloadPolicy, which this plan does not model, so nothing hides.
        exposed, hides = link + update, None
    else:
        work = ar.host_work_seconds(link, update, drive_s)
        tail = ar.tail_seconds(elements, inp.gpu.link_gbps, precision, inp.host_bw / gpus,
                               None if update_ns is None else update_ns * gpus) + drive_tail_s
        exposed = ar.exposed_seconds(work, inp.overlap_s, tail)
        hides = ar.hiding_tokens(work, m.total, m.trainable, inp.gpu.tflops)
    step = inp.compute_s + exposed
    return dict(link_gb=ar.link_bytes(elements) / ar.GB, link_s=link, host_update_s=update,
                backward_s=inp.overlap_s, exposed_s=exposed, step_s=step,
                vs_all_gpu=step / base.step_s, hiding_tokens=hides)


def offload(inp: Inputs, precision: str, base: Row, *, sharded: bool = False) -> Row:
    """AdamBridge with ``precision`` moments: under DDP every rank holds the whole state
    unless ``sharded`` (shard_state=True: 1/G each); under FSDP2 each rank its shard's."""
    gpus, trainable = inp.work.gpus, inp.model.trainable
    own = trainable / gpus if sharded or inp.work.parallel == "fsdp2" else trainable
    host = gpus * ar.host_ram_bytes(own, precision)
    if sharded:
        name, kind = f"AdamBridge {precision}, state sharded x{gpus}", "sharded"
    else:
        name, kind = f"AdamBridge {precision} moments", "offload"
    note = "synchronous step() on FSDP2 shards" if inp.work.parallel == "fsdp2" else ""
    return Row(name=name, kind=kind, precision=precision, **_gpu(inp, state_on_gpu=False),
               host_ram_gb=host / ar.GB, host_fits=host <= inp.host_usable,
               **_timing(inp, own, precision, base), note=note)


def nvme(inp: Inputs, precision: str, base: Row) -> Row:
    """AdamBridge with the NVMe tier: the state that does not fit in RAM goes to files (all
    of it when it does fit, as offload_dir without host_budget does); under DDP every rank
    keeps its whole state, in a directory of its own (shard_state does not take the tier)."""
    gpus, trainable = inp.work.gpus, inp.model.trainable
    if inp.work.parallel == "fsdp2":
        return replace(offload(inp, precision, base), name=f"AdamBridge {precision}, NVMe tier",
                       kind="nvme", note="refused: the NVMe tier does not take FSDP2 parameters")
    state = gpus * ar.state_bytes(trainable, precision)
    fixed = gpus * (trainable * ar.PINNED_BYTES
                    + (NVME_QUEUE_DEPTH + 1) * NVME_PAGE * ar.STATE_BYTES[precision])
    in_ram = min(state, max(0.0, inp.host_usable - fixed))
    files = state - in_ram if in_ram < state else state
    in_ram = state - files
    drive = ar.nvme_seconds(files, inp.nvme.gbps)
    last = min(trainable, ar.CHUNK_ELEMENTS) * ar.STATE_BYTES[precision] * (files / state)
    timing = _timing(inp, trainable, precision, base, drive_s=drive,
                     drive_tail_s=ar.nvme_seconds(last, inp.nvme.gbps))
    writes = ar.drive_writes_per_day(files, timing["step_s"], inp.nvme.drive_tb)
    where = "all state in files" if in_ram == 0 else f"{files / ar.GB:,.0f} GB in files"
    return Row(name=f"AdamBridge {precision}, NVMe: {where}", kind="nvme", precision=precision,
               **_gpu(inp, state_on_gpu=False), host_ram_gb=(in_ram + fixed) / ar.GB,
               host_fits=in_ram + fixed <= inp.host_usable, **timing, nvme_gb=files / ar.GB,
               nvme_s=drive, drive_writes_per_day=writes,
               drive_life_months=ar.drive_life_months(writes, inp.nvme.dwpd))
