"""The optimizer state stays in host memory whatever a framework's helper assigns to it.

Lightning resumes with ``optimizer.load_state_dict(...)`` and then its own
``_optimizer_to_device(optimizer, root_device)``, which assigns ``state[key] =
value.to(device)`` for every key but 'step'. On a GPU that would move the host master and
moments to the GPU; the meta device stands in for it here (its tensors hold no values, so a
state that followed them would be lost). The resumed run must equal an uninterrupted one bit
for bit, through Lightning's function itself and through a real ``Trainer.fit(ckpt_path=)``.
"""
from __future__ import annotations

import io

import pytest
import torch

from adambridge import AdamBridge

lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
from lightning.fabric.utilities.optimizer import _optimizer_to_device  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from _tiny import tiny_mlp

META = torch.device("meta")


def _model(dtype: torch.dtype) -> torch.nn.Module:
    # 300 outputs: fp8's blocks of 128 with a short last one
    return tiny_mlp((9, 300, 3), between="relu", dtype=dtype, seed=5)


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 9, generator=gen).to(dtype)).float().pow(2).mean().backward()
        opt.step()


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lightning_optimizer_to_device_keeps_the_state_on_the_host(dtype, precision, mode):
    kwargs = dict(lr=1e-3, precision=precision, small_param_threshold=0)
    straight = _model(dtype)
    opt = AdamBridge(straight.parameters(), **kwargs)
    _train(straight, opt, 3, seed=1)
    saved = _roundtrip({"model": straight.state_dict(), "optim": opt.state_dict()})
    _train(straight, opt, 3, seed=2)

    resumed = _model(dtype)
    opt2 = AdamBridge(resumed.parameters(), **kwargs)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    _optimizer_to_device(opt2, META)  # what Lightning's resume does next
    for state in opt2.state.values():
        assert all(value.is_cpu for value in state.values())
    if mode == "async":
        opt2.attach_hooks(resumed)
    _train(resumed, opt2, 3, seed=2)
    opt2.detach_hooks()
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert value.dtype == opt2.state[q][key].dtype
            assert torch.equal(value, opt2.state[q][key]), key


def test_state_keys_of_another_shape_or_user_keys_are_stored_as_given():
    p = torch.nn.Parameter(torch.randn(300))
    opt = AdamBridge([p])
    p.grad = torch.ones(300)
    opt.step()
    state = opt.state[p]
    replacement = torch.zeros(300)
    state["exp_avg"] = replacement  # a host tensor: the user's to replace, as in torch
    assert state["exp_avg"] is replacement
    state["note"] = torch.zeros(2, device=META)  # not a key of ours
    assert state["note"].is_meta


# --------------------------------------------------------------------------- a real resume


class StandInDevice(SingleDeviceStrategy):
    """A CPU run whose resume moves the optimizer state to the meta device, as a GPU run's
    moves it to the GPU: Lightning's own load_optimizer_state_dict, with that root device."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        real, self._root_device = self._root_device, META
        try:
            super().load_optimizer_state_dict(checkpoint)
        finally:
            self._root_device = real


class Tiny(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model(torch.float32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return AdamBridge(self.parameters(), lr=1e-2, precision="bf16")

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 9, generator=g),
                                              torch.randn(8, 3, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=2)


def _fit(folder, resume=None) -> tuple:
    from lightning.pytorch.callbacks import ModelCheckpoint
    model = Tiny()
    trainer = lightning.Trainer(
        accelerator="cpu", strategy=StandInDevice(device="cpu"), max_steps=8, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1,
                                   every_n_train_steps=4)])
    trainer.fit(model, ckpt_path=resume)
    opt = trainer.optimizers[0]
    return model, opt


def test_lightning_resume_with_the_state_moved_to_a_device_equals_uninterrupted(tmp_path):
    straight, opt = _fit(tmp_path)
    resumed, opt2 = _fit(tmp_path / "resumed", resume=str(tmp_path / "step=4.ckpt"))
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            other = opt2.state[q][key]
            assert other.is_cpu and value.dtype == other.dtype and torch.equal(value, other)
