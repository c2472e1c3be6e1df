"""The per-device worker thread: waits for landed copies, updates them in one batch, sends them back.

pipeline.py enqueues Pieces (a chunk of one parameter's gradient whose copy to the host was
started); a Lane's thread takes every piece whose copy has landed, runs ONE adamw_update for
all of them, starts the copies back and commits each parameter's step when its last piece is
done. See pipeline.py for who waits on whom and what a fault leaves behind.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import state as host_state
from . import topology
from .functional import adamw_update
from .optimizer import _can_alias_master

_log = logging.getLogger("adambridge")
_POLL_S = 0.1       # how often a waiting thread checks that the thread it waits on lives
_STOP = object()    # queue sentinel: the worker exits


def chunk_ranges(numel: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most chunk_size elements (chunk_size is a multiple of 128)."""
    return [(start, min(start + chunk_size, numel)) for start in range(0, numel, chunk_size)]


def worker_cpus(device: torch.device, numa_aware: bool, root: str = "/") -> tuple[int, ...]:
    """CPUs of the NUMA node ``device`` hangs off, for its worker; () means pin nothing."""
    if not numa_aware or device.type != "cuda":
        return ()
    return topology.cpus_for_cuda_device(device.index or 0, root)


def _pin_current_thread(cpus: tuple[int, ...]) -> None:
    # On Linux sched_setaffinity(0) pins the calling thread only; threads it starts later
    # (torch's intra-op team) inherit the mask, so state first touched here is node-local.
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            _log.warning("could not pin the adambridge worker to CPUs %s: %s", cpus, exc)


# --------------------------------------------------------------------------- work items


class StepRecord:
    """What one step has done so far, shared by the hooks, the workers and step_sync."""

    def __init__(self, held: bool) -> None:
        self.lock = threading.Lock()
        self.held = held
        self.began = time.perf_counter()
        self.jobs: dict[torch.Tensor, "Job"] = {}
        self.errors: list[tuple[BaseException, str]] = []
        self.updated: list[int] = []
        self.host_update_s = 0.0
        self.num_batches = 0

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def fail(self, exc: BaseException, where: str = "") -> None:
        with self.lock:
            self.errors.append((exc, where))


@dataclass(eq=False)
class Job:
    """One parameter's update in this step; ``pieces_left`` chunks still to update."""

    opt: Any
    p: torch.Tensor
    index: int
    group: dict
    state: Optional[dict]           # None until this update creates it
    step: int
    grad: torch.Tensor              # flat host gradient
    out: Optional[torch.Tensor]     # flat host copy of the new weights (None: into p/master)
    source: Optional[torch.Tensor]  # p's values, when this update creates the master
    pieces_left: int
    record: StepRecord


@dataclass(eq=False)
class WriteBack:
    """One copy back to the device, sent once its ``left`` pieces are updated."""

    send: Callable[[], None]
    left: int


@dataclass(eq=False)
class Piece:
    job: Job
    start: int
    end: int
    ticket: Any
    writeback: WriteBack


@dataclass(eq=False)
class Call:
    """Run ``fn`` on the worker thread; the caller waits on ``done``."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


# --------------------------------------------------------------------------- the worker


class Lane:
    """One device: its transport, its queue and the worker thread that runs the kernel."""

    def __init__(self, transport: Any, *, backend: str, overlap_writeback: bool,
                 cpus: tuple[int, ...] = ()) -> None:
        self.transport = transport
        self.backend = backend
        self.overlap_writeback = overlap_writeback
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[Piece] = []
        self._deferred: list[WriteBack] = []
        self.thread = threading.Thread(target=_serve, args=(weakref.ref(self), self.queue, cpus),
                                       name=f"adambridge-{transport.device}", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> Call:
        unit = Call(fn)
        self.queue.put(unit)
        return unit

    def wait(self, unit: Call) -> None:
        """Block until the worker has run ``unit``; raise if the worker died meanwhile."""
        while not unit.done.wait(_POLL_S):
            if not self.thread.is_alive():
                raise RuntimeError(f"the adambridge worker thread for {self.transport.device} "
                                   f"has died; build a new optimizer")
        if unit.error is not None:
            raise unit.error

    def stop(self) -> None:
        self.queue.put(_STOP)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def handle(self, unit: Any) -> Any:
        """Process one unit (and every landed piece behind it); return a unit taken too early."""
        if isinstance(unit, Call):
            try:
                unit.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                unit.error = exc
            unit.done.set()
            return None
        unit.ticket.wait()
        batch, carry = [unit], None
        while carry is None:
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(nxt, Piece) and nxt.ticket.ready():
                batch.append(nxt)
            else:
                carry = nxt
        if unit.job.record.held:
            self._held.extend(batch)
        else:
            self.run(batch)
        return carry

    def run(self, batch: list[Piece]) -> None:
        """Update a batch in one adamw_update call, then send back and commit what is done."""
        record = batch[0].job.record
        if record.failed:
            return
        try:
            tier = getattr(batch[0].job.opt, "_tier", None)  # NVMe tier: streams its params
            batch, streamed = tier.route(batch, self.backend, record) if tier else (batch, [])
            items = [self._item(piece) for piece in batch]
            began = time.perf_counter()
            adamw_update(items, self.backend)
            elapsed = time.perf_counter() - began
            with record.lock:
                record.host_update_s += elapsed
                record.num_batches += 1
            for piece in batch + streamed:
                self._done(piece)
        except Exception as exc:  # noqa: BLE001 - re-raised by step_sync
            record.fail(exc, f"the update worker for {self.transport.device}")

    def _item(self, piece: Piece) -> Any:
        job = piece.job
        if job.state is None:  # first update: the master is made here, first touched by us
            alias = _can_alias_master(job.p)
            source = job.p.detach() if alias else job.source
            job.state = job.opt.state[job.p] = host_state.new_state(source, job.opt.precision,
                                                                    alias=alias)
        out = None if job.out is None else job.out[piece.start:piece.end]
        return job.opt._range_item(job.p, job.group, job.state, job.step,
                                   job.grad[piece.start:piece.end], out, piece.start)

    def _done(self, piece: Piece) -> None:
        writeback = piece.writeback
        writeback.left -= 1
        if writeback.left == 0:
            if self.overlap_writeback:
                writeback.send()
            else:
                self._deferred.append(writeback)
        job = piece.job
        job.pieces_left -= 1
        if job.pieces_left == 0:
            job.state["step"].fill_(job.step)
            with job.record.lock:
                job.record.updated.append(job.index)

    def flush(self, record: StepRecord) -> None:
        """Worker side of step_sync: run what was held, send what was deferred."""
        held, self._held = self._held, []
        if held and not record.failed:
            self.run(held)
        deferred, self._deferred = self._deferred, []
        for writeback in deferred:
            if not record.failed:
                try:
                    writeback.send()
                except Exception as exc:  # noqa: BLE001
                    record.fail(exc, f"the copy back to {self.transport.device}")


def _serve(lane_ref: "weakref.ref[Lane]", units: queue.SimpleQueue, cpus: tuple[int, ...]) -> None:
    """The worker loop. It keeps its lane only while handling a unit, so the lane (and the
    optimizer above it) can be garbage-collected; then ``lane_ref()`` is None and it exits."""
    _pin_current_thread(cpus)
    torch.set_grad_enabled(False)
    carry = None
    while True:
        if carry is None:
            try:
                carry = units.get(timeout=_POLL_S * 5)
            except queue.Empty:
                if lane_ref() is None:
                    return
                continue
        if carry is _STOP:
            return
        lane = lane_ref()
        if lane is None:
            return
        unit, carry = carry, None
        try:
            carry = lane.handle(unit)
        except Exception as exc:  # noqa: BLE001 - e.g. a failed copy: step_sync raises it
            if isinstance(unit, Piece):
                unit.job.record.fail(exc, f"the copy to the host for {lane.transport.device}")
            else:
                _log.exception("adambridge worker: unexpected error")
        del lane, unit
