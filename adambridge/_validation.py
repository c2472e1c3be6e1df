"""Argument checks of AdamBridge: each raises a one-line error naming the argument and value."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from .update.functional import BACKENDS, PRECISIONS

# torch.optim.AdamW flags this optimizer does not implement: refused when truthy.
UNSUPPORTED_TORCH_FLAGS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The seed's README spells precisions as e.g. "bf16_moments"; both spellings are accepted.
_PRECISION_ALIASES = {f"{p}_moments": p for p in PRECISIONS}


def torch_flags(flags: dict, unsupported: Iterable[str]) -> None:
    for name, value in flags.items():
        if name not in unsupported:
            raise TypeError(f"AdamBridge got an unexpected keyword argument {name!r}")
        if value:
            raise ValueError(f"Unsupported torch.optim flag: {name}={value!r} "
                             f"(AdamBridge does not implement it; remove the argument)")


def group_flags(group: dict, where: str) -> None:
    """torch.optim.AdamW flags in a param group (or a loaded one): refused when truthy."""
    for name in UNSUPPORTED_TORCH_FLAGS:
        value = group.get(name)
        if value:
            raise ValueError(f"Unsupported torch.optim flag in {where}: {name}={value!r} "
                             f"(AdamBridge does not implement it; set it to False or remove it)")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any, *, where: str = "",
                    finite: bool = False) -> None:
    """lr, betas, eps and weight_decay in range; ``finite`` also refuses inf (loaded values)."""
    prefix = f"{where}: " if where else ""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{prefix}Tensor lr must be 1-element, got {lr.numel()} elements")
        lr_value = float(lr)
    else:
        lr_value = lr
    bounded = (lambda x: math.isfinite(x)) if finite else (lambda x: True)
    if not _real(lr_value) or not 0.0 <= lr_value or not bounded(lr_value):
        raise ValueError(f"{prefix}Invalid learning rate: {lr!r}")
    if not _real(eps) or not 0.0 <= eps or not bounded(eps):
        raise ValueError(f"{prefix}Invalid epsilon value: {eps!r}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{prefix}Invalid betas: {betas!r} (expected a pair of floats)")
    for index, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):  # as torch.optim.AdamW: a 1-element tensor
            if beta.numel() != 1:
                raise ValueError(f"{prefix}Tensor betas[{index}] must be 1-element, got "
                                 f"{beta.numel()} elements")
            beta = float(beta)
        if not _real(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{prefix}Invalid beta parameter at index {index}: {beta!r}")
    if not _real(weight_decay) or not 0.0 <= weight_decay or not bounded(weight_decay):
        raise ValueError(f"{prefix}Invalid weight_decay value: {weight_decay!r}")


def _choice(name: str, value: Any, valid: tuple) -> str:
    if not isinstance(value, str) or value not in valid:
        listed = ", ".join(repr(v) for v in valid)
        raise ValueError(f"Invalid {name}: {value!r} (valid: {listed})")
    return value


def precision(value: Any, name: str = "precision") -> str:
    value = _PRECISION_ALIASES.get(value, value) if isinstance(value, str) else value
    return _choice(name, value, PRECISIONS)


def backend(value: Any) -> str:
    return _choice("backend", value, BACKENDS)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: {value!r} (expected True or False)")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 0)")
    return value


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1)")
    return value


def max_grad_norm(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Invalid max_grad_norm: {value!r} (expected None or a number > 0)")
    return float(value)


def optional_positive_int(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected None or an integer >= 1)")
    return value


def chunk_size(value: Any) -> int:
    if value is None:
        return 1 << 24
    value = optional_positive_int("chunk_size", value)
    if value % 128:
        raise ValueError(f"Invalid chunk_size: {value} (must be a multiple of 128, "
                         f"the fp8 block, e.g. {max(128, value // 128 * 128)})")
    return value


def seed(value: Any, name: str = "seed") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer in [0, 2**64))")
    return value


def autotune(value: Any) -> Any:
    from .autotune import AutoTuneConfig
    if value is False or value is None:
        return None
    if value is True:
        return AutoTuneConfig()
    if isinstance(value, AutoTuneConfig):
        return value
    raise TypeError(f"Invalid autotune: {value!r} (expected a bool or an AutoTuneConfig)")


def parameter(p: torch.Tensor, index: int) -> None:
    if p.is_complex():
        raise ValueError(f"Invalid parameter {index}: complex dtype {p.dtype} is not supported "
                         f"(view it as real with torch.view_as_real)")
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        raise ValueError(f"Invalid parameter {index}: dtype {p.dtype} is not supported "
                         f"(use float32, bfloat16 or float16)")


def gradient(p: torch.Tensor, index: int, layout: Optional[tuple]) -> None:
    grad = p.grad
    if grad.is_sparse:
        raise RuntimeError(f"Invalid gradient of parameter {index}: sparse gradients are not "
                           f"supported (use a dense embedding, sparse=False)")
    if grad.shape != p.shape:
        raise ValueError(f"Invalid gradient of parameter {index}: shape {tuple(grad.shape)} "
                         f"does not match the parameter's {tuple(p.shape)}")
    if grad.dtype not in SUPPORTED_PARAM_DTYPES:
        raise ValueError(f"Invalid gradient of parameter {index}: dtype {grad.dtype} "
                         f"(expected float32, bfloat16 or float16)")
    unchanged_layout(p, index, layout)


def unchanged_layout(p: torch.Tensor, index: int, layout: Optional[tuple]) -> None:
    """The parameter still has the (shape, dtype) its state was created for."""
    if layout is not None and layout != (p.shape, p.dtype):
        shape, dtype = layout
        raise ValueError(f"Parameter {index} changed from {tuple(shape)} {dtype} to "
                         f"{tuple(p.shape)} {p.dtype} between steps; build a new optimizer "
                         f"for the changed model")
