"""Asynchronous mode with sharded host state (``shard_state=True``) under DDP.

The hook point is the DDP comm hook of ddp_async.hand_over_reduced: it all-reduces each
bucket (averaged, so ``p.grad`` stays whole and correct on every rank) and hands each
parameter's reduced gradient here, while backward goes on. Only this rank's range of it
(zero.chunk_range) is kept; a worker thread updates every range that has landed in one
batch (zero.update_ranges, the synchronous step's own code, so the bits are those of
``step()``). ``step()`` waits for the worker, updates the ranges no hook delivered, and
runs the synchronous step's all-gather of the new parameter bytes (zero.sync_step with the
updated parameters skipped), so every rank ends with the same whole model.

The first step after ``attach_hooks`` is held (updated by ``step()``), so whatever is
refused there is refused with nothing changed. Before raising, the ranks agree on whether
any of them failed, so one rank's error never leaves the others waiting in the all-gather.

With ``release_grads`` (the default) ``step()`` then sets every gradient it applied to None,
so a loop without ``zero_grad()`` never adds a backward onto an applied gradient.

Limits, each refused in one line: attach_hooks must be given the DDP model itself (its comm
hook must be in place before the first backward; a hook on a plain model would see this
rank's unreduced gradient); no ``max_grad_norm``, torch clipping, GradScaler
or autotune (step-wide facts that exist only after ranges were updated); accumulate with
DDP's ``model.no_sync()`` on the accumulating passes (DDP then reduces nothing and calls no
comm hook), not with ``accumulation_steps``, ``closes_window`` or ``opt.accumulate()``; a
second reduced gradient before ``step()`` is an error.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from . import ddp as ddp_async, fsdp, zero
from .landed_worker import LandedWorker, with_suffix
from ..pipeline import grad_edits
from ..stats import StepStats

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_log = logging.getLogger("adambridge")


def attach(opt: OptimizerDoor, model: Optional[torch.nn.Module], accumulation_steps: int,
           closes_window: Optional[Callable[[], bool]]) -> "RangeUpdater":
    """attach_hooks() for an optimizer with ``shard_state``: hooks through DDP's comm hook."""
    if fsdp.holds_dtensors(opt):
        raise ValueError("shard_state=True with FSDP2 (DTensor) parameters is not supported: "
                         "FSDP2 shards the state already; drop shard_state")
    if accumulation_steps != 1 or closes_window is not None:
        raise ValueError("attach_hooks(accumulation_steps=..., closes_window=...) with "
                         "shard_state=True is not supported; run the accumulating passes "
                         "under DDP's model.no_sync() instead")
    for name, value in (("max_grad_norm", opt.max_grad_norm),
                        ("autotune", opt.autotune_config)):
        if value is not None:
            raise ValueError(f"attach_hooks() with shard_state=True and {name} is not "
                             f"supported; use synchronous opt.step(), or drop {name}")
    owned = [p for group in opt.param_groups for p in group["params"]]
    ddp = ddp_async.wrapper_in(model)
    if ddp is None:
        raise ValueError("attach_hooks() with shard_state=True needs the DDP model (its comm "
                         "hook hands over the all-reduced gradients); pass the "
                         "DistributedDataParallel itself, not its .module, or use "
                         "synchronous opt.step()")
    ddp_async.refuse_foreign_comm_hook(ddp)
    ids = {id(p) for p in model.parameters()}
    updater = RangeUpdater(opt, [p for p in owned if id(p) in ids and p.requires_grad])
    ddp_async.hand_over_reduced(ddp, updater)
    return updater


class RangeUpdater(LandedWorker):
    """The shard_state counterpart of pipeline.Pipeline: ranges, one worker thread, finish()."""

    def __init__(self, opt: OptimizerDoor, params: list) -> None:
        self._opt_ref = weakref.ref(opt)  # the optimizer owns us, not the other way round
        self._shards = zero._Group(opt.shard_group, opt)
        self._group_of = fsdp.GroupLookup(opt)
        self._hooked = {id(p) for p in params}
        self._start_worker("zero", "shard_state")

    @property
    def opt(self) -> Any:
        return self._opt_ref()

    def hooks(self, p: torch.Tensor) -> bool:
        return id(p) in self._hooked

    # ------------------------------------------------------------------ in backward

    def on_grad(self, p: torch.Tensor, reduced: torch.Tensor) -> None:
        """DDP's comm hook: ``reduced`` is p's all-reduced gradient (a bucket view)."""
        if self._hyper_read is None:  # the step's first hook: see p.grad once DDP wrote it
            grad_edits.after_reducer(functools.partial(_note_grads, weakref.ref(self)))
        self._note_hyper()
        if self._held or p.grad is None:
            # No p.grad (the comm hook passes none such): unused by this rank's backward.
            # DDP writes it after the hooks if another rank used it, and step() updates it
            # then; else the synchronous step skips it too.
            return
        opt = self.opt
        if not self._first_of_step(p):
            return
        try:
            opt.check_gradient(p)
            start, end = self._shards.range(opt, p)
            # Only this rank's range crosses to the host (a view on CPU: DDP writes the
            # bucket again only in the next backward, after step() has waited for us).
            work = (p, self._group_of(p), start, end, zero._host_range(reduced, start, end))
        except (RuntimeError, ValueError) as exc:
            self._fail(exc)
            return
        with self._cond:
            if start == end:
                self._done.add(p)  # nothing of p is this rank's
                return
            self._pending += 1
        self._queue.put(work)

    def _second_gradient(self, p: torch.Tensor) -> str:
        return (f"parameter {self.opt.index(p)} received a second reduced gradient before the "
                f"optimizer step (its range was updated with the first); run the "
                f"accumulating passes under DDP's model.no_sync()")

    def _update(self, batch: list) -> None:
        zero.update_ranges(self.opt, batch)

    # ------------------------------------------------------------------ step

    def finish(self) -> None:
        """opt.step(): wait for the worker, update the rest of this rank's ranges, gather."""
        began = time.perf_counter()
        done, errors, held = self._end_step()
        opt = self.opt
        edited = self._check_grad_edits(done)
        if edited is not None:
            errors.append(edited)
        ungraded = [opt.index(p) for p in done if p.grad is None]
        if not errors and ungraded:  # updated, then p.grad dropped: the gather would skip it
            errors.append(RuntimeError(_unused(ungraded[0])))
        if not errors and (getattr(opt, "grad_scale", None) is not None or
                           getattr(opt, "found_inf", None) is not None):
            errors.append(self._refusal("GradScaler", held, self._count_updated(done)))
        self._agree_on_failure(errors, self._count_updated(done))
        self._check_hyper_writes(self._count_updated(done))
        stats = StepStats()
        opt.last_step_stats = stats
        zero.sync_step(opt, stats, began, skip=done)
        stats.num_params += self._count_updated(done)
        self._held = self._holds_always
        self._release_grads()

    def _count_updated(self, done: Any) -> int:
        # ``done`` also holds the parameters of which this rank owns nothing (no state).
        return sum(1 for p in done if self.opt.state.get(p))

    def _agree_on_failure(self, errors: list, updated: int) -> None:
        """Every rank raises if any failed: none is left waiting in the all-gather."""
        g = self._shards
        failed = torch.tensor([int(bool(errors))], dtype=torch.int32, device=g.device)
        g.dist.all_reduce(failed, group=g.group)
        if errors:
            raise _step_error(errors[0], updated)
        if int(failed.item()):
            raise RuntimeError(f"adambridge: the step failed on another rank; "
                               f"{_updated(updated)} and the all-gather was not run, so the "
                               f"ranks' parameters differ: reload a checkpoint")

    def _refusal(self, what: str, held: bool, updated: int) -> RuntimeError:
        done = "nothing was changed" if held else _updated(updated)
        return RuntimeError(f"{what} with attach_hooks() and shard_state=True is not supported "
                            f"({done}); detach_hooks() and use synchronous opt.step()")

    # ------------------------------------------------------------------ step-wide facts

    def _refuse_fact(self, what: str) -> None:
        self._wait()
        with self._cond:
            updated, held = self._count_updated(self._done), self._held
        raise self._refusal(what, held, updated)

    def accumulate(self) -> Any:
        raise RuntimeError("opt.accumulate() with attach_hooks() and shard_state=True is not "
                           "supported; run the accumulating passes under DDP's "
                           "model.no_sync() instead")

    def detach(self) -> None:
        self._hooked = set()  # the comm hook stays (DDP allows one); it only all-reduces now
        try:
            self._wait()
            updated = self._count_updated(self._done)
            if updated:
                _log.warning("adambridge: detach_hooks() dropped an unfinished step whose "
                             "ranges were already updated on this rank (%d parameters) but "
                             "never all-gathered: the ranks' parameters differ", updated)
        finally:
            self._stop_worker()


def _note_grads(ref: "weakref.ref[RangeUpdater]") -> None:
    updater = ref()
    opt = None if updater is None else updater.opt
    if opt is not None:
        for p in (p for group in opt.param_groups for p in group["params"]):
            if updater.hooks(p):
                updater._note_grad(p)


def _unused(index: int) -> str:
    return (f"parameter {index} was updated from DDP's reduced bucket but has no gradient at "
            f"step() (set to None in between); keep p.grad until opt.step()")


def _updated(count: int) -> str:
    return (f"{count} parameters' ranges of this step were already updated on this rank"
            if count else "nothing was updated on this rank")


def _step_error(exc: BaseException, updated: int) -> BaseException:
    return with_suffix(exc, f" ({_updated(updated)})")

