"""What each setup keeps on one GPU: the weights, the gradients as its mode holds them, the
optimizer state, the activations; and what async mode has in flight over the link.

The modes (docs/planning.md, "GPU memory per mode"): ``all-gpu`` (torch AdamW: gradients kept
until step(), 12 B of state per trainable parameter), ``sync`` (AdamBridge's step(): every
gradient until step()), ``async`` (attach_hooks with release_grads=True: each hooked
gradient released in its hook, the small group held until step()) and ``streamed`` (a
GPU-side AdamW over state streamed from host RAM, driven by the same hooks, plus its state
buffers on the device).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import arithmetic as ar
from .inputs import Inputs

MODES = ("all-gpu", "sync", "async", "streamed")
STREAM_BUFFERS = 2   # the streamed design's state chunks on the device: one arriving, one in use


@dataclass(frozen=True)
class GpuMemory:
    """Bytes on one GPU; ``in_flight`` (async mode's released gradients not yet copied) is
    reserved by the caching allocator, not allocated, and not counted in ``total``."""
    params: float
    grads: float
    state: float
    activations: float
    in_flight: float
    grads_note: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.state + self.activations


def shards(inp: Inputs) -> int:
    """Over how many GPUs the weights, gradients and GPU state are split (FSDP2: all)."""
    return inp.work.gpus if inp.work.parallel == "fsdp2" else 1


def async_grads(inp: Inputs) -> tuple[float, str, float]:
    """(gradient bytes async mode holds, why, bytes in flight) on one GPU."""
    work, model = inp.work, inp.model
    every = ar.grad_bytes(model.trainable) / shards(inp)
    if work.parallel == "fsdp2":
        return every, "FSDP2: the synchronous step() on the shards keeps every gradient", 0.0
    if work.gpus > 1:
        return every, "DDP: its buckets hold every gradient", 0.0
    if work.accumulation > 1:
        return every, "accumulation: the passes before the last keep every gradient", 0.0
    grads = model.grads
    if grads is None:
        return every, "a count has no parameter sizes: every gradient (give --model)", 0.0
    held = ar.async_grad_bytes(grads.largest, grads.small)
    why = (f"largest gradient {ar.grad_bytes(grads.largest) / ar.GB:,.2f} GB + {grads.small_params} "
           f"small parameters held until step() and their 2 device slots")
    if grads.assumed:
        why += f" ({grads.assumed})"
    flying = ar.link_backlog_bytes(grads.hooked, grads.largest, inp.gpu.link_gbps, inp.overlap_s)
    return held, why, flying


def for_mode(inp: Inputs, mode: str, precision: str = "fp32") -> GpuMemory:
    """What ``mode`` keeps on one GPU (``precision``: the streamed design's state)."""
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (one of {', '.join(MODES)})")
    model, split = inp.model, shards(inp)
    params = model.total * ar.BF16_BYTES / split
    flying, state = 0.0, 0.0
    if mode in ("all-gpu", "sync"):
        grads, why = ar.grad_bytes(model.trainable) / split, "every gradient until step()"
        if mode == "all-gpu":
            state = model.trainable * ar.ALL_GPU_STATE_BYTES / split
    else:
        grads, why, flying = async_grads(inp)
        if mode == "streamed":
            largest = model.grads.largest if model.grads is not None and model.grads.largest else model.trainable
            chunk = min(largest, ar.CHUNK_ELEMENTS)
            state = STREAM_BUFFERS * chunk * ar.STATE_BYTES[precision]
    return GpuMemory(params, grads, state, inp.activation_bytes, flying, why)
