"""The setups a plan compares, a row each: all-GPU AdamW, AdamBridge at each moment
precision (async mode), with its state sharded over the ranks, in sync mode, with the NVMe
tier, and a GPU-side AdamW over state streamed from host RAM (the design that wins where
host memory is slow against the link).

Every number of a row comes from one named formula in arithmetic.py, fed by the plan's
inputs; rows never measure anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import arithmetic as ar
from . import device_memory
from .inputs import GPU_RESERVE, Inputs, Nvme, Work  # noqa: F401 - Work, Nvme: the plan's names

NVME_QUEUE_DEPTH, NVME_PAGE = 8, 1 << 18   # OffloadConfig's defaults: the page ring's size


@dataclass(frozen=True)
class Row:
    """One setup: bytes in GB, times in seconds; None where a column does not apply."""
    name: str
    kind: str                 # "all-gpu" | "offload" | "sharded" | "sync" | "streamed" | "nvme"
    precision: Optional[str]
    gpu_params_gb: float
    gpu_grads_gb: float       # as the mode holds them (device_memory.py)
    gpu_state_gb: float
    gpu_total_gb: float       # the three plus the activations
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
    gpu_activations_gb: float = 0.0
    gpu_in_flight_gb: float = 0.0   # released gradients not yet copied (reserved, not counted)
    gpu_grads_note: str = ""
    checkpoint_extra_gb: Optional[float] = None   # host RAM a save or load adds at its peak

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits


def _gpu(inp: Inputs, mode: str, precision: str = "fp32") -> dict:
    memory = device_memory.for_mode(inp, mode, precision)
    return dict(gpu_params_gb=memory.params / ar.GB, gpu_grads_gb=memory.grads / ar.GB,
                gpu_state_gb=memory.state / ar.GB, gpu_activations_gb=memory.activations / ar.GB,
                gpu_total_gb=memory.total / ar.GB, gpu_fits=memory.total <= inp.gpu_usable,
                gpu_in_flight_gb=memory.in_flight / ar.GB, gpu_grads_note=memory.grads_note)


def _checkpoint(inp: Inputs, precision: str) -> Optional[float]:
    """GB a save or load of the host state adds at its peak: the largest parameter's state
    (None where the count gives no parameter sizes)."""
    grads = inp.model.grads
    if grads is None:
        return None
    largest = grads.largest or min(grads.small, grads.threshold)
    return ar.checkpoint_extra_bytes(largest, precision) / ar.GB


def all_gpu(inp: Inputs) -> Row:
    """AdamW entirely on the GPU (fused): the reference every other row is set against."""
    shards = device_memory.shards(inp)
    step = inp.compute_s + ar.gpu_adamw_seconds(inp.model.trainable / shards, inp.gpu.hbm_gbps)
    return Row(name="all-GPU AdamW", kind="all-gpu", precision=None, **_gpu(inp, "all-gpu"),
               host_ram_gb=0.0, host_fits=True, link_gb=None, link_s=None, host_update_s=None,
               backward_s=inp.overlap_s, exposed_s=None, step_s=step, vs_all_gpu=1.0,
               hiding_tokens=None)


def _timing(inp: Inputs, elements: float, precision: str, base: Row, *, drive_s: float = 0.0,
            drive_tail_s: float = 0.0, overlaps: bool = True) -> dict:
    """Link, update, exposed and step seconds of a rank that moves and updates ``elements``,
    all G ranks of the host sharing its bandwidth; ``overlaps`` False: step() after backward."""
    gpus = inp.work.gpus
    link = ar.link_seconds(ar.link_bytes(elements), inp.gpu.link_gbps)
    # ns per element measured with every CPU of this host: G ranks update G x the elements
    # on them together, and the tail (one rank's last chunk) has 1/G of them.
    update_ns = inp.host.update_ns_of(precision)
    update = ar.host_update_seconds(gpus * elements, precision, inp.host_bw, update_ns)
    if inp.work.parallel == "fsdp2" or not overlaps:
        # NOTE: FSDP2 shards on the GPU take the synchronous step(): AdamBridge's async path
        # on FSDP2 needs CPUOffloadPolicy, which this plan does not model, so nothing hides.
        exposed, hides = link + update + drive_s, None
    else:
        work = ar.host_work_seconds(link, update, drive_s)
        tail = ar.tail_seconds(elements, inp.gpu.link_gbps, precision, inp.host_bw / gpus,
                               None if update_ns is None else update_ns * gpus) + drive_tail_s
        exposed = ar.exposed_seconds(work, inp.overlap_s, tail)
        hides = _hides(inp, work)
    step = inp.compute_s + exposed
    return dict(link_gb=ar.link_bytes(elements) / ar.GB, link_s=link, host_update_s=update,
                backward_s=inp.overlap_s, exposed_s=exposed, step_s=step,
                vs_all_gpu=step / base.step_s, hiding_tokens=hides)


def _hides(inp: Inputs, work_s: float) -> float:
    m = inp.model
    return ar.hiding_tokens(work_s, m.total, m.trainable, inp.gpu.tflops, inp.work.checkpointing)


def _own(inp: Inputs, sharded: bool) -> float:
    """Trainable elements one rank moves and updates: all of them under DDP, 1/G sharded."""
    gpus, trainable = inp.work.gpus, inp.model.trainable
    return trainable / gpus if sharded or inp.work.parallel == "fsdp2" else trainable


def offload(inp: Inputs, precision: str, base: Row, *, sharded: bool = False) -> Row:
    """AdamBridge with ``precision`` moments in async mode: under DDP every rank holds the
    whole state unless ``sharded`` (shard_state=True: 1/G each); under FSDP2 each rank its
    shard's."""
    own = _own(inp, sharded)
    host = inp.work.gpus * ar.host_ram_bytes(own, precision)
    if sharded:
        name, kind = f"AdamBridge {precision}, state sharded x{inp.work.gpus}", "sharded"
    else:
        name, kind = f"AdamBridge {precision} moments", "offload"
    note = "synchronous step() on FSDP2 shards" if inp.work.parallel == "fsdp2" else ""
    return Row(name=name, kind=kind, precision=precision, **_gpu(inp, "async"),
               host_ram_gb=host / ar.GB, host_fits=host <= inp.host_usable,
               **_timing(inp, own, precision, base), note=note,
               checkpoint_extra_gb=_checkpoint(inp, precision))


def sync(inp: Inputs, precision: str, base: Row, *, sharded: bool = False) -> Row:
    """AdamBridge's step() without hooks: every gradient stays on the GPU until step(), then
    goes down, is updated and comes back, nothing overlapping backward."""
    own = _own(inp, sharded)
    host = inp.work.gpus * ar.host_ram_bytes(own, precision)
    shard = f", state sharded x{inp.work.gpus}" if sharded else ""
    return Row(name=f"AdamBridge {precision}{shard}, sync step()", kind="sync", precision=precision,
               **_gpu(inp, "sync"), host_ram_gb=host / ar.GB, host_fits=host <= inp.host_usable,
               **_timing(inp, own, precision, base, overlaps=False),
               checkpoint_extra_gb=_checkpoint(inp, precision))


def streamed(inp: Inputs, precision: str, base: Row, *, sharded: bool = False) -> Row:
    """A GPU-side AdamW whose ``precision`` state lives in host RAM and is streamed up and
    back each step (each direction at the link's rate at once), its DMA reading and writing
    the state in DRAM, the update at HBM speed; the same overlap as ours (the same hooks)."""
    own, gpus = _own(inp, sharded), inp.work.gpus
    link = ar.streamed_link_seconds(own, precision, inp.gpu.link_gbps)
    dram = ar.streamed_host_seconds(gpus * own, precision, inp.host_bw)
    update = ar.streamed_gpu_seconds(own, precision, inp.gpu.hbm_gbps)
    work = ar.host_work_seconds(link, dram, update)
    if inp.work.parallel == "fsdp2":
        exposed, hides = link + dram + update, None
    else:
        last = min(own, ar.CHUNK_ELEMENTS)
        tail = (2 * ar.streamed_link_seconds(last, precision, inp.gpu.link_gbps)
                + ar.streamed_gpu_seconds(last, precision, inp.gpu.hbm_gbps))
        exposed, hides = ar.exposed_seconds(work, inp.overlap_s, tail), _hides(inp, work)
    host = gpus * ar.state_bytes(own, precision)
    step = inp.compute_s + exposed
    shard = f" (sharded x{gpus})" if sharded else ""
    return Row(name=f"GPU AdamW, {precision} state streamed{shard}", kind="streamed",
               precision=precision, **_gpu(inp, "streamed", precision), host_ram_gb=host / ar.GB,
               host_fits=host <= inp.host_usable,
               link_gb=2 * own * ar.STATE_BYTES[precision] / ar.GB, link_s=link,
               host_update_s=max(dram, update), backward_s=inp.overlap_s, exposed_s=exposed,
               step_s=step, vs_all_gpu=step / base.step_s, hiding_tokens=hides,
               note=f"host DRAM {dram:.3g} s, GPU update {update:.3g} s")


def nvme(inp: Inputs, precision: str, base: Row) -> Optional[Row]:
    """AdamBridge with the NVMe tier: the state that does not fit in RAM goes to files (all
    of it when it does fit, as offload_dir without host_budget does); under DDP every rank
    keeps its whole state, in a directory of its own (shard_state does not take the tier).
    None under FSDP2, which the tier refuses."""
    gpus, trainable = inp.work.gpus, inp.model.trainable
    if inp.work.parallel == "fsdp2":
        return None
    state = gpus * ar.state_bytes(trainable, precision)
    fixed = gpus * (trainable * ar.host_extra_bytes_per_param()
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
               **_gpu(inp, "async"), host_ram_gb=(in_ram + fixed) / ar.GB,
               host_fits=in_ram + fixed <= inp.host_usable, **timing, nvme_gb=files / ar.GB,
               nvme_s=drive, drive_writes_per_day=writes,
               drive_life_months=ar.drive_life_months(writes, inp.nvme.dwpd))
