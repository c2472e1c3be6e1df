"""Lightning's resume on a GPU moves the optimizer state there: it must stay on the host.

tests/optimizer/test_state_device.py stands in with the meta device on CPU machines; here the real
thing: ``_optimizer_to_device(opt, "cuda")`` after load_state_dict writes the device copies'
values into the host tensors, and the resumed run equals an uninterrupted one bit for bit.
"""
from __future__ import annotations

import io

import pytest
import torch

from adambridge import AdamBridge

from ._resume_model import cuda_model as _model, train as _train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
from lightning.fabric.utilities.optimizer import _optimizer_to_device  # noqa: E402


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_lightning_optimizer_to_cuda_keeps_the_state_on_the_host(precision):
    straight = _model()
    opt = AdamBridge(straight.parameters(), lr=1e-3, precision=precision)
    _train(straight, opt, 3, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": straight.state_dict(), "optim": opt.state_dict()}, buffer)
    _train(straight, opt, 3, seed=2)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model()
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision=precision)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    _optimizer_to_device(opt2, torch.device("cuda"))
    assert all(v.is_cpu for s in opt2.state.values() for v in s.values())
    _train(resumed, opt2, 3, seed=2)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key
