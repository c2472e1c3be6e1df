"""The synchronous step's GradScaler and clipping: torch's own kernels, on p.grad."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..pipeline import interception

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


def sync_amp(opt: OptimizerDoor) -> bool:
    """GradScaler in synchronous mode: False to skip the step, else unscale each p.grad."""
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None and float(torch.as_tensor(found_inf).sum()) > 0:
        return False
    grad_scale = getattr(opt, "grad_scale", None)
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float()
        by_device: dict = {}
        for p in _params_with_grad(opt):
            by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_device.items():
            unused = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, unused,
                                                             inv_scale.to(device))
    return True


def sync_clip(opt: OptimizerDoor) -> float:
    """``max_grad_norm`` in synchronous mode: torch's own clip_grad_norm_; the total norm."""
    clip = interception.original_clip_grad_norm_()
    return float(clip(_params_with_grad(opt), opt.max_grad_norm))


def _params_with_grad(opt: OptimizerDoor) -> list:
    return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
