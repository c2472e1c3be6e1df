"""A backward that raised, then zero_grad(): the step is discarded and its updates rolled back.

A loop that skips a bad batch catches the exception of its backward (an out-of-memory
error, a hook that found NaN) and calls ``zero_grad()``; in synchronous mode nothing of
that batch is applied. With hooks attached the worker may already have updated the
parameters whose gradients came before the exception. ``discard`` stops the step (nothing
more is updated), waits for the workers, and restores every such update from the master
and moments kept before it (``step_wide.snapshot``, the same copy a clipping redo uses),
its ``state["step"]`` and weights too: the next step then equals a synchronous twin that
skipped the batch, bit for bit.

That copy is made only while a step keeps its state (clipping expected, or once a backward
has raised): the first backward that raises without it leaves the updates it made, named
in a warning (each one's ``state["step"]`` says it took the step), and from then on every
step keeps that state until it ends, as while clipping is expected.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from . import step_wide
from .work_items import Job, StepRecord

_log = logging.getLogger("adambridge")


def discard(pipeline: Any, record: Optional[StepRecord]) -> None:
    """Drop the step of an interrupted backward; roll back what its workers had updated.

    Without a record (the pass raised before a hook closed the window, e.g. a micro-batch
    that accumulates) only the pass's bookkeeping goes: the window starts again, as the
    gradients zero_grad() drops."""
    pipeline._open_tasks.clear()
    pipeline._micro = 0
    if record is None:
        return
    record.fail(RuntimeError("discarded by zero_grad() after a backward that raised"))
    pipeline.drain(record)  # every update of the step has run (or been skipped) now
    kept: list[int] = []
    calls = [(lane, lane.call(functools.partial(_roll_back_lane, lane, record, kept)))
             for lane in pipeline.lanes.values() if lane not in pipeline._stuck]
    for lane, unit in calls:
        pipeline._wait(lane, unit, record)
    with pipeline._record_lock:
        pipeline._record = None
    pipeline._left_running(record)  # a worker that timed out here: guarded as after a step
    pipeline._end_jobs(record)
    for lane in pipeline.lanes.values():
        lane.transport.finish()  # the current stream waits for the restored weights
    pipeline.rolls_back = True
    if kept:
        _log.warning("adambridge: zero_grad() after a backward that raised: parameters %s had "
                     "already been updated from that backward's gradients and keep the update "
                     "(their state[\"step\"] says so); from now on the state each update needs "
                     "to be rolled back is kept, so a later backward that raises leaves "
                     "nothing", sorted(kept))


def _roll_back_lane(lane: Any, record: StepRecord, kept: list) -> None:
    """Worker side: restore this lane's speculative updates, then drop what was held."""
    for job in list(record.jobs.values()):
        if job.transport is not lane.transport or not job.speculative:
            continue
        if job.streamed or len(job.saved_state) < len(job.updated_ranges):
            kept.append(job.index)  # committed to the NVMe tier, or no copy was kept
        else:
            _roll_back(job, job.index in record.updated)
    lane.flush(record, lambda: None)  # (failed: held pieces dropped, deferred copies sent)


def _roll_back(job: Job, committed: bool) -> None:
    for start, end in job.updated_ranges:
        out = None if job.out is None else job.out[start:end]
        item = job.opt.range_item(job.p, job.group, job.state, job.step,
                                  job.grad[start:end], out, start)
        step_wide.restore(item, job.saved_state[(start, end)])
        job.transport.to_device(job.p, start, end)
    if committed:  # its step was counted: uncount it
        job.state["step"].copy_(torch.tensor(float(job.step - 1)))
