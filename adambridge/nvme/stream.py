"""The paged streaming loop of the NVMe tier: read page k+1, update page k, write page k-1.

Pages of every parameter of a commit go through one ring of ``queue_depth + 1`` aligned
buffers, allocated once and reused every step: while the kernel updates the page in one
buffer, the previous page is being written from another and the next pages are being read
into the rest. New pages go to the slot of the next generation; nothing here commits.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..update.functional import adamw_update
from ..update.state import is_rounding_of
from .direct_io import AlignedBuffer, IOEngine
from .layout import PageLayout, ParamFiles

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


@dataclass(eq=False)
class StreamJob:
    """One file-backed parameter's update in a commit."""

    p: torch.Tensor
    group: dict
    step: int
    grad: torch.Tensor      # flat host gradient
    source: torch.Tensor    # p's values: the master when the state is new (generation 0)
    files: ParamFiles
    staging: torch.Tensor   # flat host copy of the new weights, written to p after the commit
    generation: int         # the committed generation this update reads
    adopt: bool = False     # p was written by anyone else: source replaces the master


def page_item(opt: OptimizerDoor, p: torch.Tensor, group: dict, views: dict, step: int,
              grad: torch.Tensor, out: torch.Tensor, start: int) -> Any:
    """The UpdateItem of one page: the optimizer's range builder on the page's buffer views,
    with offset = the page's first element (same rounding bits as an in-RAM step) and the
    master from the file even where an in-RAM state would alias the parameter."""
    master = views["master"]
    item = opt.range_item(p, group, dict(views), step, grad, out, 0)
    return dataclasses.replace(item, master=master, offset=start)


class PageStream:
    """The ring of page buffers and the loop that streams jobs through the kernel."""

    def __init__(self, pool: IOEngine) -> None:
        self.pool = pool
        self.buffers: list[AlignedBuffer] = []
        self.first_write_s: Optional[float] = None

    def ring(self, layout: PageLayout) -> list[AlignedBuffer]:
        # Allocated once (per record size); every step reuses them: no per-step allocation.
        # Buffers of a larger record serve a smaller one (a parameter's fitted pages).
        size = layout.record_bytes
        if not self.buffers or self.buffers[0].nbytes < size:
            self.buffers = [AlignedBuffer(size) for _ in range(self.pool.queue_depth + 1)]
            self.pool.register(self.buffers)
        return self.buffers

    def run(self, opt: OptimizerDoor, jobs: list[StreamJob], backend: str,
            before_write: Optional[Future] = None) -> float:
        """Stream every page of ``jobs``; return the seconds spent in the kernel.

        ``before_write`` (the last publish becoming durable) is waited for before the first
        write: until then the slots this step overwrites may still be the committed ones."""
        pages = [(job, k) for job in jobs for k in range(job.files.num_pages)]
        ring = self.ring(max((job.files.layout for job in jobs), key=_record_bytes))
        reads: dict[int, Any] = {}
        writes: list = [None] * len(ring)
        next_read = 0
        host_s = 0.0
        if self.first_write_s is None:
            self.first_write_s = time.perf_counter()
        try:
            for i, (job, k) in enumerate(pages):
                next_read = self._read_ahead(pages, i, next_read, ring, reads, writes)
                # While page i's read is on its way, each write that lands frees a buffer:
                # read into it at once, or the disk may run dry while the kernel runs next.
                while next_read < len(pages) and not reads[i].done():
                    pending = [w for w in writes if w is not None and not w.done()]
                    if not pending:
                        break
                    self.pool.wait_any(reads[i], pending)
                    next_read = self._read_ahead(pages, i, next_read, ring, reads, writes)
                self.pool.wait(reads.pop(i))
                if job.generation > 0:
                    job.files.check(k, job.generation, ring[i % len(ring)])
                began = time.perf_counter()
                self._update(opt, job, k, ring[i % len(ring)], backend)
                host_s += time.perf_counter() - began
                if i == 0:
                    self.pool.wait(before_write)
                job.files.layout.seal(ring[i % len(ring)], k, job.generation + 1)
                file, offset = job.files.locate(k, job.generation + 1)
                writes[i % len(ring)] = self.pool.write(file, ring[i % len(ring)], offset,
                                                        job.files.layout.record_bytes)
        except BaseException:
            self.pool.drain(list(reads.values()) + writes)  # no request may outlive its buffer
            raise
        error = self.pool.drain(writes)
        if error is not None:
            raise error
        return host_s

    def _read_ahead(self, pages: list, i: int, next_read: int, ring: list, reads: dict,
                    writes: list) -> int:
        """Submit the reads of pages ``next_read``... in order, each into its ring buffer once
        the write that last used that buffer is done; return the first page not yet read.

        Only page ``i`` (about to be updated) waits for its buffer: blocking on a write just
        to read further ahead would leave the disk one write to work on while the kernel
        runs (reads finish first and then hold every buffer)."""
        last = min(i + len(ring) - 1, len(pages))  # page i - 1's buffer is being written
        while next_read < last:
            slot = next_read % len(ring)
            if next_read > i and writes[slot] is not None and not writes[slot].done():
                break
            self.pool.wait(writes[slot])  # done already, or page i's own buffer
            writes[slot] = None
            reads[next_read] = self._read(*pages[next_read], ring[slot])
            next_read += 1
        return next_read
    def _read(self, job: StreamJob, k: int, buffer: AlignedBuffer) -> Any:
        if job.generation == 0:
            return self.pool.call(lambda: _fresh_page(job, k, buffer))
        file, offset = job.files.locate(k, job.generation)
        return self.pool.read(file, buffer, offset, job.files.layout.record_bytes)

    @staticmethod
    def _update(opt: OptimizerDoor, job: StreamJob, k: int, buffer: AlignedBuffer, backend: str) -> None:
        start, numel = job.files.page(k)
        end = start + numel
        views = job.files.layout.views(buffer, numel)
        if job.adopt and job.generation > 0:
            views["master"].copy_(job.source[start:end])  # as state.adopt_written does
        item = page_item(opt, job.p, job.group, views, job.step, job.grad[start:end],
                         job.staging[start:end], start)
        adamw_update([item], backend)


def _record_bytes(layout: PageLayout) -> int:
    return layout.record_bytes


def _fresh_page(job: StreamJob, k: int, buffer: AlignedBuffer) -> None:
    # A new state, as state.new_state makes it: master = p's values now, moments zero.
    start, numel = job.files.page(k)
    for key, view in job.files.layout.views(buffer, numel).items():
        if key == "master":
            view.copy_(job.source[start:start + numel])
        else:
            view.zero_()


def master_is_rounding(pool: IOEngine, files: ParamFiles, buffer: AlignedBuffer, generation: int,
                       values: torch.Tensor) -> bool:
    """Whether p's ``values`` are exactly the rounding of its master at ``generation``: one
    read of the parameter's pages, only after p was written by anyone else."""
    values = values.detach().reshape(-1).to("cpu")
    for k in range(files.num_pages):
        start, numel = files.page(k)
        file, offset = files.locate(k, generation)
        pool.wait(pool.read(file, buffer, offset, files.layout.record_bytes))
        files.check(k, generation, buffer)
        master = files.layout.views(buffer, numel)["master"]
        if not is_rounding_of(master, values[start:start + numel]):
            return False
    return True
