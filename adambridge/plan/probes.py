"""Measurements of this host that the plan's arithmetic takes: memory bandwidth and the
update kernel's arithmetic ceiling, one sample per call so that a caller can interleave them
with what it times (the host's bandwidth moves with where its CPUs are placed).
"""
from __future__ import annotations

import time
from typing import Optional

from . import arithmetic, buffers

# The ceiling's buffers: one update of 512Ki elements (7-14 MB of state) stays in a 32 MB
# last-level cache between calls, and its threads work on disjoint ranges of it; each sample
# is the fastest of CEILING_CALLS calls, so a call that another process interrupted is not
# taken for the kernel's speed.
CEILING_ELEMENTS = 1 << 19
CEILING_CALLS = 3


def native_unavailable() -> Optional[str]:
    """None when the native kernel loads, else why it cannot."""
    from .._native import build, loader
    try:
        loader.load()
    except (build.NativeBuildError, ValueError, OSError) as exc:
        return str(exc)
    return None


def bandwidth_buffers(numel: int) -> list:
    """Zeroed buffers of an fp32-moment update of ``numel`` elements, for bandwidth_gbps."""
    return buffers.update_items(numel, "fp32", random=False)


def bandwidth_gbps(items: list) -> float:
    """GB/s of one native probe pass: the streams of an fp32-moment update (28 B per
    element) read and written with no arithmetic."""
    from .._native import loader
    start = time.perf_counter()
    loader.memory_pass(items)
    seconds = time.perf_counter() - start
    return sum(item.numel for item in items) * arithmetic.HOST_BYTES_TOUCHED["fp32"] / seconds / 1e9


def ceiling_batch(precision: str) -> list:
    """The items of the ceiling's update (see CEILING_ELEMENTS)."""
    return buffers.update_items(CEILING_ELEMENTS, precision, seed=1)


def ceiling_ns(batch: list, step: int) -> float:
    """ns per element of the native update over ``batch``, its state in cache: the kernel's
    speed where memory does not bind (the fastest of CEILING_CALLS calls).

    NOTE: on a host with few cores per memory channel, fp8's decode, hash and encode take
    longer than its 16 bytes of DRAM traffic; bandwidth alone then predicts it too fast.
    """
    from ..update.functional import adamw_update
    numel = sum(item.numel for item in batch)
    fastest = float("inf")
    for call in range(CEILING_CALLS):
        stepped = buffers.next_step(batch, step * CEILING_CALLS + call)
        start = time.perf_counter()
        adamw_update(stepped, backend="native")
        fastest = min(fastest, time.perf_counter() - start)
    return fastest * 1e9 / numel
