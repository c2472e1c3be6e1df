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

Saving: ``save_state`` writes each optimizer with ``torch.save(optimizer.state_dict(), f)``,
which holds every tensor it pickles until the end, so the NVMe tier's entries (read from
its files when pickled) are all in RAM at once. ``stream_saves(accelerator)`` (done by
``attach_hooks``) makes ``save_state`` write those same files with
``adambridge.checkpoint.save``, one tensor at a time; ``load_state`` reads them as ever.
A shard_state optimizer's file is written by ``opt.save_gathered`` on every process (the
main one writing), so its state is gathered one tensor at a time, not whole on each.

fp16 with a GradScaler: GradScaler hands AdamBridge its inf flag, so our ``step()`` runs and
skips itself, while accelerate counts a step as skipped only when ``step()`` was not called
(its scheduler would then advance on a skipped step). ``report_skipped_steps(optimizer)``
(done by ``attach_hooks``; call it yourself in synchronous mode) tells accelerate.
"""
from __future__ import annotations

import re
import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate import accelerator as accelerator_module
from accelerate import checkpointing
from accelerate.state import PartialState
from accelerate.utils import OPTIMIZER_NAME, DistributedType

from .. import checkpoint
from ..optimizer import AdamBridge
from ._common import Gathered, gathers, innermost, unwrap_optimizer

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
    stream_saves(accelerator)
    gradient_state = accelerator.gradient_state
    opt.attach_hooks(_ddp_in(model) or accelerator.unwrap_model(model),
                     closes_window=lambda: bool(gradient_state.sync_gradients))
    return opt


# save_accelerator_state's optimizer files: optimizer.bin, optimizer_1.bin, ...
_OPTIMIZER_FILE = re.compile(rf"{re.escape(OPTIMIZER_NAME)}(_[0-9]+)?\.bin")


def stream_saves(accelerator: Any) -> Any:
    """Make ``accelerator.save_state`` write its optimizer files with
    ``adambridge.checkpoint.save`` (the same files, written one tensor at a time).

    Returns ``accelerator``. ``load_state`` reads the files as ever. Model weights,
    schedulers and the rest are saved by accelerate as before.
    """
    own = accelerator.save_state
    if getattr(own, "streams", False):
        return accelerator

    def save_state(*args: Any, **kwargs: Any) -> Any:
        # NOTE: accelerate writes each optimizer's state_dict() with its module-level save()
        # and offers no hook in between, so that one function is replaced for the duration
        # of this call; it hands every other file (and any other caller) to accelerate's.
        # Its save_accelerator_state, which calls state_dict() on every process, is given
        # stand-ins for shard_state optimizers, so their state is gathered only as written.
        accelerate_save, save_states = checkpointing.save, accelerator_module.save_accelerator_state
        checkpointing.save = _streaming_save(accelerate_save)
        accelerator_module.save_accelerator_state = _gathering_states(save_states)
        try:
            return own(*args, **kwargs)
        finally:
            checkpointing.save = accelerate_save
            accelerator_module.save_accelerator_state = save_states

    save_state.streams = True
    accelerator.save_state = save_state
    return accelerator


class _Gathering:
    """Stands in for a shard_state optimizer in save_accelerator_state: its state_dict()
    is the optimizer itself, which the streaming save() writes with save_gathered()."""

    def __init__(self, opt: AdamBridge) -> None:
        self.opt = opt

    def state_dict(self) -> Gathered:
        return Gathered(self.opt, "a shard_state optimizer's state in accelerate's save_state "
                                  "is written by adambridge's streaming save only; call "
                                  "accelerator.save_state() on every process")


def _gathering_states(save_states: Any) -> Any:
    def save_accelerator_state(output_dir: Any, model_states: Any, optimizers: list,
                               *args: Any, **kwargs: Any) -> Any:
        stand_ins = [_Gathering(innermost(o)) if gathers(o) else o for o in optimizers]
        return save_states(output_dir, model_states, stand_ins, *args, **kwargs)
    return save_accelerator_state


def _streaming_save(accelerate_save: Any) -> Any:
    def save(obj: Any, f: Any, save_on_each_node: bool = False,
             safe_serialization: bool = False) -> None:
        streams = (not safe_serialization and isinstance(f, (str, Path))
                   and _OPTIMIZER_FILE.fullmatch(Path(f).name) is not None
                   and PartialState().distributed_type != DistributedType.XLA)
        if not streams and not isinstance(obj, Gathered):
            accelerate_save(obj, f, save_on_each_node=save_on_each_node,
                            safe_serialization=safe_serialization)
            return
        state = PartialState()  # the processes accelerate's save() writes from
        writes = state.is_local_main_process if save_on_each_node else state.is_main_process
        if isinstance(obj, Gathered):  # a collective: every process, the writing one writes
            obj.opt.save_gathered(f if writes else None)
        elif writes:
            checkpoint.save(obj, f)
    return save


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
