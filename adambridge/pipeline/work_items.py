"""What the pipeline and its workers pass around: one step's record, one parameter's job in it,
the pieces (chunks) of a job, the copies back they share, and calls run on a worker thread.

pipeline/hooks.py makes them in backward's hooks; pipeline/worker.py updates the pieces whose copies have
landed; finish (pipeline/hooks.py) reads the record. Each hooked parameter keeps one Job, its
Pieces and their WriteBacks across steps (``Job.begin``/``Job.end``), so a gradient in flight
keeps no new GC-tracked object alive.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


class StepRecord:
    """What one step has done so far, shared by the hooks, the workers and finish.

    Nothing in it points back at the record (no Job -> record edge), so a finished step is
    freed by reference counting alone, with its gradients, even with the cyclic GC off.
    """

    def __init__(self, held: bool, clip_watch: Optional[float] = None,
                 keep_state: bool = False, hyper_inputs: tuple = (),
                 verify: bool = False) -> None:
        self.lock = threading.Lock()
        self.held = held            # update nothing before finish (first or GradScaler step)
        self.hold_rest = False      # a step-wide fact is being decided: hold what lands now
        self.clip_watch = clip_watch  # expected max_norm: hold once the landed norm passes it
        # Keep the master and moments from before each update made before the step's end
        # (step_facts.snapshot): to redo it if clipping fires, or to roll it back.
        self.keep_state = keep_state or clip_watch is not None
        # ADAMBRIDGE_VERIFY_ASYNC: every update keeps that copy, held ones too (verify.py)
        self.verify = verify
        # What each group's hyperparameters were at the step's first gradient
        # (step_facts.hyper_inputs): finish compares them with those it updates with.
        self.hyper_inputs = hyper_inputs
        self.hyper_stale = False    # a speculative update used hyperparameters since written
        self.landed_sq = 0.0        # squared 2-norm of the gradients watched so far
        self.began = time.perf_counter()
        self.jobs: dict[torch.Tensor, "Job"] = {}
        self.errors: list[tuple[BaseException, str]] = []
        self.updated: list[int] = []
        self.host_update_s = 0.0
        self.num_batches = 0
        self.grad_norm: Optional[float] = None
        self.skip = False           # GradScaler found inf/NaN: the step is not applied
        self.loop_edits: list = []  # jobs whose gradient the loop wrote (grad_edits.py)
        self.settled = False        # sent and drained once after backward (corrections.py)
        # Where the updates ran (StepStats): before step() was called (overlapped with
        # backward) or after (the caller waits); set under ``lock`` by finish and the workers.
        self.in_step = False
        self.overlap = UpdateCounts()  # updated before step() was called
        self.waited = UpdateCounts()   # updated while step() waited
        self.redone = UpdateCounts()   # updated during backward, then again at step()
        self.hook_s = 0.0           # the training thread's time in the gradient hooks
        self.held_by: Optional[tuple] = None  # why updates wait for step(): (key, words)
        self.clip_fired = False     # a clip scaled this step's gradients

    def hold(self, cause: tuple) -> None:
        """Hold what lands from now on until finish, for ``cause`` (StepStats.held_by)."""
        self.hold_rest = True
        if self.held_by is None:
            self.held_by = cause

    def count_updated(self, params: int, elems: int) -> None:
        """Updates just made: counted as overlapped, or as waited for once step() was called."""
        with self.lock:
            counts = self.waited if self.in_step else self.overlap
            counts.params += params
            counts.elems += elems

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def holds(self) -> bool:
        return self.held or self.hold_rest

    def fail(self, exc: BaseException, where: str = "") -> None:
        with self.lock:
            self.errors.append((exc, where))


@dataclass
class UpdateCounts:
    """Parameters (whole ones) and elements updated in one part of a step."""

    params: int = 0
    elems: int = 0


@dataclass(eq=False)
class Job:
    """One parameter's update in this step; ``pieces_left`` chunks still to update.

    The pipeline keeps one Job per parameter and reuses it every step (``begin``/``end``):
    a new Job, its lists and its pieces per gradient kept ~6 GC-tracked objects alive per
    gradient until step_sync, enough to trigger a full collection every few steps.
    """

    opt: OptimizerDoor
    p: torch.Tensor
    index: int
    group: dict
    state: Optional[dict]           # None until this update creates it
    step: int                       # the step this update makes; 0 until read_steps
    grad: torch.Tensor              # flat host gradient (kept until the step finishes)
    out: Optional[torch.Tensor]     # flat host copy of the new weights (None: into p/master)
    source: Optional[torch.Tensor]  # p's values, when this update creates the master
    pieces_left: int
    transport: Any = None
    # [start, end) ranges updated before the step's facts were known (speculatively)
    updated_ranges: list = field(default_factory=list)
    # the Hyper each of those updates used (of each streamed piece, for a streamed job):
    # finish redoes those whose group says otherwise by then (written after backward)
    hypers: list = field(default_factory=list)
    grad_before: Optional[torch.Tensor] = None  # what those updates used, once a fact changed it
    saved_state: dict = field(default_factory=dict)  # range -> master, moments before it
    streamed: bool = False  # committed by the NVMe tier before the step's facts were known

    @property
    def speculative(self) -> bool:
        return bool(self.updated_ranges) or self.streamed

    def begin(self, opt: OptimizerDoor, index: int, group: dict, state: Optional[dict], step: int,
              grad: torch.Tensor, out: Optional[torch.Tensor], source: Optional[torch.Tensor],
              pieces: int, transport: Any) -> None:
        """Take this job into a new step: every per-step field is set as a new Job has it."""
        self.opt, self.index, self.group, self.state, self.step = opt, index, group, state, step
        self.grad, self.out, self.source = grad, out, source
        self.pieces_left, self.transport = pieces, transport
        self.updated_ranges.clear()
        self.hypers.clear()
        self.grad_before = None
        self.saved_state.clear()
        self.streamed = False

    def end(self) -> None:
        """The step is finished: let go of its gradients, state and optimizer (a reused job
        must not keep the host gradients alive, nor the optimizer that owns the pipeline)."""
        self.opt = self.grad = self.out = self.source = self.state = None
        self.transport = self.grad_before = None
        if self.updated_ranges or self.hypers:  # (empty unless this step speculated)
            self.updated_ranges.clear()
            self.hypers.clear()
        if self.saved_state:
            self.saved_state.clear()


@dataclass(eq=False)
class WriteBack:
    """One copy back to the device, sent once its ``left`` pieces are updated."""

    send: Callable[[], None]
    left: int


@dataclass(eq=False)
class Piece:
    """One chunk of a job; hooked parameters reuse theirs (and its WriteBack) every step."""

    job: Job
    start: int
    end: int
    ticket: Any
    writeback: WriteBack
    record: Optional[StepRecord]
    span: tuple = ()  # (start, end), made once: a speculative update records it, allocating nothing
    row: Any = None   # piece_rows.PieceRow: its packed descriptor, kept between steps
    hyper: Any = None  # the Hyper of its last update (set by whoever built that update)
    kept: Any = None   # the buffers step_facts.snapshot copies its state into, reused

    def __post_init__(self) -> None:
        self.span = (self.start, self.end)


@dataclass(eq=False)
class Call:
    """Run ``fn`` on the worker thread; the caller waits on ``done``."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
