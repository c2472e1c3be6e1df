"""A step whose worker timed out: the error tells what may still change, and nothing else runs.

The worker's kernel call updates master, moments and weights in place: once step() has
stopped waiting for it (ADAMBRIDGE_SYNC_TIMEOUT), the call still finishes and commits. The
error must name the parameters it may still change, the optimizer must refuse steps after a
backward, checkpoints and attach_hooks() until that call has returned, and then go on in the
state each parameter's state["step"] describes, equal to a twin that took the same steps.
"""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.pipeline import late_work, worker
from _tiny import tiny_mlp

TIMEOUT_S = 0.5
ALL = r"\[0, 1, 2, 3\]"


def _model() -> nn.Module:
    return tiny_mlp((16, 32, 4), between="tanh")


def _optimizer(model: nn.Module) -> AdamBridge:
    return AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                      small_param_threshold=0)


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=gen) for _ in range(n)]


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _sync_step(model, opt, x) -> None:
    _backward(model, x)
    opt.step()
    opt.zero_grad()


def _assert_equal(model, opt, twin_model, twin) -> None:
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
        for key, value in twin.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.fixture
def slow_kernel(monkeypatch):
    """The next update call blocks until ``release`` is set (a hung or very slow kernel)."""
    release = threading.Event()
    real = worker.adamw_update

    def slow(items, backend):
        release.wait(30)
        real(items, backend)

    def arm() -> None:
        monkeypatch.setattr(worker, "adamw_update", slow)
        monkeypatch.setattr(late_work, "SYNC_TIMEOUT_S", TIMEOUT_S)
    yield arm, release
    release.set()


def _timed_out_step(model, opt, x, arm) -> str:
    arm()
    _backward(model, x)
    with pytest.raises(TimeoutError) as info:
        opt.step()
    return str(info.value)


def test_timeout_names_the_late_update_refuses_until_it_ended_then_equals_a_twin(
        slow_kernel, caplog):
    arm, release = slow_kernel
    data = _batches(3)
    model, twin_model = _model(), _model()
    opt, twin = _optimizer(model), _optimizer(twin_model)
    opt.attach_hooks(model)
    _sync_step(model, opt, data[0])  # the first step after attach_hooks is held: not this one
    _sync_step(twin_model, twin, data[0])
    saved = twin.state_dict()
    message = _timed_out_step(model, opt, data[1], arm)
    assert "\n" not in message and "has not answered for 0.5 s" in message
    assert "no parameter or optimizer state was changed" not in message
    assert f"parameters [0, 1, 2, 3] were in a worker call that has not returned and may still " \
           f"change" in message
    assert "call opt.step() with no backward before it" in message
    # While the call runs: no checkpoint either way.
    for call, name in ((opt.state_dict, "state_dict"),
                       (lambda: opt.load_state_dict(saved), "load_state_dict")):
        with pytest.raises(RuntimeError, match=rf"adambridge: {name}\(\) refused: the update "
                                               rf"that timed out .*parameters {ALL} may still"):
            call()
    release.set()
    opt.zero_grad()
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        opt.step()  # no backward: waits for the late update and says what it left
    assert any(f"parameters [0, 1, 2, 3] took that step" in r.message for r in caplog.records)
    # Every parameter took step 2, as the twin did: element by element.
    _sync_step(twin_model, twin, data[1])
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    _assert_equal(model, opt, twin_model, twin)
    opt.state_dict()  # checkpoints work again
    _sync_step(model, opt, data[2])  # and steps go on, equal to the twin's
    _sync_step(twin_model, twin, data[2])
    _assert_equal(model, opt, twin_model, twin)


def test_a_step_whose_backward_ran_before_the_late_update_ended_is_refused(slow_kernel):
    arm, release = slow_kernel
    data = _batches(3)
    model, twin_model = _model(), _model()
    opt, twin = _optimizer(model), _optimizer(twin_model)
    opt.attach_hooks(model)
    _sync_step(model, opt, data[0])
    _timed_out_step(model, opt, data[1], arm)
    opt.zero_grad()
    _backward(model, data[2])  # the training loop goes on while the late update runs
    with pytest.raises(RuntimeError, match=rf"step\(\) refused, nothing of it was applied: .* "
                                           rf"left in p.grad.* parameters {ALL} may still "
                                           rf"change; call opt.step\(\) with no backward"):
        opt.step()
    assert all(p.grad is not None for p in model.parameters())  # nothing was taken
    with pytest.raises(RuntimeError, match=r"refused"):  # the next one, too, until it ended
        opt.step()
    release.set()
    opt.zero_grad()
    opt.step()  # no backward: waits for it, and lifts the guard
    # The twin took steps 1 and 2; the refused batch is run again on both.
    for x in data[:2]:
        _sync_step(twin_model, twin, x)
    _assert_equal(model, opt, twin_model, twin)
    _sync_step(model, opt, data[2])
    _sync_step(twin_model, twin, data[2])
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())
    _assert_equal(model, opt, twin_model, twin)


def test_after_a_timeout_detached_steps_and_attach_hooks_are_refused_until_it_ended(
        slow_kernel):
    arm, release = slow_kernel
    data = _batches(3)
    model = _model()
    opt = _optimizer(model)
    opt.attach_hooks(model)
    _sync_step(model, opt, data[0])
    _timed_out_step(model, opt, data[1], arm)
    opt.detach_hooks()
    with pytest.raises(RuntimeError, match=r"attach_hooks\(\) refused: the update that timed"):
        opt.attach_hooks(model)
    opt.zero_grad()
    _backward(model, data[2])  # a synchronous step would race the late update
    with pytest.raises(RuntimeError, match=r"step\(\) refused, nothing of it was applied"):
        opt.step()
    release.set()
    opt.zero_grad()
    opt.step()  # no gradient: waits, lifts the guard
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    _sync_step(model, opt, data[2])
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())
