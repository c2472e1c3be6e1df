"""The pure-torch backend: the ground truth every native kernel is tested against, and the fallback.

One function, ``update_range``, applies docs/numerics.md to one UpdateItem (a contiguous range
of one parameter) on CPU tensors. Every line is one IEEE fp32 operation (no lerp, addcmul or
addcdiv, which may fuse), so the C kernel can reproduce it bit for bit.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import codecs
from .codecs import canonical_nan, sqrt_f32

if TYPE_CHECKING:  # pragma: no cover
    from .items import UpdateItem


def _load_moments(item: "UpdateItem") -> tuple[torch.Tensor, torch.Tensor]:
    if item.precision == "fp32":
        return item.exp_avg.clone(), item.exp_avg_sq.clone()
    if item.precision == "bf16":
        return codecs.bf16_decode(item.exp_avg), codecs.bf16_decode(item.exp_avg_sq)
    m = codecs.fp8_decode(item.exp_avg, item.exp_avg_scale)
    v = codecs.fp8_decode_v(item.exp_avg_sq, item.exp_avg_sq_scale)
    return m, v


def _store_moments(item: "UpdateItem", m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    if item.precision != "fp8":  # fp8 stores non-finite values as the NaN code instead
        m, v = canonical_nan(m), canonical_nan(v)
    if item.precision == "fp32":
        item.exp_avg.copy_(m)
        item.exp_avg_sq.copy_(v)
        return
    r_m = r_v = None
    if item.stochastic_rounding:
        r_m, r_v = codecs.hash_halves(item.key, item.offset, m.numel())
    if item.precision == "bf16":
        item.exp_avg.copy_(codecs.bf16_encode(m, r_m))
        item.exp_avg_sq.copy_(codecs.bf16_encode(v, r_v))
        return
    codes_m, scale_m = codecs.fp8_encode_m(m, r_m)
    codes_s, scale_s = codecs.fp8_encode_sqrt_v(s, r_v)
    item.exp_avg.copy_(codes_m)
    item.exp_avg_scale.copy_(scale_m)
    item.exp_avg_sq.copy_(codes_s)
    item.exp_avg_sq_scale.copy_(scale_s)


# NOTE: elements per pass of _update_block: every line below allocates a temporary of the
# block's size, so a whole 1 GB parameter would need ~9 GB more; 64 Ki elements
# (a multiple of the fp8 block) keep the extra memory constant and the bits unchanged.
BLOCK = 1 << 16


def update_range(item: "UpdateItem") -> None:
    """AdamW on one range, in place: master, moments and the low-precision copy.

    The range is updated in blocks of BLOCK elements; each is a range of its own (offset
    and fp8 scales sliced), so the bits are those of one pass (docs/architecture.md).
    """
    if item.numel <= BLOCK:
        _update_block(item)
        return
    for start in range(0, item.numel, BLOCK):
        _update_block(_sub_range(item, start, min(start + BLOCK, item.numel)))


def _sub_range(item: "UpdateItem", start: int, end: int) -> "UpdateItem":
    scales = {}
    if item.exp_avg_scale is not None:
        first, last = start // codecs.FP8_BLOCK, -(-end // codecs.FP8_BLOCK)
        scales = dict(exp_avg_scale=item.exp_avg_scale[first:last],
                      exp_avg_sq_scale=item.exp_avg_sq_scale[first:last])
    return replace(item, master=item.master[start:end], grad=item.grad[start:end],
                   exp_avg=item.exp_avg[start:end], exp_avg_sq=item.exp_avg_sq[start:end],
                   out=None if item.out is None else item.out[start:end],
                   offset=item.offset + start, **scales)


def _update_block(item: "UpdateItem") -> None:
    h = item.hyper
    g = item.grad.float()
    m, v = _load_moments(item)
    p = item.master * h.decay                    # decoupled weight decay
    m = m * h.beta1                              # m = beta1*m + (1-beta1)*g
    m = m + g * h.one_minus_beta1
    v = v * h.beta2                              # v = beta2*v + (1-beta2)*g*g
    v = v + (g * g) * h.one_minus_beta2
    s = sqrt_f32(v)
    d = s + h.eps_hat                            # sqrt(bc2) * (sqrt(v)/sqrt(bc2) + eps)
    p = p - h.step_hat * (m / d)                 # step_hat = lr * sqrt(bc2) / bc1
    p = canonical_nan(p)                         # every stored NaN is 0x7fc00000
    item.master.copy_(p)
    _store_moments(item, m, v, s)
    if item.out is not None:                     # rounds to nearest even
        item.out.copy_(codecs.bf16_rne(p) if item.out.dtype == torch.bfloat16 else p)
