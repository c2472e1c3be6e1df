"""Faults in asynchronous mode: interrupted backward, dying workers, detach, memory over many steps."""
from __future__ import annotations

import gc
import logging
import os

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.pipeline import hooks as hooks_module, worker
from conftest import NEEDS_PROC


class InBackward(torch.autograd.Function):
    """Identity forward; its backward first runs ``action()`` (raise, or let the worker
    handle what has landed), after the hooks of the layers above it have fired."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.action is not None:
            ctx.action()
        return grad, None


def _raise(exc):
    def action():
        raise exc("simulated failure inside backward")
    return None if exc is None else action


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, exc=None):
        x = self.layers[1](self.layers[0](x))
        x = InBackward.apply(x, _raise(exc))  # layers 2, 3 get their gradients before this raises
        return self.layers[3](self.layers[2](x)).sum()


def _opt(model, **kw):
    return AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=0, **kw)


def _past_the_held_first_step():
    """A model with hooks after its first step (held: from the second on, updates start
    during backward), and the input it trained on."""
    model = Net()
    opt = _opt(model)
    opt.attach_hooks(model)
    x = torch.randn(2, 16)
    model(x).backward()
    opt.step()
    return model, opt, x


def _settle(opt):
    for lane in opt.pipeline.lanes.values():  # the worker has handled what was queued
        lane.wait(lane.call(lambda: None))


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_fault_interrupted_backward_fails_the_next_step_naming_the_updated(exc):
    model, opt, x = _past_the_held_first_step()
    opt.zero_grad()
    with pytest.raises(exc, match="simulated"):
        model(x, exc).backward()
    _settle(opt)
    with pytest.raises(RuntimeError, match=r"backward pass of this step did not finish.*this "
                                           r"step had already updated parameters \[4, 5, 6, 7\]"):
        opt.step()
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert steps == [1, 1, 1, 1, 2, 2, 2, 2]  # each parameter says whether it took the step
    opt.zero_grad()
    model(x).backward()
    opt.step()  # the next step works again
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2, 2, 2, 2, 3, 3, 3, 3]


def test_fault_interrupted_first_step_changes_nothing():
    model = Net()
    opt = _opt(model)
    opt.attach_hooks(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="simulated"):
        model(torch.randn(2, 16), RuntimeError).backward()
    with pytest.raises(RuntimeError, match=r"did not finish.*no parameter or optimizer state "
                                           r"was changed by this step"):
        opt.step_sync()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not any(opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, MemoryError])
def test_fault_worker_exception_of_any_kind_fails_one_step_only(monkeypatch, exc):
    model, opt, x = _past_the_held_first_step()
    real = worker.adamw_update

    def failing(items, backend):
        raise exc("simulated")

    monkeypatch.setattr(worker, "adamw_update", failing)
    opt.zero_grad()
    model(x).backward()
    with pytest.raises(RuntimeError, match=rf"update worker for cpu failed \({exc.__name__}"):
        opt.step()
    monkeypatch.setattr(worker, "adamw_update", real)
    opt.zero_grad()
    model(x).backward()
    opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_fault_dead_worker_thread_is_replaced_at_the_next_step():
    model, opt, x = _past_the_held_first_step()
    lane = next(iter(opt.pipeline.lanes.values()))
    lane.stop()  # the worker thread ends, as if killed
    assert not lane.thread.is_alive()
    opt.zero_grad()
    model(x).backward()
    with pytest.raises(RuntimeError, match=r"worker thread for cpu had died; a new one runs"):
        opt.step()
    assert lane.thread.is_alive()
    opt.zero_grad()
    model(x).backward()
    opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_fault_detach_during_a_step_removes_the_hooks_and_says_what_it_dropped(caplog):
    model, opt, x = _past_the_held_first_step()
    opt.zero_grad()
    model(x).backward()
    _settle(opt)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        opt.detach_hooks()
    assert any("dropped an unfinished step" in r.message for r in caplog.records)
    other = _opt(model)  # a new optimizer hooks the same model: the old hooks are gone
    other.attach_hooks(model)
    opt.zero_grad()
    model(x).backward()
    other.step()
    assert all(int(other.state[p]["step"]) == 1 for p in model.parameters())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@NEEDS_PROC
def test_memory_flat_over_5000_steps_with_the_cyclic_gc_off():
    # 64x64 layers with a 3 MiB-ish footprint would make each leaked step's gradients show.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    opt = AdamBridge(model.parameters(), lr=1e-3, backend="torch", small_param_threshold=100,
                     chunk_size=1024, max_grad_norm=1.0)
    opt.attach_hooks(model)
    x = torch.randn(4, 64)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(300):  # past the 256 cached per-step scalar sets (functional.Hyper)
        step()
    gc.collect()
    gc.disable()
    try:
        objects_before, rss_before = len(gc.get_objects()), _rss_bytes()
        for _ in range(5000):
            step()
        objects_after, rss_after = len(gc.get_objects()), _rss_bytes()
        unreachable = gc.collect()
    finally:
        gc.enable()
    # With the cyclic GC off, every step's bookkeeping must go by reference counting alone.
    assert unreachable < 50, f"{unreachable} objects in reference cycles after 5000 steps"
    assert objects_after - objects_before < 200, (objects_before, objects_after)
    assert rss_after - rss_before < 8 << 20, (rss_before, rss_after)


def test_fault_hung_kernel_call_is_bounded_and_names_the_worker(monkeypatch):
    import threading
    from adambridge.pipeline import late_work
    model, opt, x = _past_the_held_first_step()
    release = threading.Event()
    real = worker.adamw_update

    def hanging(items, backend):
        release.wait(30)
        real(items, backend)

    monkeypatch.setattr(worker, "adamw_update", hanging)
    monkeypatch.setattr(late_work, "SYNC_TIMEOUT_S", 0.5)
    opt.zero_grad()
    model(x).backward()
    try:
        with pytest.raises(TimeoutError, match=r"worker thread 'adambridge-cpu' has not answered "
                                               r"for 0.5 s.*ADAMBRIDGE_SYNC_TIMEOUT"):
            opt.step()
    finally:
        release.set()


def test_fault_with_overlap_writeback_off_committed_parameters_still_get_their_weights(
        monkeypatch):
    # Non-contiguous parameters are copied back, not written in place: with the copies
    # deferred to the step's end, a failed batch must not keep them from committed ones.
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 16).t()) for _ in range(3)]
    opt = AdamBridge(params, lr=1e-2, backend="torch", small_param_threshold=0,
                     overlap_writeback=False)
    opt.attach_hooks(nn.ParameterList(params))
    x = torch.randn(4, 16)

    def backward():
        h = x
        for p in params:  # drained between layers: one parameter per batch, last first
            h = InBackward.apply(torch.tanh(h @ p), lambda: _settle(opt))
        h.sum().backward()

    backward()
    opt.step()
    real, first_master = worker.adamw_update, opt.state[params[0]]["master"]

    def failing(items, backend):
        if any(i.master.data_ptr() == first_master.data_ptr() for i in items):
            raise MemoryError("simulated")
        real(items, backend)

    monkeypatch.setattr(worker, "adamw_update", failing)
    opt.zero_grad()
    backward()
    with pytest.raises(RuntimeError, match=r"MemoryError: simulated.*already updated "
                                           r"parameters \[1, 2\]"):
        opt.step()
    assert [int(opt.state[p]["step"]) for p in params] == [1, 2, 2]
    for p in params[1:]:  # committed: the parameter holds its new master
        assert torch.equal(p.detach().reshape(-1), opt.state[p]["master"].view(p.shape).reshape(-1))


@pytest.mark.parametrize("where", ["hook entry", "before the pass is registered"])
def test_fault_ctrl_c_in_the_first_hook_of_a_backward_fails_the_step(monkeypatch, where):
    # A KeyboardInterrupt landing in the first gradient hook of a backward, before that hook
    # had registered the pass, used to leave a silent partial step: the next step() raised
    # nothing and sent that one parameter's gradient, still in p.grad, as a straggler.
    from adambridge.pipeline import cuda_policy, hooks
    model, opt, x = _past_the_held_first_step()
    opt.zero_grad()
    calls = []

    def interrupted(real):
        def first_call_raises(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return first_call_raises

    if where == "hook entry":
        monkeypatch.setattr(hooks.Pipeline, "on_grad", interrupted(hooks.Pipeline.on_grad))
    else:
        monkeypatch.setattr(cuda_policy, "check_hook", interrupted(cuda_policy.check_hook))
    with pytest.raises(KeyboardInterrupt):
        model(x).backward()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"backward pass of this step did not finish.*no "
                                           r"parameter or optimizer state was changed"):
        opt.step()
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1] * 8
    opt.zero_grad()
    model(x).backward()
    opt.step()  # the next step works again
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2] * 8


def _interrupt_at(call: int):
    """A trace function raising KeyboardInterrupt as the ``call``-th call of the pipeline's own
    code starts (the autograd thread is this one on the CPU): Ctrl-C landing there. Python
    checks for a signal as a function starts (and after calls, and in loops), so this is
    where a real one lands; a line event in the middle of a ``with`` statement's exit is not
    (a tracer can raise there and leak the lock, a signal cannot)."""
    seen = [0]
    root = os.path.dirname(hooks_module.__file__)

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen[0] += 1
            if seen[0] == call:
                raise KeyboardInterrupt
        return None
    return trace, seen


def test_fault_ctrl_c_at_every_call_of_a_backward_never_leaves_a_silent_partial_step():
    # The fault probe of the async issue's item 10, made exhaustive: a KeyboardInterrupt as
    # each function the pipeline runs during one backward starts. Either the step fails
    # (naming what it had updated) or every parameter took it; a step after zero_grad() works.
    import sys
    line, probed = 1, 0
    while True:
        model, opt, x = _past_the_held_first_step()
        opt.zero_grad()
        trace, seen = _interrupt_at(line)
        sys.settrace(trace)
        try:
            model(x).backward()
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        if not interrupted:
            break  # past the last call of the pipeline's part of a backward
        try:
            opt.step()
            steps = {int(opt.state[p]["step"]) for p in model.parameters()}
            assert steps == {2}, f"line {line}: a silent partial step {steps}"
        except RuntimeError as exc:
            assert "did not finish" in str(exc), f"line {line}: {exc}"
        opt.zero_grad()
        model(x).backward()
        opt.step()  # the next step works again, whatever the interrupted one left
        probed += 1
        line += 1
        opt.detach_hooks()
    assert probed > 20  # (each hook's calls, in turn)
