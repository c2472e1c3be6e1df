"""StepStats: what one optimizer step cost, in seconds and bytes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass
class StepStats:
    """Timings (seconds) and traffic (bytes) of one step.

    ``host_update_s``: time the host spent in the AdamW kernel; ``d2h_s`` / ``h2d_s``: time
    spent copying gradients down and weights up (summed over copies); ``sync_wait_s``: how
    long ``step_sync()`` (or ``step()``) waited for the host; ``wall_s``: from the first
    gradient of the step to the end of ``step_sync()``; ``d2h_bytes`` / ``h2d_bytes``: bytes
    moved each way; ``num_params`` / ``num_batches``: parameters updated and native calls made;
    ``grad_norm``: the total gradient norm torch's ``clip_grad_norm_`` returned this step
    (``max_grad_norm``, or a clipping call routed to the optimizer), else None; ``skipped``:
    GradScaler found inf/NaN and the step changed nothing; ``io_read_bytes`` /
    ``io_write_bytes`` / ``io_wait_s``: the NVMe tier's file traffic and the time its
    streaming waited for I/O (0 without ``offload_dir``).
    """

    host_update_s: float = 0.0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    sync_wait_s: float = 0.0
    wall_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    num_params: int = 0
    num_batches: int = 0
    grad_norm: Optional[float] = None
    skipped: bool = False
    io_read_bytes: int = 0
    io_write_bytes: int = 0
    io_wait_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
