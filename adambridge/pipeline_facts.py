"""The pipeline's step-wide facts: clipping and GradScaler calls routed here, applied at finish.

Mixed into pipeline.Pipeline. Every entry point first *settles* the step: hold what lands
from now on, send the gradients without hooks, wait until each lane has handled what was
queued; then all of the step's host gradients are in ``record.jobs`` and nothing runs on the
workers, so the gradients can be read and transformed in place here (step_facts.py says why
that is exact, and when a speculative update needs ``correct``).
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from . import step_facts
from .work_items import Job, StepRecord

_log = logging.getLogger("adambridge")


class FactsMixin:
    """Pipeline methods for clip_grad_norm_, clip_grad_value_, GradScaler and max_grad_norm."""

    def _settled(self) -> StepRecord:
        record = self._current_record()
        self.send_rest(record)
        self.drain(record)
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

    @staticmethod
    def _transform(jobs: list, fn: Callable[[torch.Tensor], None]) -> None:
        """Apply fn to host gradients in place, keeping what a speculative update used."""
        for job in jobs:
            if job.speculative and job.grad_before is None:
                job.grad_before = job.grad.clone()
            fn(job.grad)

    # -- routed from torch by interception.py (after backward, before the step)

    def clip_grad_norm(self, params: list, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> torch.Tensor:
        record = self._settled()
        if math.isfinite(max_norm):
            self.clip_hint = max_norm
        jobs, others = self._jobs_of(record, params)
        total = self._total_norm(jobs, others, norm_type)
        if error_if_nonfinite:
            step_facts.check_finite_norm(total, norm_type)
        self._clip(jobs, others, total, max_norm)
        record.grad_norm = float(total)
        device = params[0].device if params else torch.device("cpu")
        return total.to(device)

    def clip_with_norm(self, params: list, max_norm: float, total: torch.Tensor, *,
                       report_norm: bool = False) -> None:
        """Clip with a given total norm; ``report_norm``: it is this step's grad_norm (a
        clip_grad_norm_ over several optimizers, interception.py)."""
        record = self._settled()
        if math.isfinite(max_norm):
            self.clip_hint = max_norm
        jobs, others = self._jobs_of(record, params)
        self._clip(jobs, others, total.detach().to("cpu"), max_norm)
        if report_norm:
            record.grad_norm = float(total)

    def settled_grads(self, params: list) -> list:
        """The gradient each of ``params`` has in this step: the host copy for ours, p.grad
        for the others (None without one), once the step is settled."""
        record = self._settled()
        return [record.jobs[p].grad if p in record.jobs
                else None if p in self.group_of else p.grad for p in params]

    def clip_value(self, params: list, clip_value: float) -> None:
        record = self._settled()
        self.clips_by_value = True  # no norm predicts it: hold later steps for exactness
        jobs, others = self._jobs_of(record, params)
        for grad in others:
            grad.clamp_(min=-clip_value, max=clip_value)
        self._transform(jobs, lambda g: g.clamp_(min=-clip_value, max=clip_value))

    def unscale_grads(self, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                      allow_fp16: bool) -> dict:
        """GradScaler._unscale_grads_ for our optimizer: on the host gradients."""
        record = self._settled()
        self._note_grad_scaler(record)
        jobs = list(record.jobs.values())
        if not allow_fp16 and any(job.grad.dtype == torch.float16 for job in jobs):
            raise ValueError("Attempting to unscale FP16 gradients.")
        found = torch.zeros((), dtype=torch.float32)
        self._transform(jobs, lambda g: step_facts.unscale_([g], found, inv_scale.to("cpu")))
        if record.failed:
            found.fill_(1.0)  # the scaler must skip and back off: finish raises the error
        device = next(iter(self.lanes))
        return {device: found.to(device)}

    # -- applied by finish

    def facts_pending(self) -> bool:
        """Whether finish will apply a fact that may change gradients (scaler, max_grad_norm)."""
        opt = self.opt
        return (opt.max_grad_norm is not None or getattr(opt, "grad_scale", None) is not None
                or getattr(opt, "found_inf", None) is not None)

    def apply_step_facts(self, record: StepRecord) -> None:
        """GradScaler's skip and unscale, then max_grad_norm, on the settled step."""
        opt = self.opt
        grad_scale = getattr(opt, "grad_scale", None)
        found_inf = getattr(opt, "found_inf", None)
        if grad_scale is None and found_inf is None and opt.max_grad_norm is None:
            return  # no fact to apply (issue 13: not even the sort below, per gradient)
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
            inv, unused = step_facts.amp_inv_scale(grad_scale), torch.zeros((), dtype=torch.float32)
            self._transform(jobs, lambda g: step_facts.unscale_([g], unused, inv))
        if opt.max_grad_norm is not None:
            total = self._total_norm(jobs, [], 2.0)
            self._clip(jobs, [], total, opt.max_grad_norm)
            record.grad_norm = float(total)

    def correct_on_lane(self, lane, record: StepRecord) -> None:
        """Worker side: move each speculative update of this lane to its final gradient."""
        filed = []
        for job in record.jobs.values():
            if (job.transport is not lane.transport or job.grad_before is None
                    or torch.equal(job.grad_before, job.grad)):
                continue
            if job.streamed:
                filed.append(job.index)
            elif job.updated_ranges:
                self._correct(job)
        if filed:
            # NOTE: the NVMe tier committed these with the unclipped gradient and keeps no
            # moments to redo them from; with clipping expected it holds them (issue 14).
            raise RuntimeError(f"clipping first fired after the NVMe tier had committed "
                               f"parameters {sorted(filed)} (offload_dir); pass max_grad_norm= or "
                               f"clip from the first step after attach_hooks()")

    def _correct(self, job: Job) -> None:
        for start, end in job.updated_ranges:
            out = None if job.out is None else job.out[start:end]
            item = job.opt.range_item(job.p, job.group, job.state, job.step,
                                      job.grad[start:end], out, start)
            saved = job.saved_state.get((start, end))
            if saved is None:
                self._warn_approximate(item.precision)
                step_facts.correct(item, job.grad_before[start:end])
            else:
                step_facts.redo(item, saved, self.lanes[job.p.device].backend)
            job.transport.to_device(job.p, start, end)

    # -- helpers

    def _warn_approximate(self, precision: str) -> None:
        if not self.warned_approximate:
            self.warned_approximate = True
            _log.warning("adambridge: clipping first fired after speculative updates with %s "
                         "moments; those updates were corrected approximately. Clip from the "
                         "first step (or pass max_grad_norm=) so the moments are kept and "
                         "every correction is exact", precision)

    def _note_grad_scaler(self, record: StepRecord) -> None:
        self.uses_grad_scaler = True  # from now on every step is held until the scaler decides
        if not record.held and any(job.speculative for job in record.jobs.values()):
            record.fail(RuntimeError(
                "a GradScaler was first used at a step whose updates had already started "
                "(they cannot be skipped); use the scaler from the first step after "
                "attach_hooks()"))

    @staticmethod
    def _total_norm(jobs: list, others: list, norm_type: float) -> torch.Tensor:
        norms = [step_facts.vector_norm(job.grad, norm_type) for job in jobs]
        norms += [step_facts.vector_norm(grad, norm_type) for grad in others]
        return step_facts.total_norm(norms, norm_type)

    def _clip(self, jobs: list, others: list, total: torch.Tensor, max_norm: float) -> None:
        coef = step_facts.clip_coef(total, max_norm)
        for grad in others:
            grad.mul_(coef.to(grad.device))
        if float(coef) < 1.0:  # at 1.0 torch's multiply is the identity: nothing changes
            self._transform(jobs, step_facts.scale_by(coef))
