"""Asynchronous mode: gradient hooks, one worker thread per device, batching, chunking, faults.

Who waits on whom (DESIGN.md section 5; the copies themselves are in transport.py):

  autograd thread   the hook validates p's gradient, starts its copy to the host (one copy
                    per chunk of ``chunk_size`` elements) and enqueues one Piece per chunk.
                    It never waits.
  worker thread     waits for the oldest queued copy to land, takes every other piece whose
                    copy has landed too (copies land in order), updates them all in ONE
                    adamw_update call, then starts their copies back (``overlap_writeback``)
                    and commits ``state["step"]`` of each parameter whose last piece is done.
                    Under load more copies land per update, so the batches grow.
  step_sync()       sends the small parameters (one buffer per dtype), enqueues a Flush,
                    waits (with timeouts) until the worker reaches it, then makes the current
                    stream wait on the copies back. It is the only place the host waits.

Faults. Everything that can make a gradient unusable is checked in the hook, before the
gradient is enqueued (sparse layout, shape, dtype, a parameter replaced since the last step,
which is checked for every parameter at the first hook of each step). A failed check stops
the step: later hooks enqueue nothing and the worker updates nothing more; step_sync raises
the error. The first step after attach_hooks is *held*: the worker updates nothing until
step_sync has seen every gradient, so a model whose gradients cannot be handled fails with
nothing changed. On later steps a check can only fail if the model changed mid-training in
a way the layout check cannot see (a gradient that turns sparse); the parameters updated
before it are then named in the error. If the update kernel or a copy fails, the parameters
of that batch are in an unknown state, those of earlier batches are updated, the rest are
as before the step; the error names the updated ones. Each parameter's ``state["step"]``
always says whether it took the step. NaN/inf gradients are not errors (as in torch).

Worker threads are daemons, every wait has a timeout, and a worker holds only a weak
reference to its lane: it exits when the optimizer is garbage-collected.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from . import _validation as check
from .stats import StepStats
from .transport import make_transport
from .worker import _STOP, Job, Lane, Piece, StepRecord, WriteBack, chunk_ranges, worker_cpus

_log = logging.getLogger("adambridge")
# --------------------------------------------------------------------------- the pipeline


class Pipeline:
    """The hooks of one optimizer and one Lane per device; ``opt._pipeline`` while attached."""

    def __init__(self, opt: Any, model: Optional[torch.nn.Module], *,
                 make_transport: Callable[[torch.device], Any] = make_transport) -> None:
        self._opt_ref = weakref.ref(opt)  # the optimizer owns us, not the other way round
        owned = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
        in_model = owned if model is None else _model_params(model, owned)
        self.hooked = [p for p in in_model if p.numel() >= opt.small_param_threshold]
        hooked_ids = {id(p) for p in self.hooked}
        grouped = [p for p in owned if id(p) not in hooked_ids]
        self.group_of = {p: group for group in opt.param_groups for p in group["params"]}
        backend = opt._resolve_backend()
        self.lanes: dict[torch.device, Lane] = {}
        for p in owned:
            if p.device not in self.lanes:
                self.lanes[p.device] = Lane(make_transport(p.device), backend=backend,
                                            overlap_writeback=opt.overlap_writeback,
                                            cpus=worker_cpus(p.device, opt.numa_aware))
        self.grouped = {device: [p for p in grouped if p.device == device] for device in self.lanes}
        self._record: Optional[StepRecord] = None
        self._record_lock = threading.Lock()
        self._warm = False          # False until a step has completed: that step is held
        self._accumulating = 0
        self.tuner = None
        handles = [p.register_post_accumulate_grad_hook(_hook(weakref.ref(self)))
                   for p in self.hooked]
        queues = [lane.queue for lane in self.lanes.values()]
        self._finalizer = weakref.finalize(self, _shut_down, handles, queues)

    @property
    def opt(self) -> Any:
        return self._opt_ref()

    # -- the hook (autograd thread)

    def on_grad(self, p: torch.Tensor) -> None:
        if self._accumulating:
            return  # the gradient stays on the device and accumulates
        record = self._current_record()
        if p in record.jobs:
            raise RuntimeError(f"parameter {self.opt._param_index[p]} received a second gradient "
                               f"before step_sync(); wrap the earlier backward passes of the "
                               f"step in `with opt.accumulate():`")
        if record.failed:
            return
        index = self.opt._param_index[p]
        try:
            check.gradient(p, index, self.opt._layout.get(p))
        except (RuntimeError, ValueError) as exc:
            record.fail(exc)
            return
        try:
            self._enqueue(p, record)
        except Exception as exc:  # noqa: BLE001 - e.g. no pinned memory: raised by step_sync
            record.fail(exc, f"sending the gradient of parameter {index} to the host")

    def _current_record(self) -> StepRecord:
        with self._record_lock:
            if self._record is None:
                self._record = StepRecord(held=not self._warm)
                self._check_layouts(self._record)
            return self._record

    def _check_layouts(self, record: StepRecord) -> None:
        # Before the first update of the step: a replaced parameter fails with nothing done.
        opt = self.opt
        for p, layout in opt._layout.items():
            if p not in self.group_of:
                continue
            try:
                check.unchanged_layout(p, opt._param_index[p], layout)
            except ValueError as exc:
                record.fail(exc)
                return

    def _job(self, p: torch.Tensor, record: StepRecord, grad: torch.Tensor,
             out: Optional[torch.Tensor], pieces: int, new: bool, transport: Any) -> Job:
        opt = self.opt
        state = opt.state.get(p) or None
        step = int(state["step"].item()) + 1 if state else 1
        job = Job(opt, p, opt._param_index[p], self.group_of[p], state, step, grad, out,
                  transport.source(p) if new else None, pieces, record)
        record.jobs[p] = job
        return job

    def _enqueue(self, p: torch.Tensor, record: StepRecord) -> None:
        opt, lane = self.opt, self.lanes[p.device]
        new = not opt.state.get(p)
        if new:
            opt._layout[p] = (p.shape, p.dtype)
        grad = p.grad
        ranges = (chunk_ranges(p.numel(), opt.chunk_size) if p.is_contiguous()
                  else [(0, p.numel())])
        host_grad, tickets = lane.transport.grad_to_host(p, grad, ranges, new)
        self._release(p, grad, lane)
        job = self._job(p, record, host_grad, lane.transport.out(p), len(ranges), new,
                        lane.transport)
        for (start, end), ticket in zip(ranges, tickets):
            send = functools.partial(lane.transport.to_device, p, start, end)
            lane.queue.put(Piece(job, start, end, ticket, WriteBack(send, 1)))

    def _release(self, p: torch.Tensor, grad: torch.Tensor, lane: Lane) -> None:
        if self.opt.release_grads:
            lane.transport.release(grad)
            p.grad = None

    # -- step_sync (caller's thread)

    def _send_group(self, lane: Lane, record: StepRecord) -> None:
        """The small parameters of one device: validated, then one buffer each way."""
        opt = self.opt
        params = [p for p in self.grouped[lane.transport.device] if p.grad is not None]
        for p in params:
            try:
                check.gradient(p, opt._param_index[p], opt._layout.get(p))
            except (RuntimeError, ValueError) as exc:
                record.fail(exc)
        if not params or record.failed:
            return
        new = [p for p in params if not opt.state.get(p)]
        for p in new:
            opt._layout[p] = (p.shape, p.dtype)
        grads, ticket = lane.transport.group_to_host(params, bool(new))
        outs = lane.transport.group_out(params)
        writeback = WriteBack(functools.partial(lane.transport.group_to_device, params),
                              len(params))
        new_ids = {id(p) for p in new}
        for p, grad, out in zip(params, grads, outs):
            self._release(p, p.grad, lane)
            job = self._job(p, record, grad, out, 1, id(p) in new_ids, lane.transport)
            lane.queue.put(Piece(job, 0, p.numel(), ticket, writeback))

    def sync(self) -> StepStats:
        entered = time.perf_counter()
        record = self._current_record()
        for lane in self.lanes.values():
            try:
                self._send_group(lane, record)
            except Exception as exc:  # noqa: BLE001
                record.fail(exc, f"sending the small parameters of {lane.transport.device}")
        flushes = [(lane, lane.call(functools.partial(lane.flush, record)))
                   for lane in self.lanes.values()]
        for lane, unit in flushes:
            lane.wait(unit)  # the worker has updated, or dropped, every piece of this step
        waited = time.perf_counter() - entered
        for lane in self.lanes.values():
            lane.transport.finish()  # the current stream waits for the copies back
        with self._record_lock:
            self._record = None
        self._warm = self._warm or (bool(record.jobs) and not record.failed)
        stats = self._stats(record, waited)
        self.opt.last_step_stats = stats
        if record.failed:
            _raise_step_error(record)
        if len(self.opt._param_index) != len(self.group_of):  # checked once the step is done
            raise RuntimeError("parameters were added after attach_hooks() and are never "
                               "updated: call opt.detach_hooks(), then opt.attach_hooks(model)")
        if self.tuner is not None and not record.held:
            self.tuner.after_step(self, stats, backward_s=entered - record.began)
        return stats

    def _stats(self, record: StepRecord, waited: float) -> StepStats:
        stats = StepStats(host_update_s=record.host_update_s, sync_wait_s=waited,
                          num_params=len(record.updated), num_batches=record.num_batches)
        for lane in self.lanes.values():
            copies = lane.transport.take_stats()
            stats.d2h_s += copies.d2h_s
            stats.h2d_s += copies.h2d_s
            stats.d2h_bytes += copies.d2h_bytes
            stats.h2d_bytes += copies.h2d_bytes
        if getattr(self.opt, "_tier", None) is not None:
            self.opt._tier.take_io(stats)  # the NVMe tier's bytes and I/O wait
        stats.wall_s = time.perf_counter() - record.began
        return stats

    def run_on_workers(self, fn: Callable[[torch.device, list], None]) -> None:
        """fn(device, params) on each device's worker thread (e.g. to convert state there)."""
        calls = []
        for device, lane in self.lanes.items():
            params = [p for p in self.group_of if p.device == device]
            calls.append((lane, lane.call(functools.partial(fn, device, params))))
        for lane, unit in calls:
            lane.wait(unit)

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def detach(self) -> None:
        if self._record is not None:
            raise RuntimeError("detach_hooks() during a step: call opt.step_sync() first")
        self._finalizer()
        for lane in self.lanes.values():
            lane.thread.join(timeout=5.0)
            lane.transport.close()


def _model_params(model: torch.nn.Module, owned: list) -> list:
    owned_ids = {id(p) for p in owned}
    found = [p for p in model.parameters() if id(p) in owned_ids]
    if not found:
        raise ValueError("attach_hooks(model): none of the model's parameters belong to this "
                         "optimizer; pass the model whose parameters you gave the optimizer")
    return found


def _hook(pipeline_ref: "weakref.ref[Pipeline]") -> Callable[[torch.Tensor], None]:
    def post_accumulate_grad_hook(p: torch.Tensor) -> None:
        pipeline = pipeline_ref()
        if pipeline is not None:
            pipeline.on_grad(p)
    return post_accumulate_grad_hook


def _shut_down(handles: list, queues: list) -> None:
    for handle in handles:
        handle.remove()
    for units in queues:
        units.put(_STOP)


def _raise_step_error(record: StepRecord) -> None:
    exc, where = record.errors[0]
    if record.updated:
        done = (f"this step had already updated parameters {sorted(record.updated)}; the other "
                f"parameters and their state are as before the step")
    else:
        done = "no parameter or optimizer state was changed by this step"
    if where:
        raise RuntimeError(f"adambridge: {where} failed ({type(exc).__name__}: {exc}); "
                           f"{done}") from exc
    raise type(exc)(f"{exc}; {done}") from None


def attach(opt: Any, model: Optional[torch.nn.Module] = None, **options: Any) -> Pipeline:
    """Attach hooks for ``opt`` (see AdamBridge.attach_hooks); ``options`` are for tests."""
    pipeline = Pipeline(opt, model, **options)
    opt._pipeline = pipeline
    cpus = _pool_cpus(pipeline)
    if opt._resolve_backend() == "native":
        _configure_pool(opt, cpus)
    if opt.autotune_config is not None:
        from . import autotune
        pipeline.tuner = autotune.Tuner(opt.autotune_config, opt.autotune_log)
        autotune.tune_threads_once(opt, cpus=cpus)
    return pipeline


def _pool_cpus(pipeline: Pipeline) -> tuple[int, ...]:
    """The native pool is process-wide: pin it only when every device shares one node."""
    opt = pipeline.opt
    sets = {worker_cpus(device, opt.numa_aware) for device in pipeline.lanes}
    if len(sets) == 1:
        return sets.pop()
    _log.info("devices on several NUMA nodes: the native thread pool stays unpinned")
    return ()


def _configure_pool(opt: Any, cpus: tuple[int, ...]) -> None:
    if cpus or opt.num_threads is not None:
        from ._native import loader
        loader.set_num_threads(opt.num_threads or len(cpus), cpus)
