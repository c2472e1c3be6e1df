"""The pipeline's step-wide facts: clipping and GradScaler calls routed here, applied at finish;
hyperparameters written between backward and step(), redone at finish.

Mixed into pipeline.Pipeline. Every entry point first *settles* the step: hold what lands
from now on, send the gradients without hooks, wait until each lane has handled what was
queued; then all of the step's host gradients are in ``record.jobs`` and nothing runs on the
workers, so the gradients can be read and transformed in place here (pipeline/step_wide.py says why
that is exact, and when a speculative update needs ``correct``).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

from . import step_wide
from ..update.functional import Hyper
from .work_items import Job, StepRecord

_log = logging.getLogger("adambridge")

# Why a step's updates wait for a fact (StepStats.held_by): (cause key, words).
CLIP_CAUSE = ("clip", "a clip by the gradient norm (the norm is known only after backward)")
SCALER_CAUSE = ("grad_scaler", "a GradScaler (whether the step is skipped is known only at "
                               "step())")


class FactsMixin:
    """Pipeline methods for clip_grad_norm_, clip_grad_value_, GradScaler and max_grad_norm."""

    def _settled(self, cause: tuple) -> StepRecord:
        """The step settled for ``cause`` (key, words: what waits for it, StepStats.held_by)."""
        record = self._current_record()
        self.send_rest(record, hold=cause)
        self.drain(record)
        record.settled = True
        self._take_reassigned(record)  # p.grad assigned since its hook (pipeline/grad_edits.py)
        return record

    def _jobs_of(self, record: StepRecord, params: list) -> tuple[list, list]:
        """(jobs of our parameters in ``params``, gradients of the others) for a clip call."""
        jobs, others = [], []
        for p in params:
            if p in self.group_of:
                job = record.jobs.get(p)
                if job is not None:
                    jobs.append(job)
            elif p.grad is not None:
                others.append(p.grad)
        return jobs, others

    def _transform(self, record: StepRecord, jobs: list, fn: Callable[[torch.Tensor], None],
                   what: str) -> None:
        """Apply fn to host gradients in place, keeping what a speculative update used; an
        update made without a copy to redo it from is refused first (nothing changes)."""
        self._check_writable(record, jobs, what)
        for job in jobs:
            if job.speculative and job.grad_before is None:
                job.grad_before = job.grad.clone()
            fn(job.grad)
            self.copy_to_device_twins(job)  # what the loop reads of p.grad follows

    # -- routed from torch by pipeline/interception.py (after backward, before the step)

    def clip_grad_norm(self, params: list, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> torch.Tensor:
        record = self._settled(CLIP_CAUSE)
        if math.isfinite(max_norm):
            self.clip_hint = max_norm
        jobs, others = self._jobs_of(record, params)
        total = self._total_norm(jobs, others, norm_type)
        self.check_norm_read(params, norm_type, total)  # (ADAMBRIDGE_VERIFY_ASYNC only)
        if error_if_nonfinite:
            step_wide.check_finite_norm(total, norm_type)
        self._clip(record, jobs, others, total, max_norm)
        record.grad_norm = float(total)
        device = params[0].device if params else torch.device("cpu")
        return total.to(device)

    def clip_with_norm(self, params: list, max_norm: float, total: torch.Tensor) -> None:
        """Clip with a given total norm (torch's clip_grads_with_norm_; the loop took the
        norm itself, as torchtitan's does): it is this step's grad_norm."""
        record = self._settled(CLIP_CAUSE)
        if math.isfinite(max_norm):
            self.clip_hint = max_norm
        jobs, others = self._jobs_of(record, params)
        self._clip(record, jobs, others, total.detach().to("cpu"), max_norm)
        record.grad_norm = float(total)

    def settled_grads(self, params: list) -> list:
        """The gradient each of ``params`` has in this step: the host copy for ours, p.grad
        for the others (None without one), once the step is settled."""
        record = self._settled(CLIP_CAUSE)
        return [record.jobs[p].grad if p in record.jobs
                else None if p in self.group_of else p.grad for p in params]

    def unscale_grads(self, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                      allow_fp16: bool) -> dict:
        """GradScaler._unscale_grads_ for our optimizer: on the host gradients."""
        record = self._settled(SCALER_CAUSE)
        self._note_grad_scaler(record)
        jobs = list(record.jobs.values())
        if not allow_fp16 and any(job.grad.dtype == torch.float16 for job in jobs):
            raise ValueError("Attempting to unscale FP16 gradients.")
        found = torch.zeros((), dtype=torch.float32)
        if record.failed:
            found.fill_(1.0)  # the scaler must skip and back off: finish raises the error
        else:
            self._transform(record, jobs,
                            lambda g: step_wide.unscale_([g], found, inv_scale.to("cpu")),
                            "GradScaler.unscale_")
        device = next(iter(self.lanes))
        return {device: found.to(device)}

    # -- applied by finish

    def facts_pending(self) -> Optional[tuple]:
        """The cause (key, words) of a fact finish will apply that may change gradients
        (GradScaler, max_grad_norm), or None."""
        opt = self.opt
        if getattr(opt, "grad_scale", None) is not None or \
                getattr(opt, "found_inf", None) is not None:
            return SCALER_CAUSE
        if opt.max_grad_norm is not None:
            return ("clip", f"max_grad_norm={opt.max_grad_norm} (the norm is known only after "
                            f"backward)")
        return None

    def apply_step_facts(self, record: StepRecord) -> None:
        """GradScaler's skip and unscale, then max_grad_norm, on the settled step."""
        opt = self.opt
        grad_scale = getattr(opt, "grad_scale", None)
        found_inf = getattr(opt, "found_inf", None)
        if grad_scale is None and found_inf is None and opt.max_grad_norm is None:
            return  # no fact to apply (not even the sort below, per gradient)
        # Index order, as sync's clip_grad_norm_ sees the parameters: the total norm sums
        # the per-tensor norms in that order, so any other order changes its last bits.
        jobs = sorted(record.jobs.values(), key=lambda job: job.index)
        if grad_scale is not None or found_inf is not None:
            self._note_grad_scaler(record)
            if record.failed:
                return
        if found_inf is not None and float(torch.as_tensor(found_inf).sum()) > 0:
            record.skip = True  # GradScaler found inf/NaN: nothing of the step is applied
            return
        if grad_scale is not None:
            inv, unused = step_wide.amp_inv_scale(grad_scale), torch.zeros((), dtype=torch.float32)
            self._transform(record, jobs, lambda g: step_wide.unscale_([g], unused, inv),
                            "GradScaler's unscale")
        if opt.max_grad_norm is not None:
            total = self._total_norm(jobs, [], 2.0)
            self._clip(record, jobs, [], total, opt.max_grad_norm)
            record.grad_norm = float(total)

    def correct_on_lane(self, lane, record: StepRecord) -> None:
        """Worker side: move each speculative update of this lane to its final gradient and
        to its group's hyperparameters as they are now (a loop may write lr, betas, eps or
        weight_decay between backward and step(), as llm.c's does: the step uses them)."""
        filed, rebased = [], []
        group = step = final = None  # the Hyper of the last job's group and step
        for job in record.jobs.values():
            # (every speculative update records its Hyper: without one, nothing to correct)
            if job.transport is not lane.transport or not job.hypers:
                continue
            if job.group is not group or job.step != step:
                group, step = job.group, job.step
                final = Hyper.for_group(group, step)
            if job.grad_before is None and _all_are(job.hypers, final):
                continue  # the common case: nothing changed since the update
            stale = [used is not final and used != final for used in job.hypers]
            regrad = job.grad_before is not None and not torch.equal(job.grad_before, job.grad)
            record.hyper_stale = record.hyper_stale or any(stale)
            if not (regrad or any(stale)):
                continue
            if job.streamed:
                filed.append((job.index, regrad))
                continue
            redone = sum(end - start for (start, end), again in zip(job.updated_ranges, stale)
                         if regrad or again)
            with record.lock:  # (one worker per device corrects its own jobs)
                record.redone.params += 1
                record.redone.elems += redone
            if self._correct(job) if regrad else self._correct(job, stale):
                rebased.append(job.index)
        if rebased:
            self._warn_rebased(rebased)
        if filed:
            raise RuntimeError(_filed_error(filed))

    def _correct(self, job: Job, redo: Optional[list] = None) -> bool:
        """Redo (or correct) each range of ``job`` flagged in ``redo`` (None: every range,
        its gradient changed); True if a range whose hyperparameters changed had no
        snapshot (``step_wide.rebase``)."""
        rebased = False
        for i, ((start, end), used) in enumerate(zip(job.updated_ranges, job.hypers)):
            if redo is not None and not redo[i]:
                continue
            out = None if job.out is None else job.out[start:end]
            item = job.opt.range_item(job.p, job.group, job.state, job.step,
                                      job.grad[start:end], out, start)
            saved = job.saved_state.get((start, end))
            before = job.grad[start:end] if job.grad_before is None else \
                job.grad_before[start:end]
            if saved is not None:
                step_wide.redo(item, saved, self.lanes[job.p.device].backend)
            else:  # (a changed gradient always has a copy: _check_writable refused it else)
                step_wide.rebase(item, used, before)
                rebased = True
            job.transport.to_device(job.p, start, end)
        return rebased

    # -- hyperparameters written between a step's first gradient and its finish

    def note_hyper_writes(self, record: StepRecord) -> None:
        """After the step's updates: were its hyperparameters written after its first
        gradient? Then hold the next step (a loop that writes them every step, like llm.c's,
        gains nothing from updates made before they are known) and keep, from now on, the
        state each speculative update needs to be redone exactly (the watch)."""
        written = record.hyper_stale or not step_wide.same_inputs(
            record.hyper_inputs, step_wide.hyper_inputs(self.opt.param_groups))
        self.hyper_written_late = written
        if written:
            self.watches_hyper = True
        if written and not self.warned_hyper_hold:
            self.warned_hyper_hold = True
            _log.warning("adambridge: a param group's lr, betas, eps or weight_decay was "
                         "written between backward and step(); the step uses the new values, "
                         "as torch does, and from now on a step that follows such a write holds "
                         "its updates until step() (no overlap with backward): write them "
                         "before the backward to keep the overlap")

    def _warn_rebased(self, indices: list) -> None:
        self.watches_hyper = True  # (finish sees it too; the state is kept from the next step)
        if not self.warned_rebased:
            self.warned_rebased = True
            _log.warning("adambridge: hyperparameters were written after parameters %s had "
                         "been updated from this step's gradients, and no copy of their state "
                         "was kept; those updates were corrected approximately. From now on "
                         "that copy is kept, so later corrections are exact", sorted(indices))

    # -- helpers

    def _note_grad_scaler(self, record: StepRecord) -> None:
        self.uses_grad_scaler = True  # from now on every step is held until the scaler decides
        if not record.held and any(job.speculative for job in record.jobs.values()):
            record.fail(RuntimeError(
                "a GradScaler was first used at a step whose updates had already started "
                "(they cannot be skipped); use the scaler from the first step after "
                "attach_hooks()"))

    @staticmethod
    def _total_norm(jobs: list, others: list, norm_type: float) -> torch.Tensor:
        norms = [step_wide.vector_norm(job.grad, norm_type) for job in jobs]
        norms += [step_wide.vector_norm(grad, norm_type) for grad in others]
        return step_wide.total_norm(norms, norm_type)

    def _clip(self, record: StepRecord, jobs: list, others: list, total: torch.Tensor,
              max_norm: float) -> None:
        coef = step_wide.clip_coef(total, max_norm)
        for grad in others:
            grad.mul_(coef.to(grad.device))
        if float(coef) < 1.0:  # at 1.0 torch's multiply is the identity: nothing changes
            record.clip_fired = True
            self._transform(record, jobs, step_wide.scale_by(coef), "clipping")


def _all_are(hypers: list, final: Hyper) -> bool:
    # (Hyper.for_group is cached: the same inputs give the same object, so ``is`` decides
    # the common case; an evicted entry falls back to comparing the values)
    for used in hypers:
        if used is not final and used != final:
            return False
    return True


def _filed_error(filed: list) -> str:
    # NOTE: the NVMe tier commits with the hyperparameters it had and keeps no state in RAM to
    # redo them from; after a hyperparameter written after backward it holds its parameters
    # to the step's end. (A changed gradient never gets here: _check_writable refused it.)
    return (f"a hyperparameter (lr, betas, eps or weight_decay) was written between backward "
            f"and step() after the NVMe tier had committed parameters "
            f"{sorted(index for index, _ in filed)} with the old value (offload_dir); write "
            f"it before the backward, or from the first step after attach_hooks()")
