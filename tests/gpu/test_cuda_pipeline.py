"""Asynchronous mode on a CUDA device: CudaTransport, pinned buffers, stream ordering.

Race-exposing shapes: before every backward the compute stream is put to sleep
(``torch.cuda._sleep``), so the hooks fire long before the GPU has produced any gradient,
and the largest parameter is split into several chunks. A missing wait (D2H before the
gradient exists, H2D before backward has read p, the next forward before H2D) then reads
stale or half-written memory and breaks the bit-for-bit comparison with step().
"""
from __future__ import annotations

import os

# NOTE: cuBLAS is bitwise reproducible across streams only with a fixed workspace
# (https://docs.nvidia.com/cuda/cublas/#results-reproducibility); set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from adambridge import AdamBridge  # noqa: E402
from adambridge.host import pinned  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RTOL, ATOL = 1e-6, 1e-7
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: the CPU side of backward runs far ahead


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(1 << 20) * 0.02)  # 4 chunks at chunk_size 2**18
        self.up = nn.Linear(256, 1024)
        self.down = nn.Linear(1024, 256)
        self.norm = nn.LayerNorm(256)
        self.wt = nn.Parameter(torch.randn(512, 256).t() * 0.02)  # non-contiguous leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.down(torch.relu(self.up(x))))
        return (h @ self.wt).float().pow(2).mean() + (self.embed.float() ** 2).sum() * 1e-4


def _train(hooks: bool, *, dtype, precision, chunk_size=1 << 18, steps=4, stream=None,
           release_grads=True, overlap_writeback=True):
    torch.manual_seed(0)
    model = Net().to("cuda", dtype)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision, chunk_size=chunk_size,
                     small_param_threshold=4096, release_grads=release_grads,
                     overlap_writeback=overlap_writeback)
    if hooks:
        opt.attach_hooks(model)
    gen = torch.Generator().manual_seed(1)
    stream = stream or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the model was built on this one
    with torch.cuda.stream(stream):
        for _ in range(steps):
            x = torch.randn(64, 256, generator=gen).to("cuda", dtype)
            loss = model(x)
            torch.cuda._sleep(SLEEP_CYCLES)
            loss.backward()
            if hooks:
                opt.step_sync()
            else:
                opt.step()
            opt.zero_grad()
        values = [p.detach().clone() for p in model.parameters()]  # read on this stream
    torch.cuda.synchronize()
    return model, opt, values


CONFIGS = [
    dict(desc="bf16 params, fp32 moments, chunked", dtype=torch.bfloat16, precision="fp32"),
    dict(desc="bf16 params, bf16 moments, chunked", dtype=torch.bfloat16, precision="bf16"),
    dict(desc="bf16 params, fp8 moments, chunked", dtype=torch.bfloat16, precision="fp8"),
    dict(desc="fp32 params, bf16 moments, one chunk", dtype=torch.float32, precision="bf16",
         chunk_size=1 << 24),
    dict(desc="bf16 params, grads kept, write-back at step_sync", dtype=torch.bfloat16,
         precision="bf16", release_grads=False, overlap_writeback=False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["desc"])
def test_cuda_hooks_equal_step_bit_for_bit(config):
    kwargs = {k: v for k, v in config.items() if k != "desc"}
    sync_model, sync_opt, sync_values = _train(False, **kwargs)
    async_model, async_opt, async_values = _train(True, **kwargs)
    for a, b in zip(async_values, sync_values):
        assert torch.equal(a, b)
    for p, q in zip(async_model.parameters(), sync_model.parameters()):
        sa, sb = async_opt.state[p], sync_opt.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key].float(), sb[key].float()), key


def test_cuda_hooks_on_a_side_stream_order_the_next_forward():
    # step_sync makes the *current* stream wait on the H2D stream: run everything on a
    # non-default stream and read the weights there, without any device synchronisation.
    side = torch.cuda.Stream()
    _, _, expected = _train(False, dtype=torch.bfloat16, precision="bf16")
    _, _, got = _train(True, dtype=torch.bfloat16, precision="bf16", stream=side)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_cuda_hooks_fp32_match_torch_adamw_per_element():
    shapes = [(1 << 19,), (33, 31), (4097,)]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * 0.1).cuda() for s in shapes] for _ in range(20)]
    ref = [nn.Parameter(t.clone().cuda()) for t in init]
    ours = [nn.Parameter(t.clone().cuda()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, foreach=False)
    opt = AdamBridge(ours, lr=1e-2, weight_decay=0.05, chunk_size=1 << 17,
                     small_param_threshold=2048)
    opt.attach_hooks(nn.ParameterList(ours))
    for g in grads:
        torch.cuda._sleep(SLEEP_CYCLES)
        sum((p * gp).sum() for p, gp in zip(ours, g)).backward()
        opt.step_sync()
        for p, gp in zip(ref, g):
            p.grad = gp.clone()
        ref_opt.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt.state[q]["exp_avg"].view(q.shape).cuda(),
                                   ref_opt.state[p]["exp_avg"], rtol=RTOL, atol=ATOL)


def test_cuda_release_grads_frees_device_gradients_and_stats_count_bytes():
    model, opt, _ = _train(True, dtype=torch.bfloat16, precision="bf16", steps=1)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    model(x).backward()
    assert all(p.grad is None for p in opt.pipeline.hooked)  # freed in the hooks
    stats = opt.step_sync()
    assert all(p.grad is None for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats.d2h_bytes == grad_bytes and stats.d2h_s > 0 and stats.host_update_s > 0
    assert stats.num_params == len(list(model.parameters()))


def test_cuda_pinned_buffers_are_exact_size_and_page_locked():
    big = pinned.pinned_empty((3 << 19) + 1, torch.bfloat16)  # 3 MiB + 2 bytes
    small = pinned.pinned_empty(1000, torch.float32)
    assert big.kind == "registered" and big.registered and big.tensor.is_pinned()
    assert big.nbytes == ((3 << 19) + 1) * 2
    assert small.kind == "pin_memory" and small.tensor.is_pinned()
    big.close()
    assert not big.registered
    _, opt, _ = _train(True, dtype=torch.bfloat16, precision="bf16", steps=1)
    transport = next(iter(opt.pipeline.lanes.values())).transport
    embed = next(p for p in opt.pipeline.hooked if p.numel() == 1 << 20)
    assert transport._grad[embed].kind == "registered"
    assert transport._grad[embed].nbytes == (1 << 20) * 2
