"""Lightning: asynchronous mode for a LightningModule whose configure_optimizers returns AdamBridge.

    trainer = lightning.Trainer(..., gradient_clip_val=1.0, accumulate_grad_batches=4,
                                callbacks=[AdamBridgeCallback(async_mode=True)])

Why a callback is enough (lightning/pytorch, 2.x):

- ``Trainer._run`` restores the optimizer and scheduler state of ``ckpt_path``
  (``restore_training_state``) before the fit loop calls ``on_train_start``, where the hooks
  are attached: they update the restored state.
- Automatic optimization calls ``optimizer.step(closure)``, the closure running forward,
  backward and ``gradient_clip_val`` clipping (``precision.clip_gradients`` ends in
  ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``, which the optimizer answers
  while hooks are attached). ``step()`` finishes the step, so ``global_step`` and
  ``max_steps`` count as usual.
- ``accumulate_grad_batches``: Lightning decides per batch, before it runs, whether the
  batch steps (``fit_loop._should_accumulate()``: every N-th batch, or the last of the
  epoch); the callback reads that at ``on_train_batch_start`` and hands it to the hooks as
  ``closes_window``. Manual optimization decides itself when to step: the window closes at
  every backward there (use ``opt.accumulate()`` for the others).

The hooks are removed at ``on_train_end`` and ``on_exception``.

Saving: Lightning's default ``TorchCheckpointIO`` pickles the whole checkpoint into a
``BytesIO`` with ``torch.save`` and then writes those bytes, so a save holds the file's
bytes in RAM and, for the NVMe tier, every entry read from its files as well.
``AdamBridgeCheckpointIO`` writes the same file with ``adambridge.checkpoint.save``, one
tensor at a time, straight into the file (local paths; others go to the wrapped
CheckpointIO). The callback puts it in place of the default at ``setup`` (both modes); a
CheckpointIO of the user's own is left as it is.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from fsspec.implementations.local import LocalFileSystem

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy

from .. import checkpoint
from ..optimizer import AdamBridge
from ._common import unwrap_optimizer

_WHO = "AdamBridgeCallback"


class AdamBridgeCallback(Callback):
    """With ``async_mode``, attaches AdamBridge's hooks for the fit and routes accumulation."""

    def __init__(self, async_mode: bool = True) -> None:
        self.async_mode = bool(async_mode)
        self._attached: list[AdamBridge] = []
        self._closes = True

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default
            strategy.checkpoint_io = AdamBridgeCheckpointIO(strategy.checkpoint_io)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = [unwrap_optimizer(opt, _WHO) for opt in trainer.optimizers]
        if not optimizers:
            raise TypeError(f"{_WHO}: configure_optimizers returned no optimizer; return an "
                            f"adambridge.AdamBridge")
        if not self.async_mode:
            return
        _refuse_async_settings(trainer)
        self._detach()
        automatic = pl_module.automatic_optimization
        for opt in optimizers:
            if automatic:
                opt.attach_hooks(pl_module, closes_window=lambda: self._closes)
            else:
                opt.attach_hooks(pl_module)
            self._attached.append(opt)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        # The same test Lightning's automatic loop makes for this batch right after.
        self._closes = (trainer.strategy.handles_gradient_accumulation
                        or not trainer.fit_loop._should_accumulate())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        attached, self._attached = self._attached, []
        for opt in attached:
            opt.detach_hooks()


def _refuse_async_settings(trainer: Any) -> None:
    """Set-ups where the hooks would see gradients that Lightning still changes."""
    strategy = trainer.strategy
    if not isinstance(strategy, SingleDeviceStrategy):
        raise ValueError(f"{_WHO}(async_mode=True) needs a single-device strategy, not "
                         f"{type(strategy).__name__} (it reduces or shards gradients after "
                         f"the hooks run); use async_mode=False")


class AdamBridgeCheckpointIO(CheckpointIO):
    """Lightning's checkpoint file written with ``adambridge.checkpoint.save``: one tensor
    at a time, straight into the file, instead of the whole file built in memory first.

    ``Trainer(plugins=[AdamBridgeCheckpointIO()])`` uses it without the callback. Loading
    and removing are ``inner``'s (``TorchCheckpointIO`` by default), and so is saving to a
    path that is not on the local filesystem or with ``storage_options``.
    """

    def __init__(self, inner: Optional[CheckpointIO] = None) -> None:
        self.inner = inner if inner is not None else TorchCheckpointIO()

    def save_checkpoint(self, checkpoint_dict: dict, path: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            self.inner.save_checkpoint(checkpoint_dict, path, storage_options=storage_options)
            return
        folder = os.path.dirname(os.fspath(path))
        if folder:
            os.makedirs(folder, exist_ok=True)
        checkpoint.save(checkpoint_dict, os.fspath(path))

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict:
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
