"""Hugging Face accelerate: asynchronous mode under ``accelerator.prepare`` and ``accumulate``.

    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    adambridge.integrations.accelerate.attach_hooks(accelerator, model, optimizer)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

``prepare`` wraps the optimizer in ``AcceleratedOptimizer``, which hides ``attach_hooks``;
this module unwraps it. ``accelerator.accumulate`` sets ``sync_gradients`` before each
backward, so the hooks update exactly on the backward that closes the window, and
``AcceleratedOptimizer.step()`` calls ours on that micro-batch only.
``accelerator.clip_grad_norm_`` ends in ``torch.nn.utils.clip_grad_norm_``, which the
optimizer answers while hooks are attached. Several processes: ``prepare`` wraps the model
in DistributedDataParallel, whose all-reduced buckets the optimizer updates from (its comm
hook, see distributed/fsdp.py), so the hooks go on that wrapper; ``accumulate`` runs the other
micro-batches under ``no_sync``, so nothing is reduced or updated before the closing one. ``save_state`` / ``load_state`` go through
``state_dict`` / ``load_state_dict`` and may be called with hooks attached.

fp16 with a GradScaler: GradScaler hands AdamBridge its inf flag, so our ``step()`` runs and
skips itself, while accelerate counts a step as skipped only when ``step()`` was not called
(its scheduler would then advance on a skipped step). ``report_skipped_steps(optimizer)``
(done by ``attach_hooks``; call it yourself in synchronous mode) tells accelerate.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..optimizer import AdamBridge
from ._common import unwrap_optimizer

_WHO = "adambridge.integrations.accelerate.attach_hooks"


def attach_hooks(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> AdamBridge:
    """Attach AdamBridge's hooks under ``accelerator``; returns the unwrapped optimizer.

    ``model`` and ``optimizer`` may be what ``accelerator.prepare`` returned. The window
    closes when ``accelerator.sync_gradients`` is True during backward (always, without
    gradient accumulation). Remove the hooks with ``detach_hooks(optimizer)``.
    """
    _refuse(accelerator)
    opt = unwrap_optimizer(optimizer, _WHO)
    report_skipped_steps(optimizer)
    gradient_state = accelerator.gradient_state
    opt.attach_hooks(_ddp_in(model) or accelerator.unwrap_model(model),
                     closes_window=lambda: bool(gradient_state.sync_gradients))
    return opt


def _ddp_in(model: Any) -> Any:
    """The DistributedDataParallel that ``prepare`` wrapped the model in, or None."""
    seen = set()
    while model is not None and id(model) not in seen:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        seen.add(id(model))
        model = getattr(model, "_orig_mod", None)  # a torch.compile'd wrapper
    return None


def detach_hooks(optimizer: Any) -> None:
    """Remove the hooks of the AdamBridge under ``optimizer`` (a prepared one is fine)."""
    unwrap_optimizer(optimizer, "adambridge.integrations.accelerate.detach_hooks").detach_hooks()


_reporting: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def report_skipped_steps(optimizer: Any) -> None:
    """Make a prepared optimizer's ``step_was_skipped`` true when GradScaler skipped our step."""
    opt = unwrap_optimizer(optimizer, "adambridge.integrations.accelerate.report_skipped_steps")
    if optimizer is opt:
        return  # not wrapped by accelerate
    previous = _reporting.pop(opt, None)
    if previous is not None:
        if previous[1]() is optimizer:
            _reporting[opt] = previous  # this wrapper is told already
            return
        previous[0].remove()  # a new prepare() wrapped it again: report to the new wrapper
    wrapper = weakref.ref(optimizer)

    def after_step(inner: Any, args: Any, kwargs: Any) -> None:
        outer, stats = wrapper(), inner.last_step_stats
        # accelerate sets step_was_skipped from whether its patched step() was reached.
        if outer is not None and stats is not None and stats.skipped:
            outer._accelerate_step_called = False

    _reporting[opt] = (opt.register_step_post_hook(after_step), wrapper)


def _refuse(accelerator: Any) -> None:
    """Set-ups where the hooks would see gradients that accelerate still changes (DDP,
    the multi-process default, is handled by the optimizer itself)."""
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                DistributedType.XLA):
        raise ValueError(f"{_WHO}: accelerate's {kind.value} plugin is not supported in "
                         f"asynchronous mode; use AdamBridge without hooks (opt.step()) there")
