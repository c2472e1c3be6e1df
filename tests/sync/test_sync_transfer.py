"""Synchronous step() through pinned staging (sync/transfer.py), on the CPU with fake CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.sync import transfer
from fake_cuda import FakeCuda

SHAPES = [(33, 31), (4097,), (1,), (15,)]


def _params(dtype) -> list:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    params.append(nn.Parameter(torch.randn(17, 9, generator=gen).to(dtype).t()))  # non-contiguous
    return params


def _run(params, steps: int, present=lambda step, i: True) -> AdamBridge:
    opt = AdamBridge(params, lr=1e-2, weight_decay=0.1, backend="torch")
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad = grad if present(step, i) else None
        opt.step()
    return opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sync_transfer_staged_step_equals_the_host_step(monkeypatch, dtype):
    # Some parameters skip some steps, so the staging layout changes between steps.
    present = lambda step, i: (step + i) % 3 != 0  # noqa: E731
    expected = _params(dtype)
    expected_opt = _run(expected, 4, present)
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(transfer, "on_device", lambda t: True)
    got = _params(dtype)
    got_opt = _run(got, 4, present)
    for a, b in zip(got, expected):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(got, expected):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got_opt.state[a][key], expected_opt.state[b][key]), key
    # One stream synchronisation per step, however many parameters.
    assert len(cuda.waits("synchronize")) == 4


def test_sync_transfer_reuses_one_buffer_per_direction_and_counts_it(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(transfer, "on_device", lambda t: True)
    params = _params(torch.bfloat16)
    opt = _run(params, 1)
    registered = len(cuda.register_threads)
    assert registered == 2  # the gradients down, the new weights up
    _run_more = [opt.step() for _ in range(2)]  # same grads again: no new buffer
    assert len(cuda.register_threads) == registered and len(_run_more) == 2
    nbytes = sum(-(-p.numel() * 2 // 64) * 64 for p in params)
    assert transfer.staging_bytes(opt) == 2 * nbytes
