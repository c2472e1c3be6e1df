"""Step-wide facts: gradient norms, GradScaler's unscale, the async correction; sync's forms.

Clipping and GradScaler need a fact about the whole step (the total norm, any inf) that
exists only after the last gradient, while asynchronous mode updates each parameter as soon
as its gradient lands. The pipeline keeps the overlap and pays only when the fact changes
the update (DESIGN.md section 8):

- every host gradient is kept until the step finishes, so the fact can be computed from it
  with torch's own formulas (``total_norm``, ``clip_coef``, ``unscale_``);
- a step that turns out to need a different gradient for a parameter already updated (clipping
  fired) is *redone*: while clipping is expected the master and moments of each speculative
  update are kept (``snapshot``), and ``redo`` restores them and updates again with the
  final gradient, so the result is sync ``clip_grad_norm_`` + ``step()`` bit for bit.
  Without a snapshot (clipping first used mid-training) the update is moved algebraically
  (``correct``), an approximation the pipeline warns of;
- GradScaler steps, and steps where the norm so far already passes the limit, are *held*:
  their updates wait for the fact and are then exact.

The synchronous step's forms (``sync_amp``, ``sync_clip``: torch's own kernels on p.grad)
are at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from . import codecs, reference
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
        return torch.tensor(0.0, dtype=torch.float32)
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


def unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
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
    p_s = p*decay - step_hat*m_s/d_s. With g' the gradient that should have been used:
    m' = m_s + (1-b1)*(g'-g), v' = max(v_s + (1-b2)*(g'*g' - g*g), (1-b2)*g'*g'), and
    p' = p_s + step_hat*(m_s/d_s - m'/d'), with d = sqrt(v) + eps_hat as in the kernel. Moments are re-encoded in their precision
    (with the step's stochastic-rounding bits), the low-precision copy is rewritten.
    """
    h = item.hyper
    g_old, g_new = grad_before.float(), item.grad.float()
    m_s, v_s = reference._load_moments(item)
    m = m_s + (g_new - g_old) * h.one_minus_beta1
    # v' = b2*v + (1-b2)*g'*g' >= (1-b2)*g'*g': the bound keeps the rounding of a coarse
    # v_s (bf16, fp8) from leaving v' near 0, where m'/d' would explode.
    floor = (g_new * g_new) * h.one_minus_beta2
    v = torch.maximum(v_s + (g_new * g_new - g_old * g_old) * h.one_minus_beta2, floor)
    d_s = sqrt_f32(v_s) + h.eps_hat          # the kernel's d (docs/numerics.md)
    s = sqrt_f32(v)
    d = s + h.eps_hat
    master = codecs.canonical_nan(item.master + h.step_hat * (m_s / d_s - m / d))
    item.master.copy_(master)
    reference._store_moments(item, m, v, s)
    _write_copy(item, master)


def _write_copy(item: UpdateItem, master: torch.Tensor) -> None:
    if item.out is not None:  # rounded to nearest even, as the kernel's write-back
        item.out.copy_(codecs.bf16_rne(master) if item.out.dtype == torch.bfloat16 else master)


_SAVED_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def snapshot(item: UpdateItem) -> tuple:
    """The master and moments of ``item``'s range before a speculative update (12, 8 or
    ~6 B/param for fp32, bf16, fp8 moments).

    ``correct`` alone loses v when clipping is strong (v' = v_s - (1-b2)*(g*g - g'*g')
    cancels) and low-precision moments are too coarse for it (an fp8 v carries 2 mantissa
    bits); and a master recovered from the updated one, (p_s + step_hat*m_s/d_s) / decay,
    is an ulp or two off, which training compounds. So while clipping may fire the state
    itself is kept and the update is redone from it.
    """
    return tuple(None if getattr(item, k) is None else getattr(item, k).clone()
                 for k in _SAVED_KEYS)


def redo(item: UpdateItem, saved: tuple, backend: str) -> None:
    """Redo ``item``'s update with its final gradient from the state ``snapshot`` kept.

    The restored master and moments are those sync's update starts from, and the range's
    offset and step give the same rounding bits, so the redone update equals sync's bit
    for bit (the low-precision copy is rewritten by the update too).
    """
    _put_back(item, saved)
    from .functional import adamw_update
    adamw_update([item], backend)


def restore(item: UpdateItem, saved: tuple) -> None:
    """Undo ``item``'s update: the state ``snapshot`` kept, and the low-precision copy of it."""
    _put_back(item, saved)
    _write_copy(item, item.master)


def _put_back(item: UpdateItem, saved: tuple) -> None:
    for key, value in zip(_SAVED_KEYS, saved):
        if value is not None:
            getattr(item, key).copy_(value)


# --------------------------------------------------------------------------- synchronous mode


def sync_amp(opt: Any) -> bool:
    """GradScaler in synchronous mode: False to skip the step, else unscale each p.grad."""
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None and float(torch.as_tensor(found_inf).sum()) > 0:
        return False
    grad_scale = getattr(opt, "grad_scale", None)
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float()
        by_device: dict = {}
        for p in _params_with_grad(opt):
            by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_device.items():
            unused = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, unused,
                                                             inv_scale.to(device))
    return True


def sync_clip(opt: Any) -> float:
    """``max_grad_norm`` in synchronous mode: torch's own clip_grad_norm_; the total norm."""
    from . import interception
    clip = interception.original_clip_grad_norm_()
    return float(clip(_params_with_grad(opt), opt.max_grad_norm))


def _params_with_grad(opt: Any) -> list:
    return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
