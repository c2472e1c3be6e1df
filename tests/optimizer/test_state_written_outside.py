"""A whole dict written into opt.state[p] from outside (as torch's ZeroRedundancyOptimizer
.load_state_dict writes each saved entry) is taken as load_state_dict() would take it, or
refused in one line with the state as it was; group copies of optimizer-wide settings (which
ZeRO puts in every group) are taken when equal and refused otherwise."""
from __future__ import annotations

import copy

import pytest
import torch

from adambridge import AdamBridge


def model_of(dtype):
    torch.manual_seed(0)  # 300 rows: fp8 blocks of 128 with a short last one
    return torch.nn.Linear(9, 300).to(dtype)


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 9, generator=gen).to(dtype)).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("form", ["saved entry", "live state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_a_written_state_resumes_bit_for_bit(precision, dtype, form):
    straight = model_of(dtype)
    opt = AdamBridge(straight.parameters(), lr=1e-2, precision=precision)
    train(straight, opt, 3, seed=1)
    if form == "saved entry":  # what ZeroRedundancyOptimizer.load_state_dict writes
        written = copy.deepcopy(opt.state_dict()["state"])
    else:  # a plain copy of the live dicts
        written = {i: {k: v.clone() for k, v in opt.state[p].items()}
                   for i, p in enumerate(straight.parameters())}
    resumed = model_of(dtype)
    resumed.load_state_dict(straight.state_dict())
    opt2 = AdamBridge(resumed.parameters(), lr=1e-2, precision=precision)
    train(resumed, opt2, 1, seed=9)  # state of its own, which the writes replace
    resumed.load_state_dict(straight.state_dict())
    for i, p in enumerate(resumed.parameters()):
        opt2.state[p] = written[i]
        assert type(opt2.state[p]).__name__ == "HostState"
    train(straight, opt, 3, seed=2)
    train(resumed, opt2, 3, seed=2)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key, value in opt.state[p].items():
            other = opt2.state[q][key]
            assert value.dtype == other.dtype and torch.equal(value, other), key


def test_a_written_state_of_another_precision_is_converted():
    model = model_of(torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    train(model, opt, 2, seed=1)
    saved = copy.deepcopy(opt.state_dict()["state"])
    other = AdamBridge(model.parameters(), lr=1e-2, precision="bf16")
    for i, p in enumerate(model.parameters()):
        other.state[p] = saved[i]
        assert other.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(other.state[p]["exp_avg"], saved[i]["exp_avg"].reshape(-1).bfloat16())
    train(model, other, 1, seed=2)


def test_a_written_empty_dict_is_no_state_yet():
    model = model_of(torch.bfloat16)
    opt = AdamBridge(model.parameters(), lr=1e-2)
    train(model, opt, 2, seed=1)
    p = model.weight
    opt.state[p] = {}
    train(model, opt, 1, seed=2)
    assert opt.state[p]["step"].item() == 1
    assert torch.equal(opt.state[p]["master"].bfloat16().view(p.shape), p.detach())


def test_a_written_state_that_does_not_fit_is_refused_and_changes_nothing():
    model = model_of(torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="bf16")
    train(model, opt, 2, seed=1)
    p = model.weight
    before = {k: v.clone() for k, v in opt.state[p].items()}
    bad = copy.deepcopy(opt.state_dict()["state"][0])
    bad["exp_avg"] = bad["exp_avg"][:5]
    with pytest.raises(ValueError, match=r"^opt\.state\[p\] of parameter 0 was written from "
                                         r"outside: .*'exp_avg' .* has 45 elements[^\n]*$"):
        opt.state[p] = bad
    with pytest.raises(ValueError, match=r"^opt\.state\[p\] of parameter 0 .*expected a tensor"):
        opt.state[p] = {"step": 3.0, "exp_avg": {"nested": 1}}
    assert all(torch.equal(before[k], opt.state[p][k]) for k in before)
    train(model, opt, 1, seed=2)


def test_a_write_while_hooks_are_attached_is_refused():
    model = model_of(torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-2, small_param_threshold=0)
    train(model, opt, 1, seed=1)
    saved = copy.deepcopy(opt.state_dict()["state"])
    opt.attach_hooks(model)
    with pytest.raises(RuntimeError, match=r"^opt\.state\[p\] .* while hooks are attached; "
                                           r"call opt\.detach_hooks\(\) first[^\n]*$"):
        opt.state[model.weight] = saved[0]
    opt.detach_hooks()
    opt.state[model.weight] = saved[0]


def test_group_copies_of_settings_are_taken_when_equal_and_refused_otherwise():
    model = model_of(torch.float32)
    opt = AdamBridge([{"params": [model.weight], "precision": "bf16", "seed": 4,
                       "stochastic_rounding": True}], lr=1e-2, precision="bf16", seed=4)
    opt.add_param_group({"params": [model.bias], "precision": "bf16"})
    with pytest.raises(ValueError, match=r"^Invalid param group option 'small_param_threshold'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))],
                             "small_param_threshold": 5})
    train(model, opt, 1, seed=1)
    opt.param_groups[1]["precision"] = "fp8"  # a copy that would be ignored: refused
    with pytest.raises(ValueError, match=r"^param_groups\[1\]\['precision'\] is 'fp8', but it "
                                         r"is optimizer-wide .*precision='bf16'[^\n]*$"):
        train(model, opt, 1, seed=2)
