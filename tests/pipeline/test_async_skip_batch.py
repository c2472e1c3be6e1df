"""A skip-the-bad-batch loop: backward raises, the loop calls zero_grad() and goes on.

In synchronous mode nothing of the bad batch is applied. With hooks attached, the worker
may already have updated the parameters whose gradients came before the exception:
zero_grad() must accept the interrupted step and roll those updates back, so that training
equals a synchronous twin that skipped the same batch, bit for bit.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from _worker_pace import keep_up
from adambridge import AdamBridge

BAD = 2  # the batch whose backward raises


class Boom(torch.autograd.Function):
    """Identity whose backward raises when ``armed``: after the later layers' gradients."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise FloatingPointError("bad batch")
        return grad


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.mid, self.last = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = Boom.apply(torch.tanh(self.first(x)))
        return self.last(torch.tanh(self.mid(h)))


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=gen) for _ in range(n)]


def _loop(hooks: bool, bad: set, precision: str = "fp32", max_grad_norm=None,
          steps: int = 6) -> tuple:
    """Train on every batch; a batch in ``bad`` raises in backward (hooks) or is skipped."""
    model = Net()
    opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                     precision=precision, small_param_threshold=0, max_grad_norm=max_grad_norm)
    if hooks:
        opt.attach_hooks(model)
        keep_up(opt, model)  # last's and mid's gradients are updated before the exception
    for i, x in enumerate(_batches(steps)):
        if i in bad and not hooks:
            continue  # the twin skips the batch
        Boom.armed = i in bad
        try:
            model(x).square().mean().backward()
        except FloatingPointError:
            opt.zero_grad()
            continue
        finally:
            Boom.armed = False
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_equal(a: tuple, b: tuple) -> None:
    (model_a, opt_a), (model_b, opt_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        for key, value in opt_b.state[q].items():
            assert torch.equal(opt_a.state[p][key], value), key


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_skipped_batch_with_clipping_expected_is_rolled_back_bit_for_bit(precision):
    # max_grad_norm (never firing) keeps the state of each early update: the first bad
    # batch is undone too.
    twin = _loop(False, {BAD}, precision, max_grad_norm=1e6)
    ours = _loop(True, {BAD}, precision, max_grad_norm=1e6)
    _assert_equal(ours, twin)
    assert all(int(ours[1].state[p]["step"]) == 5 for p in ours[0].parameters())


def test_first_skipped_batch_without_a_kept_state_says_what_stayed_then_rolls_back(caplog):
    # Without clipping nothing is kept at first: the first bad batch's early updates stay
    # (named, and counted in state["step"]); every later bad batch is undone exactly.
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        model, opt = _loop(True, {1}, steps=2)
    said = [r.getMessage() for r in caplog.records if "after a backward that raised" in r.getMessage()]
    assert len(said) == 1 and "parameters [2, 3, 4, 5] had already been updated" in said[0]
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert steps == [1, 1, 2, 2, 2, 2]  # first's weight and bias never got the bad gradient
    # From here on a raising backward leaves nothing: the same loop, batches 2..5, with
    # batch 3 bad, against a twin (a copy taken now) that skips it.
    twin_model = Net()
    twin_model.load_state_dict(model.state_dict())
    twin_opt = AdamBridge(twin_model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                          small_param_threshold=0)
    twin_opt.load_state_dict(opt.state_dict())
    for i, x in enumerate(_batches(6)[2:], start=2):
        for m, o, hooked in ((model, opt, True), (twin_model, twin_opt, False)):
            if i == 3 and not hooked:
                continue
            Boom.armed = i == 3 and hooked
            try:
                m(x).square().mean().backward()
            except FloatingPointError:
                o.zero_grad()
                continue
            finally:
                Boom.armed = False
            o.step()
            o.zero_grad()
    _assert_equal((model, opt), (twin_model, twin_opt))


def test_a_raising_micro_batch_that_accumulates_restarts_the_window():
    # The first micro-batch of a window raises before any update: zero_grad() drops it (and
    # the window's count), the loop goes on with the next two as one window.
    runs = []
    for hooks in (False, True):
        model = Net()
        opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=0)
        if hooks:
            opt.attach_hooks(model)
        data = _batches(7)
        windows = [(0, 1), (2, 3), (4, 5)] if hooks else [(0, 1), (4, 5)]
        for first, second in windows:
            Boom.armed = hooks and first == 2
            try:
                with opt.accumulate():
                    model(data[first]).square().mean().backward()
            except FloatingPointError:
                opt.zero_grad()
                continue
            finally:
                Boom.armed = False
            model(data[second]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    _assert_equal(runs[1], runs[0])
    assert all(int(runs[1][1].state[p]["step"]) == 2 for p in runs[1][0].parameters())


def test_zero_grad_after_a_finished_backward_is_still_refused():
    # Only a backward that raised is a batch being skipped: after one that finished, the
    # hooks' gradients belong to the step (toggle_optimizer's case).
    model = Net()
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    for x in _batches(2):
        model(x).square().mean().backward()
        opt.step()
    model(_batches(1)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) between a backward pass and step"):
        opt.zero_grad()
