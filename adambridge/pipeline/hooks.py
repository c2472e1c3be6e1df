"""Asynchronous mode: gradient hooks, one worker thread per device, batching, chunking, faults.

Who waits on whom (the copies themselves are in pipeline/transport.py):

  autograd thread   the hook validates p's gradient, starts its copy to the host (one copy
                    per chunk of ``chunk_size`` elements) and enqueues one Piece per chunk.
                    It never waits.
  worker thread     waits for the oldest queued copy to land, takes every other piece whose
                    copy has landed too (copies land in order), updates them all in ONE
                    adamw_update call, then starts their copies back (``overlap_writeback``)
                    and commits ``state["step"]`` of each parameter whose last piece is done.
                    Under load more copies land per update, so the batches grow.
  finish()          (``opt.step()`` / ``opt.step_sync()``) sends what has no hook (small
                    parameters, gradients set by hand) as one buffer per dtype, applies the
                    step-wide facts (GradScaler, ``max_grad_norm``, clipping routed here by
                    pipeline/interception.py: see pipeline/step_wide.py), waits (with a bound) until the
                    worker has run what was held and corrected what was speculative, then
                    makes the current stream wait on the copies back.

Accumulation: a backward pass updates only if it closes the accumulation window: outside
``opt.accumulate()``, and the N-th of ``accumulation_steps=N`` (or when ``closes_window()``
says so). Backward passes are counted by an engine callback queued at the first hook of
each pass (a pass run inside another, as reentrant activation checkpointing does, is part
of it), which also tells a pass that never finished (an exception or Ctrl-C inside
backward): the step then fails at finish, naming what it had updated, or ``zero_grad()``
discards it and rolls its updates back (a skipped batch, pipeline/interrupted.py).

Faults. Everything that can make a gradient unusable is checked in the hook, before the
gradient is enqueued (sparse layout, shape, dtype, a parameter replaced since the last step).
A failed check stops the step: later hooks enqueue nothing, the worker updates nothing more,
and finish raises. The first step after attach_hooks is *held*: the worker updates nothing
until finish has seen every gradient, so a model whose gradients cannot be handled fails with
nothing changed. If the kernel or a copy fails, the parameters of that batch are in an unknown
state, those of earlier batches are updated, the rest are as before; the error names the
updated ones. Each parameter's ``state["step"]`` always says whether it took the step. A dead
worker thread is replaced at the next step. NaN/inf gradients are not errors (as in torch).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from .. import _validation as check
from . import cuda_policy, interception, interrupted, late_work, step_wide, verify
from ..stats import StepStats
from .transport import make_transport
from .work_items import Job, Piece, StepRecord, WriteBack
from .worker import _STOP, Lane, chunk_ranges, worker_cpus
from .corrections import SCALER_CAUSE, FactsMixin
from .grad_edits import (GradEditsMixin, after_reducer, grads_for_host,
                         recomputed_gradient_error, second_gradient_error)
from .grad_views import plain

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_log = logging.getLogger("adambridge")

# What a loop can do about each cause of updates made at step() (logged once per cause).
_ADVICE = {
    "grad_scaler": "GradScaler is only needed with fp16 autocast (bf16 needs none)",
    "grad_write": "a loop that changes gradients every step gains nothing from updating "
                  "during backward; where it can, make the change before backward (scale the "
                  "loss), or accept sync speed for such steps",
    "clip": "clipping that fires every step makes every step wait for its norm; a max_norm "
            "that fires only now and then keeps the overlap",
}
# Causes told by a warning of their own (the hyperparameter write: pipeline/corrections.py),
# or by design (the first step after attach_hooks).
_TOLD_ELSEWHERE = {"hyper", "first"}


class Pipeline(FactsMixin, GradEditsMixin):
    """The hooks of one optimizer and one Lane per device; ``opt.pipeline`` while attached."""

    def __init__(self, opt: OptimizerDoor, model: Optional[torch.nn.Module], *,
                 make_transport: Callable[[torch.device], Any] = make_transport,
                 accumulation_steps: int = 1,
                 closes_window: Optional[Callable[[], bool]] = None,
                 hook_grads: bool = True, edits_grads: bool = False,
                 verify_steps: int = 0) -> None:
        self._opt_ref = weakref.ref(opt)  # the optimizer owns us, not the other way round
        self._model_ref = None if model is None else weakref.ref(model)
        self.owned = [p for group in opt.param_groups for p in group["params"]]
        in_model = self.owned if model is None else _model_params(model, self.owned)
        # A parameter without elements has nothing to overlap (and nothing to copy): it
        # goes with the small ones, even with small_param_threshold=0.
        self.hooked = [p for p in in_model if p.requires_grad and p.numel() > 0
                       and p.numel() >= opt.small_param_threshold]
        _refuse_shared_params(self.owned, opt)
        self._hooked_set = {id(p) for p in self.hooked}
        self._owned_set = {id(p) for p in self.owned}
        self.accumulation_steps = check.positive_int("accumulation_steps", accumulation_steps)
        self.closes_window = closes_window
        self.group_of: dict = {}
        self._groups_seen: list = []
        self._refresh_groups()
        backend = opt.resolve_backend()
        self.lanes: dict[torch.device, Lane] = {}
        for p in self.owned:
            if p.device not in self.lanes:
                self.lanes[p.device] = Lane(make_transport(p.device), backend=backend,
                                            overlap_writeback=opt.overlap_writeback,
                                            cpus=worker_cpus(p.device, opt.numa_aware))
        self._released = opt.release_grads  # what the staging below was made for
        _stage_small_grads(self.lanes, self.hooked, opt.release_grads)
        # NOTE: every staging buffer is made now, on the workers.
        cuda_policy.prepare_lanes(self.lanes, self.hooked, self.owned, late_work.SYNC_TIMEOUT_S)
        self._record: Optional[StepRecord] = None
        self._record_lock = threading.Lock()
        self._stuck: dict = {}      # lane -> the last Call of this step it has not answered
        self._late: Optional[late_work.LateWork] = None  # what a timed-out step left running
        self._warm = False          # False until a step has completed: that step is held
        self._said_empty_step = False  # the one warning of a step() with no gradient
        self._accumulating = 0
        self._micro = 0             # backward passes ended in this accumulation window
        self._open_tasks: set = set()  # graph tasks whose end callback is pending
        self._used: dict = {}       # p -> (weakref of the kept p.grad, its version) used
        # Reused every step (Job.begin/end), keyed by id(p): each parameter's Job, and a
        # hooked one's (chunking, ranges, Pieces). Dropped after a failed step (its pieces
        # may still sit in a queue), so no reused object ever carries one step into another.
        self._jobs: dict[int, Job] = {}
        self._pieces: dict[int, tuple] = {}
        self.uses_grad_scaler = False
        self._init_grad_edits(edits_grads)
        self.verifier = verify.Verifier(verify_steps) if verify_steps else None
        self.clip_hint: Optional[float] = None  # max_norm of the last clip routed here
        self.clip_fired_last = False  # the last step's clip scaled the gradients: hold
        self.rolls_back = False  # a backward has raised: keep what rolls its updates back
        # A hyperparameter was written after a step's first gradient: since then every step
        # keeps what redoes its updates (watches), and one right after such a write is held.
        self.watches_hyper = False
        self.hyper_written_late = False
        self.warned_rebased = False
        self.warned_hyper_hold = False
        self.tuner = None
        self.hook_s = 0.0           # time in the gradient hooks since the last step
        self._told: set = set()     # the causes of lost overlap already logged (once each)
        # hook_grads=False: someone else calls on_grad (distributed/ddp.py's DDP comm hook).
        self._hooks_grads = hook_grads
        # NOTE: each gradient first lands in ``arrived`` (set.add, a C call: no Python frame
        # for a KeyboardInterrupt to land in before it), and on_grad takes it out only once
        # it has handled it: a hook that raised or was interrupted anywhere leaves it there.
        self.arrived: set = set()
        handles = [h for p in self.hooked for h in (
            p.register_post_accumulate_grad_hook(self.arrived.add),
            p.register_post_accumulate_grad_hook(_hook(weakref.ref(self))))] if hook_grads else []
        # Weak references to the lanes, not their queues: a revived lane has a new queue, and
        # a strong one would keep held pieces (and through them this pipeline) alive.
        self._finalizer = weakref.finalize(self, _shut_down, handles,
                                           [weakref.ref(lane) for lane in self.lanes.values()])
        interception.register(self)
        weakref.finalize(self, interception.release_unused)

    @property
    def opt(self) -> Any:
        return self._opt_ref()

    def step_in_flight(self) -> bool:
        """Whether backward has handed this step gradients that step() has not finished."""
        record = self._record
        return record is not None and bool(record.jobs) and not record.failed

    def hooks(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has one of this pipeline's hooks (its gradient may be released)."""
        return id(p) in self._hooked_set

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of this optimizer's parameters (hooked or sent at the step)."""
        return id(p) in self._owned_set

    def _refresh_groups(self) -> None:
        # load_state_dict and users may replace param_groups: look the group up again, so
        # the loaded hyperparameters and every later schedule change reach the update.
        groups = self.opt.param_groups
        if len(groups) != len(self._groups_seen) or any(
                a is not b for a, b in zip(groups, self._groups_seen)):
            self.group_of = {p: group for group in groups for p in group["params"]}
            self._groups_seen = list(groups)
            # Both ways the optimizer re-indexes its parameters (add_param_group,
            # load_state_dict) replace param_groups: the indices kept with the pieces go too.
            self._pieces = {}

    # -- the hook (autograd thread)

    def on_grad(self, p: torch.Tensor, reduced: Optional[torch.Tensor] = None) -> None:
        """p's gradient is ready: p.grad, or ``reduced`` (kept, never released) if given."""
        cuda_policy.check_hook(p)  # graph capture, compiled backward
        self._track_backward()
        if reduced is None and p.grad is None:
            # requires_grad was turned off after the forward (Lightning's toggle_optimizer
            # for another optimizer): autograd accumulates nothing but still calls the hook.
            self.arrived.discard(p)
            return
        if not self._window_closes():
            self.arrived.discard(p)
            return  # the gradient stays on the device and accumulates
        # (read without the lock when set: finish replaces it only after the last hook)
        record = self._record or self._current_record()
        opt = self.opt  # (a weak reference: called once per gradient, not once per use)
        if p in record.jobs:
            if reduced is None and p in self._views and p.grad is not self._views[p]:
                raise recomputed_gradient_error(opt.index(p))
            raise second_gradient_error(opt.index(p))
        if not record.failed:
            if reduced is not None and not record.jobs:  # DDP: see p.grad once DDP wrote it
                after_reducer(functools.partial(_note_reduced, weakref.ref(self)))
            self._take(opt, p, record, reduced)
        self.arrived.discard(p)  # last: an interrupt before it leaves p marked unfinished

    def _take(self, opt: OptimizerDoor, p: torch.Tensor, record: StepRecord,
              reduced: Optional[torch.Tensor]) -> None:
        try:
            opt.check_gradient(p)
            self._check_release_unchanged(opt)
        except (RuntimeError, ValueError) as exc:
            record.fail(exc)
            return
        try:
            self._enqueue(opt, p, record, reduced)
        except Exception as exc:  # noqa: BLE001 - e.g. no pinned memory: raised by finish
            record.fail(exc, f"sending the gradient of parameter {opt.index(p)} to the host")

    def _check_release_unchanged(self, opt: OptimizerDoor) -> None:
        # Small released gradients are copied at the hook (transport.stage): a kept p.grad
        # would then miss what clipping does to the copy.
        if opt.release_grads != self._released:
            raise ValueError(f"release_grads changed to {opt.release_grads} after "
                             f"attach_hooks(); call opt.detach_hooks(), then "
                             f"opt.attach_hooks(model)")

    def _track_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._open_tasks:
            return
        if not self._open_tasks:
            self._refuse_untracked_outer_pass()
        # A pass that starts while another is open either runs inside it (reentrant
        # activation checkpointing calls backward from backward) or follows one that raised.
        # Only the second is still open when the step finishes: finish tells them apart.
        self._open_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_backward_ended, weakref.ref(self), task))

    def _refuse_untracked_outer_pass(self) -> None:
        # A pass run from a custom Function's backward (reentrant checkpointing) while no
        # outer pass is tracked: the outer pass reached no hook (LoRA: every trainable
        # parameter sits in checkpointed blocks), so each inner pass would be counted as a
        # whole backward and accumulation_steps would close the window mid-pass.
        if (self.accumulation_steps > 1 and self.closes_window is None
                and not self._accumulating and _inside_function_backward()):
            raise RuntimeError(f"attach_hooks(accumulation_steps={self.accumulation_steps}) "
                               f"cannot count the backward passes: a "
                               f"torch.utils.checkpoint(use_reentrant=True) region ran its "
                               f"inner pass before the outer pass reached a hook (every hooked "
                               f"parameter checkpointed, as with LoRA); pass "
                               f"use_reentrant=False, or closes_window=, or run the earlier "
                               f"passes of the step in `with opt.accumulate():`")

    def _backward_interrupted(self, record: StepRecord) -> None:
        # A pass whose end callback never ran, or a hook that never finished, raised inside
        # backward (even before it made the step's record: it fails the record made now).
        self._open_tasks.clear()
        self.arrived.clear()
        if not record.failed:
            record.fail(RuntimeError(
                "a backward pass of this step did not finish (an exception or "
                "KeyboardInterrupt inside backward), so its gradients are incomplete"))

    def _window_closes(self) -> bool:
        if self._accumulating:
            return False
        if self.closes_window is not None:
            return bool(self.closes_window())
        return (self._micro + 1) % self.accumulation_steps == 0

    def _current_record(self) -> StepRecord:
        with self._record_lock:
            if self._record is None:
                self._refresh_groups()
                held_by = self._why_held()
                checks = self.verifier is not None and self.verifier.active
                record = StepRecord(held=held_by is not None, clip_watch=self._clip_watch(),
                                    keep_state=(self.rolls_back or self.watches_hyper
                                                or self.edits_grads or checks),
                                    verify=checks,
                                    hyper_inputs=step_wide.hyper_inputs(self.opt.param_groups))
                if self._late is not None:  # nothing may start: finish refuses the step
                    record.fail(RuntimeError("the update that timed out has not been "
                                             "accounted for"))
                record.held_by = held_by
                self._check_layouts(record)
                self._record = record
            return self._record

    def _why_held(self) -> Optional[tuple]:
        """(cause key, words) of why a new step holds its updates until finish, or None."""
        if not self._warm:
            return ("first", "the first step after attach_hooks() (every gradient is checked "
                             "before anything is updated)")
        if self.uses_grad_scaler:
            return SCALER_CAUSE
        if self.hyper_written_late:
            return ("hyper", "a hyperparameter written between backward and step() in the "
                             "last step")
        if self.edits_changed:
            return ("grad_write", f"the loop's change of a gradient in the last step "
                                  f"({self.last_edit})")
        if self.clip_fired_last and self._clip_watch() is not None:
            # NOTE: a clip that fired will most likely fire again: updating before the norm
            # is known would only do each update twice. A step where it does not fire costs
            # the overlap once; the next one speculates again.
            return ("clip", "clipping, which fired in the last step (the norm is known only "
                            "after backward)")
        return None

    def _clip_watch(self) -> Optional[float]:
        limits = [x for x in (self.opt.max_grad_norm, self.clip_hint) if x is not None]
        return min(limits) if limits else None

    def _check_layouts(self, record: StepRecord) -> None:
        # Before the first update of the step: a replaced parameter, or a torch flag set in
        # a group since (maximize=True, ...), fails with nothing done.
        opt = self.opt
        try:
            opt.follow_groups()  # a parameter put into param_groups[i]["params"]: refused
            opt.refuse_repeated_params()
        except (RuntimeError, ValueError, TypeError) as exc:
            record.fail(exc)
            return
        for i, group in enumerate(opt.param_groups):
            try:
                check.group_flags(group, f"param_groups[{i}]")
            except ValueError as exc:
                record.fail(exc)
                return
        for p in self.group_of:
            try:
                opt.check_layout(p)
            except ValueError as exc:
                record.fail(exc)
                return

    def _job_of(self, p: torch.Tensor) -> Job:
        job = self._jobs.get(id(p))
        if job is None:  # blank until begin(): made once per parameter
            job = self._jobs[id(p)] = Job(None, p, 0, {}, None, 0, None, None, None, 0)
        return job

    def _start_job(self, opt: OptimizerDoor, record: StepRecord, p: torch.Tensor, index: int,
                   group: dict, grad: torch.Tensor, out: Optional[torch.Tensor], pieces: int,
                   new: bool, transport: Any) -> Job:
        """p's reused Job, begun for this step and entered in ``record.jobs``; the worker
        reads its step (worker.read_steps: one call per batch, not a torch call per hook)."""
        state = opt.state.get(p) or None
        job = self._job_of(p)
        job.begin(opt, index, group, state, 0, grad, out,
                  transport.source(p) if new else None, pieces, transport)
        record.jobs[p] = job
        return job

    def _pieces_of(self, opt: OptimizerDoor, p: torch.Tensor) -> tuple:
        """(chunking key, lane, index, group, chunk ranges, reused Pieces) of p: remade when
        the chunking changed, dropped when param_groups change (see _refresh_groups)."""
        key = (opt.chunk_size, p.is_contiguous())  # the autotuner may change chunk_size
        cached = self._pieces.get(id(p))
        if cached is None or cached[0] != key:
            lane = self.lanes[p.device]
            ranges = chunk_ranges(p.numel(), key[0]) if key[1] else [(0, p.numel())]
            job = self._job_of(p)
            pieces = [Piece(job, start, end, None,
                            WriteBack(functools.partial(lane.transport.to_device, p, start, end),
                                      1), None)
                      for start, end in ranges]
            cached = self._pieces[id(p)] = (key, lane, opt.index(p), self.group_of[p], ranges,
                                            pieces)
        return cached

    def kept_bytes(self) -> int:
        """Bytes of the state copies hooked parameters' pieces keep for a redo (reused)."""
        return sum(t.numel() * t.element_size() for cached in self._pieces.values()
                   for piece in cached[5] if piece.kept for t in piece.kept if t is not None)

    def _enqueue(self, opt: OptimizerDoor, p: torch.Tensor, record: StepRecord,
                 reduced: Optional[torch.Tensor] = None) -> None:
        # NOTE: one call per gradient from here on (the Job is the pieces' own),
        # the index and group kept with the pieces, which go whenever param_groups change.
        _, lane, index, group, ranges, pieces = self._pieces_of(opt, p)
        transport = lane.transport
        new = opt.needs_values(p)  # a first update, or p written by someone else
        grad = plain(p.grad) if reduced is None else reduced  # (a zero view written into)
        host_grad, tickets = transport.grad_to_host(p, grad, ranges, new)
        if reduced is None:
            if opt.release_grads:
                transport.release(grad)
            self.put_view(p, grad, host_grad, _unlanded(tickets))
        job = pieces[0].job
        job.begin(opt, index, group, opt.state.get(p) or None, 0, host_grad, transport.out(p),
                  transport.source(p) if new else None, len(pieces), transport)
        record.jobs[p] = job
        for piece, ticket in zip(pieces, tickets):
            piece.ticket, piece.record, piece.writeback.left = ticket, record, 1
            lane.submit(piece)


    # -- what has no hook: one buffer per dtype each way

    def _unsent(self, record: StepRecord, device: torch.device) -> list:
        """Owned gradients of ``device`` not sent yet: small, hand-set, accumulated ones."""
        params = []
        for p in self.owned:
            # (p.grad first: it is None for most, and p.device makes a device object)
            if p.grad is None or p.device != device or p in record.jobs:
                continue
            used = self._used.get(p)
            if used is not None and used[0]() is p.grad and used[1] == p.grad._version:
                continue  # the gradient a previous step already used: no new backward
            params.append(p)
        return params

    def send_rest(self, record: StepRecord, hold: Optional[tuple] = None) -> None:
        """Send every gradient without a hook; with ``hold`` (a cause: key, words), hold what
        lands from now on."""
        if hold is not None:
            record.hold(hold)
        if record.failed:
            return
        for lane in self.lanes.values():
            try:
                self._send_group(lane, record)
            except Exception as exc:  # noqa: BLE001
                record.fail(exc, f"sending the small parameters of {lane.transport.device}")

    def _send_group(self, lane: Lane, record: StepRecord) -> None:
        opt = self.opt
        params = self._unsent(record, lane.transport.device)
        for p in params:
            try:
                opt.check_gradient(p)
            except (RuntimeError, ValueError) as exc:
                record.fail(exc)
        if not params or record.failed:
            return
        new = [p for p in params if opt.needs_values(p)]
        device_grads = grads_for_host(params)
        grads, ticket = lane.transport.group_to_host(params, device_grads, bool(new))
        outs = lane.transport.group_out(params)
        writeback = WriteBack(functools.partial(lane.transport.group_to_device, params),
                              len(params))
        new_ids = {id(p) for p in new}
        tickets = _unlanded([ticket])
        for p, grad, out in zip(params, grads, outs):
            self.note_sent(p, tickets)  # p.grad keeps it until the step ends
            job = self._start_job(opt, record, p, opt.index(p), self.group_of[p], grad, out, 1,
                                  id(p) in new_ids, lane.transport)
            lane.submit(Piece(job, 0, p.numel(), ticket, writeback, record))

    def drain(self, record: StepRecord) -> None:
        """Wait until every lane has handled (updated or held) every piece queued so far."""
        calls = [(lane, lane.call(lambda: None)) for lane in self.lanes.values()
                 if lane not in self._stuck]
        for lane, unit in calls:
            self._wait(lane, unit, record)

    def _wait(self, lane: Lane, unit: Any, record: StepRecord) -> None:
        try:
            lane.wait(unit, late_work.SYNC_TIMEOUT_S)
        except TimeoutError as exc:
            self._stuck[lane] = unit  # not waited on again this step (see pipeline/late_work.py)
            record.fail(exc)
        except RuntimeError as exc:
            record.fail(exc)

    # -- finish (the caller's thread): opt.step() / opt.step_sync()

    def finish(self) -> StepStats:
        if self._late is not None:
            return self._finish_after_timeout(self._late)
        entered = time.perf_counter()
        record = self._current_record()
        with record.lock:  # what updates from now on, step() waits for (StepStats)
            record.in_step = True
        revived = [lane for lane in self.lanes.values() if lane.revive()]
        if revived:
            record.fail(RuntimeError(f"the adambridge worker thread for "
                                     f"{revived[0].transport.device} had died; a new one runs "
                                     f"from the next step"))
        if self._open_tasks or self.arrived:
            self._backward_interrupted(record)
        # Without a step-wide fact to come, what lands now is final: keep updating it.
        pending = self.facts_pending()
        if not pending and not record.verify:
            # NOTE: the caller is in step() now, so nothing can change this step's gradients
            # or hyperparameters any more: an update run from here on needs no copy of the
            # state it started from (the tail of backward, the small parameters).
            record.keep_state = False
        self.send_rest(record, hold=pending)
        self.drain(record)
        self._take_assigned(record)
        if not record.failed:
            try:
                self.apply_step_facts(record)
            except Exception as exc:  # noqa: BLE001 - e.g. a non-finite norm
                record.fail(exc)
        self._flush(record)
        self.note_hyper_writes(record)
        late = self._left_running(record)
        waited = time.perf_counter() - entered
        for lane in self.lanes.values():
            lane.transport.finish()  # the current stream waits for the copies back
        verify_error = self._verify(record)
        self.opt.mark_written([job.p for job in record.jobs.values() if job.pieces_left == 0])
        with self._record_lock:
            self._record = None
        self._micro = 0
        self.end_views(record)
        self._remember_used(record)
        if not self._warm and self._model_ref is not None:
            cuda_policy.check_compiled_elsewhere(self._model_ref())
        if record.jobs and not record.failed:
            self.clip_fired_last = record.clip_fired
        self._warm = self._warm or (bool(record.jobs) and not record.failed)
        stats = self._stats(record, waited)
        self.opt.last_step_stats = stats
        self._tell_lost_overlap(record, stats)
        if not record.jobs and self._warm and not self._said_empty_step:
            # torch.optim would update again from the p.grad a backward left; here each
            # backward's gradients serve one step, so a second step() changes nothing.
            self._said_empty_step = True
            _log.warning("adambridge: step() with hooks attached found no gradient since the "
                         "last step and updated nothing (each backward's gradients serve one "
                         "step; torch.optim would step again on p.grad)")
        self._end_jobs(record)  # the host gradients go now, not at the next step
        if record.failed:
            _raise_step_error(record, late)
        if verify_error is not None:
            raise verify_error
        if sum(len(g["params"]) for g in self.opt.param_groups) != len(self.owned):  # step done
            raise RuntimeError("parameters were added after attach_hooks() and are never "
                               "updated: call opt.detach_hooks(), then opt.attach_hooks(model)")
        if self.tuner is not None and not record.held:
            self.tuner.after_step(self, stats, backward_s=entered - record.began)
        return stats

    def _flush(self, record: StepRecord) -> None:
        calls = []
        for lane in self.lanes.values():
            if record.skip:
                fn = lane.drop
            else:
                fn = functools.partial(lane.flush, record,
                                       functools.partial(self.correct_on_lane, lane, record))
            calls.append((lane, lane.call(fn)))
        for lane, unit in calls:
            if lane in self._stuck:  # its late work ends when it answers this last call
                self._stuck[lane] = unit
            else:
                self._wait(lane, unit, record)

    def _left_running(self, record: StepRecord) -> Optional[late_work.LateWork]:
        """The late work of a step whose worker timed out, guarding the optimizer; or None."""
        if not self._stuck:
            return None
        stuck, self._stuck = self._stuck, {}
        with record.lock:  # (the worker sets busy under it)
            running = [index for lane in stuck for index in lane.busy]
        waits = [(lane.thread, unit.done) for lane, unit in stuck.items()]
        self._late = late_work.LateWork(self.opt, record, waits, running)
        return self._late

    def _finish_after_timeout(self, late: late_work.LateWork) -> StepStats:
        """The step after a timeout: nothing of it is applied (see pipeline/late_work.py); it waits
        for the late work (without a backward before it) and lifts the guard once it ended."""
        backward_ran = self._record is not None or any(p.grad is not None for p in self.owned)
        with self._record_lock:
            self._record = None
        self._micro, self._jobs, self._pieces = 0, {}, {}
        self._open_tasks.clear()
        self.opt.last_step_stats = StepStats()
        try:
            late.settle(self.opt, backward_ran, late_work.SYNC_TIMEOUT_S)
        finally:
            if late.closed:
                self._late = None
                for lane in self.lanes.values():
                    lane.transport.finish()  # the current stream waits for the late copies
        return self.opt.last_step_stats

    def _verify(self, record: StepRecord) -> Optional[RuntimeError]:
        """ADAMBRIDGE_VERIFY_ASYNC: this step's updates against sync mode's (verify.py)."""
        if not record.verify:
            return None
        try:
            self.verifier.check(self.opt, record, self.shadows(), self.opt.resolve_backend())
        except RuntimeError as exc:
            return exc
        return None

    def read_mismatch(self, p: torch.Tensor, func: Any, ours: Any, sync: Any) -> str:
        """The one line of a read whose value differs from sync mode's (grad_views.py)."""
        step = self.verifier.step + 1 if self.verifier is not None else 0
        return (f"adambridge ({verify.ENV}): step {step}, parameter {self.opt.index(p)}: "
                f"{func} on p.grad gives {ours!r} in async mode and {sync!r} in sync mode; "
                f"most likely cause: the value was computed from the host copy of a GPU "
                f"gradient (a norm), whose last bits may differ from the GPU's")

    def _end_jobs(self, record: StepRecord) -> None:
        if record.failed:
            # Its pieces may still be queued (a worker that timed out): never reuse them.
            self._jobs, self._pieces = {}, {}
            record.jobs = {}  # (a late correction may still walk the old dict)
        else:
            for job in record.jobs.values():
                job.end()
            record.jobs.clear()

    def _remember_used(self, record: StepRecord) -> None:
        # A gradient kept in p.grad (release_grads=False) must not be used twice: any later
        # step without a new backward updates nothing. Added to, not replaced: a step that
        # used nothing must not make the gradient it skipped look new to the one after.
        for p in record.jobs:
            if p.grad is not None:
                self._used[p] = (weakref.ref(p.grad), p.grad._version)

    def _stats(self, record: StepRecord, waited: float) -> StepStats:
        stats = StepStats(host_update_s=record.host_update_s, sync_wait_s=waited,
                          num_params=0 if record.skip else len(record.updated),
                          num_batches=record.num_batches, grad_norm=record.grad_norm,
                          skipped=record.skip,
                          params_in_backward=record.overlap.params,
                          elems_in_backward=record.overlap.elems,
                          params_in_step=record.waited.params, elems_in_step=record.waited.elems,
                          params_redone=record.redone.params, elems_redone=record.redone.elems,
                          held_by=None if record.held_by is None or not record.waited.elems
                          else record.held_by[1],
                          hook_s=self.hook_s)
        self.hook_s = 0.0
        for lane in self.lanes.values():
            copies = lane.transport.take_stats()
            stats.d2h_s += copies.d2h_s
            stats.h2d_s += copies.h2d_s
            stats.d2h_bytes += copies.d2h_bytes
            stats.h2d_bytes += copies.h2d_bytes
        tier = getattr(self.opt, "nvme_tier", None)
        if tier is not None:
            tier.take_io(stats)  # the NVMe tier's bytes and I/O wait
        stats.wall_s = time.perf_counter() - record.began
        return stats

    def _tell_lost_overlap(self, record: StepRecord, stats: StepStats) -> None:
        """The first step that updated at step() for a cause: one log line naming it."""
        if record.held_by is None or not stats.elems_in_step or record.failed:
            return
        key, words = record.held_by
        if key in self._told or key in _TOLD_ELSEWHERE:
            return
        self._told.add(key)
        _log.warning("adambridge: %d of %d updated elements of this step ran at step(), "
                     "not during backward, held by %s; %s", stats.elems_in_step,
                     stats.elems_in_step + stats.elems_in_backward, words, _ADVICE[key])

    def run_on_workers(self, fn: Callable[[torch.device, list], None]) -> None:
        """fn(device, params) on each device's worker thread (e.g. to convert state there)."""
        calls = []
        for device, lane in self.lanes.items():
            params = [p for p in self.owned if p.device == device]
            calls.append((lane, lane.call(functools.partial(fn, device, params))))
        for lane, unit in calls:
            lane.wait(unit, late_work.SYNC_TIMEOUT_S)

    def check_zero_grad(self) -> None:
        """zero_grad() after a backward that handed gradients to the hooks, before step().

        torch would drop those gradients, but the hooks have taken them out of p.grad and
        may have updated with them (e.g. a backward of another optimizer's loss reached
        these parameters): refused, so that this optimizer never steps on a gradient the
        user meant to discard. Held first steps make this fail before anything changed.
        After a backward that raised (a batch being skipped) the step is discarded instead,
        its updates rolled back (pipeline/interrupted.py).
        """
        record = self._record
        if self._open_tasks:  # a backward raised: the loop skips its batch
            interrupted.discard(self, record)
            return
        if record is None or not record.jobs or record.failed:
            return
        done = f" (parameters {sorted(record.updated)} already took it)" if record.updated else ""
        raise RuntimeError(f"zero_grad() between a backward pass and step(): the hooks had "
                           f"already taken this optimizer's gradients for the step{done}; "
                           f"turn requires_grad off on its parameters for that backward "
                           f"(Lightning: self.toggle_optimizer(other)), or call step() first; "
                           f"a loop that recomputes the step's gradients (SAM, ASAM) runs "
                           f"exactly in sync mode (opt.detach_hooks())")

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def detach(self) -> None:
        """Remove the hooks and stop the workers, always; a step in flight is dropped."""
        record, self._record = self._record, None
        self._jobs, self._pieces = {}, {}
        if self._late is not None:
            self._late.attached = False  # its guard now answers the optimizer's step()
        for lane in self.lanes.values():
            lane.drop_gathered()
        self.restore_plain_grads()
        self._finalizer()
        interception.unregister(self)
        for lane in self.lanes.values():
            lane.thread.join(timeout=5.0)
            lane.transport.close()
        if record is not None and record.updated:
            _log.warning("adambridge: detach_hooks() dropped an unfinished step that had "
                         "already updated parameters %s", sorted(record.updated))


def _unlanded(tickets: list) -> tuple:
    """The tickets a view of this gradient must wait for (none on the host: all landed)."""
    return () if all(t.ready() for t in tickets) else tuple(tickets)


def _model_params(model: torch.nn.Module, owned: list) -> list:
    owned_ids = {id(p) for p in owned}
    found = [p for p in model.parameters() if id(p) in owned_ids]
    if not found:
        raise ValueError("attach_hooks(model): none of the model's parameters belong to this "
                         "optimizer; pass the model whose parameters you gave the optimizer")
    return found


_STAGE_MAX_NUMEL = 4096  # above it the copy costs more than the objects it saves


def _stage_small_grads(lanes: dict, hooked: list, release_grads: bool) -> None:
    # Only released gradients: a kept p.grad must still show what clipping did to it.
    if not release_grads:
        return
    for device, lane in lanes.items():
        stage = getattr(lane.transport, "stage", None)
        if stage is not None:
            stage([p for p in hooked if p.device == device and p.numel() <= _STAGE_MAX_NUMEL])


def _refuse_shared_params(owned: list, opt: OptimizerDoor) -> None:
    # Every owned parameter, hooked or not: a pipeline takes the gradient of each out of
    # p.grad, so the other optimizer would silently skip it (or reuse a used gradient).
    shared = interception.owned_anywhere(owned)
    if shared is not None:
        raise RuntimeError(f"attach_hooks(): parameter {opt.index(shared)} also belongs to "
                           f"another AdamBridge optimizer with hooks attached; give each "
                           f"optimizer its own parameters, or detach the other first")


def _hook(pipeline_ref: "weakref.ref[Pipeline]") -> Callable[[torch.Tensor], None]:
    def post_accumulate_grad_hook(p: torch.Tensor) -> None:
        pipeline = pipeline_ref()
        if pipeline is not None:
            began = time.perf_counter()
            try:
                pipeline.on_grad(p)
            finally:  # the optimizer's time on the training thread (StepStats.hook_s)
                pipeline.hook_s += time.perf_counter() - began
    return post_accumulate_grad_hook


def _inside_function_backward() -> bool:
    """Whether this thread runs inside a Python autograd Function's backward (a nested pass)."""
    # NOTE: BackwardCFunction is torch's internal; a release without it gets no refusal
    # (the behaviour before the check) rather than an AttributeError inside backward.
    apply = getattr(getattr(torch.autograd.function, "BackwardCFunction", None), "apply", None)
    apply_code = getattr(apply, "__code__", None)
    if apply_code is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is apply_code:
            return True
        frame = frame.f_back
    return False


def _backward_ended(pipeline_ref: "weakref.ref[Pipeline]", task: int) -> None:
    pipeline = pipeline_ref()
    if pipeline is not None and task in pipeline._open_tasks:
        pipeline._open_tasks.discard(task)
        if not pipeline._open_tasks:
            pipeline._micro += 1  # the outermost pass ended: one more backward of the window


def _note_reduced(pipeline_ref: "weakref.ref[Pipeline]") -> None:
    """Under DDP, once its reducer has written p.grad: the values each job took are those,
    so a loop that changes them before step() is seen (grad_edits._take_reassigned)."""
    pipeline = pipeline_ref()
    record = None if pipeline is None else pipeline._record
    if record is not None:
        for p in record.jobs:
            if p.grad is not None:
                pipeline._taken[p] = (p.grad, p.grad._version, ())


def _shut_down(handles: list, lane_refs: list) -> None:
    for handle in handles:
        handle.remove()
    for lane_ref in lane_refs:
        lane = lane_ref()
        if lane is not None:  # a collected lane's worker exits by itself
            lane.queue.put(_STOP)


def _raise_step_error(record: StepRecord, late: Optional[late_work.LateWork] = None) -> None:
    exc, where = record.errors[0]
    if late is not None:  # a worker may still be changing parameters: say which
        done = late.left_behind()
    elif record.updated and not record.skip:
        done = (f"this step had already updated parameters {sorted(record.updated)}; the other "
                f"parameters and their state are as before the step")
    else:
        done = "no parameter or optimizer state was changed by this step"
    if where:
        raise RuntimeError(f"adambridge: {where} failed ({type(exc).__name__}: {exc}); "
                           f"{done}") from exc
    try:
        error = type(exc)(f"{exc}; {done}")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        error = RuntimeError(f"{type(exc).__name__}: {exc}; {done}")
    raise error from None


def new(opt: OptimizerDoor, model: Optional[torch.nn.Module] = None,
        **options: Any) -> Pipeline:
    """The hooks for ``opt`` (see AdamBridge.attach_hooks, which holds what this returns and
    then calls start()); ``options`` are for tests."""
    cuda_policy.check_model(model)
    late_work.check_attach(opt)  # a detached pipeline's worker may still be in a late update
    return Pipeline(opt, model, **options)


def start(pipeline: Pipeline) -> None:
    """The native pool placed for the pipeline's devices, and the thread tuning started."""
    opt = pipeline.opt
    # on one NUMA node the pool is not pinned against the autograd thread
    cpus, threads = cuda_policy.pool_plan(_pool_cpus(pipeline), list(pipeline.lanes))
    if opt.resolve_backend() == "native":
        _configure_pool(opt, cpus, threads)
    if opt.autotune_config is not None:
        from .. import autotune
        pipeline.tuner = opt.tuner  # the optimizer's: a re-attach goes on where it was
        autotune.tune_threads_once(opt, cpus=cpus)
    _say_what_is_hooked(pipeline, opt.small_param_threshold)


def _say_what_is_hooked(pipeline: Pipeline, threshold: int) -> None:
    """Once, at attach_hooks(): how much of the model overlaps backward (a model whose every
    tensor is under the threshold, most LoRA adapters, overlaps nothing: a warning)."""
    hooked, owned = len(pipeline.hooked), len(pipeline.owned)
    rest = owned - hooked
    if hooked == 0:
        _log.warning("adambridge: attach_hooks() hooked none of the %d parameters (each is under "
                     "small_param_threshold=%d elements): all of them update at step(), so "
                     "nothing overlaps backward; pass a smaller small_param_threshold (0 hooks "
                     "every parameter) to overlap them", owned, threshold)
        return
    share = sum(p.numel() for p in pipeline.hooked) / max(
        1, sum(p.numel() for p in pipeline.owned))
    _log.info("adambridge: attach_hooks() hooked %d of %d parameters (%.0f%% of the elements); "
              "the other %d (under small_param_threshold=%d elements) update at step()",
              hooked, owned, 100 * share, rest, threshold)


def _pool_cpus(pipeline: Pipeline) -> tuple[int, ...]:
    """The native pool is process-wide: pin it only when every device shares one node."""
    opt = pipeline.opt
    sets = {worker_cpus(device, opt.numa_aware) for device in pipeline.lanes}
    if len(sets) == 1:
        return sets.pop()
    _log.info("devices on several NUMA nodes: the native thread pool stays unpinned")
    return ()


def _configure_pool(opt: OptimizerDoor, cpus: tuple[int, ...], threads: Optional[int] = None) -> None:
    if cpus or opt.num_threads is not None or threads:
        from .._native import loader
        loader.set_num_threads(opt.num_threads or threads or len(cpus), cpus)
