"""The NVMe tier: which parameters' state lives in files, and the paged step that streams it.

``AdamBridge(..., offload_dir=PATH or [PATHS] or OffloadConfig, host_budget=BYTES)`` keeps the
smallest parameters' state in RAM while it fits ``host_budget`` and puts the rest in files
(nvme/layout.py). A step streams each file-backed parameter through the kernel page by page:
page k+1 is being read while page k is updated and page k-1 written (nvme/direct_io.py), into a ring
of aligned buffers allocated once. The new pages go to the other A/B slot; after every page of
the step is written and fsynced, one manifest publish commits them all, and only then are the
parameters written back and ``state["step"]`` advanced. A fault before the publish raises
with the parameters, the RAM state and the committed files exactly as before the step.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from ..host.mapped import Mappings
from ..update import state as host_state
from ..update.codecs import FP8_BLOCK
from .config import OffloadConfig, Placed, all_in_ram, check_offload, place  # noqa: F401
from . import recovery
from .engine import open_engine
from .filed import Pinned, filed_state, keep_values
from .direct_io import (IOEngine, TierError, check_claim, claim_directory, lock_directory,
                        release_lock)
from .layout import (PageLayout, ParamFiles, fitted, read_state, rename_manifest,
                     stage_manifest, sync_directory)
from .stream import PageStream, StreamJob, master_is_rounding
from ..stats import StepStats

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


def placement(opt: OptimizerDoor) -> list[Placed]:
    """``opt.placement()``: where each parameter's state lives, in state_dict order."""
    tier = opt.nvme_tier
    return all_in_ram(opt) if tier is None else tier.placement()


class FiledState(dict):
    """``opt.state[p]`` of a file-backed parameter: only ``step`` is in RAM. Asking it for a
    moment or the master says where they are instead of a bare KeyError."""

    def __missing__(self, key: Any) -> Any:
        raise KeyError(f"{key!r}: this parameter's state lives in the NVMe tier's files "
                       f"(offload_dir), opt.state[p] holds only 'step'; read "
                       f"opt.state_dict()['state'] for its committed tensors")


class Tier:
    """The file-backed state of one optimizer (``opt.nvme_tier``)."""

    def __init__(self, opt: OptimizerDoor, config: OffloadConfig, host_budget: Optional[int]) -> None:
        self.config, self.host_budget = config, host_budget
        self.dirs: tuple[Path, ...] = tuple(config.paths)
        self._opt = weakref.ref(opt)
        self._lock_fds: list[int] = []
        self._claims: list[bytes] = []  # each directory's token (nvme_io.check_claim)
        self._pid = os.getpid()
        try:
            for directory in self.dirs:
                self._lock_fds.append(lock_directory(directory))
                self._claims.append(claim_directory(directory, self._lock_fds[-1]))
        except ValueError:
            for fd in self._lock_fds:
                release_lock(fd)
            raise
        try:
            self.pool = open_engine(config.io_engine, config.queue_depth)
        except ValueError:
            for fd in self._lock_fds:
                release_lock(fd)
            raise
        self.lock = threading.RLock()   # held while pages are in flight; state_dict waits on it
        self._where: dict[torch.Tensor, str] = {}
        self._files: dict[torch.Tensor, ParamFiles] = {}
        self._committed: dict[int, tuple[int, int]] = {}   # index -> (generation, step)
        # How often each (index, slot) has been written: a state_dict() entry pinned to a
        # generation reads only while its slot's count is the one it saw (nvme/filed.py).
        self._slot_writes: dict[tuple[int, int], int] = defaultdict(int)
        self._pinned_read: Optional[tuple[Pinned, dict]] = None  # read, not yet taken
        self._live_parts: weakref.WeakSet = weakref.WeakSet()  # state_dict() entries alive
        self._staging: dict[torch.Tensor, torch.Tensor] = {}
        self.stream = PageStream(self.pool)
        self._landed: dict[Any, list] = defaultdict(list)  # async: pieces per job
        self._landed_step: Any = lambda: None              # the StepRecord they belong to
        self._last_commit_s: Optional[float] = None
        self._renamed: Optional[Future] = None  # the directory fsync of the last publish
        # An earlier run's committed state here: refused before it is overwritten (recovery.py).
        self._earlier = recovery.found(self.dirs[0])
        self._finalizer = weakref.finalize(self, _close, self.pool, self._lock_fds,
                                           self._files, self._live_parts)

    def close(self) -> None:
        """Release the files and directory locks now instead of when the tier is collected
        (idempotent). Steps, state_dict() and load_state_dict() raise afterwards."""
        self._finalizer()

    def opt(self) -> OptimizerDoor:
        return self._opt()

    def resume(self) -> int:
        """Take the state an earlier run committed in these directories (killed, say) as this
        optimizer's, before its first step; return its step. Every parameter must be
        file-placed (``host_budget=0``) with the earlier run's sizes, precision and page
        size; the parameters are set to their masters' rounding. See docs/nvme.md."""
        self._check_open()
        with self.lock:
            step = recovery.resume(self, self._earlier)
            self._earlier = None
        return step

    def discard(self) -> None:
        """Start fresh: the earlier run's state in these directories is overwritten by the
        first step instead of refused."""
        self._earlier = None

    def state_of_earlier(self, p: torch.Tensor, generation: int, step: int) -> dict:
        """p's state as an earlier run committed it (every page's checksum checked), now
        this tier's committed state of p."""
        index = self._opt().index(p)
        layout = fitted(self._opt().precision, self.config.page_size, p.numel())
        files = self._files[p] = ParamFiles(self.dirs, index, p.numel(), layout)
        state = read_state(files, self.stream.ring(self.layout)[0], generation, step)
        self._committed[index] = (generation, step)
        self._opt().state[p] = FiledState(step=state["step"])
        return state

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            # Two processes writing one set of files would corrupt them without an error.
            raise TierError(f"NVMe tier: this optimizer's files belong to process "
                            f"{self._pid}, not to this forked child; build the optimizer in "
                            f"the process that trains")
        if not self._finalizer.alive:
            raise TierError("NVMe tier: this optimizer's tier was closed "
                            "(opt.nvme_tier.close()); build a new AdamBridge and load your "
                            "last state_dict() into it")

    def __getstate__(self) -> dict:
        # A copy would share (or lose) the locked files that hold the state.
        raise TypeError("an AdamBridge with offload_dir cannot be copied or pickled (its state "
                        "lives in files locked to it); save opt.state_dict() and load it into "
                        "a new AdamBridge with its own offload_dir")

    # -- placement

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self._opt().precision, self.config.page_size)

    def _place(self) -> None:
        opt = self._opt()
        # The index's size, O(1): holds() runs for every piece of every step.
        if len(self._where) == len(opt.param_index):
            return
        new = [p for p in opt.param_index if p not in self._where]
        if not new:
            return
        used = sum(host_state.HOST_BYTES_PER_PARAM[opt.precision] * p.numel()
                   for p, where in self._where.items() if where == "ram")
        budget = None if self.host_budget is None else max(0, int(self.host_budget - used))
        where = place([(opt.index(p), p.numel()) for p in new], opt.precision, budget)
        for p in new:
            self._where[p] = where[opt.index(p)]

    def holds(self, p: torch.Tensor) -> bool:
        self._place()
        return self._where.get(p) == "file"

    def keeps_in_ram(self, p: Any) -> bool:
        """Whether p's state is kept in RAM (not a file-placed parameter's)."""
        return not (isinstance(p, torch.Tensor) and self.holds(p))

    def placement(self) -> list[Placed]:
        self._place()
        opt = self._opt()
        per_param = host_state.HOST_BYTES_PER_PARAM[opt.precision]
        return [Placed(opt.index(p), p.numel(), self._where[p], int(per_param * p.numel()),
                       self.pool.name if self._where[p] == "file" else "")
                for group in opt.param_groups for p in group["params"]]

    @property
    def io_engine(self) -> str:
        """The engine moving this tier's pages, in words: 'io_uring', or the thread pool and
        (with io_engine='auto') why io_uring was not used."""
        return self.pool.describe()

    def new_state(self, p: torch.Tensor) -> dict:
        """The in-RAM part of a file-backed state: only ``step``. Files are created (space
        reserved) here, before any update, so a full drive fails with nothing changed."""
        self._check_open()
        with self.lock:
            if self._earlier is not None:
                raise recovery.refusal(self._earlier)
            if p not in self._files:
                index = self._opt().index(p)
                layout = fitted(self._opt().precision, self.config.page_size, p.numel())
                self._files[p] = ParamFiles(self.dirs, index, p.numel(), layout)
            self._committed.pop(self._files[p].index, None)  # generation 0: read from p
        return FiledState(step=torch.tensor(0.0, dtype=torch.float32))

    # -- the synchronous step

    def step(self, work: list, backend: str, stats: StepStats) -> list:
        """Stream and commit the file-backed parameters of ``work``; return the others.

        The step's I/O is added to ``stats`` (the synchronous step's)."""
        opt = self._opt()
        mine = [w for w in work if self.holds(w[0])]
        if not mine:
            return work
        self.pool.counters.take()
        jobs = [self._job(p, group, step, _host_grad(p), p.detach().reshape(-1),
                          written=opt.written_elsewhere(p))
                for p, group, _, step in mine]
        self.commit(jobs, backend)
        for p, _, state, step in mine:
            p.detach().copy_(self._staged(p).view(p.shape))
            state["step"].fill_(step)
        self.take_io(stats)
        return [w for w in work if not self.holds(w[0])]

    def _job(self, p: torch.Tensor, group: dict, step: int, grad: torch.Tensor,
             source: torch.Tensor, out: Optional[torch.Tensor] = None,
             written: bool = False) -> StreamJob:
        staging = self._staged(p) if out is None else out
        return StreamJob(p, group, step, grad, source, self._files[p], staging, 0,
                         adopt=written)

    def _staged(self, p: torch.Tensor) -> torch.Tensor:
        """Where the kernel writes p's new values until the commit: p itself must keep the
        old ones until then, so a failed step leaves it untouched. Allocated once."""
        staging = self._staging.get(p)
        if staging is None:
            staging = self._staging[p] = host_state.host_empty(p.numel(), p.dtype)
        return staging

    def commit(self, jobs: list[StreamJob], backend: str) -> float:
        """Stream every page of ``jobs``, fsync, publish; return the kernel seconds."""
        self._check_open()
        with self.lock:
            self._check_claims()
            if self._earlier is not None:
                raise recovery.refusal(self._earlier)
            for job in jobs:
                job.files.check_sizes()
                job.generation = self._committed.get(job.files.index, (0, 0))[0]
                if job.adopt and job.generation > 0:
                    # Weights written by anyone else win, unless they are the rounding of
                    # the committed master (so a resume stays bit-exact): params.py, NOTE.
                    ring = self.stream.ring(self.layout)
                    job.adopt = not master_is_rounding(self.pool, job.files, ring[0],
                                                       job.generation, job.source)
            for job in jobs:
                self._writing(job.files.index, job.generation + 1)
            host_s = self.stream.run(self._opt(), jobs, backend, self._renamed)
            committed = dict(self._committed)
            for job in jobs:
                committed[job.files.index] = (job.generation + 1, job.step)
            self._publish(committed, [f for job in jobs for f in job.files.files])
            self._committed = committed
            self._last_commit_s = time.perf_counter()
        return host_s

    def _check_claims(self) -> None:
        """Raise before writing if another optimizer took one of the directories (a lock
        that does not reach across machines let it in)."""
        for directory, token in zip(self.dirs, self._claims):
            check_claim(directory, token)

    def _publish(self, committed: dict, written: list) -> None:
        """Commit: fdatasync every file in ``written`` and stage the new manifest, all at once
        (their device flushes overlap instead of following each other), then rename it into
        place. Nothing is renamed unless every page it names is durable."""
        opt = self._opt()
        by_index = {files.index: files for files in self._files.values()}
        entries = {i: {"numel": by_index[i].numel, "precision": opt.precision,
                       "page_size": by_index[i].layout.page_size, "seed": opt.seed,
                       "generation": gen, "step": step}
                   for i, (gen, step) in committed.items() if i in by_index}
        files = {id(f): f for f in written}.values()
        stage = functools.partial(stage_manifest, self.dirs[0], self.config.page_size, self.dirs,
                                  entries)
        error = self.pool.drain([self.pool.call(f.sync) for f in files] + [self.pool.call(stage)])
        if error is not None:
            raise error
        self.pool.wait(self._renamed)
        rename_manifest(self.dirs[0])
        # The rename becomes durable in the background; the next write to a slot waits for it.
        self._renamed = self.pool.call(functools.partial(sync_directory, self.dirs[0]))

    # -- asynchronous mode: called by the worker with each batch of landed pieces

    def route(self, batch: list, backend: str, record: Any) -> tuple[list, list]:
        """(pieces for the in-RAM update, pieces whose parameter was streamed and committed).

        A file-backed parameter is streamed once all its pieces have landed: its pages need
        the whole gradient, and one commit per parameter keeps the files consistent.
        ``record`` is the step's StepRecord (pieces of an earlier, failed step are dropped)."""
        rest, ready = [], []
        if self._landed_step() is not record:
            self._landed.clear()  # pieces of a step that failed before they all landed
            self._landed_step = weakref.ref(record)  # weak: a finished step frees its grads
        for piece in batch:
            job = piece.job
            if not self.holds(job.p):
                rest.append(piece)
                continue
            self._landed[job].append(piece)
            if len(self._landed[job]) == job.pieces_left:
                ready.append(job)
        if not ready:
            return rest, []
        try:
            self._commit_async(ready, backend, record)
        finally:
            done = [piece for job in ready for piece in self._landed.pop(job)]
        return rest, done

    def _commit_async(self, ready: list, backend: str, record: Any) -> None:
        opt = self._opt()
        written = {}
        for job in ready:
            written[job] = job.state is not None and job.source is not None
            job.state = opt.ensure_state(job.p, job.source)
        jobs = [self._job(job.p, job.group, job.step, job.grad,
                          job.source if job.source is not None else job.p.detach().reshape(-1),
                          job.out if _separate(job.out, job.p) else None, written[job])
                for job in ready]
        host_s = self.commit(jobs, backend)
        for job, streamed in zip(ready, jobs):
            job.source = None
            if job.out is None:
                job.p.detach().copy_(streamed.staging.view(job.p.shape))
            elif streamed.staging is not job.out:
                job.out.copy_(streamed.staging)
            # else: the kernel wrote the transport's buffer, sent once the pieces are done
        with record.lock:
            record.host_update_s += host_s

    def split(self, batch: list) -> tuple[list, list]:
        """(pieces of in-RAM parameters, pieces of file-backed ones)."""
        filed = [piece for piece in batch if self.holds(piece.job.p)]
        return [piece for piece in batch if not self.holds(piece.job.p)], filed

    def take_io(self, stats: StepStats) -> None:
        """Add the I/O since the last take to ``stats`` (async mode, at step_sync)."""
        read, written, wait_s = self.pool.counters.take()
        stats.io_read_bytes += read
        stats.io_write_bytes += written
        stats.io_wait_s += wait_s

    def host_bytes(self) -> int:
        """Host bytes the tier holds beside the in-RAM states: its ring of aligned page
        buffers (allocated at the first stream, page records for O_DIRECT I/O), the
        staging of each file-placed parameter's new weights until a step commits, and the
        tensors of a parameter that a state_dict() read has not taken yet."""
        ring = sum(buffer.resident_bytes for buffer in self.stream.buffers)
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        pinned = self._pinned_read
        waiting = 0 if pinned is None else sum(t.nbytes for t in pinned[1].values())
        return ring + staging + waiting

    # -- checkpoints

    def committed_states(self) -> dict:
        """{p: its committed state} for every file-backed parameter, each tensor read from
        the files when something reads it (nvme/filed.py): nothing is read here.

        Holding the lock waits for any step still writing (the checkpoint race of DeepSpeed
        #7549): a checkpoint is always of committed generations, never of pages in flight."""
        self._check_open()
        states = {}
        with self.lock:
            for p, files in self._files.items():
                generation, step = self._committed.get(files.index, (0, 0))
                if generation == 0:  # made, never committed: as a fresh in-RAM state
                    fresh = host_state.new_state(p.detach(), self._opt().precision, alias=False)
                    states[p] = {**fresh, "step": torch.tensor(float(step), dtype=torch.float32)}
                else:
                    # The committed step, not state["step"]: a step that has just committed
                    # advances that only after releasing the lock.
                    states[p] = filed_state(self, files, generation, step, self._live_parts)
        return states

    def slot_epoch(self, index: int, generation: int) -> int:
        """How often the slot of parameter ``index`` that ``generation`` lives in has been
        written (by steps and loads)."""
        return self._slot_writes[index, generation % 2]

    def _writing(self, index: int, generation: int) -> None:
        """Pages of ``generation`` are about to be written: the entries pinned to the
        generation two before it (the same slot) can no longer be read."""
        slot = generation % 2
        keep_values(part for part in self._live_parts if part.pinned.files.index == index
                    and part.pinned.generation % 2 == slot)
        self._slot_writes[index, slot] += 1
        if self._pinned_read is not None and self._pinned_read[0].files.index == index:
            self._pinned_read = None

    def read_pinned(self, pinned: Pinned, key: str) -> torch.Tensor:
        """Tensor ``key`` of a pinned parameter, read from its generation's pages; the
        parameter's other tensors, read with it, wait here until taken."""
        self._check_open()
        with self.lock:  # waits for a step still writing
            if self.slot_epoch(pinned.files.index, pinned.generation) != pinned.epoch:
                # (_writing keeps the values of every live entry first: a bug if it ever runs)
                raise RuntimeError(
                    f"adambridge: this state_dict() entry of parameter {pinned.files.index} "
                    f"(step {pinned.step}) was in the NVMe tier's files, which later steps or "
                    f"loads have rewritten; call opt.state_dict() again right before saving")
            held = self._pinned_read
            if held is None or held[0] is not pinned or key not in held[1]:
                buffer = self.stream.ring(pinned.files.layout)[0]
                state = read_state(pinned.files, buffer, pinned.generation, pinned.step)
                del state["step"]
                held = self._pinned_read = (pinned, state)
            value = held[1].pop(key)
            if not held[1]:
                self._pinned_read = None
            return value

    def adopt(self, states: Iterable[tuple]) -> dict:
        """load_state_dict: write the file-placed states into their files and commit them;
        return every (key, state) of ``states`` as a dict, those entries reduced to
        ``step``. Each state is written as it comes (built from the loaded tensors as they
        are, where it needs no conversion: restore's ``kept``), so only one file-placed
        parameter's state is in RAM at a time. Raises before any change: the pages go to
        the next generation, which only the final publish commits."""
        self._check_open()
        out, written, maps = {}, {}, Mappings()
        with self.lock:
            self._check_claims()
            earlier, self._earlier = self._earlier, None  # the load replaces it, as asked
            try:
                return self._adopt(states, out, written, maps)
            except BaseException:
                self._earlier = earlier  # nothing was committed: it is still there
                raise

    def _adopt(self, states: Iterable[tuple], out: dict, written: dict, maps: Mappings) -> dict:
        """adopt() under the lock: each state written as it comes, then one publish."""
        self.pool.wait(self._renamed)  # the slots written below may be the committed ones
        for p, state in states:
            if not isinstance(p, torch.Tensor) or not self.holds(p):
                out[p] = state
                continue
            if p not in self._files:
                self.new_state(p)
            files = self._files[p]
            generation = self._committed.get(files.index, (0, 0))[0] + 1
            self._writing(files.index, generation)
            self._write_state(files, state, generation, maps)
            written[p] = (files.index, generation, int(state["step"].item()))
            out[p] = FiledState(step=state["step"])
            del state  # before the next one is built: one parameter's state at a time
        # Parameters the checkpoint has no state for start fresh, as in torch.
        kept = {self._files[p].index for p in out if isinstance(p, torch.Tensor)
                and p in self._files}
        committed = {i: v for i, v in self._committed.items() if i in kept}
        committed.update({i: (gen, step) for i, gen, step in written.values()})
        self._publish(committed, [f for p in written for f in self._files[p].files])
        self._committed = committed
        return out

    def _write_state(self, files: ParamFiles, state: dict, generation: int,
                     maps: Optional[Mappings] = None) -> None:
        """Write ``state`` page by page into ``generation``; where a tensor of it lies in a
        file mapping (a checkpoint loaded with mmap=True, read as it is), each page read
        from it is handed back, so the mapping holds one page of it at a time."""
        buffer = self.stream.ring(self.layout)[0]
        flat = {key: value.reshape(-1) for key, value in state.items() if key != "step"}
        for k in range(files.num_pages):
            start, numel = files.page(k)
            for key, view in files.layout.views(buffer, numel).items():
                first = start // FP8_BLOCK if key.endswith("_scale") else start
                source = flat[key][first:first + view.numel()]
                view.copy_(source)
                if maps is not None:
                    maps.release(source)  # a no-op unless it lies in a file mapping
            files.layout.seal(buffer, k, generation)
            file, offset = files.locate(k, generation)
            self.pool.wait(self.pool.write(file, buffer, offset, files.layout.record_bytes))

    # -- endurance

    @property
    def bytes_written(self) -> int:
        """Every byte this tier has written to its drives: the endurance cost."""
        return self.pool.counters.total_written

    def drive_writes_per_day(self, capacity_bytes: int, step_s: Optional[float] = None) -> float:
        """Drive writes per day per drive: at one step (every file-backed page rewritten)
        every ``step_s`` seconds, or (None) at the rate measured from the first page read to
        the last commit. The drives share the writes evenly (pages are striped)."""
        if step_s is not None:
            per_step = sum(f.num_pages * f.layout.record_bytes for f in self._files.values())
            rate = per_step / step_s
        elif self.stream.first_write_s is None or self._last_commit_s is None:
            return 0.0
        else:
            elapsed = self._last_commit_s - self.stream.first_write_s
            rate = self.bytes_written / max(elapsed, 1e-9)
        return rate * 86400.0 / (capacity_bytes * len(self.dirs))


def _separate(out: Optional[torch.Tensor], p: torch.Tensor) -> bool:
    """A transport buffer that is not p's own storage (a pinned copy for a CUDA parameter,
    a buffer for a non-contiguous one) can take the new values directly: it reaches p only
    when the worker sends it, after the commit."""
    return out is not None and out.data_ptr() != p.data_ptr()


def _close(pool: IOEngine, lock_fds: list, files: dict, live_parts: Any) -> None:
    # NOTE: a finalizer runs wherever the cyclic GC happens to run, including inside
    # threading's own bookkeeping while it holds its locks (a new thread registering itself
    # in Thread._set_tstate_lock); joining a thread there waits for one of those locks
    # forever (seen as a hang in Thread.start). So the helper threads are told to stop and
    # left to exit; nothing of theirs can still be queued once the tier is unreachable but
    # the directory fsync of the last commit, which they finish.
    pool.close(join=False)
    try:
        keep_values(live_parts)  # state_dict() entries still alive keep their values
    finally:
        for param_files in files.values():
            param_files.close()
    for fd in lock_fds:
        release_lock(fd)


def _host_grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient as a flat host tensor (a blocking copy for a device gradient)."""
    grad = p.grad.detach()
    if not grad.is_cpu:
        grad = grad.to("cpu")
    return grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
