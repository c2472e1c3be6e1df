"""The per-device worker thread: waits for landed copies, updates them in one batch, sends them back.

pipeline/hooks.py enqueues Pieces (a chunk of one parameter's gradient whose copy to the host was
started); a Lane's thread takes every piece whose copy has landed, runs ONE adamw_update for
all of them, starts the copies back and commits each parameter's step when its last piece is
done. While a step is *held* (its first step, a GradScaler step, or once a step-wide fact
such as the gradient norm is being decided) landed pieces wait for ``finish``. See
pipeline/hooks.py for who waits on whom and what a fault leaves behind.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

from . import piece_rows, rank_pool, step_wide
from ..host import topology
from ..update import state as host_state
from ..update.functional import Hyper, adamw_update
from .slots import copy_many
from .work_items import Call, Job, Piece, StepRecord, WriteBack

_log = logging.getLogger("adambridge")
_POLL_S = 0.1       # how often a waiting thread checks that the thread it waits on lives
_STOP = object()    # queue sentinel: the worker exits


def chunk_ranges(numel: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most chunk_size elements (chunk_size is a multiple of 128)."""
    return [(start, min(start + chunk_size, numel)) for start in range(0, numel, chunk_size)]


def worker_cpus(device: torch.device, numa_aware: bool, root: str = "/") -> tuple[int, ...]:
    """CPUs of the NUMA node ``device`` hangs off, for its worker; () means pin nothing.

    A CPU device under torchrun: this rank's share of the host (pipeline/rank_pool.py)."""
    if numa_aware and device.type == "cpu":
        return rank_pool.host_rank_cpus(numa_aware, root=root)
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


# --------------------------------------------------------------------------- the worker


class Lane:
    """One device: its transport, its queue and the worker thread that runs the kernel."""

    def __init__(self, transport: Any, *, backend: str, overlap_writeback: bool,
                 cpus: tuple[int, ...] = ()) -> None:
        self.transport = transport
        self.backend = backend
        self.overlap_writeback = overlap_writeback
        self.cpus = cpus
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[Piece] = []
        self._deferred: list[WriteBack] = []
        # Indices of the parameters the worker is changing now (a finish that times out
        # names them: they may still change after it has returned).
        self.busy: list[int] = []
        # NOTE: Pieces gathered by submit() until they are worth a wake-up.
        self.gather_numel = getattr(transport, "gather_numel", 0)
        self._gathered: list[Piece] = []
        self._gathered_numel = 0
        self._gather_lock = threading.Lock()
        self.thread = self._start_thread()

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=_serve, args=(weakref.ref(self), self.queue, self.cpus),
                                  name=f"adambridge-{self.transport.device}", daemon=True)
        thread.start()
        return thread

    def revive(self) -> bool:
        """Start a new worker thread if the old one has died; True if it had."""
        if self.thread.is_alive():
            return False
        _discard(self.queue)  # what the dead thread left holds the step's jobs alive
        self.queue = queue.SimpleQueue()
        self._held, self._deferred, self.busy = [], [], []
        self.drop_gathered()
        self.thread = self._start_thread()
        return True

    def submit(self, piece: Piece) -> None:
        """Queue a piece whose copy to the host has started (any thread).

        A transport with ``gather_numel`` (the host one: its copies have always landed) has
        its pieces gathered until they add up to that many elements, then queued as one
        list: on the CPU a wake-up of the worker per small gradient cost more than the
        update, mostly in the two threads taking turns at the GIL. ``call`` queues what is
        gathered first, so a Call still runs after every piece submitted before it.
        """
        if self.gather_numel <= 0:
            self.queue.put(piece)
            return
        with self._gather_lock:
            self._gathered.append(piece)
            self._gathered_numel += piece.end - piece.start
            if self._gathered_numel >= self.gather_numel:
                self._send_gathered_locked()

    def _send_gathered_locked(self) -> None:
        if self._gathered:
            self.queue.put(self._gathered)
            self._gathered, self._gathered_numel = [], 0

    def drop_gathered(self) -> None:
        """Forget the gathered pieces of a step that will not finish."""
        with self._gather_lock:
            self._gathered, self._gathered_numel = [], 0

    def call(self, fn: Callable[[], Any]) -> Call:
        unit = Call(fn)
        with self._gather_lock:  # the pieces gathered so far go first
            self._send_gathered_locked()
            self.queue.put(unit)
        return unit

    def wait(self, unit: Call, timeout_s: Optional[float] = None) -> None:
        """Block until the worker has run ``unit``; raise if it died or ``timeout_s`` passed."""
        began = time.monotonic()
        while not unit.done.wait(_POLL_S):
            if not self.thread.is_alive():
                raise RuntimeError(f"the adambridge worker thread for {self.transport.device} "
                                   f"has died; the next step starts a new one")
            if timeout_s is not None and time.monotonic() - began > timeout_s:
                raise TimeoutError(f"the adambridge worker thread {self.thread.name!r} has not "
                                   f"answered for {timeout_s:g} s (a hung kernel call or "
                                   f"copy?); raise ADAMBRIDGE_SYNC_TIMEOUT if that is expected")
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
        batch, carry = self._landed(unit if isinstance(unit, list) else [unit])
        if self._must_hold(batch):
            self._held.extend(batch)
        else:
            self.run(batch, speculative=True)
        return carry

    def _landed(self, pieces: list[Piece]) -> tuple[list[Piece], Any]:
        """(the first piece and every later one of its step whose copy has landed, the unit
        taken too early); ``pieces`` is a unit (one piece or a gathered list)."""
        pieces[0].ticket.wait()
        record = pieces[0].record
        batch: list[Piece] = []
        while True:
            for i, piece in enumerate(pieces):
                landed = not batch or piece.ticket.ready()  # the first one was waited for
                if piece.record is not record or not landed:
                    return batch, pieces[i:]  # copies land in order: the rest wait too
                batch.append(piece)
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                return batch, None
            if isinstance(nxt, Piece):
                pieces = [nxt]
            elif isinstance(nxt, list):
                pieces = nxt
            else:
                return batch, nxt

    def _must_hold(self, batch: list[Piece]) -> bool:
        record = batch[0].record
        if record.holds():
            return True
        if record.clip_watch is None:
            return False
        # Clipping is expected: keep updating only while the norm so far stays under the
        # limit; once it passes, clipping will fire, so hold the rest for the exact update.
        landed = sum(float(torch.linalg.vector_norm(p.job.grad[p.start:p.end],
                                                    dtype=torch.float32)) ** 2 for p in batch)
        with record.lock:
            record.landed_sq += landed
            if record.landed_sq ** 0.5 > record.clip_watch:
                record.hold(("clip", f"clipping: the norm of the gradients landed so far "
                                     f"passed max_norm={record.clip_watch:g} during backward"))
        return record.hold_rest

    def run(self, batch: list[Piece], speculative: bool = False) -> None:
        """Update a batch in one adamw_update call, then send back and commit what is done."""
        record = batch[0].record
        with record.lock:  # (a failing step takes the lock: from then on nothing starts)
            if record.failed:
                return
            self.busy = [piece.job.index for piece in batch]
        try:
            read_steps(batch)
            batch, streamed = self._route(batch, record, speculative)
            elapsed = self._update(batch, (speculative or record.verify) and record.keep_state)
            with record.lock:
                record.host_update_s += elapsed
                record.num_batches += bool(batch)
            if speculative:
                for piece in batch:
                    piece.job.updated_ranges.append(piece.span)
                    piece.job.hypers.append(piece.hyper)
            for piece in streamed:
                piece.job.streamed = speculative
                if speculative:
                    piece.job.hypers.append(piece.hyper)
            finished = self._done(record, batch) + self._done(record, streamed)
            record.count_updated(finished, sum(piece.end - piece.start
                                               for piece in (*batch, *streamed)))
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish
            record.fail(exc, f"the update worker for {self.transport.device}")
        finally:
            self.busy = []

    def _update(self, batch: list[Piece], keep_state: bool) -> float:
        """One adamw_update over the batch; returns the seconds the update itself took."""
        if not batch:
            return 0.0
        if self.backend == "native":
            desc = piece_rows.pack(batch, self._item)  # kept rows, refreshed
            if keep_state:  # (after pack: a first update has made its state there)
                _keep_state(batch, [_state_views(piece) for piece in batch])
            began = time.perf_counter()
            piece_rows.run(desc)
            return time.perf_counter() - began
        items = [self._item(piece) for piece in batch]
        if keep_state:
            _keep_state(batch, [step_wide.state_of(item) for item in items])
        began = time.perf_counter()
        adamw_update(items, self.backend)
        return time.perf_counter() - began

    def _route(self, batch: list[Piece], record: StepRecord,
               speculative: bool) -> tuple[list[Piece], list[Piece]]:
        """(pieces for the in-RAM update, pieces the NVMe tier has streamed and committed)."""
        tier = getattr(batch[0].job.opt, "nvme_tier", None)
        if tier is None:
            return batch, []
        if speculative and record.keep_state:
            # NOTE: redoing a clipped update (step_wide.redo) or rolling one back needs the
            # state from before it, which the tier keeps only in files: its pieces wait for
            # the step's end.
            batch, filed = tier.split(batch)
            self._held.extend(filed)
        if not speculative:
            return tier.route(batch, self.backend, record)
        filed = [piece for piece in batch if tier.holds(piece.job.p)]
        for piece in filed:  # what the tier's pages will read (finish compares it)
            piece.hyper = Hyper.for_group(piece.job.group, piece.job.step)
        rest, streamed = tier.route(batch, self.backend, record)
        for piece in streamed:
            if Hyper.for_group(piece.job.group, piece.job.step) != piece.hyper:
                piece.hyper = None  # written while its pages streamed: unknown, never final
        return rest, streamed

    def _item(self, piece: Piece) -> Any:
        job = piece.job
        if job.state is None or job.source is not None:
            # A first update (the master is made here, first touched by us) or p written by
            # someone else since the last step (the master takes its values).
            job.state = job.opt.ensure_state(job.p, job.source)
            job.source = None
        out = None if job.out is None else job.out[piece.start:piece.end]
        item = job.opt.range_item(job.p, job.group, job.state, job.step,
                                  job.grad[piece.start:piece.end], out, piece.start)
        piece.hyper = item.hyper  # what this update reads of the group (finish compares it)
        return item

    def _done(self, record: StepRecord, pieces: list[Piece]) -> int:
        """Send back each copy whose pieces are all updated; commit each finished job's step
        (``record.updated`` takes them at once, even if a copy back raises midway); returns
        how many jobs finished."""
        finished: list[Job] = []
        try:
            for piece in pieces:
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
                    finished.append(job)
        finally:
            if finished:
                _commit_steps(finished)
                with record.lock:
                    record.updated.extend(job.index for job in finished)
        return len(finished)

    def drop(self) -> None:
        """Forget the held pieces and deferred copies of a step that will not finish."""
        self._held, self._deferred = [], []

    def flush(self, record: StepRecord, before: Callable[[], None]) -> None:
        """Worker side of finish: ``before`` (corrections), run what was held, send deferred.

        Deferred copies back are sent even if the step failed: they belong to parameters
        whose update was committed, and the device must not keep the old weights.
        """
        held, self._held = self._held, []
        with record.lock:
            correcting = not record.failed
            if correcting:  # what the corrections may change
                self.busy = [job.index for job in record.jobs.values()
                             if job.transport is self.transport and job.speculative]
        if correcting:
            try:
                before()
            except BaseException as exc:  # noqa: BLE001
                record.fail(exc, f"correcting the speculative updates on {self.transport.device}")
            finally:
                self.busy = []
        if held and not record.failed:
            self.run(held)
        deferred, self._deferred = self._deferred, []
        for writeback in deferred:
            try:
                writeback.send()
            except Exception as exc:  # noqa: BLE001
                record.fail(exc, f"the copy back to {self.transport.device}")


def _discard(units: queue.SimpleQueue) -> None:
    while True:
        try:
            units.get_nowait()
        except queue.Empty:
            return


def read_steps(pieces: list[Piece]) -> None:
    """Set job.step (state["step"] + 1, or 1 for a first update) where it is still 0.

    NOTE: read in one torch call per batch; an ``item()`` in every hook was a
    torch call per gradient on the autograd thread (each one lets the GIL go)."""
    unread = [piece.job for piece in pieces if piece.job.step == 0]
    if not unread:
        return
    counted = [job for job in unread if job.state]
    if counted:
        values = torch.stack([job.state["step"] for job in counted]).tolist()
        for job, value in zip(counted, values):
            job.step = int(value) + 1
    for job in unread:
        if job.step == 0:  # no state yet: this update makes it
            job.step = 1


def _commit_steps(jobs: list[Job]) -> None:
    """state["step"] = job.step for each job, as one multi-tensor copy per step value.

    NOTE: a fill_ per parameter was a torch call per gradient on the worker, and
    each such call lets the GIL go to the autograd thread and back."""
    by_step: dict[int, list] = {}
    for job in jobs:
        by_step.setdefault(job.step, []).append(job.state["step"])
    for step, counters in by_step.items():
        value = torch.tensor(float(step), dtype=torch.float32)  # as fill_(step) rounds an int
        copy_many(counters, [value] * len(counters))


def _keep_state(batch: list[Piece], sources: list) -> None:
    # Clipping may fire, or a hyperparameter be written, after this speculative update:
    # step_wide.redo starts from this state. Each piece copies into the buffers it kept
    # from its last snapshot (one multi-tensor copy for the batch, no allocation).
    kept = step_wide.snapshot_many(sources, [piece.kept for piece in batch])
    for piece, saved in zip(batch, kept):
        piece.kept = piece.job.saved_state[piece.span] = saved


def _state_views(piece: Piece) -> tuple:
    """The master and moments the update of ``piece`` writes, in snapshot order."""
    views = host_state.range_views(piece.job.state, piece.start, piece.end)
    return tuple(views[key] for key in step_wide.SAVED_KEYS)


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
        except BaseException as exc:  # noqa: BLE001 - e.g. a failed copy: finish raises it
            if isinstance(unit, (Piece, list)):
                first = unit if isinstance(unit, Piece) else unit[0]
                first.record.fail(exc, f"the copy to the host for {lane.transport.device}")
            else:
                _log.exception("adambridge worker: unexpected error")
        del lane, unit
