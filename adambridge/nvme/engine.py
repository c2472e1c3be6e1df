"""Which engine moves the NVMe tier's pages: io_uring where the kernel allows it, else threads.

``OffloadConfig(io_engine=...)``: 'auto' (the default) tries io_uring at tier creation and
falls back to the pread/pwrite thread pool when io_uring_setup is refused (ENOSYS, EPERM from
a seccomp filter, kernel.io_uring_disabled=2) or the native library is unavailable; the
reason is kept and shown by ``opt.placement()`` and ``python -m adambridge info``.
'io_uring' or 'threads' forces one ('io_uring' raises where it cannot be had). With 'auto',
the environment variable ADAMBRIDGE_NVME_IO=auto|io_uring|threads decides instead.
"""
from __future__ import annotations

import os

from ..host import platform_facts
from .direct_io import IOEngine, IOPool, describe_direct_io
from .uring import UringEngine, open_ring, uring_library

ENGINES = ("auto", "io_uring", "threads")
ENV = "ADAMBRIDGE_NVME_IO"


def check_engine(value: object, what: str = "io_engine") -> str:
    if value not in ENGINES:
        raise ValueError(f"Invalid {what}: {value!r} (expected one of {', '.join(ENGINES)})")
    return value  # type: ignore[return-value]


def resolve(io_engine: str) -> str:
    """The engine asked for: ``io_engine`` unless it is 'auto', then $ADAMBRIDGE_NVME_IO."""
    if io_engine != "auto":
        return io_engine
    return check_engine(os.environ.get(ENV, "").strip() or "auto", ENV)


def _ring_entries(queue_depth: int) -> int:
    # Reads ahead plus writes behind stay under 2 * queue_depth; the rest is headroom.
    return max(16, 2 * queue_depth + 4)


def open_engine(io_engine: str, queue_depth: int) -> IOEngine:
    """The engine for a new tier; ValueError in one line when io_uring is forced but refused."""
    choice = resolve(io_engine)
    if choice == "threads":
        return IOPool(queue_depth)
    lib, why = None, f"io_uring is Linux-only, this is {platform_facts.facts().system}"
    if platform_facts.facts().system == "linux":
        lib, why = uring_library()
    ring = None
    if lib is not None:
        ring, why = open_ring(lib, _ring_entries(queue_depth))
    if ring is not None:
        return UringEngine(queue_depth, lib, ring)
    if choice == "io_uring":
        raise ValueError(f"io_engine='io_uring' is not available here: {why}; pass "
                         f"io_engine='threads' (or 'auto' to fall back by itself)")
    pool = IOPool(queue_depth)
    pool.fallback_reason = why
    return pool


def describe_tier_io(directory: str) -> str:
    """One line for ``python -m adambridge info``: O_DIRECT in ``directory`` and the engine
    a tier made now would use."""
    try:
        engine = open_engine("auto", 2)
    except ValueError as exc:  # ADAMBRIDGE_NVME_IO=io_uring where it is refused
        return str(exc)
    try:
        return describe_direct_io(directory, engine.describe())
    finally:
        engine.close()
