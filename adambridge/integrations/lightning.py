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
CheckpointIO of the user's own is left as it is. A shard_state optimizer (whose
state_dict() gathers the whole state on every rank) is saved with the gathered save: the
callback makes the strategy put a stand-in in the checkpoint dict and write it on every
rank in step, rank 0 writing through AdamBridgeCheckpointIO, one tensor gathered at a time.
Several ranks with a CheckpointIO of the user's own are refused at ``on_train_start``.
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
from ._common import Gathered, gathers, innermost, unwrap_optimizer

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
        _gather_saves(strategy)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = [unwrap_optimizer(opt, _WHO) for opt in trainer.optimizers]
        if not optimizers:
            raise TypeError(f"{_WHO}: configure_optimizers returned no optimizer; return an "
                            f"adambridge.AdamBridge")
        _refuse_ungathered_saves(trainer.strategy, optimizers)
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


# --------------------------------------------------------------------------- shard_state saves


def _gather_saves(strategy: Any) -> None:
    """Make the strategy save shard_state optimizers with save_gathered: Lightning calls
    optimizer_state() and save_checkpoint() on every rank, and writes on rank 0 only."""
    own_state, own_save = strategy.optimizer_state, strategy.save_checkpoint
    if getattr(own_save, "gathers", False):
        return

    def optimizer_state(optimizer: Any) -> Any:
        gathered = gathers(optimizer) and isinstance(strategy.checkpoint_io, AdamBridgeCheckpointIO)
        if not gathered:
            return own_state(optimizer)
        return Gathered(innermost(optimizer), f"{_WHO}: a shard_state optimizer's state in "
                                              f"Lightning's checkpoint is written by "
                                              f"trainer.save_checkpoint on every rank only")

    def save_checkpoint(checkpoint_dict: dict, filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        states = checkpoint_dict.get("optimizer_states", [])
        found = [state for state in states if isinstance(state, Gathered)]
        if not found:
            own_save(checkpoint_dict, filepath, storage_options=storage_options)
            return
        if len(found) > 1 or not strategy.checkpoint_io.streams(filepath, storage_options):
            raise ValueError(f"{_WHO}: shard_state's gathered save writes one optimizer to a "
                             f"local path; got {len(found)} shard_state optimizers and path "
                             f"{filepath!r}{' with storage_options' if storage_options else ''}")
        opt = found[0].opt
        obj = {**checkpoint_dict, "optimizer_states": [
            opt.sharded_state_dict() if isinstance(state, Gathered) else state
            for state in states]}
        writes = strategy.is_global_zero
        if writes:
            _make_folder(filepath)
        from ..distributed import zero_gathered  # imports torch.distributed.checkpoint
        zero_gathered.save(opt, obj, os.fspath(filepath) if writes else None)

    # NOTE: Lightning has no hook between building the checkpoint dict and writing it, so
    # the strategy's two methods are replaced on this strategy only.
    save_checkpoint.gathers = True
    strategy.optimizer_state, strategy.save_checkpoint = optimizer_state, save_checkpoint


def _refuse_ungathered_saves(strategy: Any, optimizers: list) -> None:
    """shard_state on several ranks with a CheckpointIO that is not ours: Lightning would call
    it on rank 0 only with the whole state gathered on every rank."""
    if strategy.world_size > 1 and any(o.shard_group is not None for o in optimizers) and \
            not isinstance(strategy.checkpoint_io, AdamBridgeCheckpointIO):
        raise ValueError(f"{_WHO}: shard_state on {strategy.world_size} ranks is saved with "
                         f"its gathered save, which {type(strategy.checkpoint_io).__name__} "
                         f"cannot run on every rank; use adambridge.integrations.lightning."
                         f"AdamBridgeCheckpointIO (the callback's default)")


def _make_folder(path: Any) -> None:
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)


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
        if not self.streams(path, storage_options):
            self.inner.save_checkpoint(checkpoint_dict, path, storage_options=storage_options)
            return
        _make_folder(path)
        checkpoint.save(checkpoint_dict, os.fspath(path))

    def streams(self, path: Any, storage_options: Optional[Any] = None) -> bool:
        """Whether a save to ``path`` is written here (a local path, no storage_options)."""
        return storage_options is None and isinstance(get_filesystem(path), LocalFileSystem)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict:
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
