"""AutoTuneConfig and the tuner: thread count once, then moment precision step-down."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
