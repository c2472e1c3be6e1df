"""torch.set_default_dtype: the optimizer's state keeps its own dtypes whatever the default.

LLM fine-tuning scripts often call ``torch.set_default_dtype(torch.bfloat16)``. Every tensor
of state made without an explicit dtype would then be bf16: a step counter that sticks at
256 (257 rounds to 256, freezing the bias correction and the rounding key), fp8 block scales
the kernel refuses, hyperparameter rows rounded to bf16. Each run below is compared with the
same run under the float32 default, bit for bit, and the fp32 moments with torch AdamW.
"""
from __future__ import annotations

import io
from contextlib import contextmanager
from functools import lru_cache

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.nvme.tier import OffloadConfig

STEPS = 600  # past 256, where a bf16 step counter stops counting
PRECISIONS = ("fp32", "bf16", "fp8")
MODES = ("sync", "async")
LR, WD = 1e-3, 1e-2
RTOL, ATOL = 1e-6, 1e-7  # the arithmetic invariant against torch AdamW


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Given(nn.Module):
    """Parameters whose gradient is exactly the tensor passed to forward: sum(p * g)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        # Explicit dtypes, so both defaults start from the same values: an fp32 parameter
        # (its own master), a bf16 one of a tail size, and one of 3 fp8 blocks, the last short.
        self.w = nn.Parameter(torch.randn(300, generator=gen, dtype=torch.float32))
        self.b = nn.Parameter(torch.randn(17, generator=gen, dtype=torch.float32).bfloat16())

    def forward(self, grads: list) -> torch.Tensor:
        return sum((p * g).sum().float() for p, g in zip(self.parameters(), grads))


def grads_of(step: int) -> list:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(300, generator=gen, dtype=torch.float32),
            torch.randn(17, generator=gen, dtype=torch.float32).bfloat16()]


def train(model: Given, opt: AdamBridge, steps: range, mode: str) -> None:
    if mode == "async":
        opt.attach_hooks(model)
    for step in steps:
        model(grads_of(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()


def run(default: torch.dtype, precision: str, mode: str, backend: str, **kwargs) -> tuple:
    with default_dtype(default):
        model = Given()
        opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision=precision,
                         backend=backend, small_param_threshold=0, **kwargs)
        train(model, opt, range(STEPS), mode)
        return model, opt


@lru_cache(maxsize=None)
def expected(precision: str, backend: str) -> tuple:
    """Parameters and saved state after STEPS sync steps under the float32 default."""
    model, opt = run(torch.float32, precision, "sync", backend)
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]


def assert_identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype)
    assert torch.equal(a, b), f"{what}: max difference {(a.double() - b.double()).abs().max()}"


def assert_as_expected(model: Given, saved: dict, precision: str, backend: str) -> None:
    params, state = expected(precision, backend)
    for i, (p, q) in enumerate(zip(model.parameters(), params)):
        assert_identical(p.detach(), q, f"parameter {i}")
    assert state.keys() == saved.keys()
    for i, entry in saved.items():
        assert entry["step"].dtype == torch.float32 and entry["step"].item() == STEPS
        assert entry.keys() == state[i].keys()
        for key, value in entry.items():
            assert_identical(value, state[i][key], f"state[{i}][{key!r}]")


def adamw_masters() -> list:
    """torch AdamW under the float32 default, on fp32 copies of the starting weights."""
    params = [nn.Parameter(p.detach().float().clone()) for p in Given().parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for p, g in zip(params, grads_of(step)):
            p.grad = g.float()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_default_bf16_state_dtypes_and_600_steps_equal_the_float32_default(
        precision, mode, backend):
    model, opt = run(torch.bfloat16, precision, mode, backend)
    for p in model.parameters():
        state = opt.state[p]
        assert state["step"].dtype == torch.float32 and state["step"].item() == STEPS
        assert state["master"].dtype == torch.float32
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert key not in state or state[key].dtype == torch.float32, key
    assert_as_expected(model, opt.state_dict()["state"], precision, backend)


def test_default_bf16_fp32_moments_equal_torch_adamw(backend):
    model, opt = run(torch.bfloat16, "fp32", "sync", backend)
    for p, reference in zip(model.parameters(), adamw_masters()):
        master = opt.state[p]["master"].view(p.shape)
        torch.testing.assert_close(master, reference, rtol=RTOL, atol=ATOL)


def tier(tmp_path) -> dict:
    (tmp_path / "drive").mkdir(parents=True)
    # 300 bytes of host budget: the 300-element parameter's state lives in the files.
    return dict(offload_dir=OffloadConfig([tmp_path / "drive"], page_size=256, queue_depth=2),
                host_budget=300)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_default_bf16_nvme_tier_equals_in_ram_float32_default(precision, mode, tmp_path):
    model, opt = run(torch.bfloat16, precision, mode, "auto", **tier(tmp_path))
    assert {placed.where for placed in opt.placement()} == {"file", "ram"}
    assert_as_expected(model, opt.state_dict()["state"], precision, "auto")
    opt.nvme_tier.close()


@pytest.mark.parametrize("where", ["ram", "nvme"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_default_bf16_checkpoint_round_trip_resumes_bit_for_bit(precision, where, tmp_path):
    with default_dtype(torch.bfloat16):
        files = tier(tmp_path / "first") if where == "nvme" else {}
        model = Given()
        opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision=precision,
                         small_param_threshold=0, **files)
        train(model, opt, range(STEPS // 2), "sync")
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)

        files = tier(tmp_path / "second") if where == "nvme" else {}
        resumed = Given()
        opt2 = AdamBridge(resumed.parameters(), lr=LR, weight_decay=WD, precision=precision,
                          small_param_threshold=0, **files)
        resumed.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optim"])
        assert all(s["step"].dtype == torch.float32 for s in opt2.state_dict()["state"].values())
        train(resumed, opt2, range(STEPS // 2, STEPS), "async")
    assert_as_expected(resumed, opt2.state_dict()["state"], precision, "auto")
    for o in (opt, opt2):
        if o.nvme_tier is not None:
            o.nvme_tier.close()


@pytest.mark.parametrize("default", [torch.float16, torch.float64])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_other_defaults_change_nothing(default, precision, backend):
    for mode in MODES:
        model, opt = run(default, precision, mode, backend)
        assert_as_expected(model, opt.state_dict()["state"], precision, backend)
