"""A step that timed out: what its worker may still change, and the guard that waits for it.

When finish() stops waiting for a worker thread (``ADAMBRIDGE_SYNC_TIMEOUT``), the worker
may be inside a kernel call or a copy that writes master, moments and weights in place:
nothing can take that back, and nothing can stop it. So the step's error names what may
still change, and until the worker has answered the last call finish queued on it, the
optimizer refuses every ``step()`` with a backward before it, ``state_dict()``,
``load_state_dict()`` and ``attach_hooks()``, in one line.

``opt.step()`` with no backward before it waits for the late work (bounded again) and
reports what it left, as after any failed step: each parameter's ``state["step"]`` says
whether it took the step. Training then goes on from there. A step whose backward ran
before that is refused with nothing of it applied (its forward may have read weights the
late update was writing); its gradients stay in ``p.grad``.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

from .work_items import StepRecord

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

# The longest step() waits for the workers (ADAMBRIDGE_SYNC_TIMEOUT, seconds).
SYNC_TIMEOUT_S = float(os.environ.get("ADAMBRIDGE_SYNC_TIMEOUT", "600"))

_log = logging.getLogger("adambridge")
_POLL_S = 0.1
_WAIT_HINT = "call opt.step() with no backward before it to wait for that update to end"
# optimizer -> its unfinished LateWork (weak: a collected optimizer needs no guard)
_pending: "weakref.WeakKeyDictionary[Any, LateWork]" = weakref.WeakKeyDictionary()


class LateWork:
    """The calls a timed-out step left on its worker threads, and the optimizer's guard."""

    def __init__(self, opt: OptimizerDoor, record: StepRecord, waits: list, running: list) -> None:
        # The record's lock and the list the late commits extend, not the record: its errors'
        # tracebacks hold the frames of the step() that timed out, and so the optimizer.
        self._lock, self._updated = record.lock, record.updated
        self.waits = waits  # [(worker thread, `done` of the last Call finish queued on it)]
        self.running = sorted(set(running))
        with self._lock:
            self.committed = sorted(set(self._updated) - set(self.running))
        self.attached = True  # while its pipeline is attached, that pipeline's finish() asks
        self.closed = False
        self._handles = [opt.register_step_pre_hook(_before_step),
                         opt.register_state_dict_pre_hook(_before_state_dict),
                         opt.register_load_state_dict_pre_hook(_before_load_state_dict)]
        _pending[opt] = self

    def ended(self) -> bool:
        """Whether every worker has answered (or died: then nothing more can change)."""
        return all(done.is_set() or not thread.is_alive() for thread, done in self.waits)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for thread, done in self.waits:
            while not done.wait(_POLL_S) and thread.is_alive():
                if time.monotonic() > deadline:
                    return False
        return True

    def left_behind(self) -> str:
        """What the timed-out step may still change, for its error (one line)."""
        running = (f"parameters {self.running} were in a worker call that has not returned "
                   f"and may still change, with their state, when it does (each one's "
                   f"state[\"step\"] then says whether it took the step)"
                   if self.running else "no update was running, but the worker's queue "
                   "had not been reached")
        done = (f"; parameters {self.committed} had taken the step (their new weights may "
                f"still be copied back)" if self.committed else "")
        return (f"{running}{done}; the other parameters and their state are as before the "
                f"step; until that call returns, step() after a backward, state_dict(), "
                f"load_state_dict() and attach_hooks() are refused: {_WAIT_HINT}")

    def refusal(self, what: str) -> str:
        return (f"adambridge: {what} refused: the update that timed out at the last step "
                f"has not ended (parameters {self.running} may still change); {_WAIT_HINT}")

    def close(self, opt: OptimizerDoor) -> str:
        """Lift the guard once the work has ended; returns what the timed-out step left."""
        for handle in self._handles:
            handle.remove()
        self.closed = True
        if _pending.get(opt) is self:
            del _pending[opt]
        with self._lock:
            took = sorted(set(self._updated))
        return (f"the update that timed out has ended: parameters {took} took that step "
                f"(their state[\"step\"] says so), the others did not")

    def settle(self, opt: OptimizerDoor, backward_ran: bool, timeout_s: float) -> None:
        """The first step after the timeout: wait (only without a backward), then raise or
        lift the guard. Nothing of this step is applied either way."""
        ended = self.ended() if backward_ran else self.wait(timeout_s)
        report = self.close(opt) if ended else ""
        if backward_ran:
            tail = report if ended else f"parameters {self.running} may still change; {_WAIT_HINT}"
            raise RuntimeError(f"adambridge: step() refused, nothing of it was applied: its "
                               f"backward ran before the update that timed out at the last "
                               f"step had ended and been accounted for, so its forward may "
                               f"have read weights that update was writing; its gradients "
                               f"are left in p.grad: zero them and run the batch again; "
                               f"{tail}")
        if not ended:
            raise TimeoutError(f"adambridge: the update that timed out at the last step has "
                               f"still not returned after a further {timeout_s:g} s "
                               f"(parameters {self.running} may still change); {_WAIT_HINT}, "
                               f"or raise ADAMBRIDGE_SYNC_TIMEOUT")
        _log.warning("adambridge: %s", report)


def pending(opt: OptimizerDoor) -> "LateWork | None":
    late = _pending.get(opt)
    return None if late is None or late.closed else late


def check_attach(opt: OptimizerDoor) -> None:
    """attach_hooks(): refused while a detached pipeline's late work runs; lifted if ended."""
    late = pending(opt)
    if late is None:
        return
    if not late.ended():
        raise RuntimeError(late.refusal("attach_hooks()"))
    _log.warning("adambridge: %s", late.close(opt))


def _before_step(opt: OptimizerDoor, args: Any, kwargs: Any) -> None:
    late = pending(opt)
    if late is None or late.attached:
        return  # the attached pipeline's finish() settles it, with its own step record
    params = (p for group in opt.param_groups for p in group["params"])
    late.settle(opt, any(p.grad is not None for p in params), SYNC_TIMEOUT_S)


def _before_state_dict(opt: OptimizerDoor) -> None:
    late = pending(opt)
    if late is not None and not late.ended():
        raise RuntimeError(late.refusal("state_dict()"))


def _before_load_state_dict(opt: OptimizerDoor, state_dict: Any) -> None:
    late = pending(opt)
    if late is not None and not late.ended():
        raise RuntimeError(late.refusal("load_state_dict()"))
