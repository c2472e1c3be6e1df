"""Core fixes found while running the frameworks' features in asynchronous mode.

Reentrant activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``, e.g. the
Trainer's ``gradient_checkpointing_kwargs={"use_reentrant": True}``) runs a backward pass
inside backward. The pipeline took the inner pass for a new one and the outer for an
interrupted pass, so every such step failed with "a backward pass of this step did not
finish". A pass inside another is now part of it; a pass still open at the step's end is
the interrupted one.
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from adambridge import AdamBridge


class Checkpointed(torch.nn.Module):
    def __init__(self, fail_inside: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 64), torch.nn.Linear(64, 64),
                                  torch.nn.Linear(64, 4))
        self.fail_inside = fail_inside

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h)) if not self.fail_inside else Boom.apply(self.b(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(checkpoint(self.inner, h, use_reentrant=True))


class Boom(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: x.view_as(x))

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom inside the checkpointed backward")


def train(hooked: bool, accumulation: int = 1, steps: int = 3) -> list:
    torch.manual_seed(0)
    net = Checkpointed()
    opt = AdamBridge(net.parameters(), lr=1e-2, backend="torch", small_param_threshold=200)
    if hooked:
        opt.attach_hooks(net, accumulation_steps=accumulation)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(accumulation):
            x = torch.randn(8, 16, generator=g, requires_grad=True)
            torch.nn.functional.mse_loss(net(x), torch.randn(8, 4, generator=g)).backward()
        opt.step()
        opt.zero_grad()
    assert {int(s["step"]) for s in opt.state.values()} == {steps}
    opt.detach_hooks()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_reentrant_checkpointing_equals_sync_bit_for_bit(accumulation):
    for sync, hooked in zip(train(False, accumulation), train(True, accumulation)):
        torch.testing.assert_close(hooked, sync, rtol=0, atol=0)


def test_an_exception_inside_the_inner_backward_still_fails_the_step():
    net = Checkpointed(fail_inside=True)
    opt = AdamBridge(net.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(net)
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        net(x).sum().backward()
    with pytest.raises(RuntimeError, match="backward pass of this step did not finish"):
        opt.step()
    net.fail_inside = False
    opt.zero_grad()
    net(x).sum().backward()
    opt.step()  # usable again
    assert {int(s["step"]) for s in opt.state.values()} == {1}
    opt.detach_hooks()
