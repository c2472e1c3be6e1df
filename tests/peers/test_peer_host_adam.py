"""What DeepSpeed's CPU-Adam tests (tests/unit/ops/adam/) check, restated for AdamBridge.

DeepSpeed sweeps tensor sizes and parameter dtypes against torch.optim.AdamW, checks that
bf16 moments really are bf16 on the host, splits one tensor over two optimizers ("hybrid"
Adam) and hands its CPU optimizer flat partitions by editing ``param_groups`` after
construction. It compares norms with a 1% band, on one storage when run without a GPU; here
every comparison is per element, between tensors of their own memory (``_twins``).

NOTE: with bf16 or fp8 moments the stored moments are rounded, so from the second step on
the update is not torch's (docs/numerics.md promises no per-element bound against AdamW).
Two properties still pin those precisions to AdamW: the first step updates from the exact
moments (they are stored after the update), and every later step equals the torch twin of
the kernel bit for bit, in either mode.
"""
from __future__ import annotations

import pytest
import torch

from adambridge import AdamBridge

from ._twins import (MODES, PRECISIONS, adamw_twin, assert_identical, assert_matches_adamw,
                     backward_with, bridge, fixed_grads, own_copy, state_tensors,
                     step_reference)

# Tails around every width the kernels use (8, 16, 128-element fp8 blocks, chunking), one
# past the async threshold and one past a million, all in one optimizer (one batch).
SIZES = (1, 7, 22, 55, 64, 128, 1025, 65537, 2**20 + 3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _inits(dtype: torch.dtype, sizes=SIZES) -> list:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


def _train(params, opt, grads) -> None:
    for step_grads in grads:
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_host_adam_fp32_moments_equal_adamw_over_sizes(dtype, mode):
    """Ten steps, every size at once: master, moments and step equal AdamW on an fp32 copy;
    a bf16/fp16 parameter is its master rounded to nearest even."""
    inits = _inits(dtype)
    grads = fixed_grads([(n,) for n in SIZES], steps=10)
    ref, ref_opt = adamw_twin(inits, **HYPER)
    params = [own_copy(v) for v in inits]
    opt = bridge(params, mode, **HYPER)
    for step_grads in grads:
        step_reference(ref, ref_opt, step_grads, dtype)
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()
    assert_matches_adamw(opt, params, ref, ref_opt, what=f"{dtype} {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_host_adam_low_precision_first_step_equals_adamw(precision, mode):
    """The first update reads the exact moments, so it equals AdamW's at fp32 tolerance for
    every size; the stored moments are the codec's, so only the parameters are compared."""
    inits = _inits(torch.float32)
    grads = fixed_grads([(n,) for n in SIZES], steps=1)
    ref, ref_opt = adamw_twin(inits, **HYPER)
    params = [own_copy(v) for v in inits]
    opt = bridge(params, mode, precision=precision, **HYPER)
    step_reference(ref, ref_opt, grads[0], torch.float32)
    _train(params, opt, grads)
    assert_matches_adamw(opt, params, ref, ref_opt, moments=False, what=precision)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_host_adam_low_precision_steps_equal_torch_twin_in_both_modes(precision, dtype):
    """Eight steps with bf16/fp16 parameters: the native kernel in sync and async mode equals
    the torch twin (backend='torch', sync) bit for bit, parameters and every state tensor."""
    # Without the million-element tensor: the torch twin's codecs take seconds on it.
    sizes = SIZES[:-1]
    inits = _inits(dtype, sizes)
    grads = fixed_grads([(n,) for n in sizes], steps=8)
    runs = {}
    for name, backend, mode in (("twin", "torch", "sync"), ("sync", "auto", "sync"),
                                ("async", "auto", "async")):
        params = [own_copy(v) for v in inits]
        opt = bridge(params, mode, precision=precision, backend=backend, seed=3, **HYPER)
        _train(params, opt, grads)
        runs[name] = [p.detach() for p in params] + state_tensors(opt, params)
    assert_identical(runs["sync"], runs["twin"], what=f"{precision} sync vs torch twin")
    assert_identical(runs["async"], runs["twin"], what=f"{precision} async vs torch twin")


STATE_DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
                "fp8": (torch.float8_e4m3fn, torch.float8_e5m2)}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_host_adam_state_dtypes_and_device(precision, dtype):
    """The moments are kept in the precision asked for, whatever the parameter's dtype, next
    to an fp32 master, all in host memory and in memory of their own."""
    p = own_copy(torch.randn(300).to(dtype))
    opt = AdamBridge([p], precision=precision)
    backward_with([p], [torch.randn(300)])
    opt.step()
    state = opt.state[p]
    m_dtype, v_dtype = STATE_DTYPES[precision]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (m_dtype, v_dtype)
    assert state["master"].dtype == torch.float32
    if precision == "fp8":  # one fp32 scale per block of 128 elements: 300 -> 3 blocks
        assert state["exp_avg_scale"].shape == state["exp_avg_sq_scale"].shape == (3,)
    own = p.untyped_storage().data_ptr()
    for key, value in state.items():
        assert value.device.type == "cpu", key
        # An fp32 parameter is its own master; everything else is memory of the optimizer's.
        shares = value.numel() > 1 and value.untyped_storage().data_ptr() == own
        assert shares == (key == "master" and dtype == torch.float32), f"{key} storage"


# Halves at a multiple of 128, so fp8 block scales fall on the same elements either way.
SPLIT = 256


@pytest.mark.parametrize("precision", PRECISIONS)
def test_host_adam_split_tensor_equals_whole(precision):
    """DeepSpeed's hybrid Adam: a tensor updated as two halves by two optimizers equals the
    whole updated by one, bit for bit (nearest rounding of the moments: the stochastic bits
    are keyed by the element's index in its own tensor, which the split changes)."""
    whole = own_copy(torch.randn(2 * SPLIT))
    halves = [own_copy(h) for h in whole.detach().chunk(2)]
    opts = [AdamBridge([p], precision=precision, stochastic_rounding=False, **HYPER)
            for p in [whole] + halves]
    for step_grads in fixed_grads([(2 * SPLIT,)], steps=6):
        g = step_grads[0]
        backward_with([whole], [g])
        backward_with(halves, list(g.chunk(2)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    joined = torch.cat([h.detach() for h in halves])
    assert_identical([joined], [whole.detach()], what=f"{precision} halves vs whole")
    for key in ("exp_avg", "exp_avg_sq"):
        parts = torch.cat([opts[i + 1].state[h][key] for i, h in enumerate(halves)])
        assert_identical([parts], [opts[0].state[whole][key]], what=key)


@pytest.mark.parametrize("mode", MODES)
def test_host_adam_partitions_swapped_into_groups_equal_adamw(mode):
    """ZeRO-offload builds its CPU optimizer, then puts its flat fp32 partitions into
    ``param_groups[i]['params']``: those are what is stepped, as AdamW steps them (async:
    hooks attached after the swap, so they cover the partitions)."""
    sizes = (33, 1025, 7)
    inits = _inits(torch.float32, sizes)
    placeholders = [own_copy(torch.zeros(1)) for _ in range(2)]
    opt = AdamBridge([dict(params=[placeholders[0]]), dict(params=[placeholders[1]], lr=3e-3)],
                     small_param_threshold=0, **HYPER)
    params = [own_copy(v) for v in inits]
    opt.param_groups[0]["params"] = params[:2]
    opt.param_groups[1]["params"] = params[2:]
    if mode == "async":
        opt.attach_hooks()
    ref, _ = adamw_twin(inits)
    ref_opt = torch.optim.AdamW([dict(params=ref[:2]), dict(params=ref[2:], lr=3e-3)], **HYPER)
    for step_grads in fixed_grads([(n,) for n in sizes], steps=5):
        step_reference(ref, ref_opt, step_grads, torch.float32)
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()
    assert_matches_adamw(opt, params, ref, ref_opt, what=f"swapped partitions, {mode}")
    assert not any(p in opt.state for p in placeholders)


def test_host_adam_swapped_groups_refused_with_hooks():
    """In async mode the hooks were laid on the old parameters: an edit is refused in one
    line before anything is updated."""
    old, new = own_copy(torch.randn(64)), own_copy(torch.randn(64))
    opt = bridge([old], "async")
    opt.param_groups[0]["params"] = [new]
    before = new.detach().clone()
    with pytest.raises(RuntimeError, match=r"detach_hooks\(\)") as info:
        backward_with([new], [torch.randn(64)])
        opt.step()
    assert "\n" not in str(info.value)
    assert torch.equal(new.detach(), before) and new not in opt.state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_host_adam_under_bf16_default_dtype(precision, mode):
    """torchao's default-dtype test: a model built under torch.set_default_dtype(bf16)
    trains; the master stays fp32 and the moments take the precision asked for, not the
    default dtype. fp32 moments equal AdamW on an fp32 copy over four steps, bf16/fp8 moments
    on the first (the exact moments)."""
    steps = 4 if precision == "fp32" else 1
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 32))
        params = list(model.parameters())
        ref, ref_opt = adamw_twin(params, **HYPER)
        # release_grads=False keeps p.grad after the hooks took it, for the reference.
        opt = bridge(params, mode, model=model, release_grads=False, precision=precision,
                     **HYPER)
        gen = torch.Generator().manual_seed(2)
        for _ in range(steps):
            x = torch.randn(4, 32, generator=gen)
            model(x).float().square().mean().backward()
            step_reference(ref, ref_opt, [p.grad for p in params], torch.bfloat16)
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_default_dtype(old)
    m_dtype, v_dtype = STATE_DTYPES[precision]
    for p in params:
        state = opt.state[p]
        assert state["master"].dtype == torch.float32
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (m_dtype, v_dtype)
    assert_matches_adamw(opt, params, ref, ref_opt, moments=precision == "fp32",
                         what=f"default bf16, {precision} {mode}")
