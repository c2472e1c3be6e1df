"""Gradient views on a CUDA device (pipeline/grad_views.py): loops that touch p.grad between
backward and step(), async against sync on the same GPU.

What only a GPU shows: a view's values live in pinned host memory, so a read copies them to
the device for the operation and a write copies the result back; the device memory a
released gradient gave back must stay given back (a _foreach_ call over views is split into
batches); and norms are taken on the host copy (their last bit may differ from the GPU's:
checked within an ulp, every other value bit for bit).
"""
from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bitwise cuBLAS, before CUDA

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils import clip_grad_value_  # noqa: E402  (bound before attach_hooks)

from adambridge import AdamBridge  # noqa: E402
from adambridge.pipeline import grad_views  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512)).cuda()


def _mask(model, step, log):
    gen = torch.Generator(device="cuda").manual_seed(step)
    for p in model.parameters():
        p.grad.masked_fill_(torch.rand(p.shape, generator=gen, device="cuda") < 0.3, 0.0)


def _assign(model, step, log):
    for p in model.parameters():
        p.grad = p.grad * 0.5


def _clip_value(model, step, log):
    clip_grad_value_(model.parameters(), 1e-4)


def _sums(model, step, log):
    log.append(torch.stack([p.grad.float().sum() for p in model.parameters()]).cpu())


LOOPS = {"mask in place": _mask, "assign": _assign, "clip_grad_value_ bound early": _clip_value,
         "sums read": _sums}


def _run(hooks: bool, between, release_grads: bool) -> tuple:
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, weight_decay=0.1, release_grads=release_grads)
    if hooks:
        opt.attach_hooks(model)
    gen = torch.Generator().manual_seed(1)
    log: list = []
    for step in range(3):
        model(torch.randn(16, 512, generator=gen).cuda()).square().mean().backward()
        between(model, step, log)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    if hooks:
        opt.detach_hooks()
    return [p.detach().cpu() for p in model.parameters()], log


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_cuda_loop_touching_gradients_equals_sync_bit_for_bit(name, release_grads):
    (sync, sync_log), (ours, our_log) = (_run(hooks, LOOPS[name], release_grads)
                                         for hooks in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))
    assert all(torch.equal(a, b) for a, b in zip(our_log, sync_log))


def test_cuda_norms_read_from_views_are_within_an_ulp_of_the_gpus():
    def norms(model, step, log):
        log.append(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    (_, sync_log), (_, our_log) = (_run(hooks, norms, True) for hooks in (False, True))
    for ours, sync in zip(our_log, sync_log):
        torch.testing.assert_close(ours.cpu(), sync.cpu(), rtol=2.4e-7, atol=0)


def test_cuda_released_gradients_stay_given_back_while_the_loop_reads_them():
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    x = torch.randn(16, 512).cuda()
    model(x).square().mean().backward()  # the held first step
    opt.step()
    model(x).square().mean().backward()
    torch.cuda.synchronize()
    assert all(isinstance(p.grad, grad_views.GradView) for p in model.parameters())
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch._foreach_norm([p.grad.float() for p in model.parameters()])  # one gradient at a time
    torch._foreach_abs([p.grad for p in model.parameters()])  # in batches of views
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # (_foreach_abs returns its results: they stay until the statement ends, one batch of
    # gradients read back plus the results; everything else one gradient at a time)
    assert torch.cuda.max_memory_allocated() - resident <= 3 * largest + (1 << 20) + \
        sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.memory_allocated() - resident <= (1 << 20)  # nothing left behind
    assert total.device.type == "cuda"
    opt.step()
    opt.detach_hooks()
