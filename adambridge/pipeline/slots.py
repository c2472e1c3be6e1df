"""Fixed slots for the parameters without a hook: one staging buffer per dtype each way.

NOTE: The small parameters (and any owned parameter outside the hooked
model) move at step_sync as one buffer per dtype. Each parameter has a fixed slot, made once
at attach_hooks, so a step in which some of them have no gradient (MoE experts, unused
biases) copies only the runs of slots that do, and never rebuilds, re-registers or waits.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..host.pinned import PinnedBuffer


class SlotBuffers:
    """Per dtype: a host grad and out buffer (page-locked) and a device twin of each.

    The device twins let one multi-tensor copy gather the gradients into their slots and
    scatter the new weights out of them, so each way costs one copy per run of slots.
    """

    def __init__(self, params: Iterable[torch.Tensor], device: torch.device) -> None:
        self.slot: dict[torch.Tensor, tuple[torch.dtype, int, int]] = {}
        sizes: dict[torch.dtype, int] = {}
        for p in params:
            start = sizes.get(p.dtype, 0)
            self.slot[p] = (p.dtype, start, start + p.numel())
            sizes[p.dtype] = start + p.numel()
        self.host_grad = {d: PinnedBuffer(n, d) for d, n in sizes.items()}
        self.host_out = {d: PinnedBuffer(n, d) for d, n in sizes.items()}
        self.device_grad = {d: torch.empty(n, dtype=d, device=device) for d, n in sizes.items()}
        self.device_out = {d: torch.empty(n, dtype=d, device=device) for d, n in sizes.items()}

    def __contains__(self, p: torch.Tensor) -> bool:
        return p in self.slot

    def view(self, table: dict, p: torch.Tensor) -> torch.Tensor:
        dtype, start, end = self.slot[p]
        buffer = table[dtype]
        return (buffer.tensor if isinstance(buffer, PinnedBuffer) else buffer)[start:end]

    def runs(self, params: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, int, int]]:
        """The slots of ``params`` merged into maximal [start, end) runs, per dtype."""
        runs: list[list] = []
        for dtype, start, end in sorted((self.slot[p] for p in params),
                                        key=lambda s: (str(s[0]), s[1])):
            if runs and runs[-1][0] == dtype and runs[-1][2] == start:
                runs[-1][2] = end
            else:
                runs.append([dtype, start, end])
        return [tuple(run) for run in runs]

    def nbytes(self) -> int:
        """Page-locked bytes (the host side; the device twins are device memory)."""
        return sum(b.nbytes for table in (self.host_grad, self.host_out) for b in table.values())

    def close(self) -> None:
        for table in (self.host_grad, self.host_out):
            for buffer in table.values():
                buffer.close()
        self.slot.clear()


def copy_many(dsts: list, srcs: list) -> None:
    """dst.copy_(src) for each pair, as one multi-tensor kernel where torch has one."""
    if not dsts:
        return
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
