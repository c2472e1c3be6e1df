"""state_dict / load_state_dict: exact resume, precision conversion, refusing mismatches."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from adambridge import AdamBridge
from adambridge.checkpoint import to_torch_adamw
from adambridge.update import state as host_state
from adambridge.update.state import NUMERICS_VERSION


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


@pytest.mark.parametrize("order", ["model first", "optimizer first"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_resume_continues_bit_for_bit(precision, dtype, order, backend):
    kwargs = dict(lr=1e-3, precision=precision, backend=backend, seed=11)
    straight = _model(dtype)
    opt = AdamBridge(straight.parameters(), **kwargs)
    _train(straight, opt, 6, seed=1)
    saved_model = _roundtrip(straight.state_dict())
    saved_opt = _roundtrip(opt.state_dict())
    _train(straight, opt, 6, seed=2)

    resumed = _model(dtype)
    opt2 = AdamBridge(resumed.parameters(), **dict(kwargs, seed=0))  # seed comes from the file
    if order == "model first":
        resumed.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
    else:  # the parameters then hold the rounding of the loaded masters: masters are kept
        opt2.load_state_dict(saved_opt)
        resumed.load_state_dict(saved_model)
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


# --------------------------------------------------------------------------- both ways

SHAPES = [(17,), (9, 13), (130,)]


def _fixed_grads(steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


def _run(params, opt, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def _fp32_params(values):
    return [torch.nn.Parameter(v.detach().clone()) for v in values]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_our_checkpoint_steps_in_torch_adamw_as_ours_in_fp32(precision, backend):
    params = _fp32_params([torch.randn(s) for s in SHAPES])
    opt = AdamBridge(params, lr=1e-2, precision=precision, backend=backend)
    _run(params, opt, _fixed_grads(4, seed=1))
    saved = _roundtrip(opt.state_dict())

    ref_params, ours_params = _fp32_params(params), _fp32_params(params)
    ref = torch.optim.AdamW(ref_params, lr=0.5)  # lr and the rest come from the checkpoint
    ref.load_state_dict(to_torch_adamw(_roundtrip(saved)))  # decodes fp8, a no-op else
    ours = AdamBridge(ours_params, lr=0.5, precision="fp32", backend=backend)
    ours.load_state_dict(saved)
    for p in ref_params:  # what torch expects: moments in the parameter's shape and dtype
        assert ref.state[p]["exp_avg"].shape == p.shape
        assert ref.state[p]["exp_avg_sq"].dtype == p.dtype
    grads = _fixed_grads(5, seed=2)
    _run(ref_params, ref, grads)
    _run(ours_params, ours, grads)
    for r, o in zip(ref_params, ours_params):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[o][key], ref.state[r][key].reshape(-1),
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_our_checkpoint_saved_again_by_torch_loads_from_torchs_form(precision):
    params = _fp32_params([torch.randn(s) for s in SHAPES])
    opt = AdamBridge(params, lr=1e-2, precision=precision, backend="torch")
    _run(params, opt, _fixed_grads(3, seed=1))
    ref_params = _fp32_params(params)
    ref = torch.optim.AdamW(ref_params)
    ref.load_state_dict(to_torch_adamw(_roundtrip(opt.state_dict())))  # casts every float tensor
    again = AdamBridge(_fp32_params(params), precision=precision, backend="torch")
    again.load_state_dict(_roundtrip(ref.state_dict()))
    for p, q in zip(params, again.param_groups[0]["params"]):
        m, v = host_state.decode_moments(opt.state[p])
        m2, v2 = host_state.decode_moments(again.state[q])
        rel = {"bf16": 2 ** -7, "fp8": 2 ** -2}[precision]
        assert ((m2 - m).abs() <= rel * m.abs().amax()).all()
        assert ((v2 - v).abs() <= 2 * rel * v.abs().amax()).all()
    _run(ref_params, ref, _fixed_grads(2, seed=2))  # now torch's moments are newer
    after = AdamBridge(_fp32_params(ref_params), precision="fp32", backend="torch")
    after.load_state_dict(_roundtrip(ref.state_dict()))
    for p, q in zip(ref_params, after.param_groups[0]["params"]):
        assert torch.equal(after.state[q]["exp_avg"], ref.state[p]["exp_avg"].reshape(-1))
        assert torch.equal(after.state[q]["master"], p.detach().reshape(-1))
        assert after.state[q]["step"].item() == 5


# --------------------------------------------------------------------------- checked values


def _group0(key, value):
    return lambda sd: sd["param_groups"][0].__setitem__(key, value)


def _step0(value):
    return lambda sd: sd["state"][0].__setitem__("step", value)


VALUE_ERRORS = [
    dict(desc="step -1", mutate=_step0(torch.tensor(-1.0)), match=r"'step' of parameter 0: tensor\(-1\.\)"),
    dict(desc="step NaN", mutate=_step0(torch.tensor(float("nan"))), match=r"'step' of parameter 0: tensor\(nan\)"),
    dict(desc="step 1e30", mutate=_step0(1e30), match=r"'step' of parameter 0: 1e\+30"),
    dict(desc="step 1.5", mutate=_step0(1.5), match=r"'step' of parameter 0: 1\.5"),
    dict(desc="lr -1", mutate=_group0("lr", -1.0), match=r"param_groups\[0\]: Invalid learning rate: -1\.0"),
    dict(desc="lr inf", mutate=_group0("lr", float("inf")), match=r"Invalid learning rate: inf"),
    dict(desc="eps -1", mutate=_group0("eps", -1.0), match=r"Invalid epsilon value: -1\.0"),
    dict(desc="beta 1.0", mutate=_group0("betas", (1.0, 0.9)), match=r"beta parameter at index 0: 1\.0"),
    dict(desc="seed -1", mutate=_group0("seed", -1), match=r"Invalid checkpoint seed param_groups\[0\]\['seed'\]: -1 \(expected"),
    dict(desc="precision fp4", mutate=_group0("precision", "fp4"), match=r"Invalid checkpoint precision param_groups\[0\]\['precision'\]: 'fp4'"),
    dict(desc="a later numerics version", mutate=_group0("numerics", NUMERICS_VERSION + 1),
         match=rf"'numerics'\] is {NUMERICS_VERSION + 1}, this adambridge computes numerics {NUMERICS_VERSION}"),
    dict(desc="an int32 master", mutate=lambda sd: sd["state"][0].update(
        master=sd["state"][0]["master"].int()), match=r"'master' of parameter 0: dtype torch.int32"),
    dict(desc="an int moment", mutate=lambda sd: sd["state"][1].update(
        ab_exp_avg=sd["state"][1]["ab_exp_avg"].int()),
         match=r"'ab_exp_avg' of parameter 1: dtype torch.int32"),
    dict(desc="an int torch moment beside ours", mutate=lambda sd: sd["state"][1].update(
        exp_avg=torch.zeros(300, dtype=torch.int32), exp_avg_sq=torch.zeros(300)),
         match=r"'exp_avg' of parameter 1: dtype torch.int32"),
    dict(desc="missing betas", mutate=lambda sd: sd["param_groups"][0].pop("betas"),
         match=r"param_groups\[0\] lacks 'betas'"),
    dict(desc="missing state", mutate=lambda sd: sd.pop("state"), match=r"Checkpoint lacks 'state'"),
    dict(desc="missing step", mutate=lambda sd: sd["state"][0].pop("step"),
         match=r"parameter 0 lacks 'step'"),
    dict(desc="fp8 without scales", mutate=lambda sd: sd["state"][2].pop("ab_exp_avg_scale"),
         match=r"fp8 moments without 'ab_exp_avg_scale'"),
    dict(desc="amsgrad on", mutate=_group0("amsgrad", True), match=r"amsgrad=True"),
]


@pytest.mark.parametrize("case", VALUE_ERRORS, ids=lambda c: c["desc"])
def test_loaded_values_are_checked_before_anything_changes(case):
    model = _model(torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="fp8", backend="torch", seed=4)
    _train(model, opt, 2, seed=1)
    saved = copy.deepcopy(opt.state_dict())
    case["mutate"](saved)
    kept = copy.deepcopy(opt)
    with pytest.raises(ValueError, match=case["match"]) as info:
        opt.load_state_dict(saved)
    assert "\n" not in str(info.value)
    assert opt.seed == kept.seed == 4
    before_state, before_groups = _snapshot(kept)
    after_state, after_groups = _snapshot(opt)
    assert before_groups == after_groups
    assert len(before_state) == len(after_state)
    for a, b in zip(before_state.values(), after_state.values()):  # in parameter order
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _train(model, opt, 1, seed=2)  # and it still steps


# --------------------------------------------------------------------------- DCP


@pytest.fixture
def dcp_api():
    dcp = pytest.importorskip("torch.distributed.checkpoint",
                              reason="torch.distributed is not built into this torch")
    from torch.distributed.checkpoint import state_dict as dsd
    with warnings.catch_warnings():
        # Single process, no process group: DCP saves and loads locally, and says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield dcp, dsd


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dcp_resume_keeps_seed_and_precision_bit_for_bit(precision, dcp_api, tmp_path, backend):
    dcp, dsd = dcp_api
    kwargs = dict(lr=1e-3, precision=precision, backend=backend)
    straight = _model()
    opt = AdamBridge(straight.parameters(), seed=7, **kwargs)
    _train(straight, opt, 3, seed=1)
    dcp.save({"model": straight.state_dict(), "optim": dsd.get_optimizer_state_dict(straight, opt)},
             checkpoint_id=str(tmp_path))
    _train(straight, opt, 3, seed=2)

    resumed = _model()
    opt3 = AdamBridge(resumed.parameters(), seed=0, **kwargs)  # the seed comes from the file
    target = {"model": resumed.state_dict(), "optim": dsd.get_optimizer_state_dict(resumed, opt3)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(target["model"])
    dsd.set_optimizer_state_dict(resumed, opt3, target["optim"])
    assert opt3.seed == 7 and opt3.precision == precision
    _train(resumed, opt3, 3, seed=2)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt3.state[q][key]), key


def test_dcp_state_of_a_fresh_optimizer_does_not_revert_weights_loaded_after(dcp_api):
    _, dsd = dcp_api
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, backend="torch")
    dsd.get_optimizer_state_dict(model, opt)  # a zero-lr step: masters of the random weights
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
    _train(model, opt, 1, seed=1)
    for p in model.parameters():  # one lr=1e-3 step from 0.5, not from the random weights
        assert (p.float() - 0.5).abs().max() < 2e-2


def test_torch_cast_of_ab_step_to_fp16_is_not_an_error():
    p = torch.nn.Parameter(torch.randn(130).half())
    opt = AdamBridge([p], precision="fp8", backend="torch")
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    torch_form = to_torch_adamw(copy.deepcopy(saved))["state"][0]  # as AdamW would hold it
    saved["state"][0].update(exp_avg=torch_form["exp_avg"], exp_avg_sq=torch_form["exp_avg_sq"])
    saved["state"][0]["step"] = torch.tensor(70000.0)
    saved["state"][0]["ab_step"] = torch.tensor(70000).half()  # inf, as torch's load casts it
    saved["state"][0]["ab_exp_avg"] = torch.zeros_like(saved["state"][0]["ab_exp_avg"])
    opt.load_state_dict(saved)  # our entries are then not trusted: torch's form is used
    assert opt.state[p]["step"].item() == 70000
    m, _ = host_state.decode_moments(opt.state[p])
    torch_m = saved["state"][0]["exp_avg"].float()
    assert torch_m.abs().min() > 0 and ((m - torch_m).abs() <= 0.25 * torch_m.abs()).all()
