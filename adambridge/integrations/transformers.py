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
"""
from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback

from ..optimizer import AdamBridge
from ._common import unwrap_optimizer

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


class AdamBridgeCallback(TrainerCallback):
    """Checks the Trainer's settings and, with ``async_mode``, attaches the hooks for ``train()``."""

    def __init__(self, async_mode: bool = True) -> None:
        self.async_mode = bool(async_mode)
        self._attached: Optional[AdamBridge] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = unwrap_optimizer(kwargs.get("optimizer"), _WHO)
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
