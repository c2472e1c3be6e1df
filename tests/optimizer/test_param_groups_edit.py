"""Parameters put into, taken out of or replaced in ``param_groups[i]["params"]`` directly.

torch.optim steps whatever the groups hold, and frameworks rely on it: DeepSpeed's
ZeRO-offload builds its CPU optimizer over the model and then hands it its fp32 partitions
this way. AdamBridge's synchronous step does the same (each new parameter checked as
add_param_group checks it), compared here with torch.optim.AdamW driven the same way; with
hooks attached a change is refused in one line before anything is updated.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge

RTOL, ATOL = 1e-6, 1e-7  # the arithmetic invariant against torch AdamW
LR, WD = 1e-2, 1e-2


def _params(count: int = 2) -> list:
    gen = torch.Generator().manual_seed(1)
    sizes = [300, 17, 1, 129][:count] if count <= 4 else [5 + i for i in range(count)]
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(params: list, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:  # every tensor has a gradient, listed in a group or not
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _drive(make_opt, params: list, edits: dict, steps: int = 6):
    """``edits[step](opt, params)`` changes the groups before that step."""
    opt = make_opt([params[0]])
    for step in range(steps):
        if step in edits:
            edits[step](opt, params)
        _grads(params, step)
        opt.step()
    return opt


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def _ours(backend):
    return lambda params: AdamBridge(params, lr=LR, weight_decay=WD, backend=backend)


def _copies(params: list) -> list:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _append(i):
    return lambda opt, params: opt.param_groups[0]["params"].append(params[i])


def _remove(i):
    return lambda opt, params: opt.param_groups[0]["params"].remove(params[i])


def _replace(*indices):
    def edit(opt, params):
        opt.param_groups[0]["params"] = [params[i] for i in indices]
    return edit


EDITS = [
    dict(desc="one appended, then another", edits={2: _append(1), 4: _append(2)}, count=3),
    dict(desc="appended, then the first taken out", edits={1: _append(1), 3: _remove(0)}),
    dict(desc="the list replaced wholesale (DeepSpeed's partitions)",
         edits={2: _replace(1, 2, 3)}, count=4),
    dict(desc="70 small parameters appended (the plan's native facts)",
         edits={2: lambda opt, params: opt.param_groups[0]["params"].extend(params[1:])},
         count=70),
]


def _assert_like_adamw(ours: list, theirs: list, opt, adamw) -> None:
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"param {i}")
        assert (p in opt.state) == (q in adamw.state), i
        if q in adamw.state:
            assert opt.state[p]["step"].item() == adamw.state[q]["step"].item(), i


@pytest.mark.parametrize("case", EDITS, ids=[c["desc"] for c in EDITS])
def test_param_groups_edited_directly_step_as_torch_adamw(case, backend):
    params = _params(case.get("count", 2))
    theirs = _copies(params)
    opt = _drive(_ours(backend), params, case["edits"])
    adamw = _drive(_adamw, theirs, case["edits"])
    _assert_like_adamw(params, theirs, opt, adamw)


def test_param_groups_edited_directly_are_what_state_dict_saves_and_resumes():
    params = _params(3)
    opt = _drive(_ours("auto"), params, {1: _append(1), 2: _append(2), 3: _remove(0)}, steps=4)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["params"] == [0, 1]  # positions in the groups as they are
    assert set(saved["state"]) == {0, 1}  # the parameter taken out is no longer saved
    resumed = _copies(params)
    opt2 = AdamBridge(resumed[1:], lr=LR, weight_decay=WD)
    opt2.load_state_dict(saved)
    for step in range(4, 6):
        _grads(params, step)
        _grads(resumed, step)
        opt.step()
        opt2.step()
    for p, q in zip(params[1:], resumed[1:]):
        assert torch.equal(p, q)
        assert all(torch.equal(v, opt2.state[q][k]) for k, v in opt.state[p].items())


@pytest.mark.parametrize("bad", [
    dict(desc="a float64 tensor", make=lambda: nn.Parameter(torch.zeros(4, dtype=torch.float64)),
         error=ValueError, match=r"^Invalid parameter 1: dtype torch.float64 is not supported"),
    dict(desc="not a tensor", make=lambda: 3.0, error=TypeError,
         match=r"^Invalid param_groups entry 1: float \(expected a parameter tensor\)$"),
])
def test_param_groups_given_an_invalid_parameter_refuse_it_in_one_line(bad):
    params = _params(1)
    opt = AdamBridge(params, lr=LR)
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["params"].append(bad["make"]())
    before = params[0].detach().clone()
    _grads(params, 1)
    with pytest.raises(bad["error"], match=bad["match"]) as info:
        opt.step()
    assert "\n" not in str(info.value) and "tensor(" not in str(info.value)
    assert torch.equal(before, params[0])


def test_param_groups_listing_a_tensor_twice_save_as_torch_and_refuse_a_step():
    params = _params(2)
    opt, ref = AdamBridge(params, lr=LR), _adamw(params)
    for o in (opt, ref):
        o.param_groups[0]["params"].append(params[0])
    # Each tensor keeps one id everywhere (torch gives a repeat within a group the id of its
    # last listing, [2, 1, 2]: the same mapping); the state loads into torch's AdamW.
    saved = opt.state_dict()
    assert saved["param_groups"][0]["params"] == [0, 1, 0]
    assert ref.state_dict()["param_groups"][0]["params"] == [2, 1, 2]
    ref.load_state_dict(saved)
    _grads(params, 0)
    with pytest.raises(ValueError, match=r"^param_groups list parameter 0 \(shape \(300,\)\) "
                                         r"more than once, so torch.optim would update it once "
                                         r"per listing each step; list each tensor once"):
        opt.step()


@pytest.mark.parametrize("case", [
    dict(desc="put in", start=1, edit=_append(1), match=r"parameter 1 \(shape \(17,\)\) was put"),
    dict(desc="taken out", start=2, edit=_remove(0),
         match=r"parameter 0 \(shape \(300,\)\) was taken out"),
], ids=lambda case: case["desc"])
def test_param_groups_edited_with_hooks_attached_are_refused_before_any_update(case):
    params = _params(2)
    model = nn.ParameterList(params)
    opt = AdamBridge(params[:case["start"]], lr=LR, small_param_threshold=0)
    opt.attach_hooks(model)
    sum(p.sum() for p in params).backward()  # through the hooks
    opt.step()
    case["edit"](opt, params)
    before = [p.detach().clone() for p in params]
    sum(p.sum() for p in params).backward()
    with pytest.raises(RuntimeError, match=r"param_groups changed after attach_hooks\(\): "
                                           + case["match"] + r".*call opt.detach_hooks\(\), "
                                           r"then opt.attach_hooks\(model\)") as info:
        opt.step()
    assert "tensor(" not in str(info.value) and "\n" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    opt.detach_hooks()
    for p in params:
        p.grad = None
    opt.attach_hooks(model)  # the fix the error names: the hooks follow the new groups
    sum(p.sum() for p in params).backward()
    opt.step()
    group = opt.param_groups[0]["params"]
    stepped = [i for i, p in enumerate(params) if any(p is q for q in group)]
    assert stepped and all(not torch.equal(before[i], params[i]) for i in stepped)
    opt.detach_hooks()


# -- the same tensors listed again, or reordered (the async issue's items 7 and 8)


def _trained(hooks: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = AdamBridge(model.parameters(), lr=LR, small_param_threshold=0)
    if hooks:
        opt.attach_hooks(model)
    for _ in range(2):
        model(torch.randn(3, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("hooks", [False, True], ids=["sync", "hooks"])
def test_state_dict_of_groups_extended_with_themselves_is_torchs(hooks):
    # torch's test_state_dict_deterministic: every tensor keeps the id of its first listing.
    model, opt = _trained(hooks)
    saved = opt.state_dict()
    opt.param_groups.extend(opt.param_groups)
    twice = opt.state_dict()
    assert twice["param_groups"][-1]["params"] == saved["param_groups"][-1]["params"]
    assert len(twice["param_groups"]) == 2 and twice["state"].keys() == saved["state"].keys()
    ref = torch.optim.AdamW(model.parameters(), lr=LR)
    ref.param_groups.extend(ref.param_groups)
    assert twice["param_groups"][1]["params"] == ref.state_dict()["param_groups"][1]["params"]


@pytest.mark.parametrize("hooks", [False, True], ids=["sync", "hooks"])
def test_step_over_groups_listing_a_tensor_twice_is_refused_with_nothing_changed(hooks):
    model, opt = _trained(hooks)
    opt.param_groups.extend(opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 6)).square().sum().backward()
    with pytest.raises(ValueError, match=r"^param_groups list parameter 0 \(shape \(5, 6\)\) more "
                                         r"than once.*list each tensor once"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if hooks:
        opt.detach_hooks()


@pytest.mark.parametrize("edit", ["reverse", "extend"])
def test_groups_edited_without_adding_or_removing_under_hooks_say_what_changed(edit):
    # A bare StopIteration came out of step() and state_dict() before.
    model, opt = _trained(hooks=True)
    if edit == "reverse":
        opt.param_groups[0]["params"].reverse()
        match = r"param_groups changed after attach_hooks\(\): param_groups were reordered"
        model(torch.randn(3, 6)).square().sum().backward()
        with pytest.raises(RuntimeError, match=match):
            opt.step()
        with pytest.raises(RuntimeError, match=match):
            opt.state_dict()
    else:
        opt.param_groups[0]["params"].extend(list(opt.param_groups[0]["params"]))
        opt.state_dict()  # as torch's
        model(torch.randn(3, 6)).square().sum().backward()
        with pytest.raises(ValueError, match=r"more than once"):
            opt.step()
    opt.detach_hooks()
