"""adambridge.integrations.accelerate through the real Accelerator, on CPU, on a tiny MLP.

Each run: ``prepare`` (model, optimizer, LambdaLR scheduler, a 7-batch loader), two epochs
under ``accelerator.accumulate`` with gradient_accumulation_steps=2 (each epoch ends on a
one-batch window), ``accelerator.clip_grad_norm_`` on every closing micro-batch, and
``save_state`` after the first epoch. A resume is a fresh Accelerator that attaches the hooks,
then ``load_state``s (the order a user script has), then runs the second epoch.
"""
import os
import types

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

from _streamed_saves import record_streamed_saves  # noqa: E402
from adambridge import AdamBridge  # noqa: E402
from adambridge.integrations import accelerate as integration  # noqa: E402

FIRES, NEVER_FIRES = 0.05, 1e6
EPOCHS, STEPS_PER_EPOCH = 2, 4
TOLERANCE = dict(rtol=1e-6, atol=1e-7)


def make_run(mode: str):
    """A fresh Accelerator and the prepared objects of one run."""
    AcceleratorState._reset_state(True)  # Accelerator keeps process-wide singletons
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    # small_param_threshold=512: the weight matrices get hooks, the biases go at the step.
    opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=512)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(14, 16, generator=g),
                                          torch.randn(14, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, opt, schedule, loader = accelerator.prepare(model, opt, schedule, loader)
    if mode == "async":  # which also streams save_state's optimizer files
        assert isinstance(integration.attach_hooks(accelerator, model, opt), AdamBridge)
    else:
        integration.stream_saves(accelerator)
    return accelerator, model, opt, schedule, loader


def epoch(run, max_norm: float, norms: list) -> None:
    accelerator, model, opt, schedule, loader = run
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()  # the wrapper calls ours on the closing micro-batch only
            schedule.step()
            opt.zero_grad()


def train(folder: str, mode: str, max_norm: float, resume: bool = False) -> dict:
    run = make_run(mode)
    accelerator, model, opt = run[:3]
    norms: list = []
    if resume:
        accelerator.load_state(folder)  # with the hooks already attached
        epoch(run, max_norm, norms)
    else:
        epoch(run, max_norm, norms)
        accelerator.save_state(folder)
        epoch(run, max_norm, norms)
    inner = opt.optimizer
    if mode == "async":
        integration.detach_hooks(opt)
    assert inner.pipeline is None
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: inner.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
             for p in model.parameters()]
    return dict(params=params, state=state, norms=norms, lr=inner.param_groups[0]["lr"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("sync", "async"):
        folder = str(tmp_path_factory.mktemp(f"{mode}-state"))
        out[mode, "fires"] = train(folder, mode, FIRES)
        out[mode, "resumed"] = train(folder, mode, FIRES, resume=True)
        out[mode, "never"] = train(folder, mode, NEVER_FIRES)
    return out


def assert_same(a: dict, b: dict, **tolerance) -> None:
    tolerance = tolerance or dict(rtol=0, atol=0)
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        torch.testing.assert_close(x, y, **tolerance)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a["state"][i][key], b["state"][i][key], **tolerance)
        assert int(a["state"][i]["step"]) == int(b["state"][i]["step"]) == EPOCHS * STEPS_PER_EPOCH
    assert a["lr"] == b["lr"]


def test_async_equals_sync_bit_for_bit_when_clipping_does_not_fire(runs):
    assert len(runs["async", "never"]["norms"]) == EPOCHS * STEPS_PER_EPOCH
    assert_same(runs["sync", "never"], runs["async", "never"])
    torch.testing.assert_close(torch.tensor(runs["async", "never"]["norms"]),
                               torch.tensor(runs["sync", "never"]["norms"]), **TOLERANCE)


def test_async_clipping_fires_and_matches_sync_bit_for_bit(runs):
    hooked, sync = runs["async", "fires"], runs["sync", "fires"]
    assert min(hooked["norms"]) > FIRES  # the real norm came back, so clipping fired
    assert hooked["norms"] == sync["norms"]
    assert_same(sync, hooked)
    unclipped = runs["async", "never"]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, hooked["params"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_load_state_then_second_epoch_equals_uninterrupted_run(runs, mode):
    resumed, whole = runs[mode, "resumed"], runs[mode, "fires"]
    assert resumed["norms"] == whole["norms"][STEPS_PER_EPOCH:]
    assert_same(whole, resumed)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_state_streams_the_optimizer_file_and_nothing_else(tmp_path, monkeypatch, mode):
    # The resumes above load these files with accelerate's own load_state.
    written = record_streamed_saves(monkeypatch)
    own = accelerate.checkpointing.save
    run = make_run(mode)
    integration.stream_saves(run[0])  # a second call wraps nothing more
    epoch(run, FIRES, [])
    run[0].save_state(str(tmp_path))
    assert written == [os.path.join(str(tmp_path), "optimizer.bin")]
    assert {"model.safetensors", "scheduler.bin"} <= set(os.listdir(tmp_path))
    assert accelerate.checkpointing.save is own  # accelerate's again once save_state returns
    if mode == "async":
        integration.detach_hooks(run[2])


def test_attach_hooks_refuses_plugins_it_cannot_follow():
    # (Several processes under DDP work: tests/distributed/test_integrations_ranks.py.)
    model = torch.nn.Linear(4, 4)
    opt = AdamBridge(model.parameters(), backend="torch")
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        stub = types.SimpleNamespace(distributed_type=kind, num_processes=2)
        with pytest.raises(ValueError, match=kind.value):
            integration.attach_hooks(stub, model, opt)
    single = types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    with pytest.raises(TypeError, match="SGD, not AdamBridge"):
        integration.attach_hooks(single, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.pipeline is None


@pytest.mark.parametrize("hooked", [False, True])
def test_a_step_the_grad_scaler_skips_is_skipped_for_accelerate_too(hooked):
    # accelerate makes no GradScaler on CPU, so the prepared optimizer is wrapped by hand.
    from accelerate.optimizer import AcceleratedOptimizer
    accelerator = make_run("sync")[0]
    model = torch.nn.Linear(4, 4)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    scaler = torch.amp.GradScaler("cpu")
    wrapper = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    if hooked:
        integration.attach_hooks(accelerator, model, wrapper)
    else:
        integration.report_skipped_steps(wrapper)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(1, 4)).sum() * float("inf")).backward()
    wrapper.step()
    assert opt.last_step_stats.skipped and torch.equal(before, model.weight)
    assert wrapper.step_was_skipped  # so accelerate's scheduler does not advance
    wrapper.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    wrapper.step()
    assert not opt.last_step_stats.skipped and not wrapper.step_was_skipped
    integration.detach_hooks(wrapper)
    again = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)  # a new prepare()
    integration.report_skipped_steps(again)
    integration.report_skipped_steps(again)  # once per wrapper: one hook, on the new one
    again.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).sum() * float("nan")).backward()
    again.step()
    assert again.step_was_skipped and len(opt._optimizer_step_post_hooks) == 1


def test_readme_accelerate_example_runs():
    from _readme import example
    accelerator, model, _, _, loader = make_run("sync")  # only for a model and a loader
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    code = example("accelerate (`prepare`, `accumulate`", "docs/frameworks.md")
    # The torch backend: the test does not wait for the kernel to build (results are equal).
    code = code.replace('precision="bf16")', 'precision="bf16", backend="torch")')
    assert 'backend="torch"' in code
    names = dict(model=model, loader=loader.base_dataloader,
                 loss_fn=torch.nn.functional.mse_loss)
    exec(compile(code, "README.md", "exec"), names)
    opt = names["opt"].optimizer
    assert opt.pipeline is not None and not opt.last_step_stats.skipped
    assert {int(s["step"]) for s in opt.state.values()} == {2}  # 7 batches, 4 per window
    opt.detach_hooks()


def test_accelerate_clip_is_its_own_and_equals_sync():
    # accelerate (1.16) takes the norm itself over the parameters whose p.grad is set; no
    # adambridge wrapper is needed: a released gradient's p.grad is a view that counts.
    original = vars(accelerate.Accelerator)["_clip_grad_norm_dtensor_aware"]
    runs = []
    for mode in ("sync", "async"):
        accelerator, model, opt, schedule, loader = make_run(mode)
        assert vars(accelerate.Accelerator)["_clip_grad_norm_dtensor_aware"] is original
        norms = []
        epoch((accelerator, model, opt, schedule, loader), FIRES, norms)
        if mode == "async":
            integration.detach_hooks(opt)
        runs.append(([p.detach().clone() for p in model.parameters()], norms))
    (sync, sync_norms), (ours, our_norms) = runs
    assert our_norms == sync_norms
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))
