"""The loop's gradients after the hooks have taken them: what p.grad is, and what a write may do.

Mixed into pipeline.Pipeline. The promise is sync mode's: whatever the loop does to a
gradient between ``backward()`` and ``step()`` (reads it, edits it in place, assigns a new
one, zeroes it, through any function, bound whenever, at any size) acts on the gradient the
update uses, or is refused in one line before anything changed. The mechanism covers the
class instead of a list of functions:

- **Reads are served.** The hook that takes p's gradient puts a GradView of it in p.grad
  (pipeline/grad_views.py): every operation on it reads the step's own copy of the gradient.
- **Writes are seen before they happen.** A write to a GradView first asks
  ``allow_grad_write``: the step is settled (what lands from now on is held, nothing runs on
  the workers), then the write goes ahead if p's update has not been made yet, or was made
  with a copy of its state kept (finish then redoes it from that copy, exactly, as a firing
  clip is redone: pipeline/step_wide.py); an update made without that copy cannot be
  redone, so the write is refused, and the step fails, before the gradient changes.
- **Assignments are taken at the step.** ``p.grad = masked`` replaces the view; the settle of
  a routed fact and ``finish`` take the new tensor as the gradient (``_take_reassigned``),
  under the same rule.
- **The loop is watched from its first step.** That step is held (pipeline/hooks.py), so a
  loop that changes gradients every step shows it before any update is made; from then on
  every step keeps the copy a redo needs (``edits_grads``; 12, 8 or ~6 B per parameter), and a
  step right after one where the loop wrote a gradient is held, as speculating for a loop
  that changes every gradient would only do the update twice. ``attach_hooks(edits_grads=True)``
  keeps the copy from the start, for a loop whose first change comes later.
- **The step consumes its gradients.** With ``release_grads=True`` p.grad is None after
  ``step()``; ``zero_grad(set_to_none=False)`` then gives every parameter that had a gradient
  zeros again, as torch's would (made only if something writes them), so a parameter that
  receives no gradient (an MoE expert without tokens) steps on zeros as in sync mode.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

from . import verify
from .grad_views import GradView, StepSource, current_write, plain, retire, zeros_like
from .work_items import Job, StepRecord


def second_gradient_error(index: int) -> RuntimeError:
    """A parameter's gradient arrived twice in one step (two backward passes, or reentrant
    activation checkpointing using it twice)."""
    return RuntimeError(f"parameter {index} received a second gradient before the optimizer "
                        f"step; wrap the earlier backward passes of the step in `with "
                        f"opt.accumulate():`, or pass accumulation_steps=N to attach_hooks; "
                        f"within one backward, a parameter used in more than one "
                        f"torch.utils.checkpoint(use_reentrant=True) region gets a gradient "
                        f"from each: pass use_reentrant=False")


def recomputed_gradient_error(index: int) -> RuntimeError:
    """A new backward after the step's gradient of a parameter was discarded (p.grad set to
    None between two passes, as SAM and ASAM do): accumulating would not be that loop."""
    return RuntimeError(f"adambridge: parameter {index} received a new gradient in a step "
                        f"whose earlier gradient was discarded (p.grad set to None between "
                        f"two backward passes, as SAM and ASAM do); async mode cannot "
                        f"recompute a step's gradients yet: run this loop in sync mode "
                        f"(opt.detach_hooks()), which gives its exact result")


class GradEditsMixin:
    """Pipeline methods that keep p.grad faithful between backward and step()."""

    def _init_grad_edits(self, edits_grads: bool) -> None:
        self._views: dict = {}        # p -> the GradView a hook put in p.grad this step
        self._sources: dict = {}      # id(p) -> its StepSource, armed by each step's hook
        # p -> (the tensor in p.grad whose values the step took, its version, its tickets):
        # sent without a hook (it stays in p.grad), or assigned over a view
        self._taken: dict = {}
        self._consumed: set = set()   # ids of parameters a finished step took a gradient of
        self.edits_grads = edits_grads  # keep what redoes an update, every step from now on
        self.edits_changed = False    # the last step's loop changed gradients: hold the next
        self.last_edit = ""           # which write, where (StepStats.held_by, the log line)

    # -- the hook's side

    def put_view(self, p: torch.Tensor, grad: torch.Tensor, host: torch.Tensor,
                 tickets: Any) -> None:
        """p.grad becomes a view of the step's gradient (``host``, and ``grad`` if kept)."""
        source = self._sources.get(id(p))
        if source is None:
            source = self._sources[id(p)] = StepSource(self, p)
        shadow = grad.detach().clone() if self._verifying() else None
        source.arm(host, None if self.opt.release_grads else grad, tickets, shadow)
        view = GradView(grad, source)
        self._views[p] = view
        p.grad = view

    # -- a write to a view, or an assigned p.grad (the caller's thread)

    def allow_grad_write(self, p: torch.Tensor) -> None:
        """Before anything writes p's gradient: settle the step, then allow or refuse."""
        task = torch._C._current_graph_task_id()
        if task != -1:  # written inside backward: backward raises, so the step fails as
            self._open_tasks.add(task)  # after any interrupted pass
            caller = _first_frame_outside(_LIBRARY_DIRS[1:])  # (adambridge's own only)
            if caller is None or caller.f_code.co_filename.startswith(_LIBRARY_DIRS[0]):
                raise second_gradient_error(self.opt.index(p))  # autograd accumulating
            raise _hook_write_error(self.opt.index(p), caller)
        record = self._record or self._current_record()
        if not record.settled:  # once a step: from then on what lands is held, none runs
            self.last_edit = _describe_write(self.opt.index(p))
            record = self._settled(("grad_write", self.last_edit))
        job = record.jobs.get(p)
        if job is not None:
            self._check_writable(record, [job], "a write to p.grad")
            self._note_edit(record, job)

    def changed_grads_this_step(self) -> bool:
        """Whether the loop has already changed a gradient of this step (it is held)."""
        record = self._record
        return record is not None and bool(record.loop_edits)

    def _note_edit(self, record: StepRecord, job: Job) -> None:
        if job.speculative and job.grad_before is None:  # what the update used: finish
            job.grad_before = job.grad.clone()  # compares it and redoes the update
        record.loop_edits.append(job)
        self.edits_grads = True

    def _check_writable(self, record: StepRecord, jobs: list, what: str) -> None:
        """Refuse (and fail the step) if a job's update was made with no copy to redo it."""
        for job in jobs:
            if job.streamed or len(job.saved_state) < len(job.updated_ranges):
                exc = _unredoable(job, what)
                record.fail(exc)
                raise exc

    def note_sent(self, p: torch.Tensor, tickets: tuple) -> None:
        """A gradient without a hook was sent from p.grad, which keeps it: later writes to it
        (through a reference the loop took earlier, say) are taken again at the step."""
        self._taken[p] = (p.grad, p.grad._version, tickets)

    def _take_reassigned(self, record: StepRecord) -> None:
        """p.grad replaced since the step took it (``p.grad = masked``), or a gradient sent
        from p.grad written since: those values are the gradient."""
        for p, job in record.jobs.items():
            grad, view = p.grad, self._views.get(p)
            if (view is None and p not in self._taken) or grad is view or \
                    self._still_taken(p, grad):
                continue
            if grad is None:
                raise RuntimeError(f"adambridge: the gradient of parameter {job.index} was set to "
                                   f"None after backward, which would leave it out of the step "
                                   f"in sync mode, but async mode has taken it already; freeze "
                                   f"it before the backward (requires_grad_(False)) instead")
            self.opt.check_gradient(p)
            self._check_writable(record, [job], "assigning p.grad")
            self._note_edit(record, job)
            for ticket in self._taken.get(p, (None, None, ()))[2]:
                ticket.wait()  # the first copy has landed: it must not land over this one
            job.grad.copy_(plain(grad).reshape(-1))
            self._taken[p] = (grad, grad._version, ())
            if view is not None and self._verifying():  # sync mode's gradient is this one
                view.source.shadow_grad = plain(grad).detach().clone()

    def copy_to_device_twins(self, job: Job) -> None:
        """After a routed fact changed job's host gradient (a clip that fired, GradScaler's
        unscale): every other tensor that holds p's gradient takes those values, the kept
        device gradient and one sent from p.grad (what the loop reads) and the shadow."""
        p, host = job.p, job.grad
        view, taken = self._views.get(p), self._taken.get(p)
        twins = [] if view is None else [view.source.kept, view.source.shadow_grad]
        if taken is not None and taken[0] is p.grad and p.grad is not view:
            twins.append(plain(p.grad))
        for twin in twins:
            if twin is not None and twin.data_ptr() != host.data_ptr():
                twin.copy_(host.view(twin.shape))
        if taken is not None and taken[0] is p.grad:
            self._taken[p] = (p.grad, p.grad._version, taken[2])  # our own write

    def check_norm_read(self, params: list, norm_type: float, total: torch.Tensor) -> None:
        """ADAMBRIDGE_VERIFY_ASYNC: the routed norm against torch's over the shadows."""
        if not self._verifying():
            return
        shadows = self.shadows()
        grads = [shadows.get(id(p)) if self.owns(p) else p.grad for p in params]
        sync = torch.nn.utils.get_total_norm([g for g in grads if g is not None], norm_type)
        if not verify.same_read(total, sync.to(total.device)):
            raise RuntimeError(self.read_mismatch(params[0], "clip_grad_norm_'s total norm",
                                                  total, sync))

    def _verifying(self) -> bool:
        return self.verifier is not None and self.verifier.active

    def _take_assigned(self, record: StepRecord) -> None:
        """``_take_reassigned`` at finish: a refusal fails the step (finish raises it)."""
        try:
            self._take_reassigned(record)
        except (RuntimeError, ValueError) as exc:
            if all(error is not exc for error, _ in record.errors):
                record.fail(exc)

    def _still_taken(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> bool:
        taken = self._taken.get(p)
        return (taken is not None and grad is not None and taken[0] is grad
                and taken[1] == grad._version)

    def shadows(self) -> dict:
        """id(p) -> the gradient sync mode would use (ADAMBRIDGE_VERIFY_ASYNC)."""
        found = {id(p): plain(p.grad) for p in self._taken if p not in self._views}
        found.update((pid, source.shadow_grad) for pid, source in self._sources.items())
        return found

    # -- the step's end

    def end_views(self, record: StepRecord) -> None:
        """Retire this step's views; p.grad is None (consumed) or the kept device gradient."""
        release = self.opt.release_grads
        for p, view in self._views.items():
            source = view.source
            kept = source.kept
            retire(view)
            source.disarm()
            if not release and p.grad is view:
                p.grad = kept
        if release:
            # NOTE: every gradient the step took, so the next backward starts from none even
            # without zero_grad(): a view, one sent from p.grad, or DDP's (written into p.grad
            # by its reducer after the comm hook, it would be added onto by that backward).
            for p in record.jobs:
                p.grad = None
                self._consumed.add(id(p))
        self._views.clear()
        self._taken.clear()
        # (a loop that writes gradients writes them every step, almost always changing them:
        # the next step is held rather than speculated and redone)
        self.edits_changed = bool(record.loop_edits) and not record.failed
        record.loop_edits.clear()

    def restore_plain_grads(self) -> None:
        """detach_hooks(): every view in p.grad (a step's, kept zeros) becomes its values,
        a plain tensor again, for the synchronous steps from now on."""
        for p in self.owned:
            if isinstance(p.grad, GradView):
                p.grad = p.grad.source.read()
        for view in self._views.values():
            source = view.source
            retire(view)
            source.disarm()
        self._views.clear()

    def zero_grads_kept(self, params: Optional[list] = None) -> None:
        """After torch's zero_grad(set_to_none=False) (the optimizer's, or a module's over
        ``params``): zeros for each gradient a step consumed, as torch's would be."""
        for p in self.owned if params is None else params:
            if p.grad is None and id(p) in self._consumed:
                p.grad = zeros_like(p)


def _first_frame_outside(dirs: tuple) -> Any:
    """The innermost Python frame of a file under none of ``dirs`` (None if there is none)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame = frame.f_back
    return frame


def _where(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _hook_write_error(index: int, caller: Any) -> RuntimeError:
    """Code of the user's wrote p.grad inside backward, after the hook had taken it: a
    post-accumulate-grad hook registered after attach_hooks (it runs after ours)."""
    return RuntimeError(f"adambridge: the gradient of parameter {index} was written during "
                        f"backward ({_where(caller)}, a hook of your own?) after async mode "
                        f"had taken it; register your post-accumulate-grad hook before "
                        f"opt.attach_hooks(model), so it runs first, or make the change "
                        f"after backward")


def _describe_write(index: int) -> str:
    """'<op> on p.grad of parameter i at file:line': the write about to run, and the first
    frame of the caller's code (outside torch and adambridge) that made it."""
    caller = _first_frame_outside(_LIBRARY_DIRS)
    where = "" if caller is None else f" at {_where(caller)}"
    return f"{current_write() or 'a write'} on p.grad of parameter {index}{where}"


# torch's and adambridge's own files: the frames a write's location skips
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _unredoable(job: Job, what: str) -> RuntimeError:
    if job.streamed:
        return RuntimeError(f"adambridge: {what} changed the gradient of parameter {job.index} "
                            f"after backward, after the NVMe tier had committed its update "
                            f"(offload_dir); pass attach_hooks(model, edits_grads=True), or "
                            f"change gradients from the first step after attach_hooks()")
    return RuntimeError(f"adambridge: {what} changed the gradient of parameter {job.index} "
                        f"after backward, but async mode had already updated that parameter "
                        f"from it and, as no earlier step of this loop had changed a gradient, "
                        f"kept no copy of its state to redo the update; pass "
                        f"attach_hooks(model, edits_grads=True) to keep one from the first "
                        f"step, or change gradients from the first step after attach_hooks()")


def after_reducer(callback: Any) -> None:
    """Run ``callback`` when this backward ends, after DDP's reducer has written every p.grad
    (its own end-of-backward callback is queued after the last bucket's comm hook, so one
    queued from a comm hook would run before it: this one queues the callback again from
    there, which puts it after every callback queued so far)."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(callback))


def grads_for_host(params: list) -> list:
    """The real tensors behind params' gradients (a zero or kept view's values)."""
    return [plain(p.grad) for p in params]
