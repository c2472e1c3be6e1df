"""A checkpoint load allocates nothing on the GPU, whether the dict is on the host or mapped to the GPU.

tests/checkpoint/test_checkpoint_stream.py checks on CPU machines that every tensor a load
makes is a host tensor; here the real thing: the CUDA caching allocator's peak over
``load_state_dict`` stays where it was before it, for a dict from ``torch.load`` and for one
``map_location="cuda"`` put on the GPU (read to the host tensor by tensor), and the resumed
run equals an uninterrupted one bit for bit.
"""
from __future__ import annotations

import io

import pytest
import torch

from adambridge import AdamBridge

from ._resume_model import cuda_model as _model, train as _train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("map_location", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_cuda_load_allocates_nothing_on_the_gpu(precision, map_location):
    straight = _model()
    opt = AdamBridge(straight.parameters(), lr=1e-3, precision=precision)
    _train(straight, opt, 3, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": straight.state_dict(), "optim": opt.state_dict()}, buffer)
    _train(straight, opt, 3, seed=2)

    resumed = _model()
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision=precision)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True, map_location=map_location)
    resumed.load_state_dict(saved["model"])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt2.load_state_dict(saved["optim"])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before
    for state in opt2.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if isinstance(t, torch.Tensor))
    del saved
    _train(resumed, opt2, 3, seed=2)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
