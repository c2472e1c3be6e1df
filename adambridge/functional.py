"""adamw_update(items): one multi-tensor AdamW call, routed to the native kernel or to torch.

An UpdateItem is a contiguous range of one parameter's host state (a whole parameter, a
chunk or, later, a shard); the optimizer and the pipeline build them, this module runs them.
"""
from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import reference
from .codecs import f32

PRECISIONS = ("fp32", "bf16", "fp8")
BACKENDS = ("auto", "native", "torch")


@dataclass(frozen=True)
class Hyper:
    """The per-tensor scalars of docs/numerics.md section 1, already rounded to fp32.

    ``step_size`` and ``eps`` are step_hat = lr * sqrt(bc2) / bc1 and eps_hat = eps * sqrt(bc2):
    torch's ``denom = sqrt(v) / sqrt(bc2) + eps`` scaled by sqrt(bc2), so the element update
    has one division instead of two.
    """

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    decay: float
    step_size: float
    eps: float

    @classmethod
    def for_step(cls, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int) -> "Hyper":
        """The scalars of one step (cached: every parameter of a group shares them)."""
        return _hyper_for_step(cls, lr, beta1, beta2, eps, weight_decay, step)


@lru_cache(maxsize=256)
def _hyper_for_step(cls, lr, beta1, beta2, eps, weight_decay, step) -> Hyper:
    # torch.optim.AdamW's double-precision bias corrections, each scalar rounded once to fp32.
    bias_correction1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    return cls(
        beta1=f32(beta1),
        beta2=f32(beta2),
        one_minus_beta1=f32(1 - beta1),
        one_minus_beta2=f32(1 - beta2),
        decay=f32(1 - lr * weight_decay),
        step_size=f32(lr * bc2_sqrt / bias_correction1),
        eps=f32(eps * bc2_sqrt),
    )


@dataclass
class UpdateItem:
    """One contiguous range [offset, offset + numel) of one parameter, all tensors 1-D on CPU.

    ``exp_avg_scale``/``exp_avg_sq_scale`` (fp8 only) hold the scales of this range's blocks;
    ``out`` (bf16/fp16/fp32 or None) receives the rounded copy of the new master.
    """

    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: Optional[torch.Tensor]
    exp_avg_sq_scale: Optional[torch.Tensor]
    out: Optional[torch.Tensor]
    offset: int
    key: int
    precision: str
    stochastic_rounding: bool
    hyper: Hyper

    @property
    def numel(self) -> int:
        return self.master.numel()


def adamw_update(items: Sequence[UpdateItem], backend: str = "native") -> None:
    """Update every item in place: one native call for the whole batch, or the torch loop."""
    if not items:
        return
    if backend == "native":
        from ._native import loader
        loader.update(items)
    elif backend == "torch":
        for item in items:
            reference.update_range(item)
    else:
        raise ValueError(f"Invalid backend: {backend!r} (valid: 'native', 'torch')")
