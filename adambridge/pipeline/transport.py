"""Who copies what, where: CudaTransport (streams, events, pinned buffers) and HostTransport.

A transport moves one device's gradients to host memory and the updated weights back; the
scheduling in pipeline/hooks.py drives either through the same methods and never asks which:

  grad_to_host(p, grad, ranges, with_values)   autograd thread: start copying ``grad`` (and,
                                               for a first update, p's values) to the host;
                                               returns the host grad and one Ticket per range
  out(p) / group_out(params)                   where the kernel writes the rounded weights
  to_device(p, start, end)                     worker thread: start copying a range back
  group_to_host / group_to_device              the small parameters, one buffer each way
                                               (their gradients given: p.grad may be a view)
  finish()                                     step_sync: order the caller's work after ours

A Ticket says when a copy has landed: ``ready()`` polls, ``wait()`` blocks.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..host.pinned import PinnedBuffer
from .slots import SlotBuffers, copy_many
from ..update.state import host_empty

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


_LANDED = Landed()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- host


class HostTransport:
    """Parameters already in host memory: gradients are used where they are, nothing waits.

    The kernel writes the new weights straight into a contiguous parameter (an fp32 one is
    its own master); only a non-contiguous parameter gets a buffer and a copy back. The
    gradients of the parameters given to ``stage`` are copied into a buffer of their own.
    """

    # NOTE: The worker is woken once per this many gradient elements (pipeline/worker.py,
    # Lane.submit): every copy has landed at once, so waiting costs no overlap but the tail.
    gather_numel = 1 << 16

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._out: dict[torch.Tensor, torch.Tensor] = {}
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): flat, shaped
        self._stats = CopyStats()

    def stage(self, params: Sequence[torch.Tensor]) -> None:
        """Copy these parameters' gradients into a buffer each, made now and reused.

        For small gradients that the pipeline releases: the gradient (and the two tensor
        objects that reach it) then dies in its hook instead of living until step_sync,
        which kept the cyclic GC busy; the copy costs less than those objects did.
        """
        for p in params:
            flat = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            self._staged[id(p)] = (flat, flat.view(p.shape))

    def grad_to_host(self, p: torch.Tensor, grad: torch.Tensor, ranges: Ranges,
                     with_values: bool) -> tuple[torch.Tensor, list]:
        staged = self._staged.get(id(p))
        if staged is not None:
            # the same values in the same (logical) order; detached only if it needs it
            # (create_graph=True), as a detach is one more tensor object per gradient
            staged[1].copy_(grad.detach() if grad.requires_grad else grad)
            return staged[0], [_LANDED] * len(ranges)
        return _flat(grad.detach()), [_LANDED] * len(ranges)  # one shared ticket: no state

    def release(self, grad: torch.Tensor) -> None:
        return None  # the work item keeps the host gradient alive until it is used

    def prepare(self, hooked: Sequence[torch.Tensor], rest: Sequence[torch.Tensor]) -> None:
        return None  # nothing to stage: gradients are used where they are

    def staging_bytes(self) -> int:
        return 0  # no page-locked memory

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

    def group_to_host(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      with_values: bool) -> tuple[list, Landed]:
        return [_flat(grad.detach()) for grad in grads], Landed()

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
        self._staged.clear()


# --------------------------------------------------------------------------- CUDA


def _event(timing: bool = False) -> "torch.cuda.Event":
    # NOTE: blocking=True: a host thread waiting on the event sleeps in the
    # driver instead of spinning a core for all of backward (cudaEventBlockingSync).
    return torch.cuda.Event(enable_timing=timing, blocking=True)


def _record_stream(tensor: torch.Tensor, stream: "torch.cuda.Stream") -> None:
    tensor.record_stream(stream)  # a function so CPU tests can record the call


def refuse_capture(device: torch.device) -> None:
    """One-line refusal under CUDA graph capture: a replay would re-run copies, not updates."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"adambridge: attach_hooks() cannot run under CUDA graph capture on "
                           f"{device} (a replay updates nothing); capture forward and "
                           f"backward without hooks and call opt.step() after each replay")


class CudaTicket:
    """A copy on the D2H stream; it has landed when its end event has completed."""

    def __init__(self, event: "torch.cuda.Event") -> None:
        self.event = event

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()  # blocking-sync: sleeps, and releases the GIL


class CudaTransport:
    """One CUDA device: a D2H stream, an H2D stream, events, exact-size pinned buffers.

    Who waits on whom (no device-wide synchronisation anywhere):
      - the D2H stream waits on ``grad_ready``, recorded on the stream backward runs on
        (the hook's current stream, remembered as ``backward_stream``), so it copies a
        gradient only once it exists; the small parameters' copies at step_sync wait on
        that stream too, not on step_sync's caller's (they may differ: item 7);
      - the worker waits (host side) on the end event of each D2H copy before updating;
      - the H2D stream waits on ``grad_ready`` too: every kernel that reads p in this
        backward was queued before it, so the new weights cannot overtake them;
      - ``finish()`` makes the caller's current stream and the backward stream wait on the
        H2D stream, so the next forward on either sees the new weights.
    Buffers are made by ``prepare`` at attach_hooks, on the worker thread (item 6).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self._grad: dict[torch.Tensor, PinnedBuffer] = {}
        self._out: dict[torch.Tensor, PinnedBuffer] = {}
        self._grad_ready: dict[torch.Tensor, "torch.cuda.Event"] = {}
        self._values: dict[torch.Tensor, torch.Tensor] = {}  # p's values for a first update
        self._slots: Optional[SlotBuffers] = None
        self._prepare_error: Optional[BaseException] = None
        self.backward_stream: Optional["torch.cuda.Stream"] = None
        self._timings: list = []  # (direction, start event, end event, bytes) not yet summed
        self._step_end: list = []  # events recorded by finish: the step's last copies
        # Runs before the buffers below are released (and unregistered) on garbage collection.
        weakref.finalize(self, _drain, self.d2h_stream, self.h2d_stream).atexit = False

    def prepare(self, hooked: Sequence[torch.Tensor], rest: Sequence[torch.Tensor]) -> None:
        """Allocate and pin every staging buffer now (the worker thread, at attach_hooks).

        NOTE: Pinning GBs inside the first backward stalls the kernel
        launches of the autograd thread and first-touches the pages on its node; here they
        land on the worker's node. A failure is kept and raised by every step (at
        step_sync, with nothing changed), never out of backward.
        """
        try:
            for p in hooked:
                self._buffer(self._grad, p)
                self._buffer(self._out, p)
            self._slots = SlotBuffers([p for p in rest if p.device == self.device], self.device)
        except Exception as exc:  # noqa: BLE001 - raised at step time
            self._prepare_error = exc

    def _check_prepared(self) -> None:
        if self._prepare_error is not None:
            raise RuntimeError(f"the pinned staging buffers could not be made at attach_hooks() "
                               f"({self._prepare_error}); free host memory or raise "
                               f"`ulimit -l`, then detach_hooks() and attach_hooks() again")
        if self._slots is None:  # used without prepare: every buffer is made on first use
            self._slots = SlotBuffers([], self.device)

    def staging_bytes(self) -> int:
        """Host bytes of the staging buffers (page-locked; they cannot be swapped out)."""
        slots = self._slots.nbytes() if self._slots is not None else 0
        return slots + sum(b.nbytes for t in (self._grad, self._out) for b in t.values())

    def _buffer(self, table: dict, p: torch.Tensor) -> torch.Tensor:
        buffer = table.get(p)
        if buffer is None:
            buffer = table[p] = PinnedBuffer(p.numel(), p.dtype)
        buffer.check_usable()
        return buffer.tensor

    def _timed_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor,
                    stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        start, end = _event(timing=True), _event(timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        self._timings.append((direction, start, end, _nbytes(src)))
        return end

    def _mark_ready(self, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        grad_ready = torch.cuda.Event()  # only streams wait on it, never a host thread
        grad_ready.record(stream)
        self.d2h_stream.wait_event(grad_ready)  # the gradient exists before we read it
        return grad_ready

    def grad_to_host(self, p: torch.Tensor, grad: torch.Tensor, ranges: Ranges,
                     with_values: bool) -> tuple[torch.Tensor, list]:
        refuse_capture(self.device)
        self._check_prepared()
        # The hook runs on the autograd device thread: its current stream is backward's.
        self.backward_stream = torch.cuda.current_stream(self.device)
        self._grad_ready[p] = self._mark_ready(self.backward_stream)
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
        # NOTE: Always, released or not: whoever drops the last reference
        # to ``grad`` (our release, zero_grad, autograd replacing p.grad) must not let the
        # caching allocator hand its memory out before these copies have run
        # (https://pytorch.org/docs/stable/notes/cuda.html#cuda-streams).
        _record_stream(grad, self.d2h_stream)
        return host, tickets

    def release(self, grad: torch.Tensor) -> None:
        return None  # grad_to_host has recorded the D2H stream on it already

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

    # -- what has no hook: fixed slots (pipeline/slots.py), or p's own buffers for a hooked p

    def group_to_host(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      with_values: bool) -> tuple[list, CudaTicket]:
        refuse_capture(self.device)
        self._check_prepared()
        slots = self._slots
        stream = self.backward_stream or torch.cuda.current_stream(self.device)
        grad_ready = self._mark_ready(stream)
        slotted = [p for p in params if p in slots]
        grad_of = dict(zip(map(id, params), grads))
        done = None
        with torch.cuda.stream(self.d2h_stream):
            if with_values:  # into the out buffers, which the kernel overwrites later
                for p in params:
                    out = slots.view(slots.host_out, p) if p in slots else self.out(p)
                    self._values[p] = out
                    done = self._timed_copy("d2h", out, _flat(p.detach()), self.d2h_stream)
            copy_many([slots.view(slots.device_grad, p).view(p.shape) for p in slotted],
                      [grad_of[id(p)].detach() for p in slotted])
            for dtype, start, end in slots.runs(slotted):
                done = self._timed_copy("d2h", slots.host_grad[dtype].tensor[start:end],
                                        slots.device_grad[dtype][start:end], self.d2h_stream)
            for p in params:
                if p not in slots:
                    done = self._timed_copy("d2h", self._buffer(self._grad, p),
                                            _flat(grad_of[id(p)].detach()), self.d2h_stream)
        for p, grad in zip(params, grads):
            self._grad_ready[p] = grad_ready
            _record_stream(grad, self.d2h_stream)
        views = [slots.view(slots.host_grad, p) if p in slots else self._grad[p].tensor
                 for p in params]
        # Copies on one stream land in order: the last one landing means all have.
        return views, CudaTicket(done)

    def group_out(self, params: Sequence[torch.Tensor]) -> list:
        slots = self._slots
        return [slots.view(slots.host_out, p) if p in slots else self.out(p) for p in params]

    def group_to_device(self, params: Sequence[torch.Tensor]) -> None:
        slots = self._slots
        slotted = [p for p in params if p in slots]
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self._grad_ready[params[0]])
            for dtype, start, end in slots.runs(slotted):
                self._timed_copy("h2d", slots.device_out[dtype][start:end],
                                 slots.host_out[dtype].tensor[start:end], self.h2d_stream)
            copy_many([p.detach() for p in slotted],
                      [slots.view(slots.device_out, p).view(p.shape) for p in slotted])
        for p in params:
            if p not in slots:
                self.to_device(p, 0, p.numel())

    def finish(self) -> None:
        """Order the next forward after the copies back; mark where this step's copies end."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.h2d_stream)
        if self.backward_stream is not None and self.backward_stream != current:
            self.backward_stream.wait_stream(self.h2d_stream)  # backward ran elsewhere (item 7)
        # NOTE: take_stats waits for these, so every copy of the step is
        # counted in this step's StepStats (the wait is the tail of the last copy back).
        self._step_end = [_event(), _event()]
        self._step_end[0].record(self.d2h_stream)
        self._step_end[1].record(self.h2d_stream)
        self._grad_ready.clear()
        self._values.clear()
        self.backward_stream = None

    def take_stats(self) -> CopyStats:
        """Copy times and bytes of every copy queued up to the last ``finish()``."""
        for end in self._step_end:
            end.synchronize()
        self._step_end = []
        stats, pending = CopyStats(), []
        for entry in self._timings:
            direction, start, end, nbytes = entry
            if not end.query():  # queued after finish (none in the pipeline's order)
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
        if self._slots is not None:
            self._slots.close()
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
