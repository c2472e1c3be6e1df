"""Training quality: bf16/fp8 moments stay within noise of fp32; bf16-only AdamW falls behind."""
from __future__ import annotations

import pytest
import torch

from adambridge import AdamBridge

STEPS = 200
LR = 2e-4  # most AdamW updates are below half a bf16 ulp of these weights (as in the seed)


def _teacher_and_student():
    gen = torch.Generator().manual_seed(0)
    teacher = [torch.randn(32, 64, generator=gen) / 4, torch.randn(64, 8, generator=gen) / 8]
    student = [w + torch.randn(w.shape, generator=gen) * 0.05 for w in teacher]
    return teacher, student


def _batches(order_seed):
    gen = torch.Generator().manual_seed(100 + order_seed)
    return [torch.randn(64, 32, generator=gen) for _ in range(STEPS)]


def _loss(weights, x, teacher):
    target = torch.tanh(x @ teacher[0]) @ teacher[1]
    pred = torch.tanh(x @ weights[0].float()) @ weights[1].float()
    return (pred - target).pow(2).mean()


def _train(config, order_seed=0):
    teacher, init = _teacher_and_student()
    dtype = torch.float32 if config == "reference" else torch.bfloat16
    weights = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in init]
    if config in ("reference", "bf16-only"):
        opt = torch.optim.AdamW(weights, lr=LR, weight_decay=0.0)
    else:
        opt = AdamBridge(weights, lr=LR, weight_decay=0.0, precision=config)
    for x in _batches(order_seed):
        opt.zero_grad()
        _loss(weights, x, teacher).backward()
        opt.step()
    val = torch.randn(2048, 32, generator=torch.Generator().manual_seed(999))
    changed = sum((w.detach().bfloat16() != i.bfloat16()).sum().item() for w, i in zip(weights, init))
    total = sum(w.numel() for w in weights)
    with torch.no_grad():
        return _loss(weights, val, teacher).item(), changed / total


@pytest.fixture(scope="module")
def results():
    out = {c: _train(c) for c in ("reference", "fp32", "bf16", "fp8", "bf16-only")}
    out["noise"] = [_train("reference", order_seed=s)[0] for s in (1, 2)]
    start = _train_start_loss()
    print("\nconfig      val loss   changed@bf16")
    for name in ("reference", "fp32", "bf16", "fp8", "bf16-only"):
        print(f"{name:10s}  {out[name][0]:.6f}   {out[name][1]:.1%}")
    print(f"start loss {start:.6f}; reference over data orders: {out['noise']}")
    out["start"] = start
    return out


def _train_start_loss():
    teacher, init = _teacher_and_student()
    val = torch.randn(2048, 32, generator=torch.Generator().manual_seed(999))
    return _loss(init, val, teacher).item()


def _noise_band(results):
    losses = [results["reference"][0], *results["noise"]]
    return max(losses) - min(losses)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_adambridge_precisions_match_reference_within_noise(results, precision):
    band = max(_noise_band(results), 1e-6)
    reduction = results["start"] - results["reference"][0]
    assert reduction > 0.3 * results["start"]  # training really progressed
    # Within the reference's own spread over data orders, or 2% of its loss reduction.
    assert abs(results[precision][0] - results["reference"][0]) <= max(band, 0.02 * reduction)


def test_bf16_only_adamw_falls_visibly_behind(results):
    gap = results["bf16-only"][0] - results["reference"][0]
    assert gap > 10 * max(_noise_band(results), 0.02 * (results["start"] - results["reference"][0]))
    assert results["bf16-only"][1] < 0.5 * results["bf16"][1]
