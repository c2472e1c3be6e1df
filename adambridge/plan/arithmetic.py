"""The plan's arithmetic: every formula as a named function of bytes, seconds and tokens.

Units: bytes and seconds; GB means 10**9 bytes and GB/s 10**9 bytes per second, as the
figures of vendors and of the planning page do. Nothing here measures or reads the machine:
the same inputs give the same numbers. docs/planning.md names each function with its
derivation and the worked figures the tests check.
"""
from __future__ import annotations

import math
from typing import Optional

GB = 1e9
PRECISIONS = ("fp32", "bf16", "fp8")

# Mixed precision keeps a bf16 weight and a bf16 gradient per parameter on the GPU.
BF16_BYTES = 2.0
# Persistent optimizer state per trainable parameter: fp32 master (4) plus m and v.
# fp8 stores m as E4M3 and sqrt(v) as E5M2 (1 + 1) with one fp32 scale per 128 each.
STATE_BYTES = {"fp32": 4.0 + 4 + 4, "bf16": 4.0 + 2 + 2, "fp8": 4.0 + 2 * (1 + 4 / 128)}
ALL_GPU_STATE_BYTES = STATE_BYTES["fp32"]
# Async mode's page-locked staging: one bf16 gradient and one bf16 write-back buffer.
PINNED_BYTES = 2.0 + 2.0
# Link traffic per trainable parameter and step: the CPU-side step moves the bf16 gradient
# down and the bf16 weight up; streaming the fp32 state to the GPU and back moves 12 + 12.
LINK_BYTES_CPU_STEP = 2.0 + 2.0
LINK_BYTES_STREAM_BACK = 12.0 + 12.0
# DRAM bytes the host update touches per parameter (bf16 gradient in, bf16 weight out):
# read master, g, m, v and write master, m, v, the weight (fp8: plus its block scales).
HOST_BYTES_TOUCHED = {"fp32": 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2.0,
                      "bf16": 4 + 2 + 2 + 2 + 4 + 2 + 2 + 2.0,
                      "fp8": 4 + 2 + 1 + 1 + 4 + 1 + 1 + 2 + 2 * 2 * 4 / 128}
# A fused all-GPU AdamW step touches the same streams as the fp32 host update.
GPU_ADAMW_BYTES_TOUCHED = HOST_BYTES_TOUCHED["fp32"]
# The optimizer's default chunk_size: a larger last gradient is pipelined in chunks, so at
# most one chunk's copy down, update and copy up are left when backward ends.
CHUNK_ELEMENTS = 1 << 24
SECONDS_PER_DAY = 86_400.0
DAYS_PER_MONTH = 365.25 / 12
WARRANTY_YEARS = 5.0  # the period drive-endurance ratings (DWPD) are quoted over


# ---------------------------------------------------------------------------- memory

def state_bytes_per_param(precision: str) -> float:
    """Persistent optimizer bytes per trainable parameter: 12 (fp32), 8 (bf16), 6.06 (fp8)."""
    return STATE_BYTES[precision]


def state_bytes(trainable: float, precision: str = "fp32") -> float:
    """Bytes of optimizer state for ``trainable`` parameters: 7e9 x 12 B = 84 GB."""
    return trainable * STATE_BYTES[precision]


def gpu_bytes(total: float, trainable: float, *, state_on_gpu: bool,
              shards: int = 1) -> tuple[float, float, float]:
    """(params, grads, state) bytes per GPU: bf16 weights for every parameter, a bf16
    gradient and (all-GPU AdamW only) 12 B of state per trainable one, over ``shards``."""
    state = trainable * ALL_GPU_STATE_BYTES if state_on_gpu else 0.0
    return (total * BF16_BYTES / shards, trainable * BF16_BYTES / shards, state / shards)


def host_extra_bytes_per_param() -> float:
    """Host bytes per trainable parameter beyond its state, in every AdamBridge setup: the
    pinned staging (a bf16 gradient and a bf16 write-back buffer). The one place a term is
    added (the NVMe row and host_ram_bytes both read it)."""
    return PINNED_BYTES


def host_ram_bytes(elements: float, precision: str, *, pinned: bool = True) -> float:
    """Host bytes for ``elements`` of state, plus host_extra_bytes_per_param (4 B each)."""
    return elements * (STATE_BYTES[precision] + (host_extra_bytes_per_param() if pinned else 0.0))


def checkpoint_extra_bytes(largest_elements: float, precision: str) -> float:
    """Host RAM a save or load of the state adds at its peak beyond the steady state and
    beyond what torch.optim.AdamW adds on the same path: at most the largest parameter's
    state, as the state streams parameter by parameter."""
    return largest_elements * STATE_BYTES[precision]


def params_that_fit(ram_bytes: float, bytes_per_param: float = ALL_GPU_STATE_BYTES) -> float:
    """How many parameters' state fits in ``ram_bytes``: 1.5 TB / 12 B = 125e9."""
    return ram_bytes / bytes_per_param


def usable_bytes(capacity_gb: float, reserve: float) -> float:
    """The part of a memory the plan may fill: ``reserve`` (a fraction) is left to others."""
    return capacity_gb * GB * (1.0 - reserve)


# ---------------------------------------------------------------------------- the GPU per mode

def grad_bytes(elements: float) -> float:
    """Device bytes of bf16 gradients: every trainable one in sync mode, under DDP (its
    buckets hold them all) and while async mode accumulates over several backward passes."""
    return elements * BF16_BYTES


def async_grad_bytes(largest: float, small: float) -> float:
    """Device bytes of gradients alive at once in async mode with release_grads=True, one
    backward per step, one GPU: the largest hooked gradient (each is released in its hook,
    once its copy to the host is queued) and the small parameters' (no hook: held until
    step()), plus the small group's two device slots (gradients out, weights back)."""
    return (largest + small) * BF16_BYTES + 2 * small * BF16_BYTES


def link_backlog_bytes(hooked: float, largest: float, link_gbps: float, backward_s: float) -> float:
    """Released gradients whose copy to the host has not run when backward ends: backward
    makes 2 B per hooked parameter in ``backward_s`` and the link drains the gradients' half
    of its budget (2 of LINK_BYTES_CPU_STEP) meanwhile; at least the largest is in flight.
    The caching allocator keeps their blocks reserved (not allocated) until the copy has
    landed, and waits for those copies before it would run out of memory."""
    drained = link_gbps * GB * backward_s * BF16_BYTES / LINK_BYTES_CPU_STEP
    return max(largest * BF16_BYTES, hooked * BF16_BYTES - drained)


# ---------------------------------------------------------------------------- the state streamed to the GPU

def streamed_link_seconds(elements: float, precision: str, link_gbps: float) -> float:
    """A GPU-side AdamW whose state lives in host RAM: each step the state goes up and comes
    back, each direction at ``link_gbps`` at once (PCIe is full duplex): 7B fp32: 84 GB each
    way, 3.4 s at 25 GB/s."""
    return elements * STATE_BYTES[precision] / (link_gbps * GB)


def streamed_host_seconds(elements: float, precision: str, host_bw_gbps: float) -> float:
    """Host DRAM time of that stream: the copies read the state and write it back (2 x the
    state's bytes, against HOST_BYTES_TOUCHED of the host step)."""
    return 2 * elements * STATE_BYTES[precision] / (host_bw_gbps * GB)


def streamed_gpu_seconds(elements: float, precision: str, hbm_gbps: float) -> float:
    """The GPU's AdamW over the state as it arrives: the host update's bytes at HBM speed."""
    return elements * HOST_BYTES_TOUCHED[precision] / (hbm_gbps * GB)


def streamed_crossover(precision: str) -> float:
    """Host GB/s per GPU, as a multiple of the link's per direction, under which streaming
    the state beats the host step when both are bound by their slowest stage: the stream
    moves the state's bytes each way over the link, the host step touches
    HOST_BYTES_TOUCHED in DRAM (fp32: 28 / 12 = 2.33; bf16 2.5; fp8 2.66)."""
    return HOST_BYTES_TOUCHED[precision] / STATE_BYTES[precision]


# ---------------------------------------------------------------------------- the link

def link_bytes(elements: float, bytes_per_param: float = LINK_BYTES_CPU_STEP) -> float:
    """Bytes over the host link per step: 4 B/param for the CPU-side step (7B: 28 GB),
    24 B/param to stream the state to the GPU and back (7B: 168 GB)."""
    return elements * bytes_per_param


def link_seconds(nbytes: float, link_gbps: float) -> float:
    """Seconds of link time, both directions on one budget: 28 GB at 25 GB/s = 1.12 s."""
    return nbytes / (link_gbps * GB)


# ---------------------------------------------------------------------------- the host

def effective_host_bw(host_bw_gbps: float, gpus: int, numa_nodes: int) -> float:
    """GB/s the host updates get: each GPU's threads and state stay on its own NUMA node,
    so G GPUs spread over the nodes use min(G, nodes) of them."""
    nodes = max(1, numa_nodes)
    return host_bw_gbps * min(max(1, gpus), nodes) / nodes


def host_update_seconds(elements: float, precision: str, host_bw_gbps: float,
                        update_ns: Optional[float] = None) -> float:
    """Seconds of the host AdamW: bytes touched / bandwidth (7e9 x 28 B at 200 GB/s = 0.98 s
    with fp32 moments), or ``update_ns`` per element where the kernel's arithmetic is slower
    than memory (fp8's decode, hash and encode on few cores): whichever takes longer."""
    memory = elements * HOST_BYTES_TOUCHED[precision] / (host_bw_gbps * GB)
    return memory if update_ns is None else max(memory, elements * update_ns * 1e-9)


# ---------------------------------------------------------------------------- the GPU

def forward_flops(total: float, tokens: float) -> float:
    """Forward pass: 2 FLOPs per parameter per token (a multiply and an add)."""
    return 2.0 * total * tokens


def backward_flops(total: float, trainable: float, tokens: float,
                   recompute: bool = False) -> float:
    """Backward pass: 2NT for the activations' gradients plus 2 per trainable parameter per
    token for the weights' gradients, so 4NT when every parameter trains; with activation
    checkpointing (``recompute``) the forward runs again inside it: + 2NT."""
    again = forward_flops(total, tokens) if recompute else 0.0
    return 2.0 * total * tokens + 2.0 * trainable * tokens + again


def compute_seconds(flops: float, tflops: float) -> float:
    """Seconds of GPU work at ``tflops`` achieved TFLOP/s."""
    return flops / (tflops * 1e12)


def gpu_adamw_seconds(elements: float, hbm_gbps: float) -> float:
    """Seconds of a fused all-GPU AdamW step: it is memory-bound on the GPU's own memory."""
    return elements * GPU_ADAMW_BYTES_TOUCHED / (hbm_gbps * GB)


# ---------------------------------------------------------------------------- overlap

def host_work_seconds(*stages: float) -> float:
    """The host pipeline's seconds: copy down, update, copy up (and the drive) work on
    different parameters at once, so the slowest stage sets the pace."""
    return max(stages)


def tail_seconds(elements: float, link_gbps: float, precision: str, host_bw_gbps: float,
                 update_ns: Optional[float] = None) -> float:
    """What cannot overlap: the first layer's gradient exists only when backward ends, and
    its last chunk (at most CHUNK_ELEMENTS) still goes down, is updated and comes back up."""
    last = min(elements, CHUNK_ELEMENTS)
    return (link_seconds(link_bytes(last), link_gbps)
            + host_update_seconds(last, precision, host_bw_gbps, update_ns))


def exposed_seconds(host_work_s: float, overlap_s: float, tail_s: float) -> float:
    """The part of the host work left on the step: what ``overlap_s`` of backward cannot
    cover, plus the tail."""
    return max(0.0, host_work_s - overlap_s) + tail_s


def hiding_tokens(host_work_s: float, total: float, trainable: float, tflops: float,
                  recompute: bool = False) -> float:
    """Tokens per backward pass at which backward lasts as long as the host work:
    T = host seconds x FLOP/s / (2N + 2N_trainable), + 2N with activation checkpointing.
    Linear in N on both sides, so it does not depend on the model's size (7B, 1.12 s,
    400 TFLOP/s: 16,000 tokens)."""
    return host_work_s * tflops * 1e12 / backward_flops(total, trainable, 1.0, recompute)


# ---------------------------------------------------------------------------- the drive

def nvme_seconds(file_state_bytes: float, nvme_gbps: float) -> float:
    """Seconds of drive traffic per step: the state in files is read and written once."""
    return 2.0 * file_state_bytes / (nvme_gbps * GB)


def drive_writes_per_day(bytes_per_step: float, step_s: float, capacity_tb: float) -> float:
    """Full-drive writes per day at one step every ``step_s`` seconds."""
    return bytes_per_step * (SECONDS_PER_DAY / step_s) / (capacity_tb * 1e12)


def drive_life_months(writes_per_day: float, rated_dwpd: float) -> Optional[float]:
    """Months until the drive's rated writes (DWPD over WARRANTY_YEARS) are used up."""
    if writes_per_day <= 0:
        return None
    return rated_dwpd * WARRANTY_YEARS * 365.25 / writes_per_day / DAYS_PER_MONTH


# ---------------------------------------------------------------------------- accumulation

def accumulation_for(exposed_s: float, pass_s: float, gpu_adamw_s: float, *, target: float,
                     at_least: int, limit: int = 1024) -> Optional[int]:
    """Fewest passes per step K (>= ``at_least``) with (K x pass + exposed) / (K x pass +
    the all-GPU optimizer step) <= 1 + target: the exposed part is paid once per step, so
    accumulating more passes of the same size spreads it. None beyond ``limit``."""
    if pass_s <= 0:
        return None
    need = (exposed_s - (1.0 + target) * gpu_adamw_s) / (target * pass_s)
    passes = max(at_least, math.ceil(need - 1e-9))
    return passes if passes <= limit else None
