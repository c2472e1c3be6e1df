"""Stream ordering on a real GPU: each test delays one side of a wait, or reuses
freed memory, so that a missing wait or record_stream changes bits; the reference is step().

Race-exposing shapes (as in test_cuda_pipeline.py): the compute stream sleeps before every
backward so the hooks fire long before the gradients exist, the largest parameter is split
into 4 chunks, one parameter is non-contiguous, and the small ones travel in slots.
"""
from __future__ import annotations

import os

# NOTE: cuBLAS is bitwise reproducible across streams only with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from contextlib import nullcontext  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from adambridge import AdamBridge
from adambridge.pipeline import worker  # noqa: E402
from adambridge.pipeline.transport import CudaTransport  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time


class NanFill(torch.autograd.Function):
    """Identity whose backward allocates and NaN-fills blocks of every parameter's size on
    the compute stream: without record_stream a released gradient's block is handed out
    here before its (delayed) copy to the host has run, and NaN reaches the update."""

    sizes: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for _ in range(3):
            junk = [torch.full((n,), float("nan"), dtype=d, device=grad.device)
                    for n, d in NanFill.sizes]
            del junk
        return grad


class Net(nn.Module):
    """Net of test_cuda_pipeline.py plus ``late`` (first gradient at step 1) and ``gate``
    (a small parameter used on even steps only)."""

    def __init__(self, nan_fill: bool = False) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(1 << 20) * 0.02)  # 4 chunks at 2**18
        self.up = nn.Linear(256, 1024)
        self.down = nn.Linear(1024, 256)
        self.norm = nn.LayerNorm(256)
        self.wt = nn.Parameter(torch.randn(512, 256).t() * 0.02)  # non-contiguous leaf
        self.late = nn.Parameter(torch.randn(256, 256) * 0.02)
        self.gate = nn.Parameter(torch.ones(256))
        self.nan_fill = nan_fill
        self.step = 0

    def used(self, step: int) -> list:
        skip = ({"late"} if step < 1 else set()) | ({"gate"} if step % 2 else set())
        return [p for name, p in self.named_parameters() if name not in skip]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.nan_fill:
            h = NanFill.apply(h)
        h = self.norm(self.down(h))
        if self.step >= 1:
            h = h + h @ self.late
        if self.step % 2 == 0:
            h = h * self.gate
        return (h @ self.wt).float().pow(2).mean() + (self.embed.float() ** 2).sum() * 1e-4


def _run(hooks: bool, *, steps: int = 4, dtype=torch.bfloat16, precision: str = "bf16",
         autocast: bool = False, accumulation: int = 1, stream=None, step_outside: bool = False,
         nan_fill: bool = False, release_grads: bool = True, overlap_writeback: bool = True,
         on_stats=None):
    torch.manual_seed(0)
    model = Net(nan_fill).to("cuda", dtype)
    NanFill.sizes = [(p.numel(), p.dtype) for p in model.parameters()]
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision, chunk_size=1 << 18,
                     small_param_threshold=4096, release_grads=release_grads,
                     overlap_writeback=overlap_writeback)
    if hooks:
        opt.attach_hooks(model, accumulation_steps=accumulation)
    gen = torch.Generator().manual_seed(1)
    stream = stream or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the model was built on this one
    for step in range(steps):
        model.step = step
        with torch.cuda.stream(stream):
            for _ in range(accumulation):
                x = torch.randn(64, 256, generator=gen).to("cuda", dtype)
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    loss = model(x)
                torch.cuda._sleep(SLEEP_CYCLES)
                loss.backward()
        with nullcontext() if step_outside else torch.cuda.stream(stream):
            if hooks:
                stats = opt.step_sync()
                if on_stats is not None:
                    on_stats(step, model, stats)
            else:
                opt.step()
            opt.zero_grad()  # kept gradients (release_grads=False) must not accumulate
        if step_outside:
            # As torch asks after an optimizer step on another stream; what is *not*
            # synchronised is step_sync's start against the backward stream (item 7).
            stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        values = [p.detach().clone() for p in model.parameters()]  # read where it trained
    torch.cuda.synchronize()
    if hooks:
        opt.detach_hooks()
    return model, opt, values


def _assert_same(run_a, run_b) -> None:
    (model_a, opt_a, values_a), (model_b, opt_b, values_b) = run_a, run_b
    for (name, _), a, b in zip(model_a.named_parameters(), values_a, values_b):
        assert torch.equal(a, b), name
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key].float(), sb[key].float()), (name, key)


def _delay(monkeypatch, direction: str) -> None:
    """Put the copy stream to sleep after its waits, just before each copy of ``direction``."""
    real = CudaTransport._timed_copy

    def delayed(self, which, dst, src, stream):
        if which == direction:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        return real(self, which, dst, src, stream)

    monkeypatch.setattr(CudaTransport, "_timed_copy", delayed)


def test_cuda_order_control_sync_step_is_deterministic():
    # The control: if step() against itself differs, no async comparison below means anything.
    _assert_same(_run(False), _run(False))


def test_cuda_order_delayed_copy_back_equals_sync(monkeypatch):
    # A late H2D copy: finish() must make the next forward wait for it.
    expected = _run(False)
    _delay(monkeypatch, "h2d")
    _assert_same(_run(True), expected)


def test_cuda_order_delayed_copy_down_with_reused_memory_equals_sync(monkeypatch):
    # A late D2H copy of a released gradient whose block the compute stream reuses and
    # NaN-fills: only record_stream keeps the allocator from handing it out.
    expected = _run(False, nan_fill=True)
    _delay(monkeypatch, "d2h")
    _assert_same(_run(True, nan_fill=True), expected)


@pytest.mark.parametrize("config", [
    dict(desc="accumulation over 3 micro-batches", accumulation=3),
    dict(desc="fp16 parameters", dtype=torch.float16),
    dict(desc="fp32 parameters under bf16 autocast", dtype=torch.float32, autocast=True),
    dict(desc="grads kept, write-back at step_sync", release_grads=False,
         overlap_writeback=False),
], ids=lambda c: c["desc"])
def test_cuda_order_async_equals_sync(config):
    # Every config also has ``late`` (first gradient at step 1) and ``gate`` (absent on
    # odd steps: its slot is skipped, nothing is rebuilt).
    kwargs = {k: v for k, v in config.items() if k != "desc"}
    _assert_same(_run(True, **kwargs), _run(False, **kwargs))


def test_cuda_order_backward_on_a_side_stream_step_sync_outside():
    # Backward inside torch.cuda.stream(side), step_sync on the default stream: the small
    # parameters' copies and finish() must follow the backward stream, not the caller's.
    side = torch.cuda.Stream()
    expected = _run(False, stream=side)
    _assert_same(_run(True, stream=side, step_outside=True), expected)


def test_cuda_order_stats_bytes_are_the_bytes_of_that_step():
    # The parameter set changes from step to step, so copies counted in the wrong step
    # (a take_stats that does not wait for the last copies back) change the totals.
    seen = []

    def check(step, model, stats):
        if step >= 2:  # steps 0 and 1 also copy p's values down (first updates)
            nbytes = sum(p.numel() * p.element_size() for p in model.used(step))
            seen.append((stats.d2h_bytes, stats.h2d_bytes, nbytes))

    _run(True, steps=6, on_stats=check)
    assert len(seen) == 4
    for d2h, h2d, nbytes in seen:
        assert d2h == nbytes and h2d == nbytes


def test_cuda_order_failed_step_still_sends_committed_weights_back(monkeypatch):
    # overlap_writeback=False defers every copy back to step_sync; a step that fails after
    # some parameters committed must still send theirs, or device and master disagree.
    torch.manual_seed(0)
    model = Net().to("cuda", torch.bfloat16)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="bf16", chunk_size=1 << 18,
                     small_param_threshold=4096, overlap_writeback=False)
    opt.attach_hooks(model)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    model(x).backward()
    opt.step_sync()  # the first step is held; from here updates run during backward
    fail = {"on": False}
    real = worker.adamw_update

    def failing(items, backend):
        if fail["on"]:
            raise RuntimeError("injected kernel failure")
        return real(items, backend)

    monkeypatch.setattr(worker, "adamw_update", failing)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.cuda._sleep(SLEEP_CYCLES)
    model(x).backward()
    for lane in opt.pipeline.lanes.values():  # every hooked gradient is updated now
        lane.wait(lane.call(lambda: None))
    fail["on"] = True  # the small parameters' batch, sent by step_sync, fails
    hooked = {id(p) for p in opt.pipeline.hooked}
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        opt.step_sync()
    torch.cuda.synchronize()
    for name, p in model.named_parameters():
        if name == "late":
            continue  # never used at step 0: no state
        state = opt.state[p]
        if id(p) in hooked:
            assert int(state["step"]) == 2, name
            master = state["master"].view(p.shape).to(torch.bfloat16).to("cuda")
            assert torch.equal(p.detach(), master), name
        else:
            assert int(state["step"]) == 1 and torch.equal(p.detach(), before[name]), name
    opt.detach_hooks()


def test_cuda_order_memory_is_flat_and_release_grads_lowers_the_backward_peak():
    def run(release: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])
        model.to("cuda", torch.bfloat16)
        opt = AdamBridge(model.parameters(), precision="bf16", release_grads=release)
        opt.attach_hooks(model)
        x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
        allocated, peaks = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            model(x).float().pow(2).mean().backward()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - start)
            opt.step_sync()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
        opt.detach_hooks()
        return allocated, peaks

    kept_allocated, kept_peaks = run(False)
    released_allocated, released_peaks = run(True)
    assert len(set(released_allocated[1:])) == 1, released_allocated  # no growth per step
    assert len(set(kept_allocated[1:])) == 1, kept_allocated
    assert max(released_peaks[1:]) < min(kept_peaks[1:]), (released_peaks, kept_peaks)


def test_cuda_order_failed_registration_clears_the_error_and_raises_at_step_sync(monkeypatch):
    from adambridge.host import pinned
    # Invalid flags make the real cudaHostRegister fail and leave its error pending.
    monkeypatch.setattr(pinned, "_REGISTER_PORTABLE", 0x7FFF0000)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinned.pinned_empty(1 << 20, torch.bfloat16)
    torch.ones(8, device="cuda").add_(1)  # a launch here would raise the pending error
    torch.cuda.synchronize()
    torch.manual_seed(0)
    model = Net().to("cuda", torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = AdamBridge(model.parameters(), precision="bf16", chunk_size=1 << 18,
                     small_param_threshold=4096)
    opt.attach_hooks(model)  # the 2 MiB buffers fail to register here, on the worker
    model(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)).backward()  # no error
    with pytest.raises(RuntimeError, match=r"cudaHostRegister.*no parameter or optimizer "
                                           r"state was changed"):
        opt.step_sync()
    torch.cuda.synchronize()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(not s for s in opt.state.values())
    opt.detach_hooks()


SHAPES = [(1 << 19,), (33, 31), (4097,), (1,), (15,), (17,)]


def _init_and_grads(steps: int):
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    init.append(torch.randn(64, 48, generator=gen).t())  # non-contiguous
    grads = [[(torch.randn(t.shape, generator=gen) * 0.1).cuda() for t in init]
             for _ in range(steps)]
    return init, grads


def _assert_like_adamw(ours, opt, ref, ref_opt) -> None:
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[q][key].view(q.shape).cuda(),
                                       ref_opt.state[p][key], rtol=1e-6, atol=1e-7)


def test_cuda_sync_step_matches_torch_adamw_per_element():
    # step() on CUDA parameters: one pinned staging buffer each way (sync/transfer.py).
    init, grads = _init_and_grads(20)
    ref = [nn.Parameter(t.clone().cuda()) for t in init]
    ours = [nn.Parameter(t.cuda()) for t in init]  # keeps the non-contiguous layout
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, foreach=False)
    opt = AdamBridge(ours, lr=1e-2, weight_decay=0.05)
    for g in grads:
        for p, q, gp in zip(ref, ours, g):
            p.grad, q.grad = gp.clone(), gp.clone()
        ref_opt.step()
        opt.step()
    _assert_like_adamw(ours, opt, ref, ref_opt)


def test_cuda_detach_then_sync_step_matches_torch_adamw():
    init, grads = _init_and_grads(6)
    ref = [nn.Parameter(t.clone().cuda()) for t in init]
    ours = [nn.Parameter(t.cuda()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, foreach=False)
    opt = AdamBridge(ours, lr=1e-2, weight_decay=0.05, chunk_size=1 << 17,
                     small_param_threshold=2048)
    opt.attach_hooks(nn.ParameterList(ours))
    for i, g in enumerate(grads):
        if i == 3:
            opt.detach_hooks()  # the rest through sync step()
        for p, gp in zip(ref, g):
            p.grad = gp.clone()
        ref_opt.step()
        if i < 3:
            torch.cuda._sleep(SLEEP_CYCLES)
            sum((q * gq).sum() for q, gq in zip(ours, g)).backward()
            opt.step_sync()
        else:
            for q, gq in zip(ours, g):
                q.grad = gq.clone()
            opt.step()
            opt.zero_grad()
    _assert_like_adamw(ours, opt, ref, ref_opt)


def test_cuda_sync_step_bf16_equals_the_same_step_on_the_cpu():
    # The staging layout (aligned slices, skipped parameters) must not move a single bit.
    init, grads = _init_and_grads(4)
    results = []
    for device in ("cpu", "cuda"):
        params = [nn.Parameter(t.to(device, torch.bfloat16)) for t in init]
        opt = AdamBridge(params, lr=1e-2, precision="bf16")
        for step, g in enumerate(grads):
            for i, (p, gp) in enumerate(zip(params, g)):
                p.grad = gp.to(device, torch.bfloat16) if (i + step) % 3 else None
            opt.step()
        results.append([p.detach().cpu() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cuda_64_adjacent_registered_buffers_are_all_pinned():
    from adambridge.host import pinned
    # 1-4 MiB blocks that malloc places next to each other: registrations sharing a page
    # would fail (cudaErrorHostMemoryAlreadyRegistered) or leave a buffer pageable.
    sizes = [(1 << 19) + i * 24_579 for i in range(64)]  # bf16 elements: 1 MiB .. ~4 MiB
    buffers = [pinned.pinned_empty(n, torch.bfloat16) for n in sizes]
    source = torch.randn(max(sizes), device="cuda").to(torch.bfloat16)
    for buffer, n in zip(buffers, sizes):
        assert buffer.kind == "registered" and buffer.registered and buffer.tensor.is_pinned()
        buffer.tensor.copy_(source[:n], non_blocking=True)
    torch.cuda.synchronize()
    for buffer, n in zip(buffers, sizes):
        assert torch.equal(buffer.tensor, source[:n].cpu())
        buffer.close()
