"""Where each update of an asynchronous step ran, as StepStats counts it, per loop.

The counts (not timings) say whether a loop keeps the overlap: ``params_in_backward`` were
updated before ``step()`` was called, ``params_in_step`` while ``step()`` waited,
``params_redone`` twice. The hooked updates are let finish before the loop's code runs
(the worker drains what has landed), so the split is deterministic. Every loop here also
equals sync mode with ``torch.equal`` (parameters and every state tensor).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

from adambridge import AdamBridge

STEPS = 4
WIDTH = 96  # 96x96 fp32: every weight and bias hooked with small_param_threshold=0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, 1))


def _data() -> list:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, WIDTH, generator=gen) for _ in range(STEPS)]


@dataclass
class Loop:
    desc: str
    between: Callable  # (params) -> None, between backward and step()
    held_by: str       # the cause StepStats.held_by names from the second step on ("" none)
    redone: bool = False


def _nothing(params):
    pass


def _clip_value_never_fires(params):
    torch.nn.utils.clip_grad_value_(params, 1e9)


def _nan_to_num_of_finite(params):
    for p in params:
        p.grad.nan_to_num_()


def _clip_value_fires(params):
    torch.nn.utils.clip_grad_value_(params, 1e-4)


def _halve(params):
    for p in params:
        p.grad.mul_(0.5)


def _clip_norm_fires(params):
    torch.nn.utils.clip_grad_norm_(params, 1e-4)


def _clip_norm_never_fires(params):
    torch.nn.utils.clip_grad_norm_(params, 1e9)


LOOPS = [
    Loop("plain", _nothing, held_by=""),
    Loop("clip_grad_value_ that never changes a value", _clip_value_never_fires, held_by=""),
    Loop("nan_to_num_ of finite gradients", _nan_to_num_of_finite, held_by=""),
    Loop("clip_grad_norm_ that never fires", _clip_norm_never_fires, held_by=""),
    Loop("clip_grad_value_ that changes values", _clip_value_fires,
         held_by="clamp"),
    Loop("p.grad.mul_(0.5)", _halve, held_by="mul_ on p.grad"),
    Loop("clip_grad_norm_ that fires", _clip_norm_fires, held_by="clip", redone=False),
]


def _run(loop: Loop, hooks: bool, precision: str, release_grads: bool) -> tuple:
    model = _model()
    params = list(model.parameters())
    opt = AdamBridge(params, lr=1e-3, weight_decay=0.1, precision=precision,
                     release_grads=release_grads, small_param_threshold=0)
    if hooks:
        opt.attach_hooks(model)
    stats = []
    for x in _data():
        model(x).square().mean().backward()
        if hooks:  # what has landed is updated before the loop's code runs
            for lane in opt.pipeline.lanes.values():
                lane.wait(lane.call(lambda: None))
        loop.between(params)
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats)
    if hooks:
        opt.detach_hooks()
    return model, opt, stats


def _assert_same(a: tuple, b: tuple) -> None:
    for (name, pa), pb in zip(a[0].named_parameters(), b[0].parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs"
        for key, value in a[1].state[pa].items():
            assert torch.equal(value, b[1].state[pb][key]), f"state[{key!r}] of {name} differs"


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("precision", ["fp32", "fp8"])
@pytest.mark.parametrize("loop", LOOPS, ids=[loop.desc for loop in LOOPS])
def test_overlap_counts_per_loop(loop, precision, release_grads):
    sync = _run(loop, hooks=False, precision=precision, release_grads=release_grads)
    hooked = _run(loop, hooks=True, precision=precision, release_grads=release_grads)
    _assert_same(hooked, sync)
    first, *steady = hooked[2]
    n = len(list(hooked[0].parameters()))
    assert first.params_in_step == n and first.params_in_backward == 0  # held by design
    assert "first step after attach_hooks" in first.held_by
    for stats in steady:
        assert stats.params_in_backward + stats.params_in_step == stats.num_params == n
        assert stats.elems_in_backward + stats.elems_in_step == sum(
            p.numel() for p in hooked[0].parameters())
        assert (stats.params_redone > 0) == loop.redone
        if not loop.held_by:  # every update overlapped backward
            assert stats.held_by is None and stats.params_in_step == 0
            assert stats.overlap_share == 1.0
        else:
            assert loop.held_by in stats.held_by
            assert stats.params_in_step > 0 and stats.overlap_share < 1.0


def test_overlap_counts_clip_that_first_fires_later_is_redone_once():
    # A clip that fires after steps where it did not: the updates made during backward are
    # redone (counted), and from then on the step holds once the norm passes the limit.
    model = _model()
    params = list(model.parameters())
    opt = AdamBridge(params, lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    limits = [1e9, 1e9, 1e-4, 1e-4]
    stats = []
    for x, limit in zip(_data(), limits):
        model(x).square().mean().backward()
        for lane in opt.pipeline.lanes.values():
            lane.wait(lane.call(lambda: None))
        torch.nn.utils.clip_grad_norm_(params, limit)
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats)
    opt.detach_hooks()
    assert stats[1].params_redone == 0 and stats[1].params_in_step == 0
    assert stats[2].params_redone == len(params)  # clipping fired first here: redone
    assert stats[3].params_redone == 0  # held once the norm passed the limit: done once
    assert "clip" in stats[3].held_by


def test_overlap_lost_is_logged_once_per_cause(caplog):
    model = _model()
    params = list(model.parameters())
    opt = AdamBridge(params, lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        for x in _data():
            model(x).square().mean().backward()
            _halve(params)
            opt.step()
            opt.zero_grad()
    opt.detach_hooks()
    lines = [r.getMessage() for r in caplog.records if "ran at step(), not during backward"
             in r.getMessage()]
    assert len(lines) == 1, lines
    assert "mul_ on p.grad of parameter 0 at test_async_overlap_counts.py:" in lines[0]
    assert "gains nothing from updating during backward" in lines[0]


def test_overlap_counts_sync_mode_reports_none():
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3)
    model(_data()[0]).square().mean().backward()
    opt.step()
    stats = opt.last_step_stats
    assert stats.params_in_backward == stats.params_in_step == 0 and stats.held_by is None
    assert stats.overlap_share is None


def _mixed_writes(params):
    # In-place writes of other dtypes and kinds into (bf16) gradients, each run aside first
    # (as its out-of-place twin, or on a copy): some change values, some do not.
    gen = torch.Generator().manual_seed(5)
    for p in params:
        g = p.grad
        g.nan_to_num_()                                           # no change
        torch.nn.utils.clip_grad_value_([p], 1e9)                 # no change
        g.mul_(torch.rand(g.shape, generator=gen))                # fp32 tensor into bf16
        g.add_(torch.randn(g.shape, generator=gen) * 1e-4, alpha=0.5)
        g.lerp_(torch.zeros_like(g), 0.25)
        g.clamp_(-1e-3, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlap_writes_run_aside_equal_sync(dtype):
    runs = []
    for hooks in (False, True):
        model = _model().to(dtype)
        params = list(model.parameters())
        opt = AdamBridge(params, lr=1e-3, small_param_threshold=0)
        if hooks:
            opt.attach_hooks(model)
        for x in _data():
            model(x.to(dtype)).float().square().mean().backward()
            _mixed_writes(params)
            opt.step()
            opt.zero_grad()
        if hooks:
            opt.detach_hooks()
        runs.append((model, opt))
    _assert_same(runs[1], runs[0])
