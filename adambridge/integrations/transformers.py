"""Hugging Face transformers ``Trainer``: AdamBridge as its optimizer, async mode by a callback.

    from adambridge.integrations.transformers import AdamBridgeCallback, optimizer_cls_and_kwargs

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset,
                      optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, precision="bf16"),
                      callbacks=[AdamBridgeCallback(async_mode=True)])

Why the callback is enough (transformers/trainer.py, ``_inner_training_loop``):

- ``_prepare_for_training`` builds the optimizer, wraps it in accelerate's
  ``AcceleratedOptimizer`` and, when resuming, loads the optimizer and scheduler state; only
  then do callbacks get ``on_train_begin``. The hooks are attached there, so they update the
  restored state.
- Before each micro-batch's backward the Trainer sets accelerate's
  ``GradientState.sync_gradients`` to whether that backward closes the accumulation window
  (the last micro-batch of the window or of the epoch); ``closes_window`` reads it, so
  ``gradient_accumulation_steps`` needs nothing else.
- ``max_grad_norm``: the Trainer calls ``accelerator.clip_grad_norm_``, which calls
  ``torch.nn.utils.clip_grad_norm_``; while hooks are attached the optimizer answers it with
  the exact global norm (the logged ``grad_norm``) and clips the host gradients.
- ``AcceleratedOptimizer.step()`` / ``zero_grad()`` reach ours whenever ``sync_gradients``
  is True, which is exactly the closing micro-batch: ``step()`` finishes the step.
- Several processes (DDP): the callback is given the model DDP wraps; the optimizer finds
  the wrapper and updates from its all-reduced buckets. The Trainer runs the other
  micro-batches of a window under ``no_sync``, so nothing is reduced before the closing one.
- fp16 with a GradScaler: a step the scaler skips is reported to accelerate
  (``integrations.accelerate.report_skipped_steps``, both modes), so the Trainer holds the
  LR schedule on that step as it does with AdamW.

The hooks are removed at ``on_train_end``, and before attaching again if an earlier
``train()`` ended in an exception.

Saving: the Trainer writes the optimizer with ``torch.save(optimizer.state_dict(), path)``,
which holds every tensor it pickles until the end, so the NVMe tier's entries (read from
its files when pickled) are all in RAM at once. ``stream_saves(trainer)`` makes the
Trainer write that same file with ``adambridge.checkpoint.save``, one tensor at a time;
``resume_from_checkpoint`` loads it with the Trainer's own ``torch.load``. Under
shard_state every rank calls ``opt.save_gathered`` and the saving process writes: one
tensor of the state is gathered at a time instead of the whole state on every rank.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers import trainer as hf_trainer

from .. import checkpoint
from ..optimizer import AdamBridge
from ._common import gathers, innermost, unwrap_optimizer

_WHO = "AdamBridgeCallback"
# TrainingArguments.optim values that mean plain AdamW: the ones AdamBridge stands in for.
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def optimizer_cls_and_kwargs(args: Any, **adambridge_kwargs: Any) -> tuple[type, dict]:
    """``(AdamBridge, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    The Trainer passes only the parameter groups (with ``args.weight_decay``), so lr, betas
    and eps are taken from ``args`` here; ``adambridge_kwargs`` (precision, seed, ...) win.
    """
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _ADAMW_OPTIMS:
        raise ValueError(f"TrainingArguments.optim={optim!r} asks for another optimizer than "
                         f"AdamW; leave optim at its default when using AdamBridge")
    if args.optim_args:
        raise ValueError("TrainingArguments.optim_args is not read by AdamBridge; pass those "
                         "options to optimizer_cls_and_kwargs(args, ...) instead")
    kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                  eps=args.adam_epsilon)
    kwargs.update(adambridge_kwargs)
    return AdamBridge, kwargs


def stream_saves(trainer: Trainer) -> Trainer:
    """Make ``trainer`` write its optimizer checkpoint with ``adambridge.checkpoint.save``.

    The file, its name and its loading are the Trainer's own; only the writing streams, so
    saving the NVMe tier holds one tensor of its state instead of all of it (shard_state:
    ``opt.save_gathered`` on every rank, the saving process writing). Set-ups where
    the Trainer does not save with ``torch.save`` (DeepSpeed, FSDP, XLA, SageMaker MP) keep
    the Trainer's save. Returns ``trainer``.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"stream_saves(trainer): trainer is {type(trainer).__name__}, not a "
                        f"transformers.Trainer; pass the Trainer you will train")
    own = trainer._save_optimizer_and_scheduler
    if getattr(own, "streams", False):
        return trainer

    def save_optimizer_and_scheduler(output_dir: str) -> None:
        if not _saves_with_torch_save(trainer):
            own(output_dir)
            return
        path = os.path.join(output_dir, hf_trainer.OPTIMIZER_NAME)
        if gathers(trainer.optimizer):  # a collective: every rank, the saving one writes
            innermost(trainer.optimizer).save_gathered(path if trainer.args.should_save
                                                       else None)
        elif trainer.args.should_save:
            checkpoint.save(trainer.optimizer.state_dict(), path)
        if trainer.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(trainer.lr_scheduler.state_dict(),
                           os.path.join(output_dir, hf_trainer.SCHEDULER_NAME))
            hf_trainer.reissue_pt_warnings(caught)

    save_optimizer_and_scheduler.streams = True
    # NOTE: the Trainer has no hook between state_dict() and its torch.save, so the one
    # method that makes both is replaced on this Trainer only, for the set-up it handles.
    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, AdamBridgeCallback):
            callback.saves_stream = True
    return trainer


def _saves_with_torch_save(trainer: Trainer) -> bool:
    """Whether the Trainer saves the optimizer with plain torch.save (its last branch)."""
    return not (hf_trainer.is_torch_xla_available() or hf_trainer.is_sagemaker_mp_enabled()
                or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)


def _saves_optimizer(args: Any) -> bool:
    # (getattr: arguments made by hand, as a stand-in for TrainingArguments, may lack them)
    strategy = getattr(args, "save_strategy", "no")
    return str(getattr(strategy, "value", strategy)) != "no" and \
        not getattr(args, "save_only_model", False)


def _check_unstreamed_saves(opt: AdamBridge, args: Any) -> None:
    """The Trainer's own torch.save: refused where it would hang, a warning where it holds
    the NVMe tier's state in RAM."""
    if opt.shard_group is not None and args.world_size > 1:
        raise ValueError(f"{_WHO}: the Trainer saves the optimizer on one process and "
                         f"shard_state's state_dict() gathers from every rank, so its first "
                         f"save would hang; call adambridge.integrations.transformers."
                         f"stream_saves(trainer) before train()")
    if opt.nvme_tier is not None:
        warnings.warn("the Trainer's checkpoints hold the NVMe tier's whole state in RAM "
                      "while saving (torch.save); call adambridge.integrations."
                      "transformers.stream_saves(trainer) once to save it streamed",
                      stacklevel=3)


class AdamBridgeCallback(TrainerCallback):
    """Checks the Trainer's settings and, with ``async_mode``, attaches the hooks for ``train()``.

    Without ``stream_saves(trainer)`` (called after the callbacks are in the Trainer) it
    warns once with the NVMe tier, whose state the Trainer's saves would hold in RAM, and
    refuses shard_state on several ranks, where the Trainer's first save would hang.
    """

    def __init__(self, async_mode: bool = True) -> None:
        self.async_mode = bool(async_mode)
        self.saves_stream = False
        self._attached: Optional[AdamBridge] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = unwrap_optimizer(kwargs.get("optimizer"), _WHO)
        if not self.saves_stream and _saves_optimizer(args):
            _check_unstreamed_saves(opt, args)
        from .accelerate import report_skipped_steps
        report_skipped_steps(kwargs["optimizer"])
        if not self.async_mode:
            return
        _refuse_async_settings(args)
        self._detach()  # an earlier train() that raised left them on
        from accelerate.state import GradientState
        gradient_state = GradientState()  # the Trainer's accelerator shares this state
        opt.attach_hooks(kwargs["model"],
                         closes_window=lambda: bool(gradient_state.sync_gradients))
        self._attached = opt

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    def _detach(self) -> None:
        opt, self._attached = self._attached, None
        if opt is not None:
            opt.detach_hooks()


def _refuse_async_settings(args: Any) -> None:
    """Settings under which the hooks would see gradients the Trainer changes afterwards."""
    if args.deepspeed:
        raise ValueError(f"{_WHO}(async_mode=True) does not work with TrainingArguments."
                         f"deepspeed (DeepSpeed owns the step); use async_mode=False or drop it")
    if args.fsdp:
        raise ValueError(f"{_WHO}(async_mode=True) does not support TrainingArguments.fsdp "
                         f"(FSDP shards gradients after the hooks run); use async_mode=False")
    # Several processes otherwise mean DDP, which the optimizer follows itself: it updates
    # from DDP's all-reduced buckets (distributed/fsdp.py), found from the model it is given.
