"""Routes torch's gradient clipping and GradScaler's unscale to attached pipelines.

In asynchronous mode ``p.grad`` of a gradient a hook has taken is a GradView
(pipeline/grad_views.py): any function may read or change it and gets sync mode's result,
so nothing here is needed for correctness. What is routed is what has a cheaper exact form
on the host copies the pipeline already holds, and tells the pipeline a step-wide fact
before it has to redo anything:

- ``clip_grad_norm_`` / ``clip_grads_with_norm_`` over parameters an attached pipeline owns
  are answered by that pipeline (the norm of the host gradients with torch's own formulas,
  the clip applied to them, the max_norm remembered so that later steps keep what a redo
  needs and stop updating early once the norm passes it: pipeline/step_wide.py); every other
  call goes to torch unchanged. torch's own ``clip_grad_norm_``, bound by name before the
  wrappers went in, takes its norm from the views and calls clip_grad.py's
  ``_clip_grads_with_norm_``, which is wrapped too.
- ``GradScaler._unscale_grads_`` for an optimizer with hooks attached is answered by its
  pipeline (unscale and inf check of the host gradients; the step is held until it decides).
- ``torch.nn.Module.zero_grad(set_to_none=False)``: a gradient the last step consumed is
  None (``release_grads``), which torch's zeroing skips; sync mode would zero it, and a
  parameter that then gets no gradient (an MoE expert without tokens) would step on the
  zeros. The pipelines owning the module's parameters give those gradients their zeros
  back, as ``AdamBridge.zero_grad(set_to_none=False)`` does.

The wrappers are installed by the first attach and removed by the last detach.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad_module

from . import step_wide

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_lock = threading.Lock()
_pipelines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_originals: dict = {}
_checked: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()  # check_sync_step's
_generation = [0]  # bumped by every register/unregister (check_sync_step's cache)


def _params(parameters: Any) -> list:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _claims(pipeline: Any, p: torch.Tensor) -> bool:
    # Ownership, not only a hook: a parameter under small_param_threshold has no hook, but
    # once its step is settled (e.g. by GradScaler.unscale_) its gradient has left p.grad
    # too, and only the pipeline still has it. (The distributed pipelines own what they hook.)
    owns = getattr(pipeline, "owns", None)
    return owns(p) if owns is not None else pipeline.hooks(p)


def _owners(params: list) -> list:
    """The attached pipelines owning any of ``params``, each once."""
    return list({id(pl): pl for pl in list(_pipelines) for p in params
                 if _claims(pl, p)}.values())


def _split(owners: list, params: list) -> list:
    """Each owner's share of ``params``; the first also takes the parameters nobody owns
    (its clip treats them as torch would, on p.grad), so no gradient is clipped twice."""
    shares = [[p for p in params if _claims(pl, p)] for pl in owners]
    claimed = {id(p) for share in shares for p in share}
    shares[0] += [p for p in params if id(p) not in claimed]
    return shares


def _clip_norm(params: list, max_norm: float, norm_type: float,
               error_if_nonfinite: bool) -> Optional[torch.Tensor]:
    """clip_grad_norm_ answered by the owning pipeline(s); None when none owns a parameter."""
    owners = _owners(params)
    if not owners:
        return None
    if len(owners) == 1:
        return owners[0].clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite)
    # Several optimizers with hooks: one total norm over all of them, as torch takes it (the
    # per-tensor norms in the order of ``params``), then each clips its share with it.
    shares = _split(owners, params)
    grads: dict = {}
    for pl, share in zip(owners, shares):
        grads.update(zip(map(id, share), pl.settled_grads(share)))
    norms = [step_wide.vector_norm(grads[id(p)], norm_type) for p in params
             if grads.get(id(p)) is not None]
    total = step_wide.total_norm(norms, norm_type)
    if error_if_nonfinite:
        step_wide.check_finite_norm(total, norm_type)
    for pl, share in zip(owners, shares):
        pl.clip_with_norm(share, max_norm, total)
    return total.to(params[0].device)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    params = _params(parameters)
    total = _clip_norm(params, float(max_norm), float(norm_type), error_if_nonfinite)
    if total is None:
        return _originals["clip_grad_norm_"](params, max_norm, norm_type,
                                             error_if_nonfinite, foreach)
    return total


def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                          foreach: Optional[bool] = None) -> None:
    params = _params(parameters)
    owners = _owners(params)
    if not owners:
        return _originals["clip_grads_with_norm_"](params, max_norm, total_norm, foreach)
    for pl, share in zip(owners, _split(owners, params)):
        pl.clip_with_norm(share, float(max_norm), total_norm)
    return None


def _unscale_grads_(scaler: Any, optimizer: Any, inv_scale: torch.Tensor,
                    found_inf: torch.Tensor, allow_fp16: bool) -> dict:
    pipeline = getattr(optimizer, "_pipeline", None)
    if pipeline is None or pipeline not in _pipelines:
        return _originals["_unscale_grads_"](scaler, optimizer, inv_scale, found_inf, allow_fp16)
    return pipeline.unscale_grads(inv_scale, found_inf, allow_fp16)


def _module_zero_grad(module: torch.nn.Module, set_to_none: bool = True) -> None:
    _originals["module_zero_grad"](module, set_to_none)
    if not set_to_none:
        params = list(module.parameters())
        for pipeline in _owners(params):
            pipeline.zero_grads_kept(params)  # (every kind of pipeline has it)


_WRAPPERS = {
    "clip_grad_norm_": clip_grad_norm_,
    "clip_grads_with_norm_": clip_grads_with_norm_,
}


def _install() -> None:
    # Public names of torch.nn.utils, and the same objects where clip_grad.py defines them
    # (clip_grads_with_norm_ is _clip_grads_with_norm_ there).
    for name, wrapper in _WRAPPERS.items():
        original = getattr(nn_utils, name, None)
        if original is None:
            continue
        _originals[name] = original
        setattr(nn_utils, name, wrapper)
        for module_name, value in list(vars(clip_grad_module).items()):
            if value is original:
                setattr(clip_grad_module, module_name, wrapper)
    from torch.amp.grad_scaler import GradScaler
    _originals["_unscale_grads_"] = GradScaler._unscale_grads_
    GradScaler._unscale_grads_ = _unscale_grads_
    _originals["module_zero_grad"] = torch.nn.Module.zero_grad
    torch.nn.Module.zero_grad = _module_zero_grad


def _uninstall() -> None:
    for name, wrapper in _WRAPPERS.items():
        if name not in _originals:
            continue
        for module in (nn_utils, clip_grad_module):
            for module_name, value in list(vars(module).items()):
                if value is wrapper:
                    setattr(module, module_name, _originals[name])
    from torch.amp.grad_scaler import GradScaler
    if GradScaler.__dict__.get("_unscale_grads_") is _unscale_grads_:
        GradScaler._unscale_grads_ = _originals["_unscale_grads_"]
    if vars(torch.nn.Module).get("zero_grad") is _module_zero_grad:
        torch.nn.Module.zero_grad = _originals["module_zero_grad"]
    _originals.clear()


def register(pipeline: Any) -> None:
    with _lock:
        if not _originals:
            _install()
        _pipelines.add(pipeline)
        _generation[0] += 1


def unregister(pipeline: Any) -> None:
    with _lock:
        _pipelines.discard(pipeline)
        _generation[0] += 1
        if not _pipelines and _originals:
            _uninstall()


def release_unused() -> None:
    """Remove the wrappers once no pipeline is left (also when pipelines were collected)."""
    with _lock:
        if _originals and not any(True for _ in _pipelines):
            _uninstall()


def original_clip_grad_norm_() -> Any:
    """torch's own clip_grad_norm_, whether or not the wrapper is installed."""
    return _originals.get("clip_grad_norm_", nn_utils.clip_grad_norm_)


def owned_anywhere(params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    """The first of ``params`` that an attached pipeline owns, or None."""
    pipelines = list(_pipelines)
    return next((p for p in params if any(_claims(pl, p) for pl in pipelines)), None)


def check_sync_step(opt: OptimizerDoor) -> None:
    """Refuse a synchronous step over a parameter another optimizer's pipeline owns.

    That pipeline takes the gradient out of p.grad (release_grads) and updates p itself, so
    this step would silently skip p, or update it from a gradient the other already used.
    Checked again only when the attached pipelines or this optimizer's parameters change.
    """
    if not _pipelines:
        return
    count = sum(len(group["params"]) for group in opt.param_groups)  # per step: no list
    key = (_generation[0], id(opt.param_groups), count)
    if _checked.get(opt) == key:
        return
    shared = owned_anywhere(p for group in opt.param_groups for p in group["params"])
    if shared is not None:
        raise RuntimeError(f"step(): parameter {opt.index(shared)} also belongs to another "
                           f"AdamBridge optimizer with hooks attached, which updates it; give "
                           f"each optimizer its own parameters")
    _checked[opt] = key
