"""adambridge.integrations.lightning through the real Lightning Trainer, on CPU, on a tiny MLP.

Each fit: automatic optimization, configure_optimizers returning AdamBridge and a per-step
LambdaLR, 7 batches per epoch with accumulate_grad_batches=2 (each epoch ends on a one-batch
window), gradient clipping, max_steps=8 (two epochs; async mode must stop there too), and a
ModelCheckpoint every 4 steps. A resume fits from the step-4 checkpoint, saved after the
first epoch's last batch: the one point Lightning itself resumes exactly with a plain
DataLoader (sync mode too: mid-epoch it restarts the loader from its first batch, and from
a checkpoint saved at on_train_epoch_end it runs one batch of the old epoch again).
"""
import os
import types

import pytest
import torch

lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from _streamed_saves import record_streamed_saves  # noqa: E402
from adambridge import AdamBridge  # noqa: E402
from adambridge.integrations import lightning as integration  # noqa: E402
from adambridge.integrations.lightning import AdamBridgeCallback  # noqa: E402

FIRES, NEVER_FIRES, VALUE = 0.05, 1e6, 0.002
STEPS, STEPS_PER_EPOCH = 8, 4
TOLERANCE = dict(rtol=1e-6, atol=1e-7)


class Tiny(lightning.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 4))
        self.automatic_optimization = not manual
        self.hooked_steps = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.hooked_steps += opt.optimizer.pipeline is not None
            opt.step()
        return loss

    def configure_optimizers(self):
        # small_param_threshold=512: the weight matrices get hooks, the biases go at the step.
        opt = AdamBridge(self.parameters(), lr=1e-2, backend="torch", small_param_threshold=512)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(14, 16, generator=g),
                                              torch.randn(14, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=2)


class Norms(lightning.Callback):
    """The pre-clip gradient norm of every step: from p.grad in sync, from the step's stats."""

    def __init__(self) -> None:
        self.norms, self.pending = [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if optimizer.pipeline is None:  # sync mode: the gradients are all here
            self.pending = float(torch.nn.utils.get_total_norm(grads))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        if opt.pipeline is not None and opt.last_step_stats is not None:
            self.pending, opt.last_step_stats = opt.last_step_stats.grad_norm, None
        if self.pending is not None:
            self.norms.append(self.pending)
            self.pending = None


def fit(folder: str, mode: str, clip: float, algorithm: str = "norm", resume=None,
        **trainer_kwargs) -> dict:
    model, norms = Tiny(), Norms()
    trainer = lightning.Trainer(**trainer_kwargs,
        accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=2,
        gradient_clip_val=clip, gradient_clip_algorithm=algorithm, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AdamBridgeCallback(async_mode=mode == "async"), norms,
                   ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1,
                                   every_n_train_steps=STEPS_PER_EPOCH)])
    trainer.fit(model, ckpt_path=resume)
    opt = trainer.optimizers[0]
    assert opt.pipeline is None and trainer.global_step == STEPS
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
             for p in model.parameters()]
    return dict(params=params, state=state, norms=norms.norms, lr=opt.param_groups[0]["lr"],
                io=trainer.strategy.checkpoint_io)


class OwnIO(TorchCheckpointIO):
    """A user's own CheckpointIO: the callback leaves it in place."""


@pytest.mark.parametrize("plugins, streams", [([], True), ([OwnIO()], False)],
                         ids=["default io", "own io"])
def test_callback_streams_the_checkpoints_unless_the_io_is_the_users(tmp_path, monkeypatch,
                                                                    plugins, streams):
    # The resumes of this file load the streamed files with Lightning's own load.
    written = record_streamed_saves(monkeypatch)
    run = fit(str(tmp_path), "sync", NEVER_FIRES, plugins=plugins)
    saved = [os.path.join(str(tmp_path), f"step={step}.ckpt") for step in (STEPS_PER_EPOCH, STEPS)]
    assert all(os.path.isfile(path) for path in saved)
    assert written == (saved if streams else [])
    assert isinstance(run["io"], integration.AdamBridgeCheckpointIO) is streams


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("sync", "async"):
        def folder(name):
            return str(tmp_path_factory.mktemp(f"{mode}-{name}"))
        first = folder("fires")
        out[mode, "fires"] = fit(first, mode, FIRES)
        out[mode, "resumed"] = fit(first, mode, FIRES,
                                   resume=f"{first}/step={STEPS_PER_EPOCH}.ckpt")
        out[mode, "never"] = fit(folder("never"), mode, NEVER_FIRES)
        out[mode, "value"] = fit(folder("value"), mode, VALUE, algorithm="value")
    return out


def assert_same(a: dict, b: dict, **tolerance) -> None:
    tolerance = tolerance or dict(rtol=0, atol=0)
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        torch.testing.assert_close(x, y, **tolerance)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a["state"][i][key], b["state"][i][key], **tolerance)
        assert int(a["state"][i]["step"]) == int(b["state"][i]["step"]) == STEPS
    assert a["lr"] == b["lr"]


def test_async_equals_sync_bit_for_bit_when_clipping_does_not_fire(runs):
    assert_same(runs["sync", "never"], runs["async", "never"])


def test_async_norm_clipping_fires_and_matches_sync_bit_for_bit(runs):
    hooked, sync = runs["async", "fires"], runs["sync", "fires"]
    assert len(hooked["norms"]) == len(sync["norms"]) == STEPS
    assert min(hooked["norms"]) > FIRES
    assert hooked["norms"] == sync["norms"]
    assert_same(sync, hooked)
    unclipped = runs["async", "never"]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, hooked["params"]))


def test_async_value_clipping_matches_sync_bit_for_bit(runs):
    assert_same(runs["sync", "value"], runs["async", "value"])
    unclipped = runs["async", "never"]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, runs["async", "value"]["params"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_from_checkpoint_equals_uninterrupted_fit(runs, mode):
    assert runs[mode, "resumed"]["norms"] == runs[mode, "fires"]["norms"][STEPS_PER_EPOCH:]
    assert_same(runs[mode, "fires"], runs[mode, "resumed"])


def test_manual_optimization_in_async_mode_advances_global_step():
    model = Tiny(manual=True)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False,
                                callbacks=[AdamBridgeCallback(async_mode=True)])
    trainer.fit(model)
    opt = trainer.optimizers[0]
    assert trainer.global_step == 5 and opt.pipeline is None and model.hooked_steps == 5
    assert {int(opt.state[p]["step"]) for p in model.parameters()} == {5}


def test_callback_refuses_another_optimizer_and_detaches_on_exception():
    class Plain(Tiny):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, callbacks=[AdamBridgeCallback()])
    with pytest.raises(TypeError, match="SGD, not AdamBridge"):
        trainer.fit(Plain())

    class Fails(Tiny):
        def training_step(self, batch, batch_idx):
            raise ValueError("boom")

    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, callbacks=[AdamBridgeCallback()])
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(Fails())
    assert trainer.optimizers[0].pipeline is None


def test_async_mode_refuses_strategies_that_reduce_or_shard_gradients():
    class DDPStrategy:  # what Lightning's DDP strategy is to the check: not single-device
        pass

    with pytest.raises(ValueError, match="single-device strategy, not DDPStrategy"):
        integration._refuse_async_settings(types.SimpleNamespace(strategy=DDPStrategy()))


def test_readme_lightning_example_runs():
    from _readme import example

    class Base(Tiny):  # what the example's `...` stands for
        pass

    code = example("Lightning, automatic optimization", "docs/frameworks.md")
    # The torch backend: the test does not wait for the kernel to build (results are equal).
    code = code.replace('precision="bf16")', 'precision="bf16", backend="torch")')
    assert 'backend="torch"' in code
    code = code.replace("lightning.LightningModule", "Base").replace("max_steps=1000",
                                                                      "max_steps=2")
    code = code.replace("Trainer(", "Trainer(accelerator='cpu', logger=False, "
                                    "enable_checkpointing=False, enable_progress_bar=False, ")
    names = dict(Base=Base)
    exec(compile(code, "README.md", "exec"), names)
    trainer = names["trainer"]
    assert trainer.global_step == 2 and trainer.optimizers[0].pipeline is None
