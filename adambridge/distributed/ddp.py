"""Asynchronous mode under DDP: the wrapper found from what attach_hooks is given, and its comm hook.

A per-parameter hook would run before DDP's all-reduce and see this rank's own gradient, so
under DDP the hooks stay off and a DDP comm hook all-reduces each bucket and hands the
reduced slices to the pipeline (``hand_over_reduced``); every rank then updates with the
same averaged gradient.

Finding the wrapper. DDP leaves nothing on the module it wraps or on its parameters (its
reducer's hooks live in C++), so the wrapper is found from what the user passes:

- ``model`` is the DDP model, or holds one among its modules: found at once.
- ``model`` is any other module while torch.distributed runs with more than one rank (the
  module DDP wraps, ``ddp.module``; a module wrapped after attach_hooks; a model that no DDP
  wraps): no gradient hook is registered, so no gradient is used before it is reduced, and
  every gradient goes to the host at ``step()``, as the synchronous step takes it. A forward
  pre-hook on the module and its submodules asks DDP which wrapper's forward is running
  (``DistributedDataParallel._get_active_ddp_module``, what TorchDynamo asks); the first
  forward run inside a DDP holding these parameters binds the comm hook to that DDP, and
  from the next backward the updates overlap it.
- ``model=None`` with more than one rank: refused in one line (nothing to look at).
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Optional

import torch

_log = logging.getLogger("adambridge")


def _ddp_type() -> Optional[type]:
    module = sys.modules.get("torch.nn.parallel")
    return getattr(module, "DistributedDataParallel", None) if module is not None else None


def world_size() -> int:
    """The default process group's size; 1 when torch.distributed is not initialized."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def wrapper_in(model: Optional[torch.nn.Module]) -> Optional[Any]:
    """The DistributedDataParallel that ``model`` is or holds, else None (no heap scan)."""
    ddp_type = _ddp_type()
    if model is None or ddp_type is None:
        return None
    return next((m for m in model.modules() if isinstance(m, ddp_type)), None)


def refuse_unknown_wrapper(model: Optional[torch.nn.Module], what: str) -> None:
    """Refuse attach_hooks(None) with several ranks: no module to find DDP through."""
    ranks = world_size()
    if model is None and ranks > 1:
        raise ValueError(f"{what} with no model under torch.distributed ({ranks} ranks) cannot "
                         f"tell whether DDP reduces the gradients; pass the model: "
                         f"opt.attach_hooks(ddp_model)")


# --------------------------------------------------------------------------- late binding


def bind_when_wrapped(model: torch.nn.Module, pipeline: Any) -> None:
    """Until a DDP's forward runs ``model``, its gradients go at step(); then bind that DDP.

    Forward pre-hooks on model and its submodules (a framework may call only a submodule
    from inside DDP's forward, as Lightning's wrapper calls training_step); they are removed
    once bound, when the hooks are detached, or with the pipeline.
    """
    state = {"warned": False, "handles": []}
    ours = {id(p) for p in model.parameters() if pipeline.hooks(p)}
    hook = _pre_hook(weakref.ref(pipeline), ours, state)
    state["handles"] = [m.register_forward_pre_hook(hook) for m in model.modules()]
    weakref.finalize(pipeline, _remove, state["handles"])


def _pre_hook(pipeline_ref: "weakref.ref", ours: set, state: dict):
    def before_forward(module: torch.nn.Module, args: Any) -> None:
        pipeline = pipeline_ref()
        if pipeline is None or pipeline.opt is None or pipeline.opt.pipeline is not pipeline:
            _remove(state["handles"])  # detached: the pipeline is done
            return
        ddp = _active_wrapper()
        if ddp is not None and any(id(p) in ours for p in ddp.parameters()):
            _remove(state["handles"])
            hand_over_reduced(ddp, pipeline)
        elif ddp is None and torch.is_grad_enabled() and not state["warned"]:
            state["warned"] = True
            _log.warning("adambridge: attach_hooks(model) under torch.distributed with %d "
                         "ranks: this forward ran outside DDP, so the gradients of its "
                         "backward are updated at step(), as synchronous step() would (no "
                         "overlap); pass the DDP model to attach_hooks", world_size())
    return before_forward


def _active_wrapper() -> Optional[Any]:
    ddp_type = _ddp_type()
    active = getattr(ddp_type, "_get_active_ddp_module", None)
    return active() if active is not None else None


def _remove(handles: list) -> None:
    while handles:
        handles.pop().remove()


# --------------------------------------------------------------------------- the comm hook


def hand_over_reduced(ddp: Any, pipeline: Any) -> None:
    """Asynchronous mode under DDP: each bucket is all-reduced (averaged, as DDP's default
    hook does), then its hooked parameters' slices of it go to ``pipeline`` as their
    gradients, in backward; the rest are sent from p.grad, reduced by then, at the step.

    The comm hook is registered once per DDP model (DDP allows one) and follows the
    pipeline attached last; without one it only all-reduces.
    """
    refuse_foreign_comm_hook(ddp)
    previous = getattr(ddp, "_adambridge_pipeline", None)
    ddp._adambridge_pipeline = weakref.ref(pipeline)
    if previous is None:
        ddp.register_comm_hook(weakref.ref(ddp), _reduce_then_update)


def refuse_foreign_comm_hook(ddp: Any) -> None:
    """Refuse a DDP model whose one comm hook is someone else's."""
    if getattr(ddp, "_adambridge_pipeline", None) is None and getattr(ddp, "_comm_hooks", None):
        raise RuntimeError("attach_hooks() on a DDP model that already has a comm hook: "
                           "adambridge needs DDP's one comm hook; remove yours")


def _reduce_then_update(ddp_ref, bucket):  # DDP checks a comm hook's annotations: none
    import torch.distributed as dist
    ddp = ddp_ref()
    group = ddp.process_group if ddp is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    # Waits here (the host update must see the sum; on CUDA the stream waits, not the CPU).
    dist.all_reduce(buffer, group=group, async_op=True).wait()
    pipeline_ref = getattr(ddp, "_adambridge_pipeline", None)
    pipeline = pipeline_ref() if pipeline_ref is not None else None
    if pipeline is not None and pipeline.opt is not None and pipeline.opt.pipeline is pipeline:
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            # No p.grad: unused by this rank's backward (find_unused_parameters, static_graph);
            # step() sends it from p.grad if DDP writes another rank's reduced one there.
            if pipeline.hooks(p) and p.grad is not None:
                pipeline.on_grad(p, grad)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
