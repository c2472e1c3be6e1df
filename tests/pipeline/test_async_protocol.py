"""Asynchronous mode driven by the ordinary torch.optim protocol: step(), zero_grad(), schedulers,
load_state_dict while attached, accumulation windows, gradients without hooks."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from adambridge import AdamBridge, StepStats
from _tiny import tiny_mlp


def _model(seed: int = 0) -> nn.Module:
    return tiny_mlp((12, 32, 32, 4), between="tanh", seed=seed)


def _data(n: int, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen))
            for _ in range(n)]


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _opt(model, **kw):
    kw = dict(dict(lr=1e-2, weight_decay=0.1, backend="torch", small_param_threshold=100,
                   chunk_size=256), **kw)
    return AdamBridge(model.parameters(), **kw)


def _assert_same(model_a, opt_a, model_b, opt_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value.float(), opt_b.state[q][key].float()), key


def _sync_run(data, **kw):
    model = _model()
    opt = _opt(model, **kw)
    for x, y in data:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_protocol_step_finishes_the_step_and_returns_the_closure_loss():
    data = _data(4)
    ref_model, ref_opt = _sync_run(data)
    model = _model()
    opt = _opt(model)
    opt.attach_hooks(model)
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = _loss(model, x, y)
            loss.backward()
            return loss
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
        assert isinstance(opt.last_step_stats, StepStats)
        assert opt.last_step_stats.num_params == 6
    _assert_same(model, opt, ref_model, ref_opt)
    assert all(int(opt.state[p]["step"]) == 4 for p in model.parameters())


def test_protocol_step_sync_is_step_plus_stats():
    model = _model()
    opt = _opt(model)
    opt.attach_hooks(model)
    x, y = _data(1)[0]
    _loss(model, x, y).backward()
    stats = opt.step_sync()
    assert stats is opt.last_step_stats and stats.num_params == 6 and stats.grad_norm is None


def test_protocol_scheduler_sees_a_real_step_and_its_lr_reaches_the_update():
    data = _data(5)
    runs = []
    for hooks in (False, True):
        model = _model()
        opt = _opt(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        if hooks:
            opt.attach_hooks(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
            for x, y in data:
                _loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
        runs.append((model, opt))
    _assert_same(*runs[1], *runs[0])


def test_protocol_load_state_dict_while_attached_uses_the_loaded_groups():
    data = _data(6)
    runs = []
    for hooks in (False, True):
        model = _model()
        opt = _opt(model)
        if hooks:
            opt.attach_hooks(model)
        for i, (x, y) in enumerate(data):
            if i == 2:  # what accelerate.load_state or DCP set_optimizer_state_dict do
                saved = opt.state_dict()
                saved["param_groups"][0]["lr"] = 3e-3
                opt.load_state_dict(saved)
            if i == 4:
                opt.param_groups[0]["betas"] = (0.8, 0.99)
                opt.param_groups[0]["weight_decay"] = 0.0
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    _assert_same(*runs[1], *runs[0])
    assert runs[1][1].param_groups[0]["lr"] == 3e-3


ACCUMULATION = [
    dict(desc="accumulation_steps=3", attach=dict(accumulation_steps=3)),
    dict(desc="closes_window from the framework", attach="window"),
    dict(desc="opt.accumulate() blocks", attach="context"),
]


@pytest.mark.parametrize("config", ACCUMULATION, ids=lambda c: c["desc"])
def test_protocol_accumulation_windows_equal_sync(config):
    micro = [_data(3, seed=s) for s in range(3)]
    ref_model = _model()
    ref_opt = _opt(ref_model)
    for batches in micro:
        for x, y in batches:
            _loss(ref_model, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = _model()
    opt = _opt(model)
    position = {"i": 0}
    if config["attach"] == "window":
        opt.attach_hooks(model, closes_window=lambda: position["i"] == 2)
    elif config["attach"] == "context":
        opt.attach_hooks(model)
    else:
        opt.attach_hooks(model, **config["attach"])
    for batches in micro:
        for i, (x, y) in enumerate(batches):
            position["i"] = i
            if config["attach"] == "context" and i < 2:
                with opt.accumulate():
                    _loss(model, x, y).backward()
            else:
                _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    _assert_same(model, opt, ref_model, ref_opt)


def test_protocol_short_window_and_straggler_gradients_are_updated_at_step():
    # A parameter used only in the first micro-batch (an MoE expert, an unused head) never
    # sees a closing backward: its accumulated gradient is sent when the step finishes.
    torch.manual_seed(0)
    body, head = nn.Linear(12, 200), nn.Linear(200, 4)
    extra = nn.Linear(12, 200)

    def run(hooks: bool):
        torch.manual_seed(0)
        params = [nn.Parameter(t.detach().clone()) for t in
                  (body.weight, body.bias, head.weight, head.bias, extra.weight)]
        opt = AdamBridge(params, lr=1e-2, backend="torch", small_param_threshold=100)
        if hooks:
            opt.attach_hooks(nn.ParameterList(params), accumulation_steps=4)
        for step in range(2):
            for i, (x, y) in enumerate(_data(3, seed=step)):
                h = torch.tanh(x @ params[0].t() + params[1])
                if i == 0:
                    h = h + x @ params[4].t()
                ((h @ params[2].t() + params[3] - y) ** 2).mean().backward()
            opt.step()  # after 3 of 4 micro-batches: the window is cut short
            opt.zero_grad()
        return params, opt

    ref, ref_opt = run(False)
    ours, opt = run(True)
    for p, q in zip(ref, ours):
        assert torch.equal(p, q)
        assert int(opt.state[q]["step"]) == 2


def test_protocol_second_step_without_backward_updates_nothing():
    model = _model()
    opt = _opt(model, release_grads=False)
    opt.attach_hooks(model)
    x, y = _data(1)[0]
    _loss(model, x, y).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.last_step_stats.num_params == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    _loss(model, x, y).backward()  # a new backward accumulates into the kept gradients
    opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


@pytest.mark.parametrize("release_grads", [True, False], ids=["released", "kept"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_protocol_every_step_without_a_new_backward_updates_nothing(precision, release_grads,
                                                                    backend, caplog):
    # Each backward's gradients serve one step (README): five step() calls after one
    # backward leave what one synchronous step leaves, hooked and unhooked parameters
    # alike (small_param_threshold=100 sends the biases at the step), and say so once.
    import logging
    data = _data(2)
    ref_model, ref_opt = _sync_run(data[:1], precision=precision, backend=backend)
    model = _model()
    opt = _opt(model, precision=precision, backend=backend, release_grads=release_grads)
    opt.attach_hooks(model)
    _loss(model, *data[0]).backward()
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        for call in range(5):
            opt.step()
            assert opt.last_step_stats.num_params == (len(ref_opt.state) if call == 0 else 0)
            _assert_same(model, opt, ref_model, ref_opt)
    said = [r.getMessage() for r in caplog.records if "found no gradient" in r.getMessage()]
    assert len(said) == 1
    # A new backward's gradient serves the next step.
    opt.zero_grad()
    _loss(model, *data[1]).backward()
    _loss(ref_model, *data[1]).backward()
    opt.step()
    ref_opt.step()
    _assert_same(model, opt, ref_model, ref_opt)
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_protocol_hand_set_grad_on_frozen_parameter_is_updated_as_in_sync():
    results = []
    for hooks in (False, True):
        model = _model()
        model[0].weight.requires_grad_(False)
        opt = _opt(model)
        if hooks:
            opt.attach_hooks(model)
        for x, y in _data(3):
            _loss(model, x, y).backward()
            model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
            opt.step()
            opt.zero_grad()
        results.append((model, opt))
    _assert_same(*results[1], *results[0])
    assert int(results[1][1].state[results[1][0][0].weight]["step"]) == 3


def test_protocol_two_optimizers_on_one_model_is_a_clear_error():
    model = _model()
    first = _opt(model)
    first.attach_hooks(model)
    second = _opt(model)
    with pytest.raises(RuntimeError, match=r"parameter \d+ also belongs to another "
                                           r"AdamBridge optimizer with hooks attached"):
        second.attach_hooks(model)
    first.detach_hooks()
    second.attach_hooks(model)  # once the first has let go, the second may hook
    x, y = _data(1)[0]
    _loss(model, x, y).backward()
    second.step()


def test_protocol_two_optimizers_on_disjoint_parts_of_one_model():
    data = _data(3)
    ref = _model()
    ref_opts = [_opt(ref[0]), _opt(nn.Sequential(ref[2], ref[4]))]
    model = _model()
    opts = [_opt(model[0]), _opt(nn.Sequential(model[2], model[4]))]
    for opt in opts:
        opt.attach_hooks(model)
    for x, y in data:
        _loss(ref, x, y).backward()
        _loss(model, x, y).backward()
        for a, b in zip(ref_opts, opts):
            a.step()
            b.step()
            a.zero_grad()
            b.zero_grad()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_protocol_torch_flag_set_in_a_group_while_attached_is_refused_with_nothing_changed():
    model = _model()
    opt = _opt(model)
    opt.attach_hooks(model)
    x, y = _data(1)[0]
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["maximize"] = True
    _loss(model, x, y).backward()
    with pytest.raises(ValueError, match=r"Unsupported torch.optim flag in param_groups\[0\]: "
                                         r"maximize=True.*no parameter or optimizer state"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
