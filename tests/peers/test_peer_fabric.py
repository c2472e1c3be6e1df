"""Lightning Fabric's own loop (lightning.fabric.Fabric on the CPU), driven as its docs write
it: ``fabric.setup(model, optimizer)``, ``fabric.backward(loss)``,
``fabric.clip_gradients(...)``, ``optimizer.step()``, a step-wise scheduler, and a checkpoint
written by ``fabric.save(path, state)`` then resumed by ``fabric.load(path, state)`` into a
fresh Fabric, model and optimizer.

- sync AdamBridge (fp32 moments) equals torch.optim.AdamW through the same loop;
- async mode (``attach_hooks`` on the module Fabric wrapped) equals sync bit for bit, every
  precision, with clipping that fires, for fp32, bf16 and fp16 parameters and bf16
  autocast;
- the resumed run equals the uninterrupted one bit for bit, both modes, every precision.
"""
from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

from adambridge import AdamBridge

from ._twins import (ATOL, MODES, PRECISIONS, RTOL, assert_elements_close, assert_identical)

STEPS, SAVE_AT = 6, 3
MAX_NORM = 0.5  # the loop's gradient norms are about 1.1 to 1.7: the clip fires every step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _parts(kind: str, mode: str, precision: str, weights: str = "32-true"):
    """A fresh Fabric, model, optimizer and scheduler, set up as Fabric's docs do
    (``weights="bf16-true"``: Fabric casts the model's parameters to bf16 itself)."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=weights)
    model = _model()
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, precision=precision,
                         small_param_threshold=0)
    model, opt = fabric.setup(model, opt)
    wanted = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(weights, torch.float32)
    assert all(p.dtype == wanted for p in model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 1.0 / (1 + s))
    return fabric, model, opt, schedule


def _attach(opt, model, mode: str) -> None:
    # Hooks go on after any fabric.load, so they update the restored state.
    if mode == "async":
        opt.optimizer.attach_hooks(model)


def _steps(fabric, model, opt, schedule, steps: range, mode: str) -> None:
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        if mode == "async":  # the clip was answered from the gradients the hooks took
            assert opt.optimizer.last_step_stats.grad_norm is not None
        opt.zero_grad()
        schedule.step()


def _result(model, opt) -> list:
    inner = opt.optimizer
    params = list(model.parameters())
    return [p.detach().clone() for p in params] + [
        inner.state[p][key].detach().clone() for p in params
        for key in ("exp_avg", "exp_avg_sq")]


def _fit(kind: str, mode: str, precision: str = "fp32", resume_dir=None,
         weights: str = "32-true") -> list:
    fabric, model, opt, schedule = _parts(kind, mode, precision, weights)
    if resume_dir is None:
        _attach(opt, model, mode)
        _steps(fabric, model, opt, schedule, range(STEPS), mode)
    else:
        _attach(opt, model, mode)
        _steps(fabric, model, opt, schedule, range(SAVE_AT), mode)
        fabric.save(resume_dir / "ckpt", {"model": model, "optimizer": opt,
                                          "schedule": schedule, "step": SAVE_AT})
        if mode == "async":  # saved with the hooks on; this run ends here
            opt.optimizer.detach_hooks()
        fabric, model, opt, schedule = _parts(kind, mode, precision, weights)
        state = {"model": model, "optimizer": opt, "schedule": schedule, "step": 0}
        fabric.load(resume_dir / "ckpt", state)
        assert state["step"] == SAVE_AT
        _attach(opt, model, mode)
        _steps(fabric, model, opt, schedule, range(SAVE_AT, STEPS), mode)
    if mode == "async":
        opt.optimizer.detach_hooks()
    return _result(model, opt)


def test_fabric_sync_equals_adamw():
    ref, ours = _fit("adamw", "sync"), _fit("bridge", "sync")
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_elements_close(a, b, rtol=RTOL, atol=ATOL, what=f"tensor {i}")


# Fabric's precisions: fp32, bf16 or fp16 parameters, bf16 autocast (on the CPU Fabric turns
# "16-mixed" into bf16 autocast too, without a GradScaler).
WEIGHTS = ["32-true", "bf16-true", "16-true", "bf16-mixed"]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_async_equals_sync(precision, weights):
    assert_identical(_fit("bridge", "async", precision, weights=weights),
                     _fit("bridge", "sync", precision, weights=weights),
                     what=f"{precision} {weights} async vs sync")


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_resume_equals_uninterrupted(precision, mode, weights, tmp_path):
    assert_identical(_fit("bridge", mode, precision, resume_dir=tmp_path, weights=weights),
                     _fit("bridge", mode, precision, weights=weights),
                     what=f"{precision} {mode} {weights} resumed")
