"""What one update is made of: Hyper (a step's scalars, rounded to fp32) and UpdateItem (one
contiguous range of one parameter's host state, with the tensors the kernel reads and writes).

Python's names and C's differ in three places, tabled in csrc/adambridge.h: ``UpdateItem.master``
is ``ab_tensor.param``, ``Hyper.step_hat`` is ``ab_hyper.step_size`` and ``Hyper.eps_hat`` is
``ab_hyper.eps``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from .codecs import f32


@dataclass(frozen=True)
class Hyper:
    """The per-tensor scalars of docs/numerics.md section 1, already rounded to fp32.

    ``step_size``, ``bc2_sqrt`` and ``eps`` are torch's (lr / bc1, sqrt(bc2), eps), for code
    that reasons in torch's terms; the update itself uses ``step_hat`` = lr * sqrt(bc2) / bc1
    and ``eps_hat`` = eps * sqrt(bc2): torch's ``denom = sqrt(v) / sqrt(bc2) + eps`` scaled by
    sqrt(bc2), so the element update has one division instead of two (numerics version 2).
    """

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    decay: float
    step_size: float
    bc2_sqrt: float
    eps: float
    step_hat: float
    eps_hat: float

    @classmethod
    def for_step(cls, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int) -> "Hyper":
        """The scalars of one step (cached: every parameter of a group shares them)."""
        return _hyper_for_step(cls, lr, beta1, beta2, eps, weight_decay, step)

    @classmethod
    def for_group(cls, group: dict, step: int) -> "Hyper":
        """The scalars of ``step`` for a param_groups entry (lr, betas, eps, weight_decay)."""
        beta1, beta2 = group["betas"]  # floats, or 1-element tensors (read at every step)
        return _hyper_for_step(cls, float(group["lr"]), float(beta1), float(beta2), group["eps"],
                               group["weight_decay"], step)


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
        step_size=f32(lr / bias_correction1),
        bc2_sqrt=f32(bc2_sqrt),
        eps=f32(eps),
        step_hat=f32(lr * bc2_sqrt / bias_correction1),
        eps_hat=f32(eps * bc2_sqrt),
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
