"""AutoTuneConfig and the tuner: thread count once, then moment precision step-down.

Two decisions, each logged to ``opt.autotune_log`` as a TuneDecision with its reason:

1. Threads (native backend, once per optimizer): time the kernel on a synthetic batch at
   each candidate thread count and keep the fastest. In synchronous mode this is all the
   tuner does (at the first ``step()``); it runs at ``attach_hooks()`` in asynchronous mode,
   with the pool pinned to the device's NUMA node. The torch backend has nothing to tune.
2. Precision (asynchronous mode only: it compares the host update with backward, which
   only overlap there). After ``warmup_steps`` steps, if the median host update time exceeds
   the median backward time, every state steps its moments down one level (fp32 -> bf16 ->
   fp8, never below ``min_precision``); after ``warmup_steps`` more steps the change is kept
   only if the host time fell, else the states are converted back. Then the tuner stops.
   Converting back restores the precision, not the bits the lower precision rounded away.

The native thread pool is process-wide, so decision 1 is made once per process: a second
optimizer that tunes reuses (and logs) the first one's choice instead of re-sizing the pool
under it. Decision 2 belongs to its optimizer (``opt.tuner``, made at construction): it
outlives ``detach_hooks()``/``attach_hooks()`` and travels in ``state_dict()`` (the
``'autotune'`` entry of ``'adambridge'``), so a resumed run continues at the precision and
in the phase the saved one had reached instead of converting back and tuning again.
"""
from __future__ import annotations

import weakref
import logging
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from .door import OptimizerDoor

PRECISION_LADDER = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class AutoTuneConfig:
    """How the tuner may change the optimizer.

    ``tune_threads``: benchmark thread counts for the native kernel once.
    ``tune_precision``: when the host update outlasts backward, step moment precision down
    one level (fp32 -> bf16 -> fp8), never below ``min_precision``, keeping it only if the
    host time fell. ``thread_candidates``: counts to try (None: 1, 2, 4, ... up to the CPUs).
    ``warmup_steps``: steps observed before deciding on precision.
    """

    tune_threads: bool = True
    tune_precision: bool = True
    min_precision: str = "bf16"
    thread_candidates: Optional[tuple] = None
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        if self.min_precision not in PRECISION_LADDER:
            listed = ", ".join(repr(p) for p in PRECISION_LADDER)
            raise ValueError(f"Invalid min_precision: {self.min_precision!r} (valid: {listed})")
        if self.warmup_steps < 1:
            raise ValueError(f"Invalid warmup_steps: {self.warmup_steps} (expected >= 1)")


_log = logging.getLogger("adambridge")
# The thread count decision 1 chose in this process (the pool is process-wide), or None.
_process_threads: list = [None]
_BENCH_NUMEL = 1 << 22  # elements per thread-count trial: past the L2, still a quick sweep


@dataclass(frozen=True)
class TuneDecision:
    """One entry of ``opt.autotune_log``: ``kind`` is 'threads' or 'precision'."""

    kind: str
    action: str     # 'measured', 'chose', 'skipped', 'stepped_down', 'kept', 'reverted'
    value: Any
    reason: str


def _record(log: list, decision: TuneDecision) -> None:
    log.append(decision)
    _log.info("autotune %s %s %s: %s", decision.kind, decision.action, decision.value,
              decision.reason)


def default_thread_candidates(max_threads: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_threads, then max_threads itself."""
    counts, n = [], 1
    while n < max_threads:
        counts.append(n)
        n *= 2
    return tuple(counts + [max(1, max_threads)])


def choose_threads(measure: Callable[[int], float], candidates: Sequence[int], log: list) -> int:
    """The candidate with the smallest ``measure(n)`` (seconds), every trial logged."""
    timings = {}
    for n in candidates:
        timings[n] = measure(n)
        _record(log, TuneDecision("threads", "measured", n, f"{timings[n] * 1e3:.2f} ms per update"))
    best = min(timings, key=timings.get)
    _record(log, TuneDecision("threads", "chose", best, f"fastest of {sorted(timings)}"))
    return best


def _kernel_timer(precision: str, numel: int = _BENCH_NUMEL) -> Callable[[], float]:
    """Seconds of one native update of ``numel`` synthetic elements (median of 3 after a warm-up)."""
    from .update import state as host_state
    from .update.codecs import stream_key
    from .update.functional import Hyper, adamw_update
    master = torch.randn(numel, dtype=torch.float32)
    st = host_state.new_state(master, precision, alias=True)
    grad = torch.randn(numel, dtype=torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    hyper = Hyper.for_step(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    item = host_state.range_item(st, grad=grad, out=out, start=0, key=stream_key(0, 1, 0),
                                 hyper=hyper, stochastic_rounding=True)

    def run() -> float:
        adamw_update([item], "native")
        times = []
        for _ in range(3):
            began = time.perf_counter()
            adamw_update([item], "native")
            times.append(time.perf_counter() - began)
        return statistics.median(times)
    return run


_threads_tuned: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers whose threads decision 1 made


def tune_threads_once(opt: OptimizerDoor, cpus: Sequence[int] = ()) -> None:
    """Decision 1 (see the module docstring); later calls do nothing."""
    config = opt.autotune_config
    if config is None or opt in _threads_tuned:
        return
    _threads_tuned.add(opt)
    log = opt.autotune_log
    if not config.tune_threads:
        return
    if opt.resolve_backend() != "native":
        _record(log, TuneDecision("threads", "skipped", None, "torch backend: nothing to tune "
                                  "(torch.set_num_threads governs it)"))
        return
    if opt.num_threads is not None:
        _record(log, TuneDecision("threads", "skipped", opt.num_threads,
                                  "num_threads was set by the user"))
        return
    from .host import topology
    from ._native import loader
    if _process_threads[0] is not None:
        loader.set_num_threads(_process_threads[0], cpus)  # attach_hooks re-sized it
        _record(log, TuneDecision("threads", "skipped", _process_threads[0],
                                  "the native pool is process-wide: tuned once already in "
                                  "this process (by another optimizer), kept"))
        return
    usable = tuple(cpus) or topology.allowed_cpus()
    candidates = config.thread_candidates or default_thread_candidates(max(1, len(usable)))
    timer = _kernel_timer(opt.precision)

    def measure(n: int) -> float:
        loader.set_num_threads(n, cpus)
        return timer()
    _process_threads[0] = choose_threads(measure, candidates, log)
    loader.set_num_threads(_process_threads[0], cpus)


class Tuner:
    """Decision 2 (see the module docstring), fed one step at a time by the pipeline."""

    def __init__(self, config: AutoTuneConfig, log: list, origin: str) -> None:
        self.config = config
        self.log = log
        self.origin = origin  # the optimizer's precision before any step-down
        self.phase = "observe" if config.tune_precision else "done"
        self.samples: list[tuple[float, float]] = []
        self.previous: Optional[str] = None
        self.baseline_s = 0.0

    def state_dict(self) -> dict:
        """What a resumed run needs to go on deciding as this one would."""
        return {"origin": self.origin, "phase": self.phase, "previous": self.previous,
                "baseline_s": self.baseline_s, "samples": [list(s) for s in self.samples]}

    def load_state_dict(self, saved: dict) -> None:
        """Go on from ``saved`` (a checked ``state_dict()``; see ``resumed``)."""
        self.phase, self.previous = saved["phase"], saved["previous"]
        self.baseline_s = float(saved["baseline_s"])
        self.samples = [(float(h), float(b)) for h, b in saved["samples"]]

    def observe(self, precision: str, host_s: float, backward_s: float) -> Optional[str]:
        """The precision to convert every state to now, or None."""
        if self.phase == "done":
            return None
        self.samples.append((host_s, backward_s))
        if len(self.samples) < self.config.warmup_steps:
            return None
        host = statistics.median(s[0] for s in self.samples)
        backward = statistics.median(s[1] for s in self.samples)
        self.samples = []
        if self.phase == "trial":
            return self._judge(precision, host)
        self.phase = "done"
        times = f"host update {host * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms"
        if host <= backward:
            _record(self.log, TuneDecision("precision", "kept", precision,
                                           f"{times}: the update hides behind backward"))
            return None
        level = PRECISION_LADDER.index(precision)
        floor = PRECISION_LADDER.index(self.config.min_precision)
        if level >= floor:
            _record(self.log, TuneDecision("precision", "kept", precision, f"{times}, but "
                                           f"min_precision={self.config.min_precision!r}"))
            return None
        lower = PRECISION_LADDER[level + 1]
        self.phase, self.previous, self.baseline_s = "trial", precision, host
        _record(self.log, TuneDecision("precision", "stepped_down", lower,
                                       f"{times}: trying {precision} -> {lower}"))
        return lower

    def _judge(self, precision: str, host: float) -> Optional[str]:
        self.phase = "done"
        change = f"host update {self.baseline_s * 1e3:.2f} -> {host * 1e3:.2f} ms"
        if host < self.baseline_s:
            _record(self.log, TuneDecision("precision", "kept", precision, f"{change}: it fell"))
            return None
        _record(self.log, TuneDecision("precision", "reverted", self.previous,
                                       f"{change}: it did not fall"))
        return self.previous

    def after_step(self, pipeline: Any, stats: Any, backward_s: float) -> None:
        opt = pipeline.opt
        target = self.observe(opt.precision, stats.host_update_s, backward_s)
        if target is not None:
            convert_states(pipeline, target)


def resumed(opt: OptimizerDoor, state_dict: Any) -> tuple[str, Optional[dict]]:
    """(precision to load the state in, the tuner's saved state or None) for a checkpoint.

    A checkpoint of a run that started from this optimizer's precision (the same
    ``origin``) resumes where its tuner was: in the precision it had stepped to. Any other
    checkpoint loads in the optimizer's precision, the tuner untouched.
    """
    meta = state_dict.get("adambridge") if isinstance(state_dict, dict) else None
    saved = meta.get("autotune") if isinstance(meta, dict) else None
    tuner = opt.tuner
    if saved is None or tuner is None:
        return opt.precision, None
    _check_saved(saved)
    if saved["origin"] != tuner.origin:
        return opt.precision, None
    reached = meta.get("precision", opt.precision)
    if reached not in PRECISION_LADDER:
        raise ValueError(f"Invalid checkpoint ['adambridge']['precision']: {reached!r}")
    return reached, saved


def _check_saved(saved: Any) -> None:
    ok = (isinstance(saved, dict) and saved.get("origin") in PRECISION_LADDER
          and saved.get("phase") in ("observe", "trial", "done")
          and saved.get("previous") in PRECISION_LADDER + (None,)
          and isinstance(saved.get("baseline_s"), (int, float))
          and isinstance(saved.get("samples"), list)
          and all(isinstance(s, (list, tuple)) and len(s) == 2 for s in saved["samples"]))
    if not ok:
        raise ValueError(f"Invalid checkpoint ['adambridge']['autotune']: {saved!r} (expected "
                         f"the dict AdamBridge.state_dict() writes)")


def convert_states(pipeline: Any, precision: str) -> None:
    """Re-encode every state's moments on its device's worker (NUMA-local), then switch."""
    from .update.state import convert_precision
    opt = pipeline.opt

    def convert(device: torch.device, params: list) -> None:
        for p in params:
            if opt.state.get(p):
                convert_precision(opt.state[p], precision)
    pipeline.run_on_workers(convert)
    opt.switch_precision(precision)
