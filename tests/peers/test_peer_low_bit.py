"""What torchao's low-bit optimizer tests (test/prototype/test_low_bit_optim.py) check, for
AdamBridge: param groups with their own lr, a tensor lr, a state_dict saved with torch.save
and loaded into a fresh optimizer that must then train as the original does, and checkpoints
that cross between torch.optim.AdamW and AdamBridge, by torch.save and by DCP.

torchao's smoke test compares the resumed optimizer with the original at default float
tolerance; the promise here is stronger (a resume is bit for bit), so it is held to that.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd

from adambridge import AdamBridge
from adambridge.checkpoint import to_torch_adamw
from adambridge.dcp import LoadPlanner

from ._twins import (MODES, PRECISIONS, adamw_twin, assert_elements_close, assert_identical,
                     assert_matches_adamw, backward_with, bridge, fixed_grads, own_copy,
                     state_tensors, step_reference)

HYPER = dict(betas=(0.9, 0.99), eps=1e-8)


def _groups(params: list, lrs=(1e-4, 1e-5), wds=(0.0, 0.1)) -> list:
    """torchao's two groups (each layer its own lr), with a weight decay of their own too."""
    half = len(params) // 2
    return [dict(params=params[:half], lr=lrs[0], weight_decay=wds[0]),
            dict(params=params[half:], lr=lrs[1], weight_decay=wds[1])]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))


SHAPES = [(256, 32), (256,), (32, 256), (32,)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_low_bit_param_groups_with_own_lr_and_weight_decay(precision, mode):
    """Each group's lr and weight decay reach its parameters: fp32 moments equal AdamW over
    six steps; bf16/fp8 moments equal it on the first step (the exact moments)."""
    steps = 6 if precision == "fp32" else 1
    inits = [p.detach() for p in _model().parameters()]
    # Large enough lrs that a group's lr or decay applied to the other would show.
    lrs, wds = (3e-2, 1e-3), (0.0, 0.5)
    ref = [own_copy(v) for v in inits]
    ref_opt = torch.optim.AdamW(_groups(ref, lrs, wds), **HYPER)
    params = [own_copy(v) for v in inits]
    opt = bridge(_groups(params, lrs, wds), mode, precision=precision, **HYPER)
    for step_grads in fixed_grads(SHAPES, steps):
        step_reference(ref, ref_opt, step_grads, torch.float32)
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()
    assert_matches_adamw(opt, params, ref, ref_opt, moments=precision == "fp32",
                         what=f"{precision} {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_low_bit_tensor_lr_written_in_place_between_steps(mode):
    """A 0-d tensor lr (what capturable schedules hold), changed in place each step, is read
    at every step as torch reads it."""
    inits = [torch.randn(s) for s in ((7,), (1025,), (64, 3))]
    ref_lr, lr = torch.tensor(1e-2), torch.tensor(1e-2)
    ref, ref_opt = adamw_twin(inits, lr=ref_lr, weight_decay=0.05)
    params = [own_copy(v) for v in inits]
    opt = bridge(params, mode, lr=lr, weight_decay=0.05)
    assert lr.data_ptr() != ref_lr.data_ptr()
    for step, step_grads in enumerate(fixed_grads([v.shape for v in inits], 5)):
        for t in (ref_lr, lr):
            t.fill_(1e-2 / (step + 1))
        step_reference(ref, ref_opt, step_grads, torch.float32)
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()
    assert_matches_adamw(opt, params, ref, ref_opt, what=f"tensor lr {mode}")


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 32, generator=gen).to(dtype)
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()


def _through_torch_save(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_low_bit_saved_state_resumes_in_a_fresh_optimizer(precision, dtype, mode):
    """torchao's smoke test: one step, torch.save of state_dict, loaded into a fresh
    optimizer over a deep copy of the model; two more steps each, and the copy equals the
    original bit for bit (parameters and every state tensor)."""
    model = _model().to(dtype)
    opt = bridge(model.parameters(), mode, model=model, precision=precision, lr=1e-3)
    _train(model, opt, 1, seed=1)
    state = _through_torch_save(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = bridge(model2.parameters(), mode, model=model2, precision=precision, lr=1e-3)
    opt2.load_state_dict(state)
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    params, params2 = list(model.parameters()), list(model2.parameters())
    assert_identical([p.detach() for p in params2] + state_tensors(opt2, params2),
                     [p.detach() for p in params] + state_tensors(opt, params),
                     what=f"{precision} {dtype} {mode}")


def _fixed_train(params, opt, grads) -> None:
    for step_grads in grads:
        backward_with(params, step_grads)
        opt.step()
        opt.zero_grad()


def _save(opt, model, way: str, path) -> None:
    if way == "torch.save":
        torch.save(opt.state_dict(), path / "optim.pt")
    else:
        dcp.save({"optim": dsd.get_optimizer_state_dict(model, opt)}, checkpoint_id=str(path))


def _load(opt, model, way: str, path, fp8_into_adamw: bool = False) -> None:
    """``fp8_into_adamw``: the documented conversion of fp8 moments' codes for AdamW
    (docs/checkpoints.md, "torch.optim.AdamW and fp8 moments")."""
    if way == "torch.save":
        loaded = torch.load(path / "optim.pt", weights_only=True)
        opt.load_state_dict(to_torch_adamw(loaded) if fp8_into_adamw else loaded)
        return
    target = {"optim": dsd.get_optimizer_state_dict(model, opt)}
    # AdamW's checkpoint lacks AdamBridge's own keys: adambridge's planner lets exactly those
    # be absent (DCP's default one refuses them) and decodes fp8 codes into AdamW's moments.
    planner = LoadPlanner() if isinstance(opt, AdamBridge) or fp8_into_adamw else None
    dcp.load(target, checkpoint_id=str(path), planner=planner)
    dsd.set_optimizer_state_dict(model, opt, target["optim"])


WAYS = ("torch.save", "dcp")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", WAYS)
def test_low_bit_adamw_checkpoint_continues_in_adambridge_as_in_adamw(way, mode, tmp_path):
    """Three AdamW steps, saved; loaded into AdamBridge (fp32 moments) over a model holding
    the same weights, three more steps: equal to AdamW's uninterrupted six."""
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    grads = fixed_grads(SHAPES, 6)
    _fixed_train(ref_params, ref_opt, grads[:3])
    _save(ref_opt, ref, way, tmp_path)
    with torch.no_grad():
        for p, r in zip(params, ref_params):
            p.copy_(r)
    opt = bridge(params, mode, model=model, lr=1e-3, weight_decay=0.01)
    _load(opt, model, way, tmp_path)
    _fixed_train(ref_params, ref_opt, grads[3:])
    _fixed_train(params, opt, grads[3:])
    assert_matches_adamw(opt, params, ref_params, ref_opt, what=f"AdamW -> ours by {way}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", WAYS)
def test_low_bit_adambridge_checkpoint_continues_in_adamw(way, mode, tmp_path):
    """Three AdamBridge steps (fp32 moments, either mode), saved; loaded into AdamW, three
    more steps: equal to AdamW's uninterrupted six within the fp32 contract."""
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    grads = fixed_grads(SHAPES, 6)
    opt = bridge(params, mode, model=model, lr=1e-3, weight_decay=0.01)
    _fixed_train(params, opt, grads[:3])
    _save(opt, model, way, tmp_path)
    resumed = copy.deepcopy(model)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3, weight_decay=0.01)
    _load(resumed_opt, resumed, way, tmp_path)
    _fixed_train(ref_params, ref_opt, grads)
    resumed_params = list(resumed.parameters())
    _fixed_train(resumed_params, resumed_opt, grads[3:])
    for i, (p, r) in enumerate(zip(resumed_params, ref_params)):
        assert_elements_close(p, r, rtol=1e-6, atol=1e-7, what=f"param[{i}]")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_elements_close(resumed_opt.state[p][key], ref_opt.state[r][key],
                                  rtol=1e-6, atol=1e-7, what=f"{key}[{i}]")


def _decoded(state: dict, precision: str) -> tuple:
    """docs/numerics.md section 3, read back: bf16 widens exactly; fp8 is code * block scale
    for m, and (code * block scale) squared for v, each product one fp32 rounding."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if precision == "bf16":
        return m.float(), v.float()
    blocks = lambda scale: scale.repeat_interleave(128)[:m.numel()]  # noqa: E731
    sv = v.float() * blocks(state["exp_avg_sq_scale"])
    return m.float() * blocks(state["exp_avg_scale"]), sv * sv


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_bit_checkpoint_gives_adamw_the_decoded_moments(precision, way, tmp_path):
    """A bf16/fp8-moment checkpoint loaded into AdamW hands it exactly the moments AdamBridge
    updates from (the codec's decoding), and AdamW's step counts on."""
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision)
    _fixed_train(list(model.parameters()), opt, fixed_grads(SHAPES, 3))
    _save(opt, model, way, tmp_path)
    other = copy.deepcopy(model)
    adamw = torch.optim.AdamW(other.parameters(), lr=1e-3)
    _load(adamw, other, way, tmp_path, fp8_into_adamw=precision == "fp8")
    for i, (p, q) in enumerate(zip(model.parameters(), other.parameters())):
        m, v = _decoded(opt.state[p], precision)
        assert_identical([adamw.state[q]["exp_avg"].reshape(-1), adamw.state[q]["exp_avg_sq"]
                          .reshape(-1)], [m, v], what=f"{precision} moments[{i}]")
        assert int(adamw.state[q]["step"]) == 3


@pytest.mark.parametrize("precision", PRECISIONS)
def test_low_bit_gradient_accumulation_in_async_mode(precision):
    """torchao's CPU-offload test with grad_accum=2: two backwards per step, the hooks update
    only at the second; equal to AdamW on the summed gradients (fp32 moments, four steps) or
    on the first step (bf16/fp8), and to sync mode on the same loop bit for bit."""
    steps = 4 if precision == "fp32" else 1
    inits = [p.detach() for p in _model().parameters()]
    micro = fixed_grads(SHAPES, 2 * steps, seed=4)
    ref, ref_opt = adamw_twin(inits, lr=1e-3, weight_decay=0.01)
    runs = {}
    for mode in ("sync", "async"):
        params = [own_copy(v) for v in inits]
        opt = bridge(params, "sync", precision=precision, lr=1e-3, weight_decay=0.01,
                     small_param_threshold=0)
        if mode == "async":
            opt.attach_hooks(accumulation_steps=2)
        for step in range(steps):
            for grads in micro[2 * step:2 * step + 2]:
                backward_with(params, grads)
            opt.step()
            opt.zero_grad()
        runs[mode] = (params, opt)
    for step in range(steps):
        summed = [a + b for a, b in zip(*micro[2 * step:2 * step + 2])]
        step_reference(ref, ref_opt, summed, torch.float32)
    params, opt = runs["async"]
    assert_matches_adamw(opt, params, ref, ref_opt, moments=precision == "fp32",
                         what=f"{precision} accumulated")
    sync_params, sync_opt = runs["sync"]
    assert_identical([p.detach() for p in params] + state_tensors(opt, params),
                     [p.detach() for p in sync_params] + state_tensors(sync_opt, sync_params),
                     what=f"{precision} async vs sync")
