"""Codecs and the counter hash (torch twin): bit-level facts and statistical properties."""
from __future__ import annotations

import pytest
import torch

from adambridge.update import codecs

N_REPEATS = 100_000  # STYLE.md: test stochastic rounding statistically over 100k repeats


def test_mix32_reference_values():
    # Computed by hand from docs/numerics.md; the C self-test prints the same numbers.
    assert codecs.mix32(0) == 0
    x = 1
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    assert codecs.mix32(1) == x


def test_element_hash_tensor_matches_scalar_definition_including_high_indices():
    key = codecs.stream_key(seed=7, step=3, param_index=2)
    for start in (0, 5, 2**32 - 3, 3 * 2**32 + 1):
        got = codecs.element_hash(key, start, 6).tolist()
        want = [codecs.mix32(key ^ (i & 0xFFFFFFFF) ^ codecs.mix32(i >> 32))
                for i in range(start, start + 6)]
        assert got == want


def test_stream_key_depends_on_seed_step_and_parameter():
    keys = {codecs.stream_key(s, t, p) for s in (0, 1, 2**40) for t in (1, 2) for p in (0, 1)}
    assert len(keys) == 12


def test_hash_bits_are_uniform():
    r_m, r_v = codecs.hash_halves(codecs.stream_key(0, 1, 0), 0, N_REPEATS)
    for half in (r_m, r_v):
        counts = torch.bincount((half >> 12), minlength=16).float()  # 16 bins of the top bits
        expected = N_REPEATS / 16
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 50  # 15 degrees of freedom: p < 1e-4 beyond this


def test_bf16_nearest_matches_torch_cast():
    x = torch.randn(10_000) * 1e3
    assert torch.equal(codecs.bf16_encode(x, None), x.bfloat16())


@pytest.mark.parametrize("value", [1.0 + 2**-10, -3.3e-5, 7.77e5])
def test_bf16_stochastic_rounding_is_unbiased(value):
    x = torch.full((N_REPEATS,), value)
    r_m, _ = codecs.hash_halves(codecs.stream_key(1, 1, 0), 0, N_REPEATS)
    decoded = codecs.bf16_encode(x, r_m).float()
    lo, hi = decoded.min().item(), decoded.max().item()
    assert lo <= value <= hi and lo != hi  # only the two neighbours occur
    ulp = hi - lo
    # Mean of Bernoulli(p) * ulp: standard error ulp * 0.5 / sqrt(N); allow 5 sigma.
    assert abs(decoded.double().mean().item() - value) < 5 * ulp * 0.5 / N_REPEATS ** 0.5


def test_bf16_second_moment_freezes_with_nearest_and_tracks_with_stochastic_rounding():
    beta2, g2, steps, n = 0.999, 0.5, 1000, 4096
    exact = 1.0
    v_rne = torch.ones(n).bfloat16()
    v_sr = torch.ones(n).bfloat16()
    for t in range(1, steps + 1):
        exact = exact * beta2 + g2 * (1 - beta2)
        v_rne = codecs.bf16_encode(v_rne.float() * beta2 + g2 * (1 - beta2), None)
        _, r_v = codecs.hash_halves(codecs.stream_key(0, t, 0), 0, n)
        v_sr = codecs.bf16_encode(v_sr.float() * beta2 + g2 * (1 - beta2), r_v)
    assert exact < 0.69  # the true EMA moved most of the way from 1.0 towards 0.5
    assert torch.all(v_rne.float() == 1.0)  # each change is below half a bf16 ulp: frozen
    assert abs(v_sr.float().mean().item() - exact) < 2e-3


def _fp8_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(torch.uint8).view(dtype).float()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_every_code_round_trips(fmt):
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    grid = codecs.E4M3_GRID if fmt == "e4m3" else codecs.E5M2_GRID
    codes = torch.arange(0, 128, dtype=torch.uint8).view(dtype)
    values = codes.float()
    finite = torch.isfinite(values)
    again = codecs.fp8_round_to_grid(values[finite], grid, None).to(torch.uint8)
    assert torch.equal(again, codes[finite].view(torch.uint8))


@pytest.mark.parametrize("fmt,grid,top,dtype", [
    ("e4m3", codecs.E4M3_GRID, codecs.E4M3_MAX, torch.float8_e4m3fn),
    ("e5m2", codecs.E5M2_GRID, codecs.E5M2_MAX, torch.float8_e5m2)])
def test_fp8_nearest_error_is_at_most_half_the_grid_spacing(fmt, grid, top, dtype):
    x = torch.rand(50_000) ** 8 * top  # dense near zero: covers subnormals too
    rounded = _fp8_values(codecs.fp8_round_to_grid(x, grid, None), dtype)
    assert torch.equal(rounded, x.to(dtype).float())  # same as torch's own nearest cast
    emin, mbits = grid
    exponent = torch.floor(torch.log2(x.clamp(min=1e-30))).clamp(min=emin)
    spacing = torch.pow(2.0, exponent - mbits)
    assert ((rounded - x).abs() <= spacing / 2).all()


def test_fp8_stochastic_rounding_is_unbiased():
    value = 0.3 * codecs.E4M3_MAX / 7
    x = torch.full((N_REPEATS,), value)
    r_m, _ = codecs.hash_halves(codecs.stream_key(3, 1, 0), 0, N_REPEATS)
    rounded = _fp8_values(codecs.fp8_round_to_grid(x, codecs.E4M3_GRID, r_m), torch.float8_e4m3fn)
    ulp = rounded.max().item() - rounded.min().item()
    assert abs(rounded.double().mean().item() - value) < 5 * ulp * 0.5 / N_REPEATS ** 0.5


def _grid_spacing_round(x: torch.Tensor, grid, r16: torch.Tensor) -> torch.Tensor:
    # Numerics version 2's float formulation: y = floor(x / q + r16 * 2**-16) times q.
    emin, mbits = grid
    exponent = torch.floor(torch.log2(x.double())).clamp(min=emin)
    q = torch.pow(2.0, exponent - mbits)
    return torch.floor(x.double() / q + r16.double() * 2.0 ** -16) * q


@pytest.mark.parametrize("fmt,grid,top,dtype", [
    ("e4m3", codecs.E4M3_GRID, codecs.E4M3_MAX, torch.float8_e4m3fn),
    ("e5m2", codecs.E5M2_GRID, codecs.E5M2_MAX, torch.float8_e5m2)])
def test_fp8_integer_stochastic_rounding_equals_the_grid_spacing_form_for_normal_x(
        fmt, grid, top, dtype):
    # docs/numerics.md section 3: adding r16 below the kept bits of the fp32 pattern is
    # floor(t + r16 * 2**-16) wherever x is an fp8 normal; only the subnormal range may differ.
    x = torch.rand(N_REPEATS) ** 4 * top
    x = x[x >= 2.0 ** grid[0]]
    r16, _ = codecs.hash_halves(codecs.stream_key(5, 1, 0), 0, x.numel())
    got = _fp8_values(codecs.fp8_round_to_grid(x, grid, r16), dtype).double()
    assert torch.equal(got, _grid_spacing_round(x, grid, r16))


def test_fp8_subnormal_tie_made_by_the_grid_multiply_rounds_to_even():
    # x = 2.5 E4M3 subnormal steps + 2**-31: x * 2**-120 rounds the 2**-31 away (below half of
    # 2**-149), leaving a tie that nearest-even sends to 2 steps (version 2 gave 3).
    x = torch.tensor([2.5 * 2.0 ** -9 + 2.0 ** -31])
    assert codecs.fp8_round_to_grid(x, codecs.E4M3_GRID, None).item() == 2


def test_fp8_block_codec_relative_error_bound():
    m = torch.randn(1000) * torch.rand(1000)
    codes, scale = codecs.fp8_encode_m(m, None)
    assert scale.numel() == 8  # ceil(1000 / 128): the last block is short
    decoded = codecs.fp8_decode(codes, scale)
    block_max = m.abs().view(-1)[: 896].view(-1, 128).amax(1)
    # Within a block, the error is at most half an E4M3 ulp at the element's magnitude
    # (2**-4 relative) or half the smallest subnormal step of the block's scale.
    err = (decoded - m).abs()
    floor = codecs._per_element(scale, 1000) * 2.0 ** -9 / 2
    assert (err <= m.abs() * 2.0 ** -4 + floor + 1e-12).all()
    assert block_max.numel() == 7


def test_fp8_sqrt_storage_keeps_v_that_direct_storage_would_flush():
    # One large element sets the block scale; a gradient 2**17 times smaller gives
    # v about 2**-34 of the block's largest v.
    v = torch.full((128,), 2.0 ** -34)
    v[0] = 1.0
    m = torch.full((128,), 2.0 ** -17)
    m[0] = 1.0
    # Storing v itself, block-scaled to E5M2, flushes the small elements to zero...
    direct = (v * (codecs.E5M2_MAX / v.max())).to(torch.float8_e5m2).float()
    assert (direct[1:] == 0).all()
    # ...while m survives, so the step would be m / eps.
    m_codes, m_scale = codecs.fp8_encode_m(m, None)
    assert (codecs.fp8_decode(m_codes, m_scale)[1:] > 0).all()
    # Storing sqrt(v) keeps them: the decoded v is non-zero and within the E5M2 grid error.
    codes, scale = codecs.fp8_encode_sqrt_v(torch.sqrt(v), None)
    decoded = codecs.fp8_decode_v(codes, scale)
    assert (decoded[1:] > 0).all()
    assert ((decoded[1:] / v[1:]).sqrt() - 1).abs().max() < 0.5


# -- non-finite values (docs/numerics.md section 6) ------------------------------------------

@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fp8_block_scale_ignores_nonfinite_and_stores_the_nan_code(bad):
    m = torch.randn(300) * 1e-3
    clean_codes, clean_scale = codecs.fp8_encode_m(m, None)
    m[200] = bad
    codes, scale = codecs.fp8_encode_m(m, None)
    s_codes, s_scale = codecs.fp8_encode_sqrt_v(m.abs(), None)
    assert torch.equal(scale[[0, 2]], clean_scale[[0, 2]])
    assert scale[1] == m[128:256][torch.isfinite(m[128:256])].abs().max() / codecs.E4M3_MAX
    others = torch.arange(300) != 200
    assert torch.equal(codes.view(torch.uint8)[others][:128], clean_codes.view(torch.uint8)[:128])
    assert codes.view(torch.uint8)[200] == s_codes.view(torch.uint8)[200] == codecs.FP8_NAN_CODE
    assert torch.isnan(codecs.fp8_decode(codes, scale)[200])
    decoded = codecs.fp8_decode(codes, scale)
    assert torch.isfinite(decoded[others]).all()


def test_fp8_decode_of_nonfinite_codes_follows_torch():
    e5m2 = torch.tensor([0x7C, 0xFC, 0x7D, 0x7F], dtype=torch.uint8).view(torch.float8_e5m2)
    assert codecs.fp8_decode(e5m2, torch.ones(1)).tolist()[:2] == [float("inf"), float("-inf")]
    assert torch.isnan(codecs.fp8_decode(e5m2, torch.ones(1))[2:]).all()
    e4m3 = torch.tensor([0x7F, 0xFF, 0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn)
    decoded = codecs.fp8_decode(e4m3, torch.ones(1))
    assert torch.isnan(decoded[:2]).all() and decoded[2] == codecs.E4M3_MAX


def test_canonical_nan_and_bf16_nearest_give_one_nan():
    bits = torch.tensor([0x7FC00000, 0xFFC12345, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0x3F800000],
                        dtype=torch.int64).to(torch.int32)
    x = codecs.canonical_nan(bits.view(torch.float32))
    assert x.view(torch.int32).tolist()[:4] == [0x7FC00000] * 4
    assert x.view(torch.int32).tolist()[4:] == [0x7F800000, 0x3F800000]
    as_bf16 = codecs.bf16_rne(x).view(torch.int16).tolist()
    assert as_bf16 == [0x7FC0] * 4 + [0x7F80, 0x3F80]
    r = torch.full((6,), 0xFFFF, dtype=torch.int64)
    assert codecs.bf16_encode(x, r).view(torch.int16).tolist() == as_bf16  # SR: no carry
