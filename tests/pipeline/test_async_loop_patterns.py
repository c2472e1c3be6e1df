"""Loops that touch gradients between backward() and step(), async against sync, bit for bit.

Each pattern is written as its authors write it (torchtitan's clip, an MoE layer whose expert
gets no token, masking, noise, a manual unscale, a logged gradient norm, Lightning's
``grad_norm``, ``clip_grad_value_`` bound before ``attach_hooks``). Every one runs at two
tensor sizes (a layer under 64 KiB, which the default ``small_param_threshold`` leaves
without a hook, and one over 4 MiB, hooked and chunked), with ``release_grads`` on and off,
and with the hooked layers' updates made before the loop's code runs (the worker is let
finish what has landed), which is when a missed edit would show. The parameters, every
optimizer state tensor and every value the loop read must equal sync mode's with
``torch.equal``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_value_  # bound before any attach_hooks: item 6

from adambridge import AdamBridge

STEPS = 3
SIZES = {"small": 48, "large": 1100}  # 48x48 fp32 = 9 KiB; 1100x1100 fp32 = 4.6 MiB


class MoE(nn.Module):
    """Two experts; a step's tokens go to expert 0 only on odd steps (expert 1 idles)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.route_all_to_first = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.route_all_to_first:
            return self.experts[0](h)
        return self.experts[0](h[: len(h) // 2]).sum(0) + self.experts[1](h[len(h) // 2:]).sum(0)


def _model(width: int, moe: bool) -> nn.Module:
    torch.manual_seed(0)
    if moe:
        return MoE(width)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


@dataclass
class Loop:
    """What a loop does between backward and step; ``zero`` is its zero_grad(set_to_none=)."""

    desc: str
    between: Callable  # (model, params, step, log) -> None
    zero_to_none: bool = True
    moe: bool = False
    zero_through_model: bool = False  # model.zero_grad() rather than the optimizer's


def _titan_clip(model, params, step, log):
    # torchtitan/distributed/utils.py::clip_grad_norm_ (non-pipeline-parallel branch)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    torch.nn.utils.clip_grads_with_norm_(params, 1e-3, total, None)
    log.append(total)


def _moe_kept_zeros(model, params, step, log):
    model.route_all_to_first = step % 2 == 1  # the next step's routing


def _assign_masked(model, params, step, log):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        if p.grad is not None:
            p.grad = p.grad * (torch.rand(p.shape, generator=gen) > 0.5)


def _scale_in_place(model, params, step, log):
    for p in params:
        if p.grad is not None:
            p.grad.mul_(0.25)


def _project_flat(model, params, step, log):
    # PCGrad-style: every gradient flattened into one vector, projected off a direction it
    # opposes, copied back piece by piece; the flat norm and a finiteness check logged
    grads = [p for p in params if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in grads])
    direction = torch.randn(flat.shape, generator=torch.Generator().manual_seed(step))
    dot = torch.dot(flat, direction)
    if dot < 0:
        flat = flat - dot / direction.dot(direction) * direction
    offset = 0
    for p in grads:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    log.append((flat.norm(), bool(torch.isfinite(flat).all().item())))


def _noise(model, params, step, log):
    gen = torch.Generator().manual_seed(200 + step)
    for p in params:
        if p.grad is not None:
            p.grad.add_(torch.randn(p.grad.shape, generator=gen) * 1e-3)


def _mask_in_place(model, params, step, log):
    gen = torch.Generator().manual_seed(300 + step)
    for p in params:
        if p.grad is not None:
            p.grad.masked_fill_(torch.rand(p.shape, generator=gen) < 0.3, 0.0)


def _manual_unscale(model, params, step, log):
    for p in params:
        if p.grad is not None:
            p.grad.data.div_(8.0)  # old-style .data, as pre-GradScaler loops do


def _log_norms(model, params, step, log):
    log.append([p.grad.norm().item() if p.grad is not None else None for p in params])


def _lightning_grad_norm(model, params, step, log):
    from lightning.pytorch.utilities import grad_norm
    log.append(grad_norm(model, norm_type=2))


def _histogram(model, params, step, log):
    log.append([torch.histc(p.grad.float(), bins=16) for p in params if p.grad is not None])


def _clip_then_log(model, params, step, log):
    log.append(torch.nn.utils.clip_grad_norm_(params, 1e-3))  # routed: the host copies
    log.append([p.grad.norm() for p in params])  # the clipped values, also where p.grad keeps them


def _clip_value_bound_early(model, params, step, log):
    clip_grad_value_(params, 1e-4)


LOOPS = [
    Loop("torchtitan clip (get_total_norm + clip_grads_with_norm_)", _titan_clip),
    Loop("MoE expert without tokens, zero_grad(set_to_none=False)", _moe_kept_zeros,
         zero_to_none=False, moe=True),
    Loop("MoE expert without tokens, model.zero_grad(set_to_none=False)", _moe_kept_zeros,
         zero_to_none=False, moe=True, zero_through_model=True),
    Loop("gradient assigned after backward (p.grad = masked)", _assign_masked),
    Loop("gradient scaled in place (p.grad.mul_)", _scale_in_place),
    Loop("noise added in place", _noise),
    Loop("flattened, projected and copied back (PCGrad)", _project_flat),
    Loop("mask in place (masked_fill_)", _mask_in_place),
    Loop("manual unscale through p.grad.data", _manual_unscale),
    Loop("the loop logs each gradient's norm", _log_norms),
    Loop("Lightning's grad_norm utility", _lightning_grad_norm),
    Loop("gradient histograms", _histogram),
    Loop("clip_grad_norm_, then the loop logs each gradient's norm", _clip_then_log),
    Loop("clip_grad_value_ imported before attach_hooks", _clip_value_bound_early),
]


def _data(width: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, width, generator=gen) for _ in range(STEPS)]


def run_loop(loop: Loop, width: int, *, hooks: bool, release_grads: bool,
             settle_first: bool = True, **options) -> tuple:
    """(model, optimizer, values the loop read) after STEPS steps of ``loop``."""
    model = _model(width, loop.moe)
    params = list(model.parameters())
    opt = AdamBridge(params, lr=1e-3, weight_decay=0.1, release_grads=release_grads,
                     **options)
    if hooks:
        opt.attach_hooks(model)
    log: list = []
    for step, x in enumerate(_data(width)):
        model(x).square().mean().backward()
        if hooks and settle_first:  # the hooked updates are made before the loop's code
            for lane in opt.pipeline.lanes.values():
                lane.wait(lane.call(lambda: None))
        loop.between(model, params, step, log)
        opt.step()
        (model if loop.zero_through_model else opt).zero_grad(set_to_none=loop.zero_to_none)
    if hooks:
        opt.detach_hooks()
    return model, opt, log


def assert_same_run(a: tuple, b: tuple) -> None:
    (model_a, opt_a, log_a), (model_b, opt_b, log_b) = a, b
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs"
        state_a, state_b = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert state_a.keys() == state_b.keys(), f"state keys of {name} differ"
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), f"state[{key!r}] of {name} differs"
    _assert_same_values(log_a, log_b)


def _assert_same_values(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert type(a) is torch.Tensor and torch.equal(a, b), (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_values(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_values(a[key], b[key])
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("loop", LOOPS, ids=[loop.desc for loop in LOOPS])
def test_loop_pattern_async_equals_sync(loop, size, release_grads):
    width = SIZES[size]
    sync = run_loop(loop, width, hooks=False, release_grads=release_grads)
    hooked = run_loop(loop, width, hooks=True, release_grads=release_grads)
    assert_same_run(hooked, sync)


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("loop", [LOOPS[0], LOOPS[3], LOOPS[5]], ids=lambda loop: loop.desc)
def test_loop_pattern_small_hooked_and_unsettled_equals_sync(loop, release_grads):
    # Every parameter hooked (the small ones staged on the host), and the loop's code run
    # while the worker may still be updating (no wait): the same bits either way.
    width = SIZES["small"]
    sync = run_loop(loop, width, hooks=False, release_grads=release_grads)
    hooked = run_loop(loop, width, hooks=True, release_grads=release_grads,
                      small_param_threshold=0, settle_first=False)
    assert_same_run(hooked, sync)


def _edit_from_step(first: int) -> Loop:
    def between(model, params, step, log):
        if step >= first:
            for p in params:
                p.grad.mul_(0.5)
    return Loop(f"gradients halved from step {first}", between)


def test_loop_first_edit_after_speculative_updates_is_refused_before_it_writes():
    # Nothing was kept to redo an update made before the loop's first edit: the write is
    # refused before it changes the gradient, and the step then says what had been updated.
    model = _model(SIZES["large"], moe=False)
    opt = AdamBridge(model.parameters(), lr=1e-3)
    opt.attach_hooks(model)
    data = _data(SIZES["large"])
    for step, x in enumerate(data[:2]):
        model(x).square().mean().backward()
        for lane in opt.pipeline.lanes.values():
            lane.wait(lane.call(lambda: None))
        if step == 1:
            big = model[0].weight
            before = big.grad.clone()
            with pytest.raises(RuntimeError, match=r"^adambridge: a write to p\.grad changed the "
                                                   r"gradient of parameter 0 after backward.*"
                                                   r"edits_grads=True"):
                big.grad.mul_(0.5)
            assert torch.equal(big.grad, before)  # refused before it wrote
            with pytest.raises(RuntimeError, match=r"already updated parameters \[0"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    opt.detach_hooks()


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
def test_loop_first_edit_later_with_edits_grads_equals_sync(release_grads):
    loop, width = _edit_from_step(1), SIZES["large"]
    sync = run_loop(loop, width, hooks=False, release_grads=release_grads)
    model = _model(width, moe=False)
    opt = AdamBridge(list(model.parameters()), lr=1e-3, weight_decay=0.1,
                     release_grads=release_grads)
    opt.attach_hooks(model, edits_grads=True)
    for step, x in enumerate(_data(width)):
        model(x).square().mean().backward()
        for lane in opt.pipeline.lanes.values():
            lane.wait(lane.call(lambda: None))
        loop.between(model, list(model.parameters()), step, [])
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    assert_same_run((model, opt, []), sync)


def test_loop_edits_through_views_of_p_grad_equal_sync():
    # Writes through p.grad.view(-1), p.grad[...] and p.grad.data reach the step's gradient.
    def between(model, params, step, log):
        for p in params:
            flat = p.grad.view(-1)
            flat[: flat.numel() // 2].mul_(0.5)
            p.grad[0] = 0.0
            p.grad.data.add_(1e-4)
            log.append(p.grad.detach().sum().item())
    loop, width = Loop("writes through views", between), SIZES["large"]
    sync = run_loop(loop, width, hooks=False, release_grads=True)
    hooked = run_loop(loop, width, hooks=True, release_grads=True)
    assert_same_run(hooked, sync)


def test_loop_reference_to_p_grad_kept_past_the_step_raises_instead_of_reading_the_next():
    model = _model(SIZES["small"], moe=False)
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    x = _data(SIZES["small"])[0]
    model(x).square().mean().backward()
    kept = model[0].weight.grad
    opt.step()
    assert model[0].weight.grad is None  # the step consumed it (release_grads=True)
    with pytest.raises(RuntimeError, match=r"belonged to a step that has finished"):
        kept.sum()
    opt.detach_hooks()


def test_loop_setting_p_grad_to_none_after_backward_is_refused():
    model = _model(SIZES["small"], moe=False)
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    model(_data(SIZES["small"])[0]).square().mean().backward()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match=r"gradient of parameter 0 was set to None after "
                                           r"backward.*requires_grad_\(False\)"):
        opt.step()
    opt.detach_hooks()


def test_loop_zero_grad_kept_with_accumulation_equals_sync():
    # zero_grad(set_to_none=False) and two micro-batches per step (opt.accumulate()).
    width = SIZES["large"]
    runs = []
    for hooks in (False, True):
        model = _model(width, moe=True)
        opt = AdamBridge(model.parameters(), lr=1e-3, weight_decay=0.1)
        if hooks:
            opt.attach_hooks(model)
        for step, x in enumerate(_data(width)):
            model.route_all_to_first = step % 2 == 1
            with opt.accumulate():
                model(x).square().mean().backward()
            model(x * 0.5).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        if hooks:
            opt.detach_hooks()
        runs.append((model, opt, []))
    assert_same_run(runs[1], runs[0])


def test_loop_reads_of_p_grad_outside_torch_operators_equal_sync(tmp_path):
    # What a logger does: print, numpy, tolist, torch.save, deepcopy, item, float.
    def between(model, params, step, log):
        g = params[0].grad
        log.append(repr(g[:2, :3]))
        log.append(g.cpu().numpy()[0, :4].tolist())
        log.append(g[0, :4].tolist())
        torch.save({"grad": g}, tmp_path / f"g{step}.pt")
        log.append(torch.load(tmp_path / f"g{step}.pt")["grad"])
        log.append(copy.deepcopy(g))
        log.append(float(g.sum()))
    loop, width = Loop("reads outside operators", between), SIZES["large"]
    sync = run_loop(loop, width, hooks=False, release_grads=True)
    hooked = run_loop(loop, width, hooks=True, release_grads=True)
    assert_same_run(hooked, sync)


THROUGH_CUDA = [loop for loop in LOOPS if loop.between in (
    _titan_clip, _moe_kept_zeros, _assign_masked, _mask_in_place, _log_norms, _clip_then_log,
    _clip_value_bound_early)]


@pytest.mark.parametrize("release_grads", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("loop", THROUGH_CUDA, ids=lambda loop: loop.desc)
def test_loop_pattern_through_the_cuda_transport_equals_sync(monkeypatch, loop, release_grads):
    # CudaTransport on fake streams (tests/helpers/fake_cuda.py): the host copy is a pinned
    # buffer apart from the device gradient, so writes go both ways as they do on a GPU.
    from fake_cuda import FakeCuda
    from adambridge.pipeline import hooks
    from adambridge.pipeline.transport import CudaTransport
    FakeCuda(monkeypatch)
    real_new = hooks.new
    monkeypatch.setattr(hooks, "new", lambda opt, model=None, **options: real_new(
        opt, model, make_transport=CudaTransport, **options))
    width = SIZES["large"]
    sync = run_loop(loop, width, hooks=False, release_grads=release_grads)
    hooked = run_loop(loop, width, hooks=True, release_grads=release_grads)
    assert_same_run(hooked, sync)


def _scaling_hook(p):
    p.grad.mul_(0.5)


def _run_with_user_hook(hooks: bool, user_hook_first: bool) -> tuple:
    model = _model(SIZES["large"], moe=False)
    opt = AdamBridge(model.parameters(), lr=1e-3, weight_decay=0.1)
    if hooks and not user_hook_first:
        opt.attach_hooks(model)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_scaling_hook)
    if hooks and user_hook_first:
        opt.attach_hooks(model)
    for x in _data(SIZES["large"]):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if hooks:
        opt.detach_hooks()
    return model, opt, []


def test_loop_user_post_accumulate_hook_registered_first_equals_sync():
    # The user's hook runs before adambridge's (registered first): it scales p.grad before
    # async mode takes it, as sync mode sees it.
    assert_same_run(_run_with_user_hook(True, True), _run_with_user_hook(False, True))


def test_loop_user_post_accumulate_hook_registered_after_attach_names_the_cause():
    # One backward, no checkpointing: the error names the hook's write, not a second gradient.
    with pytest.raises(RuntimeError, match=r"^adambridge: the gradient of parameter \d+ was "
                                           r"written during backward \(test_async_loop_patterns"
                                           r"\.py:\d+, a hook of your own\?\).*register your "
                                           r"post-accumulate-grad hook before "
                                           r"opt\.attach_hooks\(model\)"):
        _run_with_user_hook(True, False)


def _sam_step(model, opt, x, rho=0.05):
    # SAM's two passes as its common wrapper makes them: backward, perturb the weights along
    # the gradient, discard the gradients (the wrapper's own zero_grad sets them to None),
    # backward again at the perturbed weights, restore, step.
    params = [p for p in model.parameters()]
    model(x).square().mean().backward()
    norm = torch.stack([p.grad.norm() for p in params]).norm()
    moves = [p.grad * (rho / (norm + 1e-12)) for p in params]
    with torch.no_grad():
        for p, move in zip(params, moves):
            p.add_(move)
    for p in params:
        p.grad = None
    model(x).square().mean().backward()
    with torch.no_grad():
        for p, move in zip(params, moves):
            p.sub_(move)
    opt.step()
    opt.zero_grad()


def test_loop_sam_is_refused_with_advice_that_gives_sam():
    # Not accumulate() (which would add the two gradients: not SAM) but sync mode.
    model = _model(SIZES["large"], moe=False)
    opt = AdamBridge(model.parameters(), lr=1e-3)
    x = _data(SIZES["large"])[0]
    _sam_step(model, opt, x)  # sync mode: runs
    opt.attach_hooks(model)
    with pytest.raises(RuntimeError, match=r"^adambridge: parameter \d+ received a new gradient "
                                           r"in a step whose earlier gradient was discarded.*"
                                           r"SAM and ASAM.*sync mode \(opt\.detach_hooks\(\)\)"):
        _sam_step(model, opt, x)
