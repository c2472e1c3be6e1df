"""Step-wide facts in asynchronous mode: gradient norms, GradScaler's unscale, and the correction.

Clipping and GradScaler need a fact about the whole step (the total norm, any inf) that
exists only after the last gradient, while asynchronous mode updates each parameter as soon
as its gradient lands. The pipeline keeps the overlap and pays only when the fact changes
the update (DESIGN.md section 8):

- every host gradient is kept until the step finishes, so the fact can be computed from it
  with torch's own formulas (``total_norm``, ``clip_coef``, ``unscale_``);
- a step that turns out to need a different gradient for a parameter already updated (clipping
  fired) is *corrected*: the update that gradient ``g`` made is moved to the one ``g'`` makes,
  from the new state and both gradients (``correct``); with fp32 moments this matches sync
  ``clip_grad_norm_`` + ``step()`` to fp32 rounding, not bit for bit;
- GradScaler steps, and steps where the norm so far already passes the limit, are *held*:
  their updates wait for the fact and are then exact.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from . import reference
from .codecs import sqrt_f32
from .functional import UpdateItem

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6).
_CLIP_EPS = 1e-6


def vector_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm torch's clip_grad_norm_ takes of one gradient (in the gradient's dtype)."""
    return torch.linalg.vector_norm(grad, norm_type)


def total_norm(norms: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch's total norm of per-tensor norms (host tensors), as clip_grad_norm_ computes it."""
    norms = [n.to("cpu") for n in norms]
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """max_norm / (total + 1e-6), clamped to 1: the factor clip_grad_norm_ multiplies by."""
    return torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)


def check_finite_norm(total: torch.Tensor, norm_type: float) -> None:
    if total.isnan() or total.isinf():
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")


def scale_by(coef: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """In-place transform: grad *= coef, in the gradient's dtype (as clip_grad_norm_ does)."""
    def apply(grad: torch.Tensor) -> None:
        grad.mul_(coef.to(grad.dtype) if grad.dtype != coef.dtype else coef)
    return apply


def unscale_(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """GradScaler's unscale and inf check on host gradients, with torch's own kernel."""
    by_dtype: dict = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)


def amp_inv_scale(grad_scale: torch.Tensor) -> torch.Tensor:
    """1 / scale on the host, reciprocal in fp64 like GradScaler.unscale_."""
    return grad_scale.detach().to("cpu").double().reciprocal().float()


# --------------------------------------------------------------------------- correction


def correct(item: UpdateItem, grad_before: torch.Tensor) -> None:
    """Turn the update ``grad_before`` made on ``item``'s range into the one ``item.grad`` makes.

    The state holds m_s = b1*m + (1-b1)*g and v_s = b2*v + (1-b2)*g*g, and the master
    p_s = p*decay - step_size*m_s/d_s. With g' the gradient that should have been used:
    m' = m_s + (1-b1)*(g'-g), v' = v_s + (1-b2)*(g'*g' - g*g), and
    p' = p_s + step_size*(m_s/d_s - m'/d'). Moments are re-encoded in their precision
    (with the step's stochastic-rounding bits), the low-precision copy is rewritten.
    """
    h = item.hyper
    g_old, g_new = grad_before.float(), item.grad.float()
    m_s, v_s = reference._load_moments(item)
    m = m_s + (g_new - g_old) * h.one_minus_beta1
    v = (v_s + (g_new * g_new - g_old * g_old) * h.one_minus_beta2).clamp_(min=0.0)
    d_s = sqrt_f32(v_s) / h.bc2_sqrt + h.eps
    s = sqrt_f32(v)
    d = s / h.bc2_sqrt + h.eps
    master = item.master + h.step_size * (m_s / d_s - m / d)
    item.master.copy_(master)
    reference._store_moments(item, m, v, s)
    if item.out is not None:
        item.out.copy_(master)  # rounds to nearest even, like the kernel's write-back


def changed(before: Optional[torch.Tensor], after: torch.Tensor) -> bool:
    return before is not None and not torch.equal(before, after)
