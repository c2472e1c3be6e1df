"""AdamBridge against torch.optim.AdamW, and everything torch users rely on."""
from __future__ import annotations

import copy

import pytest
import torch

from adambridge import AdamBridge, OptiComputeAdamW

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md: fp32 moments equal torch.optim.AdamW


def _fixed_gradients(shapes, steps, seed=1):
    # Gradients independent of the weights, so both optimizers see identical inputs and the
    # comparison measures the optimizer's arithmetic, not the chaos of a training run.
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = [10.0 ** -torch.randint(0, 5, (1,), generator=gen).item() for _ in shapes]
        out.append([torch.randn(s, generator=gen) * c for s, c in zip(shapes, scale)])
    return out


def _make_params(shapes, init, non_contiguous):
    params = []
    for shape, values in zip(shapes, init):
        if non_contiguous and len(shape) == 2:
            # A transposed leaf: a non-contiguous view of its storage.
            base = values.t().contiguous().clone()
            params.append(torch.nn.Parameter(base.t()))
        else:
            params.append(torch.nn.Parameter(values.clone()))
    return params


CONFIGS = [
    dict(desc="odd sizes, one group", shapes=[(1,), (15,), (17,), (4097,)], groups=None,
         scheduler=False, non_contiguous=False, weight_decay=0.0),
    dict(desc="several groups with their own hyperparameters and weight decay",
         shapes=[(1,), (15,), (17,), (4097,), (9, 13)],
         groups=[dict(idx=[0, 1], lr=3e-3, betas=(0.8, 0.99)), dict(idx=[2, 3, 4], eps=1e-6,
                                                                    weight_decay=0.1)],
         scheduler=False, non_contiguous=False, weight_decay=0.01),
    dict(desc="non-contiguous views and an LR scheduler", shapes=[(33, 31), (17,), (5, 3)],
         groups=None, scheduler=True, non_contiguous=True, weight_decay=0.05),
]


def _build(opt_factory, config, init):
    params = _make_params(config["shapes"], init, config["non_contiguous"])
    if config["groups"]:
        groups = []
        for g in config["groups"]:
            group = {k: v for k, v in g.items() if k != "idx"}
            group["params"] = [params[i] for i in g["idx"]]
            groups.append(group)
    else:
        groups = params
    opt = opt_factory(groups, lr=1e-2, weight_decay=config["weight_decay"])
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5) if config["scheduler"] else None
    return params, opt, sched


def _train(params, opt, sched, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["desc"])
def test_adamw_fp32_matches_torch_per_element(config, backend):
    init = [torch.randn(s) for s in config["shapes"]]
    grads = _fixed_gradients(config["shapes"], steps=60)
    ref_params, ref_opt, ref_sched = _build(torch.optim.AdamW, config, init)
    params, opt, sched = _build(lambda *a, **k: AdamBridge(*a, backend=backend, **k), config, init)
    _train(ref_params, ref_opt, ref_sched, grads)
    _train(params, opt, sched, grads)
    for ref, ours in zip(ref_params, params):
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            expected = ref_opt.state[ref][key].reshape(-1)
            torch.testing.assert_close(opt.state[ours][key], expected, rtol=RTOL, atol=ATOL)
        assert opt.state[ours]["step"].item() == ref_opt.state[ref]["step"].item()


def test_adamw_fp32_matches_torch_on_a_training_run(backend):
    # A real model and loss for a few steps (tied weights, a scheduler, clipping).
    def run(factory):
        torch.manual_seed(3)
        emb = torch.nn.Embedding(11, 8)
        model = torch.nn.Sequential(emb, torch.nn.Tanh(), torch.nn.Linear(8, 11, bias=True))
        model[2].weight = emb.weight  # weight tying: one tensor, one state
        opt = factory(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)
        for _ in range(20):
            x = torch.randint(0, 11, (4, 6))
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
        return model, opt

    ref_model, _ = run(torch.optim.AdamW)
    model, opt = run(lambda *a, **k: AdamBridge(*a, backend=backend, **k))
    assert len(opt.state) == 2  # the tied embedding/output weight once, plus the bias
    for ref, ours in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)


def test_bf16_params_equal_fp32_adamw_then_nearest_cast(backend):
    shapes = [(17,), (64, 33)]
    init = [torch.randn(s).bfloat16() for s in shapes]
    grads = _fixed_gradients(shapes, steps=50)
    ref = [torch.nn.Parameter(t.float()) for t in init]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3)
    opt = AdamBridge(ours, lr=1e-3, backend=backend)
    for step_grads in grads:
        for r, o, g in zip(ref, ours, step_grads):
            o.grad = g.bfloat16()
            r.grad = o.grad.float()
        ref_opt.step()
        opt.step()
        for r, o in zip(ref, ours):
            master = opt.state[o]["master"].view(o.shape)
            torch.testing.assert_close(master, r.detach(), rtol=RTOL, atol=ATOL)
            assert torch.equal(o.detach(), master.bfloat16())  # our write-back is RNE
            cast = r.detach().bfloat16()
            differ = o.detach() != cast
            # Where torch's fp32 master rounds to another bf16 value than ours, the two fp32
            # masters must straddle a rounding boundary within the fp32 tolerance.
            if differ.any():
                gap = (master[differ] - r.detach()[differ]).abs()
                assert (gap <= ATOL + RTOL * r.detach()[differ].abs()).all()
                assert differ.sum() <= 2


def test_master_created_lazily_from_weights_loaded_after_construction(backend):
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = AdamBridge(model.parameters(), lr=1e-3, backend=backend)
    pretrained = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    model.load_state_dict(pretrained)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    # One step of lr=1e-3 from 0.5, not from the random initial weights.
    assert (model.weight.float() - 0.5).abs().max() < 2e-2


def test_tensor_listed_twice_gets_one_state(backend):
    w = torch.nn.Parameter(torch.randn(6))
    opt = AdamBridge([w, w], lr=1e-2, backend=backend)
    ref_w = torch.nn.Parameter(w.detach().clone())
    ref = torch.optim.AdamW([ref_w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.ones(6)
        ref_w.grad = torch.ones(6)
        opt.step()
        ref.step()
    assert len(opt.state) == 1 and opt.state[w]["step"].item() == 3
    torch.testing.assert_close(w, ref_w, rtol=RTOL, atol=ATOL)


def test_params_without_grad_are_skipped_and_frozen_params_get_no_state(backend):
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    opt = AdamBridge([a, b, frozen], backend=backend)
    b_before = b.detach().clone()
    a.grad = torch.ones(5)
    opt.step()
    assert a in opt.state and b not in opt.state and frozen not in opt.state
    assert torch.equal(b.detach(), b_before)


def test_gradient_accumulation_equals_one_big_batch(backend):
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    def run(micro):
        torch.manual_seed(1)
        model = torch.nn.Linear(6, 2)
        opt = AdamBridge(model.parameters(), lr=1e-2, backend=backend)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            for chunk in x.chunk(micro):
                (model(chunk).pow(2).sum() / x.shape[0]).backward()
            opt.step()
        return model
    one, four = run(1), run(4)
    for p, q in zip(one.parameters(), four.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_zero_grad_step_closure_hooks_and_tensor_lr(backend):
    p = torch.nn.Parameter(torch.randn(7))
    opt = OptiComputeAdamW([p], lr=torch.tensor(1e-2), backend=backend)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.parametrize("attach", [False, True], ids=["sync", "async"])
def test_tensor_betas_as_torch_adamw_read_at_every_step(backend, attach):
    """torch.optim.AdamW takes 1-element tensor betas; a change in place reaches the next step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(70, 300)
    twin = copy.deepcopy(model)
    betas = (torch.tensor(0.9), torch.tensor(0.99))
    opt = AdamBridge(model.parameters(), lr=1e-2, betas=betas, backend=backend,
                     small_param_threshold=0)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    if attach:
        opt.attach_hooks(model)
    for step in range(4):
        if step == 2:  # as a schedule of beta1 would, in place
            for group in (*opt.param_groups, *ref.param_groups):
                group["betas"][0].fill_(0.8)
        # The same gradients for both (d/dp of sum(p * g) is g): gradients of a loss through
        # the two models would part with their weights and amplify an ulp into a mismatch.
        grads = [torch.randn(p.shape) for p in model.parameters()]
        for m, o in ((model, opt), (twin, ref)):
            sum((p * g).sum() for p, g in zip(m.parameters(), grads)).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_add_param_group_trains_new_params(backend):
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = AdamBridge([a], lr=0.1, backend=backend)
    opt.add_param_group({"params": [b], "lr": 0.2})
    b_before = b.detach().clone()
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    torch.testing.assert_close(b.detach(), b_before * (1 - 0.2 * 0.01) - 0.2, rtol=1e-5, atol=1e-5)


def test_grad_scaler_protocol_skips_inf_steps(backend):
    model = torch.nn.Linear(3, 1)
    opt = AdamBridge(model.parameters(), lr=1e-2, backend=backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(1, 3) * float("inf")).sum()).backward()
    scaler.step(opt)  # inf gradients: the step is skipped
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight.detach(), before[0])
    assert opt.state[model.weight]["step"].item() == 1


def test_backend_attribute_names_the_implementation(backend):
    opt = AdamBridge([torch.nn.Parameter(torch.zeros(1))], backend=backend)
    if backend == "torch":
        assert opt.backend == "torch"
    else:
        assert opt.backend.startswith("native/")
    assert opt.precision == "fp32"


@pytest.mark.parametrize("mode", ["sync torch backend", "sync native", "async native"])
def test_parameter_transposed_in_place_of_its_storage_steps_as_torch(mode):
    # p.data = p.data.t() on a square fp32 parameter keeps its storage, so the master that
    # was a view of it (fp32 contiguous parameters are their own master) would read in the
    # old order; it must become a copy of p's values as they read now, as torch's AdamW
    # (whose p is its master) sees them. The moments keep their order in both. (Async
    # mode, before the fix, went on silently in the old order: 2e-2 off torch.)
    gen = torch.Generator().manual_seed(3)
    models = [torch.nn.Linear(6, 6, bias=False) for _ in range(2)]
    start = torch.randn(6, 6, generator=gen)
    for model in models:
        model.weight.data = start.clone()
    ours, ref = models
    opt = AdamBridge(ours.parameters(), lr=1e-2, precision="fp32", small_param_threshold=0,
                     backend="torch" if "torch" in mode else "native")
    if mode.startswith("async"):
        opt.attach_hooks(ours)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 6, generator=gen)
    for step in range(4):
        if step == 2:
            for model in models:
                model.weight.data = model.weight.data.t()
        for model in models:
            model(x).square().sum().backward()
        opt.step_sync() if mode.startswith("async") else opt.step()
        torch_opt.step()
        for o in (opt, torch_opt):
            o.zero_grad(set_to_none=True)
        torch.testing.assert_close(ours.weight.detach(), ref.weight.detach(), rtol=RTOL,
                                   atol=ATOL, msg=f"{mode}, step {step + 1}")
    if mode.startswith("async"):
        opt.detach_hooks()
