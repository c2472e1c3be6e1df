"""Step-wide facts: gradient norms, GradScaler's unscale, the async correction; sync's forms.

Clipping and GradScaler need a fact about the whole step (the total norm, any inf) that
exists only after the last gradient, while asynchronous mode updates each parameter as soon
as its gradient lands. The pipeline keeps the overlap and pays only when the fact changes
the update (docs/architecture.md):

- every host gradient is kept until the step finishes, so the fact can be computed from it
  with torch's own formulas (``total_norm``, ``clip_coef``, ``unscale_``);
- a step that turns out to need a different gradient for a parameter already updated (clipping
  fired, or the loop changed a gradient: pipeline/grad_edits.py) is *redone*: while that may
  happen the master and moments of each speculative update are kept (``snapshot``), and
  ``redo`` restores them and updates again with the final gradient, so the result is sync
  ``clip_grad_norm_`` + ``step()`` bit for bit. Without a snapshot (a first change
  mid-training) the change is refused before it is made;
- GradScaler steps, and steps where the norm so far already passes the limit, are *held*:
  their updates wait for the fact and are then exact;
- the step's hyperparameters are a fact of the same kind: torch's step() reads the group
  when it is called, and a loop may write lr, betas, eps or weight_decay after backward
  (llm.c's does). Each speculative update records the Hyper it used; finish redoes those
  the group now contradicts, from a snapshot once such a write has been seen
  (``hyper_inputs`` tells), else from the updated state (``rebase``, an approximation).

The synchronous step's forms (torch's own kernels on p.grad) are in sync/scaler_clip.py.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from ..update import codecs, reference
from ..update.codecs import sqrt_f32
from ..update.functional import Hyper, UpdateItem
from .slots import copy_many

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


def rebase(item: UpdateItem, used: Hyper, grad_used: torch.Tensor) -> None:
    """Turn the update that ``used`` and ``grad_used`` made on ``item``'s range into the one
    ``item.hyper`` and ``item.grad`` make, from the updated state alone (no snapshot).

    An approximation. The master before the update is recovered from p_s and
    u = step_hat*m_s/d_s computed from the stored moments (with fp32 moments, the term the
    kernel subtracted): the fp32 value the kernel's lines take to p_s (``_recover_master``;
    where two do, an ulp may be lost), and the update is redone from it in the kernel's
    fp32 order, so with fp32 moments nearly every element comes out bit for bit. Low-precision moments store a rounding of the m and
    sqrt(v) the kernel used, so there the error is about the change of step_hat times that
    rounding (2^-8 of the update for bf16, ~2^-3 for fp8). Moments are moved only when the
    betas or the gradient changed: m = (m_s - (1-b1)*g)/b1 recovered, then updated again.
    """
    h0, h1 = used, item.hyper
    if h0.decay == 0.0:
        raise RuntimeError("cannot correct an update made with lr * weight_decay == 1 (it "
                           "zeroed the master); write hyperparameters before backward")
    g0, g1 = grad_used.float(), item.grad.float()
    m_s, v_s = reference._load_moments(item)
    s_s = sqrt_f32(v_s)
    u = h0.step_hat * (m_s / (s_s + h0.eps_hat))       # what the update subtracted
    p = _recover_master(item.master, u, h0.decay)
    same_moments = (h0.beta1, h0.beta2, h0.one_minus_beta1, h0.one_minus_beta2) == (
        h1.beta1, h1.beta2, h1.one_minus_beta1, h1.one_minus_beta2) and torch.equal(g0, g1)
    m, v, s = m_s, v_s, s_s
    if not same_moments:
        m = _before(m_s, g0, h0.beta1, h0.one_minus_beta1) * h1.beta1
        m = m + g1 * h1.one_minus_beta1
        v = _before(v_s, g0 * g0, h0.beta2, h0.one_minus_beta2).clamp_(min=0.0) * h1.beta2
        v = v + (g1 * g1) * h1.one_minus_beta2
        s = sqrt_f32(v)
    p = p * h1.decay                             # the kernel's lines, from the recovered p
    p = p - h1.step_hat * (m / (s + h1.eps_hat))
    master = codecs.canonical_nan(p)
    item.master.copy_(master)
    if not same_moments:
        reference._store_moments(item, m, v, s)
    _write_copy(item, master)


def _recover_master(updated: torch.Tensor, u: torch.Tensor, decay: float) -> torch.Tensor:
    """x with fp32 (x*decay) - u == updated: (updated + u) / decay in fp64 is within an ulp
    of it, so of that estimate and its two neighbours the one the kernel's two fp32 lines
    take to ``updated`` is taken (the estimate where none does, the first where several)."""
    estimate = ((updated.double() + u.double()) / decay).float()
    best = estimate
    found = (estimate * decay) - u == updated
    for step in (float("-inf"), float("inf")):
        neighbour = torch.nextafter(estimate, torch.full_like(estimate, step))
        hits = ~found & ((neighbour * decay) - u == updated)
        best = torch.where(hits, neighbour, best)
        found |= hits
    return best


def _before(updated: torch.Tensor, g: torch.Tensor, beta: float,
            one_minus_beta: float) -> torch.Tensor:
    """x from updated = beta*x + (1-beta)*g, in fp64 (0 where beta is 0: x did not count)."""
    if beta == 0.0:
        return torch.zeros_like(updated)
    return ((updated.double() - g.double() * one_minus_beta) / beta).float()


def _write_copy(item: UpdateItem, master: torch.Tensor) -> None:
    if item.out is not None:  # rounded to nearest even, as the kernel's write-back
        item.out.copy_(codecs.bf16_rne(master) if item.out.dtype == torch.bfloat16 else master)


SAVED_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def state_of(item: UpdateItem) -> tuple:
    """The tensors of ``item`` that ``snapshot`` keeps, in SAVED_KEYS order (None: absent)."""
    return tuple(getattr(item, k) for k in SAVED_KEYS)


def snapshot(item: UpdateItem) -> tuple:
    """The master and moments of ``item``'s range before a speculative update (12, 8 or
    ~6 B/param for fp32, bf16, fp8 moments).

    ``correct`` alone loses v when clipping is strong (v' = v_s - (1-b2)*(g*g - g'*g')
    cancels) and low-precision moments are too coarse for it (an fp8 v carries 2 mantissa
    bits); and a master recovered from the updated one, (p_s + step_hat*m_s/d_s) / decay,
    is an ulp or two off, which training compounds. So while clipping may fire (or a
    hyperparameter be written after backward) the state itself is kept and the update is
    redone from it.
    """
    return snapshot_many([state_of(item)], [None])[0]


def snapshot_many(sources: list, kept: list) -> list:
    """A copy of each tuple of ``sources`` (``state_of`` order), in one multi-tensor copy.

    ``kept[i]`` (a copy made by an earlier call, or None) is written over when it has the
    shapes and dtypes of ``sources[i]``: a parameter's pieces reuse their copies every step,
    so keeping the state allocates (and page-faults) nothing after the first step.
    """
    dsts, srcs, out = [], [], []
    for tensors, buffers in zip(sources, kept):
        if not _fits(buffers, tensors):
            buffers = tuple(None if t is None else torch.empty_like(t) for t in tensors)
        for dst, src in zip(buffers, tensors):
            if src is not None:
                dsts.append(dst)
                srcs.append(src)
        out.append(buffers)
    copy_many(dsts, srcs)
    return out


def _fits(buffers: Optional[tuple], tensors: tuple) -> bool:
    return buffers is not None and all(
        b is None if t is None else (b is not None and b.shape == t.shape and b.dtype == t.dtype)
        for b, t in zip(buffers, tensors))


def redo(item: UpdateItem, saved: tuple, backend: str) -> None:
    """Redo ``item``'s update with its final gradient from the state ``snapshot`` kept.

    The restored master and moments are those sync's update starts from, and the range's
    offset and step give the same rounding bits, so the redone update equals sync's bit
    for bit (the low-precision copy is rewritten by the update too).
    """
    _put_back(item, saved)
    from ..update.functional import adamw_update
    adamw_update([item], backend)


def restore(item: UpdateItem, saved: tuple) -> None:
    """Undo ``item``'s update: the state ``snapshot`` kept, and the low-precision copy of it."""
    _put_back(item, saved)
    _write_copy(item, item.master)


def _put_back(item: UpdateItem, saved: tuple) -> None:
    for key, value in zip(SAVED_KEYS, saved):
        if value is not None:
            getattr(item, key).copy_(value)


# --------------------------------------------------------------------------- hyperparameters


_HYPER_KEYS = ("lr", "eps", "weight_decay")


def hyper_inputs(groups: list) -> tuple:
    """What ``Hyper.for_group`` reads of each group (lr, betas, eps, weight_decay), as it
    stands: a one-element CPU tensor by value, any other tensor by identity and version
    (reading a device tensor's value would wait for the device)."""
    return tuple(_token(x) for group in groups
                 for x in (*(group[k] for k in _HYPER_KEYS), *group["betas"]))


def _token(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "cpu" and x.numel() == 1:
        return float(x)
    return (x, x._version)


def same_inputs(before: tuple, now: tuple) -> bool:
    """Whether two ``hyper_inputs`` say the same (a tensor: the same one, not written)."""
    return len(before) == len(now) and all(map(_same, before, now))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and a[0] is b[0]
                and a[1] == b[1])
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False
