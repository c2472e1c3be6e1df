"""Moment codecs (bf16, block-scaled fp8) and the stochastic-rounding counter hash, in torch.

This is the torch twin of ``csrc/codecs.h``; both follow ``docs/numerics.md`` bit for bit.
Integer work is done in int64 and masked to 32 bits, so no intermediate can overflow.
"""
from __future__ import annotations

import struct
from functools import lru_cache

import torch

# NOTE: the version of docs/numerics.md these twins implement. Bump it (next integer) in the
# same commit as any change that can alter a stored bit for some input: an operation of the
# update, a scalar's formula, the hash, a codec or its rounding, the handling of non-finite
# values. Checkpoints record it, so a resume under other numerics is a visible decision.
#   1: the first release (two divisions per element; a non-finite fp8 element spoils its block)
#   2: one division (step_hat, eps_hat); canonical NaN; fp8 block scales skip non-finite values
#   3: fp8 rounding in the integer domain on the fp32 pattern (numerics.md section 3)
NUMERICS_VERSION = 3
# Checkpoints of these versions load: 2 stores the same state (codes, scales, masters) with
# the same meaning; only the rounding of later steps differs (docs/checkpoints.md).
LOADABLE_NUMERICS = (2, 3)

MASK32 = 0xFFFFFFFF
FP8_BLOCK = 128
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# (emin, mantissa bits) of the two fp8 grids, docs/numerics.md section 3.
E4M3_GRID = (-6, 3)
E5M2_GRID = (-14, 2)
# What a non-finite m or sqrt(v) is stored as: the NaN code of both fp8 formats (section 6).
FP8_NAN_CODE = 0x7F
CANONICAL_NAN = float("nan")  # bits 0x7fc00000 in torch

_MIX_MUL1 = 0x7FEB352D
_MIX_MUL2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def f32(x: float) -> float:
    """The binary32 value nearest to ``x``, as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root.

    NOTE: torch's vectorised float sqrt is not always correctly rounded (it differed in the
    last bit from IEEE sqrt on ~1 in 8000 elements here), while C's sqrtf / vsqrtps are.
    The fp64 root rounded to fp32 is exact-rounded (53 >= 2*24 + 2 bits), so use that.
    """
    return torch.sqrt(x.double()).float()


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN replaced by the canonical quiet NaN 0x7fc00000 (numerics.md section 6).

    IEEE arithmetic leaves the payload of a NaN result to the operand order, which the two
    backends need not share, so no NaN is stored with a payload.
    """
    return x.masked_fill(torch.isnan(x), CANONICAL_NAN)


# --------------------------------------------------------------------------- the hash

def mix32(x: int) -> int:
    """The 32-bit finaliser of docs/numerics.md section 2, on a Python int."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MIX_MUL2) & MASK32
    x ^= x >> 16
    return x


@lru_cache(maxsize=64)
def _step_key(seed: int, step: int) -> int:
    key = mix32((seed & MASK32) ^ _GOLDEN)
    key = mix32(key ^ ((seed >> 32) & MASK32))
    return mix32(key ^ (step & MASK32))


def step_key(seed: int, step: int) -> int:
    """The key of (seed, step) that stream_key folds each parameter index into."""
    return _step_key(seed, step)


def stream_key(seed: int, step: int, param_index: int) -> int:
    """The per-(seed, step, parameter) key that all of a tensor's random bits derive from."""
    return mix32(_step_key(seed, step) ^ (param_index & MASK32))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # x < 2**32: split the constant in 16-bit halves so every product stays below 2**48.
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` element-wise on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL2)
    return x ^ (x >> 16)


def element_hash(key: int, start: int, n: int) -> torch.Tensor:
    """r(i) for the global indices i = start .. start+n-1, as int64 values in [0, 2**32)."""
    index = torch.arange(start, start + n, dtype=torch.int64)
    high = mix32_tensor(index >> 32)
    return mix32_tensor((index & MASK32) ^ key ^ high)


def hash_halves(key: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit random numbers of the first (low half) and second (high half) moment."""
    r = element_hash(key, start, n)
    return r & 0xFFFF, r >> 16



# --------------------------------------------------------------------------- bf16

def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & MASK32


def bf16_encode(x: torch.Tensor, r16: torch.Tensor | None) -> torch.Tensor:
    """fp32 -> bf16: stochastic rounding with 16 random bits per element, or RNE when None.

    Stochastic: add the random bits below the kept 16 and truncate, which rounds the
    magnitude up with probability equal to the discarded fraction.
    """
    if r16 is None:
        return bf16_rne(x)
    return _bf16_from_bits((_f32_bits(x.float()) + r16) >> 16)


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding to nearest even by the integer formula of numerics.md section 3.

    NOTE: not ``x.to(torch.bfloat16)``: torch's vectorised cast turns a NaN into 0xffff and
    its scalar cast into 0x7fc0; the formula gives 0x7fc0 for the canonical NaN everywhere.
    """
    bits = _f32_bits(x.float())
    return _bf16_from_bits((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


def _bf16_from_bits(code: torch.Tensor) -> torch.Tensor:
    # int64 codes in [0, 2**16] (2**16 only past 0xffff, i.e. never: inputs are canonical)
    code = code & 0xFFFF
    return torch.where(code >= 2**15, code - 2**16, code).to(torch.int16).view(torch.bfloat16)


def bf16_decode(x: torch.Tensor) -> torch.Tensor:
    return x.float()


# --------------------------------------------------------------------------- fp8

def fp8_round_to_grid(x: torch.Tensor, grid: tuple[int, int],
                      r16: torch.Tensor | None) -> torch.Tensor:
    """Round x >= 0 (scaled to at most one ulp past the format's max) onto the fp8 grid.

    Integer domain (docs/numerics.md section 3): z = x * 2**(-126 - emin) puts the fp8 grid on
    the fp32 one (fp8 subnormals on fp32 subnormals); its pattern, clamped to the NaN code's
    (where only an infinite or NaN x reaches), plus 16 random bits (r16) or half an ulp
    (nearest even, r16 None) below the kept bits, shifted: int64 codes, no sign.
    """
    emin, mbits = grid
    z = x * (2.0 ** (-126 - emin))               # exact but in the subnormal range
    drop = 23 - mbits
    bits = torch.clamp(_f32_bits(z), max=FP8_NAN_CODE << drop)
    if r16 is None:
        return (bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) >> drop
    return (bits + (r16 << (drop - 16))) >> drop


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over the finite elements of each block of FP8_BLOCK (the last may be short)."""
    n = x.numel()
    pad = (-n) % FP8_BLOCK
    finite_abs = _finite_or_zero(x.abs())
    padded = torch.nn.functional.pad(finite_abs, (0, pad)) if pad else finite_abs
    return padded.view(-1, FP8_BLOCK).amax(dim=1)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _per_element(block_values: torch.Tensor, n: int) -> torch.Tensor:
    return block_values.repeat_interleave(FP8_BLOCK)[:n]


def _fp8_inverse_scale(top: float, amax: torch.Tensor) -> torch.Tensor:
    """top / amax, or 0 where that is not finite (amax 0, or so small the quotient overflows)."""
    # NOTE: scalar / tensor in torch is reciprocal-then-multiply; divide tensors to match C.
    inv = torch.full_like(amax, top) / amax
    return torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))


def _as_fp8(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(torch.uint8).view(dtype)


def fp8_encode_m(m: torch.Tensor, r16: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """First moment (fp32, one whole range starting at a block boundary) -> (e4m3, scales).

    Non-finite elements take no part in their block's scale and are stored as the NaN code.
    """
    amax = _block_absmax(m)
    scale = amax / E4M3_MAX
    x = m.abs() * _per_element(_fp8_inverse_scale(E4M3_MAX, amax), m.numel())
    codes = fp8_round_to_grid(x, E4M3_GRID, r16)
    codes = codes | torch.where((m < 0) & (codes != FP8_NAN_CODE), 0x80, 0)
    return _as_fp8(codes, torch.float8_e4m3fn), scale


def fp8_encode_sqrt_v(s: torch.Tensor, r16: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt of the second moment (fp32, >= 0 or non-finite) -> (e5m2, scales)."""
    amax = _block_absmax(s)
    scale = amax / E5M2_MAX
    x = s * _per_element(_fp8_inverse_scale(E5M2_MAX, amax), s.numel())
    return _as_fp8(fp8_round_to_grid(x, E5M2_GRID, r16), torch.float8_e5m2), scale


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 codes (e4m3 or e5m2) times their block's scale, as fp32."""
    return codes.float() * _per_element(scale, codes.numel())


def fp8_decode_v(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The second moment v from its stored square root."""
    s = fp8_decode(codes, scale)
    return s * s


def fp8_num_blocks(numel: int) -> int:
    return (numel + FP8_BLOCK - 1) // FP8_BLOCK
