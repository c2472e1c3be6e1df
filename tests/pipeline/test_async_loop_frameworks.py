"""Gradients touched between backward and step through the frameworks' own hook points, async
against sync, bit for bit: a HF Trainer callback that masks gradients and logs their norm
(on_pre_optimizer_step, after the Trainer's clip), an accelerate loop that adds noise under
accumulate(), and a LightningModule that logs ``grad_norm`` and clamps gradients in
on_before_optimizer_step, as their documentation shows."""
from __future__ import annotations

import pytest
import torch

from adambridge import AdamBridge


def _mask(params, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    for p in params:
        if p.grad is not None:
            p.grad.masked_fill_(torch.rand(p.shape, generator=gen) < 0.25, 0.0)


def _norms(params) -> list:
    return [float(p.grad.norm()) for p in params if p.grad is not None]


def _trainer_run(tmp_path, mode: str) -> tuple:
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from test_integrations_transformers import Rows, tiny_gpt2
    from adambridge.integrations.transformers import AdamBridgeCallback, optimizer_cls_and_kwargs

    class EditAndLog(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.logged = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            params = list(model.parameters())
            _mask(params, state.global_step)
            self.logged.append(_norms(params))

    edit = EditAndLog()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / mode), per_device_train_batch_size=1,
        gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2, max_grad_norm=0.05,
        report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0)
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=1024)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=mode == "async"),
                                              edit])
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()], edit.logged


def test_hf_trainer_callback_that_masks_and_logs_gradients(tmp_path):
    (sync, sync_logged), (ours, our_logged) = (_trainer_run(tmp_path, mode)
                                               for mode in ("sync", "async"))
    assert our_logged == sync_logged and len(our_logged) == 4
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))


def test_accelerate_loop_that_adds_noise_under_accumulate():
    pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
    from test_integrations_accelerate import make_run
    from adambridge.integrations import accelerate as integration
    runs = []
    for mode in ("sync", "async"):
        accelerator, model, opt, schedule, loader = make_run(mode)
        gen = torch.Generator().manual_seed(9)
        logged = []
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    for p in model.parameters():
                        p.grad.add_(torch.randn(p.shape, generator=gen) * 1e-3)
                    logged.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
                opt.step()
                schedule.step()
                opt.zero_grad()
        if mode == "async":
            integration.detach_hooks(opt)
        runs.append(([p.detach().clone() for p in model.parameters()], logged))
    (sync, sync_logged), (ours, our_logged) = runs
    assert our_logged == sync_logged
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))


def test_lightning_module_that_logs_grad_norm_and_clamps_gradients():
    lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
    from lightning.pytorch.utilities import grad_norm
    from test_integrations_lightning import Tiny
    from adambridge.integrations.lightning import AdamBridgeCallback

    class Logged(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.logged = []

        def on_before_optimizer_step(self, optimizer):
            self.logged.append(grad_norm(self, norm_type=2))  # Lightning's docs' example
            for p in self.parameters():
                p.grad.clamp_(-0.01, 0.01)

    runs = []
    for mode in ("sync", "async"):
        module = Logged()
        trainer = lightning.Trainer(
            accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, logger=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            enable_checkpointing=False, callbacks=[AdamBridgeCallback(async_mode=mode == "async")])
        trainer.fit(module)
        runs.append(([p.detach().clone() for p in module.parameters()], module.logged))
    (sync, sync_logged), (ours, our_logged) = runs
    assert len(our_logged) == 6 and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(our_logged, sync_logged))
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))


def test_moe_expert_without_tokens_through_plain_adamw_and_both_modes():
    # torch.optim.AdamW is the reference: zero_grad(set_to_none=False) keeps a zero gradient
    # for the idle expert, which then steps on zeros (its moments decay, weight decay applies).
    from test_async_loop_patterns import MoE
    runs = []
    for kind in ("torch", "sync", "async"):
        torch.manual_seed(0)
        model = MoE(64)
        if kind == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        else:
            opt = AdamBridge(model.parameters(), lr=1e-3, weight_decay=0.1,
                             small_param_threshold=0)
            if kind == "async":
                opt.attach_hooks(model)
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            model.route_all_to_first = step % 2 == 1
            model(torch.randn(8, 64, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append([p.detach().clone() for p in model.parameters()])
    reference, sync, ours = runs
    assert all(torch.equal(a, b) for a, b in zip(ours, sync))
    for a, b in zip(sync, reference):  # the arithmetic invariant against torch's AdamW
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
