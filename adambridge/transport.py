"""Who copies what, where: CudaTransport (streams, events, pinned buffers) and HostTransport.

A transport moves one device's gradients to host memory and the updated weights back; the
scheduling in pipeline.py drives either through the same methods and never asks which:

  grad_to_host(p, grad, ranges, with_values)   autograd thread: start copying ``grad`` (and,
                                               for a first update, p's values) to the host;
                                               returns the host grad and one Ticket per range
  out(p) / group_out(params)                   where the kernel writes the rounded weights
  to_device(p, start, end)                     worker thread: start copying a range back
  group_to_host / group_to_device              the small parameters, one buffer each way
  finish()                                     step_sync: order the caller's work after ours

A Ticket says when a copy has landed: ``ready()`` polls, ``wait()`` blocks.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .pinned import PinnedBuffer
from .state import host_empty

Ranges = Sequence[tuple[int, int]]


@dataclass
class CopyStats:
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0


class Landed:
    """The ticket of a copy that has already happened (or never had to)."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- host


class HostTransport:
    """Parameters already in host memory: gradients are used where they are, nothing waits.

    The kernel writes the new weights straight into a contiguous parameter (an fp32 one is
    its own master); only a non-contiguous parameter gets a buffer and a copy back.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._out: dict[torch.Tensor, torch.Tensor] = {}
        self._stats = CopyStats()

    def grad_to_host(self, p: torch.Tensor, grad: torch.Tensor, ranges: Ranges,
                     with_values: bool) -> tuple[torch.Tensor, list]:
        return _flat(grad.detach()), [Landed() for _ in ranges]

    def release(self, grad: torch.Tensor) -> None:
        return None  # the work item keeps the host gradient alive until it is used

    def source(self, p: torch.Tensor) -> torch.Tensor:
        """p's values as a flat host tensor, for creating its master on the first update."""
        return p.detach().reshape(-1)

    def out(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        if p.is_contiguous():
            return None if p.dtype == torch.float32 else p.detach().view(-1)
        buffer = self._out.get(p)
        if buffer is None:
            buffer = self._out[p] = host_empty(p.numel(), p.dtype)
        return buffer

    def to_device(self, p: torch.Tensor, start: int, end: int) -> None:
        buffer = self._out.get(p)
        if buffer is None:
            return  # the kernel wrote into p itself
        began = time.perf_counter()
        p.detach().copy_(buffer.view(p.shape))
        self._stats.h2d_s += time.perf_counter() - began
        self._stats.h2d_bytes += _nbytes(buffer)

    def group_to_host(self, params: Sequence[torch.Tensor],
                      with_values: bool) -> tuple[list, Landed]:
        return [_flat(p.grad.detach()) for p in params], Landed()

    def group_out(self, params: Sequence[torch.Tensor]) -> list:
        return [self.out(p) for p in params]

    def group_to_device(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            self.to_device(p, 0, p.numel())

    def finish(self) -> None:
        return None

    def take_stats(self) -> CopyStats:
        stats, self._stats = self._stats, CopyStats()
        return stats

    def close(self) -> None:
        self._out.clear()


# --------------------------------------------------------------------------- CUDA


class CudaTicket:
    """A copy on the D2H stream; it has landed when its end event has completed."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()  # releases the GIL while it blocks


class CudaTransport:
    """One CUDA device: a D2H stream, an H2D stream, events, exact-size pinned buffers.

    Who waits on whom (no device-wide synchronisation anywhere):
      - the D2H stream waits on ``grad_ready`` (recorded on the autograd thread's current
        stream in the hook), so it copies the gradient only once it exists;
      - the worker waits (host side) on the end event of each D2H copy before updating;
      - the H2D stream waits on ``grad_ready`` too: every kernel that reads p in this
        backward was queued before it, so the new weights cannot overtake them;
      - ``finish()`` makes the caller's current stream wait on the H2D stream, so the next
        forward sees the new weights.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self._grad: dict[torch.Tensor, PinnedBuffer] = {}
        self._out: dict[torch.Tensor, PinnedBuffer] = {}
        self._grad_ready: dict[torch.Tensor, torch.cuda.Event] = {}
        self._values: dict[torch.Tensor, torch.Tensor] = {}  # p's values for a first update
        self._groups: dict[tuple, dict] = {}
        self._timings: list = []  # (direction, start event, end event, bytes) not yet summed
        # Runs before the buffers below are released (and unregistered) on garbage collection.
        weakref.finalize(self, _drain, self.d2h_stream, self.h2d_stream).atexit = False

    def _buffer(self, table: dict, p: torch.Tensor) -> torch.Tensor:
        buffer = table.get(p)
        if buffer is None:
            buffer = table[p] = PinnedBuffer(p.numel(), p.dtype)
        return buffer.tensor

    def _timed_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor,
                    stream: torch.cuda.Stream) -> torch.cuda.Event:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        self._timings.append((direction, start, end, _nbytes(src)))
        return end

    def _mark_ready(self) -> torch.cuda.Event:
        grad_ready = torch.cuda.Event()
        grad_ready.record(torch.cuda.current_stream(self.device))
        self.d2h_stream.wait_event(grad_ready)  # the gradient exists before we read it
        return grad_ready

    def grad_to_host(self, p: torch.Tensor, grad: torch.Tensor, ranges: Ranges,
                     with_values: bool) -> tuple[torch.Tensor, list]:
        self._grad_ready[p] = self._mark_ready()
        host = self._buffer(self._grad, p)
        tickets = []
        with torch.cuda.stream(self.d2h_stream):
            flat = _flat(grad.detach())
            if with_values:  # the master of a first update is made from p's values now
                values = self._values[p] = self._buffer(self._out, p)
                self._timed_copy("d2h", values, _flat(p.detach()), self.d2h_stream)
            for start, end in ranges:
                done = self._timed_copy("d2h", host[start:end], flat[start:end], self.d2h_stream)
                tickets.append(CudaTicket(done))
        return host, tickets

    def release(self, grad: torch.Tensor) -> None:
        # NOTE: the caller drops its last reference to ``grad`` right after; record_stream
        # keeps the caching allocator from handing the memory out again before the D2H
        # copies queued so far have run (https://pytorch.org/docs/stable/notes/cuda.html).
        grad.record_stream(self.d2h_stream)

    def source(self, p: torch.Tensor) -> torch.Tensor:
        return self._values.pop(p)

    def out(self, p: torch.Tensor) -> torch.Tensor:
        return self._buffer(self._out, p)

    def to_device(self, p: torch.Tensor, start: int, end: int) -> None:
        out = self._out[p].tensor
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self._grad_ready[p])  # p's readers in backward are queued
            if p.is_contiguous():
                self._timed_copy("h2d", p.detach().view(-1)[start:end], out[start:end],
                                 self.h2d_stream)
            else:
                self._timed_copy("h2d", p.detach(), out.view(p.shape), self.h2d_stream)

    # -- the small parameters: one flat buffer per dtype each way

    def _group(self, params: Sequence[torch.Tensor]) -> dict:
        key = tuple(id(p) for p in params)
        group = self._groups.get(key)
        if group is None:
            # A different set of small parameters this step: keep one group only. Its old
            # buffers may still feed the last step's copy back, so wait for that (rare) first.
            if self._groups:
                self.h2d_stream.synchronize()
            self._groups.clear()
            by_dtype: dict = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            group = self._groups[key] = {
                dtype: (members, PinnedBuffer(sum(p.numel() for p in members), dtype),
                        PinnedBuffer(sum(p.numel() for p in members), dtype))
                for dtype, members in by_dtype.items()}
        return group

    @staticmethod
    def _views(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> dict:
        views, offset = {}, 0
        for p in members:
            views[p] = flat[offset:offset + p.numel()]
            offset += p.numel()
        return views

    def group_to_host(self, params: Sequence[torch.Tensor],
                      with_values: bool) -> tuple[list, CudaTicket]:
        grad_ready = self._mark_ready()
        views: dict = {}
        done = None
        with torch.cuda.stream(self.d2h_stream):
            for members, grads, outs in self._group(params).values():
                if with_values:  # into the out buffer, which the kernel overwrites later
                    flat = torch.cat([_flat(p.detach()) for p in members])
                    self._timed_copy("d2h", outs.tensor, flat, self.d2h_stream)
                    self._values.update(self._views(outs.tensor, members))
                flat = torch.cat([_flat(p.grad.detach()) for p in members])
                done = self._timed_copy("d2h", grads.tensor, flat, self.d2h_stream)
                views.update(self._views(grads.tensor, members))
                for p in members:
                    self._grad_ready[p] = grad_ready
        # Copies on one stream land in order: the last one landing means all have.
        return [views[p] for p in params], CudaTicket(done)

    def group_out(self, params: Sequence[torch.Tensor]) -> list:
        views: dict = {}
        for members, _, outs in self._group(params).values():
            views.update(self._views(outs.tensor, members))
        return [views[p] for p in params]

    def group_to_device(self, params: Sequence[torch.Tensor]) -> None:
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self._grad_ready[params[0]])
            for members, _, outs in self._group(params).values():
                flat = torch.empty_like(outs.tensor, device=self.device)
                self._timed_copy("h2d", flat, outs.tensor, self.h2d_stream)
                for p, view in self._views(flat, members).items():
                    p.detach().copy_(view.view(p.shape))

    def finish(self) -> None:
        # The only wait step_sync adds on the device: the caller's stream, not the device.
        torch.cuda.current_stream(self.device).wait_stream(self.h2d_stream)
        self._grad_ready.clear()
        self._values.clear()

    def take_stats(self) -> CopyStats:
        """Copy times of the copies that have finished; the rest are counted next time."""
        stats, pending = CopyStats(), []
        for entry in self._timings:
            direction, start, end, nbytes = entry
            if not end.query():
                pending.append(entry)
                continue
            seconds = start.elapsed_time(end) / 1000.0
            if direction == "d2h":
                stats.d2h_s += seconds
                stats.d2h_bytes += nbytes
            else:
                stats.h2d_s += seconds
                stats.h2d_bytes += nbytes
        self._timings = pending
        return stats

    def close(self) -> None:
        """Free every pinned buffer; the caller has waited for all copies."""
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()
        for table in (self._grad, self._out):
            for buffer in table.values():
                buffer.close()
            table.clear()
        for group in self._groups.values():
            for _, grads, outs in group.values():
                grads.close()
                outs.close()
        self._groups.clear()
        self._timings.clear()


def _drain(*streams: torch.cuda.Stream) -> None:
    """Wait for the copies still queued, so no DMA outlives the pinning of its buffer."""
    for stream in streams:
        stream.synchronize()


def make_transport(device: torch.device):
    """The transport for parameters on ``device``."""
    if device.type == "cuda":
        return CudaTransport(device)
    if device.type == "cpu":
        return HostTransport(device)
    raise ValueError(f"Unsupported parameter device for attach_hooks: {device} "
                     f"(asynchronous mode supports cpu and cuda; use step() instead)")
