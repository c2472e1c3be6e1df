"""The tiny model most tests train: an MLP of ``nn.Linear`` layers with one kind of module
between them, built after ``torch.manual_seed(seed)`` so its weights are the same in every
test that asks for the same shape. tests/conftest.py puts tests/helpers on sys.path, so any
test takes it with ``from _tiny import tiny_mlp``."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

_BETWEEN = {"gelu": lambda width: nn.GELU(), "tanh": lambda width: nn.Tanh(),
            "relu": lambda width: nn.ReLU(), "layernorm": nn.LayerNorm}


def tiny_mlp(widths: Sequence[int], between: str = "gelu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> nn.Sequential:
    """Linear(widths[0], widths[1]), <between>, Linear(widths[1], widths[2]), ... in ``dtype``."""
    if between not in _BETWEEN:
        raise ValueError(f"between={between!r}: expected one of {sorted(_BETWEEN)}")
    torch.manual_seed(seed)
    layers: list = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(_BETWEEN[between](fan_in))
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers).to(dtype)
