"""load_state_dict of damaged or converted entries: the master and our stored moments.

A master that is float64 is taken where float32 holds it exactly (a checkpoint converted to
double) and refused where it does not; one holding inf or NaN is refused; an entry with one
of our stored moments but not the other is refused naming the key. Each refusal is one line
and leaves the optimizer as it was.
"""
from __future__ import annotations

import io

import pytest
import torch

from adambridge import AdamBridge


def _model(dtype=torch.bfloat16):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 3)).to(dtype)


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 9, generator=gen).to(dtype)).float().pow(2).mean().backward()
        opt.step()


def _saved(model, opt) -> dict:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _snapshot(opt) -> list:
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def _unchanged(before: list, opt) -> None:
    after = _snapshot(opt)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(precision: str, dtype=torch.bfloat16) -> tuple:
    model = _model(dtype)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision, seed=3)
    _train(model, opt, 3, seed=1)
    return model, opt


def _refused(saved: dict, precision: str, match: str) -> None:
    model, opt = _run(precision)
    _train(model, opt, 1, seed=4)  # state of its own, which must survive the refusal
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match) as info:
        opt.load_state_dict(saved["optim"])
    assert "\n" not in str(info.value)
    _unchanged(before, opt)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_load_float64_master_that_float32_holds_exactly_resumes_bit_for_bit(precision):
    model, opt = _run(precision)
    saved = _saved(model, opt)
    _train(model, opt, 2, seed=2)
    for entry in saved["optim"]["state"].values():
        entry["master"] = entry["master"].double()  # a checkpoint converted to double
    resumed = _model()
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision=precision)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    _train(resumed, opt2, 2, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_load_float64_master_that_float32_does_not_hold_is_refused():
    model, opt = _run("bf16")
    saved = _saved(model, opt)
    saved["optim"]["state"][0]["master"] = saved["optim"]["state"][0]["master"].double() + 1e-12
    _refused(saved, "bf16", r"^Invalid checkpoint 'master' of parameter 0: float64 values "
                            r"that float32 does not hold exactly .*save it as float32$")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_load_master_holding_inf_or_nan_is_refused(bad):
    model, opt = _run("bf16")
    saved = _saved(model, opt)
    saved["optim"]["state"][2]["master"].view(-1)[[0, 7]] = bad
    _refused(saved, "bf16", r"^Invalid checkpoint 'master' of parameter 2: 2 of 900 elements "
                            r"are inf or NaN; resume from a checkpoint written before the run "
                            r"diverged$")


@pytest.mark.parametrize("missing", ["ab_exp_avg", "ab_exp_avg_sq"])
def test_load_fp8_entry_missing_a_stored_moment_names_it(missing):
    model, opt = _run("fp8")
    saved = _saved(model, opt)
    del saved["optim"]["state"][1][missing]
    _refused(saved, "fp8", rf"^Checkpoint state of parameter 1 lacks '{missing}' \(it has .*"
                           rf"which AdamBridge saves together\)$")


def test_load_fp8_entry_missing_a_scale_names_it():
    model, opt = _run("fp8")
    saved = _saved(model, opt)
    del saved["optim"]["state"][0]["ab_exp_avg_sq_scale"]
    _refused(saved, "fp8", r"^Checkpoint of parameter 0 has fp8 moments without "
                           r"'ab_exp_avg_sq_scale'$")


def _with(saved: dict, key: str, edit) -> dict:
    """``saved`` with parameter 0's ``key`` replaced by ``edit(a copy of it)``."""
    entry = dict(saved["optim"]["state"][0])
    entry[key] = edit(entry[key].clone())
    return {**saved, "optim": {**saved["optim"], "state": {**saved["optim"]["state"], 0: entry}}}


def _set(value: float):
    def edit(t):
        t.view(-1)[7] = value
        return t
    return edit


IMPOSSIBLE_VALUES = [
    {"desc": "NaN first moment", "precision": "fp32", "key": "exp_avg", "value": float("nan"),
     "match": r"'exp_avg' of parameter 0: holds nan \(expected finite values\)"},
    {"desc": "inf first moment", "precision": "bf16", "key": "exp_avg", "value": float("inf"),
     "match": r"'exp_avg' of parameter 0: holds inf"},
    {"desc": "negative second moment", "precision": "fp32", "key": "exp_avg_sq",
     "value": -1.0, "match": r"'exp_avg_sq' of parameter 0: holds -1.0 \(expected finite "
                             r"values >= 0\)"},
    {"desc": "NaN second moment", "precision": "bf16", "key": "exp_avg_sq",
     "value": float("nan"), "match": r"'exp_avg_sq' of parameter 0: holds nan"},
    {"desc": "NaN fp8 scale", "precision": "fp8", "key": "ab_exp_avg_scale",
     "value": float("nan"), "match": r"'ab_exp_avg_scale' of parameter 0: holds nan"},
    {"desc": "inf fp8 scale", "precision": "fp8", "key": "ab_exp_avg_sq_scale",
     "value": float("inf"), "match": r"'ab_exp_avg_sq_scale' of parameter 0: holds inf"},
    {"desc": "negative fp8 scale", "precision": "fp8", "key": "ab_exp_avg_scale",
     "value": -0.5, "match": r"'ab_exp_avg_scale' of parameter 0: holds -0.5 \(expected "
                             r"finite scales >= 0\)"},
]


@pytest.mark.parametrize("case", IMPOSSIBLE_VALUES, ids=lambda c: c["desc"])
def test_load_impossible_moment_value_is_refused_naming_it(case):
    model, opt = _run(case["precision"])
    saved = _with(_saved(model, opt), case["key"], _set(case["value"]))
    _refused(saved, case["precision"], case["match"])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_load_entry_of_another_shape_with_as_many_elements_is_refused(precision):
    model, opt = _run(precision)
    saved = _saved(model, opt)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        if key in saved["optim"]["state"][0]:  # (fp8 saves its moments flat, under ab_)
            saved = _with(saved, key, lambda t: t.reshape(t.shape[1], t.shape[0]))
    _refused(saved, precision, r"parameter 0 has shape \(9, 300\), the parameter has "
                               r"\(300, 9\)")


def test_load_fp8_entry_whose_step_is_not_its_ab_step_names_both():
    model, opt = _run("fp8")
    saved = _with(_saved(model, opt), "step", lambda t: t + 2)
    _refused(saved, "fp8", r"parameter 0 has 'step' 5 but 'ab_step' 3")
