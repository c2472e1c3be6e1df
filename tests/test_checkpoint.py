"""state_dict / load_state_dict: exact resume, precision conversion, refusing mismatches."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from adambridge import AdamBridge
from adambridge import state as host_state


def _model(dtype=torch.bfloat16):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 3)).to(dtype)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 9, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resume_continues_bit_for_bit(precision, dtype, backend):
    kwargs = dict(lr=1e-3, precision=precision, backend=backend, seed=11)
    straight = _model(dtype)
    opt = AdamBridge(straight.parameters(), **kwargs)
    _train(straight, opt, 6, seed=1)
    saved_model = _roundtrip(straight.state_dict())
    saved_opt = _roundtrip(opt.state_dict())
    _train(straight, opt, 6, seed=2)

    resumed = _model(dtype)
    resumed.load_state_dict(saved_model)
    opt2 = AdamBridge(resumed.parameters(), **dict(kwargs, seed=0))  # seed comes from the file
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, 6, seed=2)

    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


@pytest.mark.parametrize("source,target", [("fp32", "bf16"), ("fp32", "fp8"), ("bf16", "fp32"),
                                           ("fp8", "bf16")])
def test_loading_another_precision_converts_the_moments(source, target):
    model = _model()
    opt = AdamBridge(model.parameters(), precision=source, backend="torch")
    _train(model, opt, 3, seed=1)
    other = AdamBridge(model.parameters(), precision=target, backend="torch")
    other.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert host_state.precision_of(other.state[p]) == target
        m_src, v_src = host_state.decode_moments(opt.state[p])
        m_dst, v_dst = host_state.decode_moments(other.state[p])
        rel = {"fp32": 1e-7, "bf16": 2 ** -8, "fp8": 2 ** -2}[target if target != "fp32" else source]
        assert ((m_dst - m_src).abs() <= rel * m_src.abs().amax() + 1e-30).all()
        assert ((v_dst - v_src).abs() <= 2 * rel * v_src.abs().amax() + 1e-30).all()
        assert torch.equal(other.state[p]["master"], opt.state[p]["master"])
    _train(model, other, 2, seed=3)  # and it keeps training


def test_a_torch_adamw_checkpoint_loads():
    model = _model(torch.float32)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, ref, 3, seed=1)
    opt = AdamBridge(model.parameters(), lr=1e-3, backend="torch")
    opt.load_state_dict(ref.state_dict())
    p = next(model.parameters())
    assert torch.equal(opt.state[p]["exp_avg"], ref.state[p]["exp_avg"].reshape(-1))
    assert opt.state[p]["step"].item() == 3


def _snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}, \
        copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


MISMATCHES = [
    dict(desc="another number of groups", mutate=lambda sd: sd["param_groups"].append(
        dict(sd["param_groups"][0], params=[])), match=r"1 parameter groups|parameter groups"),
    dict(desc="another number of parameters", mutate=lambda sd: sd["param_groups"][0][
        "params"].pop(), match=r"parameter group 0 has 3 parameters"),
    dict(desc="a moment of another size", mutate=lambda sd: sd["state"][0].update(
        exp_avg=torch.zeros(5)), match=r"'exp_avg' of parameter 0 has 5 elements"),
    dict(desc="missing exp_avg_sq", mutate=lambda sd: sd["state"][1].pop("exp_avg_sq"),
         match=r"parameter 1 lacks 'exp_avg_sq'"),
]


@pytest.mark.parametrize("case", MISMATCHES, ids=lambda c: c["desc"])
def test_mismatched_checkpoint_is_refused_and_leaves_the_optimizer_as_it_was(case):
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, backend="torch")
    _train(model, opt, 2, seed=1)
    saved = copy.deepcopy(opt.state_dict())
    case["mutate"](saved)
    before_state, before_groups = _snapshot(opt)
    with pytest.raises(ValueError, match=case["match"]):
        opt.load_state_dict(saved)
    after_state, after_groups = _snapshot(opt)
    assert before_groups == after_groups
    assert before_state.keys() == after_state.keys()
    for pid, entry in before_state.items():
        for key, value in entry.items():
            assert torch.equal(value, after_state[pid][key])
