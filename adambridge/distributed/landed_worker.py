"""The worker thread behind the distributed async modes: update what has landed, in batches.

fsdp_async.ShardUpdater (FSDP2 shards) and zero_async.RangeUpdater (shard_state ranges) both
take a reduced gradient in a hook during backward, queue its work, and let one thread update
every piece that has landed since its last batch with the synchronous step's own code; the
step waits for that thread. This module holds what the two share: the thread and its queue,
the bookkeeping of one step (seen, done, errors, pending), and the refusal of the step-wide
facts (clipping, GradScaler) that neither mode can apply once pieces were updated.
"""
from __future__ import annotations

import logging
import queue
import threading
import weakref
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from ..pipeline import interception, step_wide

_log = logging.getLogger("adambridge")
_STOP = object()
_WAIT_S = 0.1


class LandedWorker(ABC):
    """Base of the distributed updaters: ``_update(batch)`` is the subclass's update, each
    work item a tuple whose first element is its parameter; ``_refuse_fact(what)`` raises."""

    lanes: dict = {}  # no device lanes or staging buffers (host_memory.breakdown reads it)

    def _start_worker(self, name: str, label: str) -> None:
        """Start the thread ``adambridge-<name>``; ``label`` names the mode in errors."""
        self._label = label
        self._held = True           # the first step: hooks record nothing, step() updates
        self._holds_always = False  # a hyperparameter was written after backward once
        self._hyper_read = None     # step_wide.hyper_inputs at this step's first hook
        self._taken: dict = {}      # p -> (p.grad, its version) as this step took it
        self._consumed: set = set()  # ids of parameters whose gradient a step released
        self._warned_edits = False
        self._seen: set = set()     # parameters whose reduced gradient arrived in this step
        self._done: set = set()     # ... and were updated by the worker
        self._errors: list = []
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=_work, args=(weakref.ref(self), self._queue),
                                        name=f"adambridge-{name}", daemon=True)
        self._thread.start()
        interception.register(self)

    def _note_hyper(self) -> None:
        """At each hook: keep what the step's updates read of the groups (the first hook's)."""
        if self._hyper_read is None:
            self._hyper_read = step_wide.hyper_inputs(self.opt.param_groups)

    def _first_of_step(self, p: Any) -> bool:
        """Record p's gradient in this step; False (and an error kept) on a second one."""
        with self._cond:
            if self._errors:
                return False
            if p in self._seen:
                self._errors.append(RuntimeError(self._second_gradient(p)))
                return False
            self._seen.add(p)
        return True

    def _enqueue(self, work: tuple) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(work)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._errors.append(exc)

    def _run(self, batch: list) -> None:
        try:
            with self._cond:
                skip = bool(self._errors)
            if not skip:
                self._update(batch)
                with self._cond:
                    self._done.update(work[0] for work in batch)
        except Exception as exc:  # noqa: BLE001 - raised by finish, in the caller's thread
            self._fail(exc)
        finally:
            with self._cond:
                self._pending -= len(batch)
                self._cond.notify_all()

    @abstractmethod
    def _second_gradient(self, p: Any) -> str:
        """The error for a second reduced gradient of ``p`` before the step."""

    @abstractmethod
    def _update(self, batch: list) -> None:
        """Update every work item of ``batch`` (the synchronous step's own code)."""

    def _wait(self) -> None:
        with self._cond:
            while self._pending:
                if not self._thread.is_alive():
                    raise RuntimeError(f"adambridge: the {self._label} update thread died; "
                                       f"detach_hooks() and attach again")
                self._cond.wait(_WAIT_S)

    @property
    def holds_always(self) -> bool:
        """Whether every step is held until step() (a gradient or hyperparameter written
        after backward was seen, or ``attach_hooks(edits_grads=True)``)."""
        return self._holds_always

    @holds_always.setter
    def holds_always(self, value: bool) -> None:
        self._holds_always = self._holds_always or bool(value)

    def _note_grad(self, p: Any) -> None:
        """p.grad as this step takes it (its final, reduced gradient): a loop that changes
        it before step() is seen there (``_check_grad_edits``)."""
        if p.grad is not None:
            self._taken[p] = (p.grad, self._fingerprint(p.grad))

    def _fingerprint(self, grad: Any) -> Any:
        """What changes when ``grad`` is written in place: its version counter (the FSDP2
        updater overrides it: DTensor writes miss the counters)."""
        return grad._version

    def _end_step(self) -> tuple:
        """Wait for the worker; this step's (done, errors, held), the records reset."""
        self._wait()
        taken = frozenset(self._done), list(self._errors), self._held
        self._edited = [p for p, (grad, mark) in self._taken.items()
                        if p.grad is not grad or self._fingerprint(grad) != mark]
        self._seen, self._done, self._errors, self._taken = set(), set(), [], {}
        # what this step's updates read: the next step's first hook reads it again, even
        # when this step raises before _check_hyper_writes
        self._hyper_at_end, self._hyper_read = self._hyper_read, None
        return taken

    def _check_hyper_writes(self, updated: int) -> None:
        """At step(): were lr, betas, eps or weight_decay written after this step's first
        hook? Its updates read them then, and torch's step() reads them now.

        No copy of the state is kept to redo an update (a third of the optimizer's memory
        again), so from the first such write every step is held: the hooks update nothing
        and step() updates with what it sees, as sync does. Where updates were already made
        with the old values (a first write after held steps), that step is off by their
        difference, and the warning says so.
        """
        read = self._hyper_at_end
        if read is None or self._holds_always or step_wide.same_inputs(
                read, step_wide.hyper_inputs(self.opt.param_groups)):
            return
        self._holds_always = True
        made = (f": {updated} parameters of this step had been updated with the values read "
                f"during backward" if updated else "")
        _log.warning("adambridge: a param group's lr, betas, eps or weight_decay was written "
                     "between backward and step() with attach_hooks() on %s%s; from now on "
                     "every step is held until step() (no overlap with backward) and uses the "
                     "values step() sees, as torch does; write them before the backward to "
                     "keep the overlap", self._label, made)

    def _check_grad_edits(self, done: Any) -> Optional[RuntimeError]:
        """At step(): did the loop change a gradient between backward and step()? The
        synchronous step reads p.grad now, and does for every step from now on (held: exact,
        no overlap); a shard this step already updated from the old gradient cannot be
        redone (no copy of its state is kept): the error says how many."""
        edited = self._edited
        if not edited:
            return None
        self._holds_always = True
        if not self._warned_edits:
            self._warned_edits = True
            _log.warning("adambridge: a gradient was changed between backward and step() with "
                         "attach_hooks() on %s; from now on every step is held until step() "
                         "(no overlap with backward) and uses the gradients step() sees, as "
                         "torch does", self._label)
        updated = [p for p in edited if p in done]
        if not updated:
            return None
        return RuntimeError(f"adambridge: the gradient of parameter {self.opt.index(updated[0])} "
                            f"(and {len(updated) - 1} more) was changed between backward and "
                            f"step(), after {self._label} async mode had updated its shard from "
                            f"it; pass attach_hooks(model, edits_grads=True), or change "
                            f"gradients from the first step after attach_hooks()")

    def _release_grads(self) -> None:
        """After a finished step: every gradient it applied leaves p.grad (release_grads)."""
        # NOTE: one process's hooks release each gradient they take, so a loop without
        # zero_grad() never adds a new backward onto an applied gradient; DDP's buckets and
        # FSDP2's sharded gradients stay in p.grad until the step, which updated every
        # parameter that has one, so the step releases them all.
        opt = self.opt
        if opt.release_grads:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._consumed.add(id(p))
                    p.grad = None

    def zero_grads_kept(self, params: Optional[list] = None) -> None:
        """After zero_grad(set_to_none=False): zeros for each gradient a step released, as
        torch's zeroing would leave them (the next reduced gradient accumulates into them;
        a parameter that gets none steps on them, as in sync mode)."""
        opt = self.opt
        owned = [p for group in opt.param_groups for p in group["params"]]
        ids = None if params is None else {id(p) for p in params}
        for p in owned:
            if p.grad is None and id(p) in self._consumed and (ids is None or id(p) in ids):
                p.grad = torch.zeros_like(p)

    def _stop_worker(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
        interception.unregister(self)

    # --- the step-wide facts interception routes here: refused by the subclass

    @abstractmethod
    def _refuse_fact(self, what: str) -> None:
        """Raise the one-line refusal of ``what``, saying what this step already updated."""

    def clip_grad_norm(self, *args: Any) -> Any:
        self._refuse_fact("clip_grad_norm_")

    def clip_with_norm(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_fact("clip_grads_with_norm_")

    def settled_grads(self, *args: Any) -> list:  # a clip_grad_norm_ over several optimizers
        self._refuse_fact("clip_grad_norm_")
        return []

    def unscale_grads(self, *args: Any) -> dict:
        self._refuse_fact("GradScaler")
        return {}


def with_suffix(exc: BaseException, suffix: str) -> BaseException:
    """``exc`` again, its message followed by ``suffix`` (what the failed step had updated)."""
    try:
        return type(exc)(f"{exc}{suffix}")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return RuntimeError(f"{type(exc).__name__}: {exc}{suffix}")


def _work(ref: "weakref.ref[LandedWorker]", jobs: "queue.Queue[Any]") -> None:
    """The worker: every piece that has landed, in one batch, until told to stop."""
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        batch = [job]
        while True:  # take everything else that has landed meanwhile
            try:
                more = jobs.get_nowait()
            except queue.Empty:
                break
            if more is _STOP:
                jobs.put(_STOP)
                break
            batch.append(more)
        updater = ref()
        if updater is None:
            return
        updater._run(batch)
        del updater
