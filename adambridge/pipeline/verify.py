"""``ADAMBRIDGE_VERIFY_ASYNC=N``: the first N async steps checked against sync mode, bit for bit.

For a user who doubts async mode on their own loop (a framework, callbacks that touch
gradients, a custom clip): set the variable (or ``attach_hooks(model, verify_steps=N)``) and
run the loop unchanged, through the Trainer, accelerate or Lightning too. For the first N
steps after ``attach_hooks``:

- each hook keeps, beside the host copy the update uses, a copy of the gradient on its own
  device, the *shadow*: the gradient as sync mode would hold it. Every operation the loop
  runs on ``p.grad`` (a GradView, pipeline/grad_views.py) runs on the shadows too, as torch
  runs it on a device gradient, and a read whose value differs between the two raises at
  once; an assigned ``p.grad`` becomes the shadow as it is taken;
- every update keeps a copy of the state it started from (as a redo does);
- at ``step()``, once the step's updates are done, each parameter's update is made again
  from that copy, with the shadow and the group's hyperparameters as step() sees them, on
  scratch tensors (the synchronous step's own arithmetic), and compared with what async mode
  left: the master, both moments (and fp8 scales) and the parameter's own values.

A difference raises one line naming the step, the parameter and its most likely cause. When
the N steps have passed, one log line says how many updates were checked, and the checks
cost nothing more (a None test per hook). The shadows take one more copy of each gradient on
its device, and the state copies 12, 8 or ~6 B per parameter of host RAM, during those steps.
Parameters whose state the NVMe tier streams (``offload_dir``) are not checked (their state
before the update is in files): the summary line counts them.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from . import step_wide
from ..update import state as host_state
from ..update.codecs import stream_key
from ..update.functional import Hyper, adamw_update
from .work_items import Job, StepRecord

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_log = logging.getLogger("adambridge")
ENV = "ADAMBRIDGE_VERIFY_ASYNC"


def steps_to_verify(verify_steps: Optional[int]) -> int:
    """How many steps to check: the argument, else ``ADAMBRIDGE_VERIFY_ASYNC``, else 0."""
    if verify_steps is not None:
        if isinstance(verify_steps, bool) or not isinstance(verify_steps, int) \
                or verify_steps < 0:
            raise ValueError(f"Invalid verify_steps: {verify_steps!r} (expected an int >= 0)")
        return verify_steps
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0
    try:
        steps = int(raw)
    except ValueError:
        steps = -1
    if steps < 0:
        raise ValueError(f"Invalid {ENV}={raw!r}: expected the number of steps to check, an "
                         f"int >= 0 (0 or unset: no check)")
    return steps


class Verifier:
    """The check of one pipeline's first ``steps`` steps."""

    def __init__(self, steps: int) -> None:
        self.left, self.step, self.checked, self.streamed = steps, 0, 0, 0

    @property
    def active(self) -> bool:
        return self.left > 0

    def check(self, opt: OptimizerDoor, record: StepRecord, shadows: dict, backend: str) -> None:
        """After the step's updates: each one made again from its copy, compared."""
        self.step += 1
        if not record.failed and not record.skip:
            for job in record.jobs.values():
                self._check_job(opt, job, shadows.get(id(job.p)), backend)
        self.left -= 1
        if not self.active:
            skipped = f"; {self.streamed} in the NVMe tier were not checked" \
                if self.streamed else ""
            _log.warning("adambridge: %s: the first %d steps of async mode equal sync mode bit "
                         "for bit (%d parameter updates checked%s)", ENV, self.step,
                         self.checked, skipped)

    def _check_job(self, opt: OptimizerDoor, job: Job, shadow: Optional[torch.Tensor],
                   backend: str) -> None:
        if job.streamed or not job.saved_state or job.state is None:
            self.streamed += 1
            return
        grad = job.grad if shadow is None else shadow.detach().reshape(-1).to("cpu")
        twin, out = _sync_twin(opt, job, grad, backend)
        live = _live_values(opt, job)
        for key, value in twin.items():
            if value is not None and not _same_bits(value, live[key]):
                raise RuntimeError(self._mismatch(job, key, value, live[key], grad))
        if out is not None and not _same_bits(out, live["param"]):
            raise RuntimeError(self._mismatch(job, "param", out, live["param"], grad))
        self.checked += 1

    def _mismatch(self, job: Job, key: str, sync: torch.Tensor, ours: torch.Tensor,
                  grad: torch.Tensor) -> str:
        where = int((_bits(sync) != _bits(ours)).nonzero()[0])
        if not _same_bits(grad, job.grad):
            cause = ("the gradient the update used is not the one sync mode would use: "
                     "something changed the gradient after backward by a path async mode "
                     "did not see (a write through memory it does not own: a C extension, a "
                     "tensor taken inside backward)")
        elif any(used is not None and used != Hyper.for_group(job.group, job.step)
                 for used in job.hypers):
            cause = ("a hyperparameter of its group changed after the update was made and "
                     "the correction differs from sync mode's")
        else:
            cause = "the update itself differs from sync mode's: an adambridge bug, please " \
                    "report this line"
        ours_at, sync_at = float(ours.view(-1)[where]), float(sync.view(-1)[where])
        return (f"adambridge ({ENV}): step {self.step}, parameter {job.index}: async mode's "
                f"{key} differs from sync mode's at element {where} ({ours_at!r} against "
                f"{sync_at!r}); most likely cause: {cause}")


def _sync_twin(opt: OptimizerDoor, job: Job, grad: torch.Tensor, backend: str) -> tuple:
    """(master and moments, the parameter's own values or None) of job's update made again
    on scratch copies of the state it started from, with ``grad``."""
    scratch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in job.state.items()}
    for (start, end), saved in job.saved_state.items():
        views = host_state.range_views(scratch, start, end)
        for key, value in zip(step_wide.SAVED_KEYS, saved):
            if value is not None:
                views[key].copy_(value)
    p = job.p
    out = None if p.dtype == torch.float32 else torch.empty(p.numel(), dtype=p.dtype)
    hyper = Hyper.for_group(job.group, job.step)
    key = stream_key(opt.seed, job.step, job.index)
    items = [host_state.range_item(scratch, grad=grad[start:end], start=start, key=key,
                                   out=None if out is None else out[start:end], hyper=hyper,
                                   stochastic_rounding=opt.stochastic_rounding)
             for start, end in sorted(job.saved_state)]
    adamw_update(items, backend)
    twin = {k: scratch.get(k) for k in step_wide.SAVED_KEYS}
    return twin, (scratch["master"] if out is None else out)


def _live_values(opt: OptimizerDoor, job: Job) -> dict:
    live = {k: job.state.get(k) for k in step_wide.SAVED_KEYS}
    live["param"] = job.p.detach().reshape(-1).to("cpu")
    return live


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (so NaNs and signed zeros compare as stored)."""
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def _same_bits(a: torch.Tensor, b: Optional[torch.Tensor]) -> bool:
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(_bits(a), _bits(b.to(a.device)))


def same_read(a: Any, b: Any) -> bool:
    """Whether two results of the same read (tensors, numbers, lists of them) agree bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _same_bits(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same_read, a, b))
    return a == b or (a != a and b != b)  # (NaN equals NaN here)
