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

    Where the update ran (asynchronous mode only; 0 and None in sync mode, where every
    update runs inside ``step()``): ``params_in_backward`` / ``elems_in_backward`` were updated before ``step()``
    was called, overlapped with backward; ``params_in_step`` / ``elems_in_step`` while
    ``step()`` waited for them, on the training thread's critical path; ``params_redone`` /
    ``elems_redone`` were updated during backward and then again at ``step()`` because the
    loop or a step-wide fact changed their gradient or hyperparameters; ``held_by`` says why
    the step's updates waited for ``step()`` (None when nothing held them); ``hook_s`` is the
    time the training thread spent in adambridge's gradient hooks.
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
    params_in_backward: int = 0
    elems_in_backward: int = 0
    params_in_step: int = 0
    elems_in_step: int = 0
    params_redone: int = 0
    elems_redone: int = 0
    held_by: Optional[str] = None
    hook_s: float = 0.0

    @property
    def overlap_share(self) -> Optional[float]:
        """The share of the updated elements that ran off the critical path (during
        backward); None when the step updated nothing."""
        total = self.elems_in_backward + self.elems_in_step
        return None if total == 0 else self.elems_in_backward / total

    def as_dict(self) -> dict:
        return asdict(self)
