"""ADAMBRIDGE_VERIFY_ASYNC=N (attach_hooks(verify_steps=N)): the first N steps checked against
sync mode, bit for bit, by the loop itself, through the frameworks too.

A correct loop passes and says so in one log line; each planted difference is caught with a
line naming the step, the parameter and the most likely cause: a gradient changed behind the
views' back, an update that is not sync mode's, a read whose value is not sync mode's.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.pipeline import step_wide, verify, worker

WIDTH = 300  # 300x300 weights: hooked with the default small_param_threshold; biases are not


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _loop(opt, model, steps: int = 3, between=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        model(torch.randn(8, WIDTH, generator=gen)).square().mean().backward()
        if between is not None:
            between(model, step)
        opt.step()
        opt.zero_grad()


def _clip_and_noise(model, step):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad.add_(torch.randn(p.shape, generator=gen) * 1e-4)


def test_verify_passes_a_loop_that_reads_and_edits_and_says_so_once(caplog):
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="bf16")
    opt.attach_hooks(model, verify_steps=2)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        _loop(opt, model, steps=4, between=_clip_and_noise)
    said = [r.message for r in caplog.records if verify.ENV in r.message]
    assert said == [f"adambridge: {verify.ENV}: the first 2 steps of async mode equal sync mode "
                    f"bit for bit (8 parameter updates checked)"]
    assert opt.pipeline.verifier.left == 0
    opt.detach_hooks()


def test_verify_reads_the_environment_and_refuses_a_bad_value(monkeypatch):
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3)
    monkeypatch.setenv(verify.ENV, "3")
    opt.attach_hooks(model)
    assert opt.pipeline.verifier.left == 3
    opt.detach_hooks()
    monkeypatch.setenv(verify.ENV, "yes")
    with pytest.raises(ValueError, match=r"^Invalid ADAMBRIDGE_VERIFY_ASYNC='yes': expected the "
                                         r"number of steps to check"):
        opt.attach_hooks(model)
    monkeypatch.setenv(verify.ENV, "0")
    opt.attach_hooks(model)
    assert opt.pipeline.verifier is None  # off: nothing to check, nothing kept
    opt.detach_hooks()


def _plant_missed_edit(model, step):
    # A write that bypasses p.grad: into the host copy the update uses (as a C extension
    # writing memory it found through the gradient would), in the first step, whose updates
    # wait for step() (a later one may have used the gradient before this write).
    if step == 0:
        model[0].weight.grad.source.host.mul_(1.5)


def test_verify_catches_a_gradient_changed_behind_the_views():
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3)
    opt.attach_hooks(model, verify_steps=3)
    with pytest.raises(RuntimeError, match=r"^adambridge \(ADAMBRIDGE_VERIFY_ASYNC\): step 1, "
                                           r"parameter 0: async mode's master differs from sync "
                                           r"mode's at element \d+ .*most likely cause: the "
                                           r"gradient the update used is not the one sync mode"):
        _loop(opt, model, between=_plant_missed_edit)
    opt.detach_hooks()


def test_verify_catches_an_update_that_is_not_sync_modes(monkeypatch):
    real = worker.adamw_update

    def off_by_an_ulp(items, backend):
        real(items, backend)
        for item in items:
            item.master.view(-1)[:1].copy_(torch.nextafter(item.master.view(-1)[:1],
                                                           torch.tensor(1.0)))

    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, backend="torch")
    opt.attach_hooks(model, verify_steps=2)
    monkeypatch.setattr(worker, "adamw_update", off_by_an_ulp)
    with pytest.raises(RuntimeError, match=r"step 1, parameter \d+: async mode's master differs.*"
                                           r"most likely cause: the update itself differs"):
        _loop(opt, model)
    monkeypatch.undo()
    opt.detach_hooks()


def test_verify_catches_a_read_that_is_not_sync_modes(monkeypatch):
    # The routed clip takes its norm from the host copies; on a GPU torch's own would take
    # it on the device. Planted here: one ulp more than torch's.
    real = step_wide.total_norm
    monkeypatch.setattr(step_wide, "total_norm",
                        lambda norms, norm_type: torch.nextafter(real(norms, norm_type),
                                                                 torch.tensor(float("inf"))))
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3)
    opt.attach_hooks(model, verify_steps=2)
    with pytest.raises(RuntimeError, match=r"step 1, parameter 0: clip_grad_norm_'s total norm on "
                                           r"p.grad gives tensor\(.*\) in async mode and tensor"):
        _loop(opt, model, between=lambda m, step: torch.nn.utils.clip_grad_norm_(
            m.parameters(), 1e-3))
    monkeypatch.undo()
    opt.detach_hooks()  # (drops the step the clip refused)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_verify_steps_argument_is_checked(bad):
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"^Invalid verify_steps: .* \(expected an int >= 0\)$"):
        opt.attach_hooks(model, verify_steps=bad)
    assert opt.pipeline is None


# -- through the frameworks, unchanged: only the environment variable is set


def _hf_trainer_run(tmp_path, plant: bool) -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from test_integrations_transformers import Rows, tiny_gpt2
    from adambridge.integrations.transformers import AdamBridgeCallback, optimizer_cls_and_kwargs

    class Plant(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            if plant and state.global_step == 0:
                grad = next(p.grad for g in optimizer.optimizer.param_groups for p in g["params"]
                            if hasattr(p.grad, "source"))
                grad.source.host.mul_(1.5)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=3,
        learning_rate=1e-2, max_grad_norm=0.05, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="no", seed=0)
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=1024)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=True), Plant()])
    trainer.train()


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_verify_through_the_hf_trainer(tmp_path, monkeypatch, plant, caplog):
    monkeypatch.setenv(verify.ENV, "3")
    if plant:
        with pytest.raises(RuntimeError, match=r"ADAMBRIDGE_VERIFY_ASYNC\): step 1, parameter"):
            _hf_trainer_run(tmp_path, plant)
        return
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        _hf_trainer_run(tmp_path, plant)
    assert any("the first 3 steps of async mode equal sync mode" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_verify_through_accelerate(monkeypatch, plant):
    pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
    from test_integrations_accelerate import make_run
    monkeypatch.setenv(verify.ENV, "3")
    accelerator, model, opt, schedule, loader = make_run("async")
    steps = 0
    try:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
                    steps += 1
                    if plant and steps == 1:
                        next(p.grad for p in model.parameters()
                             if hasattr(p.grad, "source")).source.host.mul_(1.5)
                if plant and steps == 1 and accelerator.sync_gradients:
                    with pytest.raises(RuntimeError, match=r"VERIFY_ASYNC\): step 1, parameter"):
                        opt.step()
                    return
                opt.step()
                schedule.step()
                opt.zero_grad()
        assert opt.optimizer.pipeline.verifier.left == 0
    finally:
        opt.optimizer.detach_hooks()


@pytest.mark.parametrize("plant", [False, True], ids=["clean", "planted"])
def test_verify_through_lightning(monkeypatch, plant):
    lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
    from test_integrations_lightning import Tiny
    from adambridge.integrations.lightning import AdamBridgeCallback

    class Plant(lightning.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if plant and trainer.global_step == 0:
                next(p.grad for p in pl_module.parameters()
                     if hasattr(p.grad, "source")).source.host.mul_(1.5)

    monkeypatch.setenv(verify.ENV, "3")
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=4, gradient_clip_val=0.05, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=False, callbacks=[AdamBridgeCallback(async_mode=True), Plant()])
    if plant:
        with pytest.raises(RuntimeError, match=r"VERIFY_ASYNC\): step 1, parameter"):
            trainer.fit(Tiny())
    else:
        trainer.fit(Tiny())
