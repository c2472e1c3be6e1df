"""Synchronous step() on a device: every gradient down and every new weight up through one
page-locked staging buffer per device and direction, reused across steps, with one wait.

NOTE: A blocking ``grad.to("cpu")`` per parameter copies into fresh
pageable memory and synchronises the stream each time (2N syncs per step, at pageable
bandwidth). Here all D2H copies are queued non_blocking into slices of one pinned buffer
and the stream is synchronised once; the copies back are queued non_blocking from a second
pinned buffer on the current stream (ordered before the next forward), and an event says
when that buffer may be overwritten by the next step.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch

from ..host.pinned import PinnedBuffer

_ALIGN = 64  # bytes: every slice starts cache-line aligned, so any dtype view is valid
_STAGING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # opt -> {key: Staging}


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the CUDA staging (a function so CPU tests can say yes)."""
    return t.is_cuda


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


class Staging:
    """One growable page-locked byte buffer; ``reuse`` is the event its last reader recorded."""

    def __init__(self) -> None:
        self.buffer: Optional[PinnedBuffer] = None
        self.reuse = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.reuse is not None:
            self.reuse.synchronize()  # the last step's copies out of it have run
            self.reuse = None
        if self.buffer is None or self.buffer.nbytes < nbytes:
            if self.buffer is not None:
                self.buffer.close()
            self.buffer = PinnedBuffer(nbytes, torch.uint8)
        return self.buffer.tensor

    def close(self) -> None:
        if self.buffer is not None:
            if self.reuse is not None:
                self.reuse.synchronize()
            self.buffer.close()
            self.buffer = None


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _views(staging: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: list) -> list:
    return [staging[o:o + t.numel() * t.element_size()].view(t.dtype)
            for t, o in zip(tensors, offsets)]


def _stagings(opt: object, device: torch.device) -> tuple[Staging, Staging]:
    table = _STAGING.setdefault(opt, {})
    if device not in table:
        table[device] = (Staging(), Staging())
    return table[device]


def staging_bytes(opt: object) -> int:
    """Page-locked bytes held by ``opt``'s synchronous staging buffers."""
    return sum(s.buffer.nbytes for pair in _STAGING.get(opt, {}).values() for s in pair
               if s.buffer is not None)


class Staged:
    """The host gradients and out buffers of one synchronous step (see the module docstring)."""

    def __init__(self, opt: object, params: Sequence[torch.Tensor],
                 needs_out: Callable[[torch.Tensor], bool]) -> None:
        self.opt = opt
        self._grad: dict = {}
        self._out: dict = {}
        by_device: dict = {}
        for p in params:
            if on_device(p.grad):
                by_device.setdefault(p.grad.device, []).append(p)
            else:  # CPU (used in place) or another device (a plain blocking copy)
                self._grad[p] = _flat(p.grad.detach().to("cpu"))
        for device, members in by_device.items():
            self._down(device, members)
            self._make_outs(device, [p for p in members if needs_out(p)])

    def _down(self, device: torch.device, members: list) -> None:
        down, _ = _stagings(self.opt, device)
        grads = [p.grad.detach() for p in members]
        offsets, total = _layout(grads)
        views = _views(down.take(total), grads, offsets)
        for view, grad in zip(views, grads):
            view.copy_(_flat(grad), non_blocking=True)
        torch.cuda.current_stream(device).synchronize()  # the step's one wait: grads landed
        self._grad.update(zip(members, views))

    def _make_outs(self, device: torch.device, members: list) -> None:
        if not members:
            return
        _, up = _stagings(self.opt, device)
        offsets, total = _layout([p.detach() for p in members])
        self._out.update(zip(members, _views(up.take(total), members, offsets)))

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        return self._grad[p]

    def out(self, p: torch.Tensor, fallback: Callable[[torch.Tensor], Optional[torch.Tensor]]):
        """Where the kernel writes p's rounded copy: the pinned up-buffer for a device p."""
        out = self._out.get(p)
        return out if out is not None else fallback(p)

    def write_back(self, pairs: Sequence[tuple], fallback: Callable) -> None:
        """Queue p.copy_(new weights) non_blocking per staged p; ``fallback(p, state)`` else."""
        devices = set()
        for p, state in pairs:
            out = self._out.get(p)
            if out is None:
                fallback(p, state)
                continue
            p.detach().copy_(out.view(p.shape), non_blocking=True)
            devices.add(p.device)
        for device in devices:
            reuse = torch.cuda.Event(blocking=True)  # waited on by the next take(), not now
            reuse.record(torch.cuda.current_stream(device))
            _stagings(self.opt, device)[1].reuse = reuse
