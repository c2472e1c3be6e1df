"""CUDA graph capture with hooks attached is refused in the hook.

In its own file (its own process under scripts/gpu_check.sh): an aborted capture can leave
the CUDA context unusable for whatever runs after it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _messages(exc: BaseException) -> list:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return [str(e) for e in seen]


def test_cuda_graph_capture_with_hooks_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(256, 4096), nn.Linear(4096, 256)).cuda()
    opt = AdamBridge(model.parameters(), small_param_threshold=4096)
    opt.attach_hooks(model)
    x = torch.randn(8, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up before a capture
        model(x).sum().backward()
        opt.step_sync()
        opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as raised:
        with torch.cuda.graph(graph):
            model(x).sum().backward()
    # torch may replace our error with the aborted capture's; ours must be in the chain.
    refusal = [m for m in _messages(raised.value) if "does not work under CUDA graph capture" in m]
    assert refusal and "\n" not in refusal[0]
