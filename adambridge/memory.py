"""What an optimizer holds in host memory, by kind.

``host_state_bytes()`` counts the optimizer state only (masters and moments). The copies
to and from a device also need page-locked staging, which the OS can never swap out: two
buffers per hooked parameter in async mode (+4 B/param for bf16 parameters) and two reused
buffers per device for a synchronous step() on a device. B/param figures must include it.
With the NVMe tier (``offload_dir``) the state of a file-placed parameter is in its files,
not in ``state``, but the tier holds its ring of aligned page buffers and, per file-placed
parameter, the new weights until a step commits (``nvme_buffers``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sync import transfer

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from .door import OptimizerDoor


def breakdown(opt: OptimizerDoor) -> dict[str, int]:
    """{'state', 'pinned_staging', 'writeback', 'kept', 'nvme_buffers', 'total'} in bytes.

    state: masters and moments; pinned_staging: page-locked buffers (attach_hooks'
    transports and step()'s device staging); writeback: pageable buffers the kernel
    writes the rounded weights of non-contiguous parameters into; kept: the copies of
    master and moments async mode keeps to redo an update made during backward (while
    clipping is expected, after a hyperparameter written after backward, or a skipped
    batch), reused every step; nvme_buffers: the NVMe tier's aligned I/O buffers and its
    staging of new weights (nvme/tier.py, Tier.host_bytes).
    """
    pinned, kept = transfer.staging_bytes(opt), 0
    pipeline = getattr(opt, "_pipeline", None)
    if pipeline is not None:
        pinned += sum(lane.transport.staging_bytes() for lane in pipeline.lanes.values()
                      if hasattr(lane.transport, "staging_bytes"))
        kept = pipeline.kept_bytes() if hasattr(pipeline, "kept_bytes") else 0
    writeback = sum(t.numel() * t.element_size() for t in getattr(opt, "_writeback", {}).values()
                    if isinstance(t, torch.Tensor))
    state = opt.host_state_bytes()
    nvme = opt.nvme_tier.host_bytes() if opt.nvme_tier is not None else 0
    return dict(state=state, pinned_staging=pinned, writeback=writeback, kept=kept,
                nvme_buffers=nvme, total=state + pinned + writeback + kept + nvme)
