"""Kept descriptor rows (pipeline/piece_rows.py): refreshed every step, repacked whenever a fact changes.

Each case runs the same model through step() and through hooks + step_sync() with the native
backend, applies an event to both between steps, and compares parameters and moments element
by element, bit for bit (the two paths share the kernel, the keys and the hyperparameters).
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.pipeline import piece_rows
from adambridge._native import loader

pytestmark = pytest.mark.skipif(
    loader.native_or_none() is None,
    reason="kept rows are native descriptors: needs the native library, which a C compiler "
           "builds at import (gcc or clang; Debian package gcc)")


class Small(nn.Module):
    """Whole-parameter pieces only: two Linears and a transposed (non-contiguous) leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 20)
        self.t = nn.Parameter(torch.randn(9, 20).t() * 0.3)
        self.b = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) @ self.t.to(x.dtype))


def _lr(opt, model) -> None:
    for group in opt.param_groups:
        group["lr"] *= 0.5


def _load(opt, model) -> None:
    # new state tensors: every kept row points at freed or foreign memory unless repacked
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _new_moments(opt, model) -> None:
    # what a precision change does: the same dict, new moment tensors, param_groups untouched
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            if key in state:
                state[key] = state[key].clone()


def _new_storage(opt, model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


_OLD_STORAGE = []  # kept alive: a row still holding an old address writes there, not into freed memory


def _moment_storage(opt, model) -> None:
    # the same state tensors, new storage behind them (t.data = ...): only pointers tell
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            _OLD_STORAGE.append(state[key].data)
            state[key].data = torch.full_like(state[key], 0.25 if key == "exp_avg" else 0.5)


def _rounding(opt, model) -> None:
    opt.stochastic_rounding = not opt.stochastic_rounding


EVENTS = [
    dict(desc="schedule: lr halved", event=_lr),
    dict(desc="load_state_dict: new state tensors", event=_load),
    dict(desc="state tensors replaced, groups kept", event=_new_moments),
    dict(desc="p.data replaced: new parameter storage", event=_new_storage),
    dict(desc="moments given new storage behind the same tensors", event=_moment_storage),
    dict(desc="stochastic_rounding toggled", event=_rounding),
]
CONFIGS = [
    dict(desc="fp32 params, fp32 moments", dtype=torch.float32, precision="fp32"),
    dict(desc="fp32 params, bf16 moments", dtype=torch.float32, precision="bf16"),
    dict(desc="bf16 params, fp8 moments", dtype=torch.bfloat16, precision="fp8"),
]


def _pair(dtype: torch.dtype, precision: str):
    torch.manual_seed(0)
    models = [Small().to(dtype) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [AdamBridge(m.parameters(), lr=1e-2, weight_decay=0.1, precision=precision,
                       small_param_threshold=0, backend="native") for m in models]
    opts[1].attach_hooks(models[1])
    return models, opts


def _step(models, opts, x) -> None:
    for model, opt in zip(models, opts):
        model(x).square().mean().backward()
        if opt.pipeline is not None:
            opt.step_sync()
        else:
            opt.step()
            model.zero_grad(set_to_none=True)


def _assert_same(models, opts, where: str) -> None:
    pairs = zip(models[0].parameters(), models[1].parameters())
    for i, (a, b) in enumerate(pairs):
        assert torch.equal(a, b), f"{where}: parameter {i}"
        sa, sb = opts[0].state[a], opts[1].state[b]
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            if key in sa:
                assert torch.equal(sa[key], sb[key]), f"{where}: {key} of parameter {i}"
        assert float(sa["step"]) == float(sb["step"]), f"{where}: step of parameter {i}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["desc"])
@pytest.mark.parametrize("case", EVENTS, ids=lambda c: c["desc"])
def test_kept_rows_equal_the_sync_step_across_changes(config, case):
    models, opts = _pair(config["dtype"], config["precision"])
    x = torch.randn(6, 12, dtype=config["dtype"])
    for step in range(5):
        if step == 3:
            for model, opt in zip(models, opts):
                case["event"](opt, model)
            before = [copy.deepcopy(opt.state_dict()["state"]) for opt in opts]
        _step(models, opts, x)
        _assert_same(models, opts, f"step {step + 1}, {case['desc']}")
        if step == 3:  # both paths could miss a change alike: the moments must have moved
            for opt, old in zip(opts, before):
                for i, state in opt.state_dict()["state"].items():
                    key = "exp_avg" if "exp_avg" in state else "ab_exp_avg"  # fp8: its codes
                    assert not torch.equal(state[key], old[i][key]), (
                        f"{case['desc']}: parameter {i}'s {key} did not move")
    opts[1].detach_hooks()


def _packed_rows(monkeypatch) -> list:
    """Record how many rows the loader packs afresh on the workers (the kept ones are only
    refreshed); the sync step's own packing runs on this thread and is not counted."""
    packed = []
    real = loader.descriptors

    def counting(items):
        if threading.current_thread().name.startswith("adambridge-"):
            packed.append(len(items))
        return real(items)

    monkeypatch.setattr(piece_rows.loader, "descriptors", counting)
    return packed


def test_kept_rows_are_refreshed_not_repacked_until_the_state_changes(monkeypatch):
    models, opts = _pair(torch.float32, "bf16")
    x = torch.randn(6, 12)
    for _ in range(2):  # the held first step packs each row once
        _step(models, opts, x)
    packed = _packed_rows(monkeypatch)
    _step(models, opts, x)
    assert packed == [], "a steady step repacked kept rows"
    _load(opts[1], models[1])
    _load(opts[0], models[0])
    _step(models, opts, x)
    assert sum(packed) == len(list(models[1].parameters())), packed
    packed.clear()
    _step(models, opts, x)
    assert packed == []
    _assert_same(models, opts, "after the reload")
    opts[1].detach_hooks()


def test_kept_row_refuses_a_gradient_the_kernel_cannot_read():
    models, opts = _pair(torch.float32, "fp32")
    x = torch.randn(6, 12)
    for _ in range(2):
        _step(models, opts, x)
    p = models[1].a.weight  # fp32 and contiguous: the kernel writes into p (no out)
    pieces = opts[1].pipeline._pieces[id(p)][-1]
    job = pieces[0].job
    job.begin(opts[1], 0, opts[1].param_groups[0], opts[1].state[p], 3,
              torch.zeros(p.numel() + 1), None, None, 1, None)
    with pytest.raises(ValueError, match="Invalid grad: the native kernel needs a contiguous "
                                         "CPU tensor of 240"):
        piece_rows.RowPacker().refresh(pieces[0])
    job.end()
    opts[1].detach_hooks()
