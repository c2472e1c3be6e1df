"""Our fp8 checkpoints in torch.optim.AdamW: the one conversion they need, and the refusal when it is skipped.

fp32 and bf16 moments are saved as torch's ``exp_avg`` / ``exp_avg_sq``, which AdamW takes
as they are. fp8 moments are codes with a scale per 128 elements (``ab_exp_avg``, ...), which
AdamW cannot read, so such a checkpoint carries no ``exp_avg``: ``to_torch_adamw`` decodes
them. Loaded without it, AdamW's first step would fail on the missing key (``KeyError:
'exp_avg'`` from deep inside torch); a global step pre-hook turns that into one line that
names the fix, before anything changes.
"""
from __future__ import annotations

from itertools import islice
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..host.mapped import Mappings
from ..update import state as host_state
from .saved import NATIVE_KEYS, OURS

_FP8_MARK = OURS + "exp_avg_scale"  # only an fp8 entry of ours has it
_CHECKED_PER_GROUP = 16  # the entries a step looks at per group (a loaded dict is uniform)
UNCONVERTED = ("{name} holds an AdamBridge fp8 checkpoint's stored moments (ab_exp_avg codes "
               "and scales), which it cannot step from; load adambridge.checkpoint."
               "to_torch_adamw(state_dict) instead of the checkpoint itself")


def to_torch_adamw(state_dict: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Make an AdamBridge checkpoint loadable by ``torch.optim.AdamW``; returns it, changed
    in place.

    Each entry of fp8 moments gets ``exp_avg`` and ``exp_avg_sq`` decoded, in ``dtype`` and
    its master's shape, and loses the codes and scales, one parameter at a time. Entries of
    fp32 or bf16 moments (and torch's own) are left as they are: AdamW takes them. Pass your
    parameters' dtype as ``dtype`` to keep the dict smaller (AdamW's load casts the moments
    to it anyway)::

        adamw.load_state_dict(to_torch_adamw(torch.load(path), dtype=torch.bfloat16))
    """
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        raise TypeError(f"Invalid state_dict: {type(state_dict).__name__} (expected an "
                        f"optimizer state_dict with a 'state' dict)")
    maps = Mappings()
    for key, entry in state_dict["state"].items():
        if isinstance(entry, dict) and _FP8_MARK in entry and "exp_avg" not in entry:
            _decode_entry(key, entry, dtype, maps)
    return state_dict


def _decode_entry(key: Any, entry: dict, dtype: torch.dtype, maps: Mappings) -> None:
    missing = [OURS + k for k in NATIVE_KEYS if OURS + k not in entry]
    if missing:
        raise ValueError(f"Checkpoint state {key!r} has fp8 moments without {missing[0]!r}")
    stored = {k: entry[OURS + k].detach().to("cpu").reshape(-1) for k in NATIVE_KEYS}
    if (stored["exp_avg"].dtype, stored["exp_avg_sq"].dtype) != host_state.MOMENT_DTYPES["fp8"]:
        raise ValueError(f"Checkpoint state {key!r}: 'ab_exp_avg' has dtype "
                         f"{stored['exp_avg'].dtype}, not fp8 codes (torch.optim.AdamW cast "
                         f"them on a load); convert the checkpoint AdamBridge saved")
    master = entry.get("master")
    shape = master.shape if isinstance(master, torch.Tensor) else stored["exp_avg"].shape
    m, v = host_state.decode_moments(stored)
    entry["exp_avg"], entry["exp_avg_sq"] = m.to(dtype).view(shape), v.to(dtype).view(shape)
    for k in NATIVE_KEYS:
        maps.release(entry.pop(OURS + k))


def refuse_unconverted(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: torch.optim.Adam or AdamW holding our fp8 entries
    refuses to step, in one line.

    NOTE: torch.optim.Optimizer.load_state_dict takes any dict and Adam's step then reads
    state["exp_avg"]; an entry of ours that lacks it would fail there with a bare KeyError.
    Other optimizers are let be: a wrapper such as ZeroRedundancyOptimizer keeps the loaded
    entries in its own state while the optimizer it wraps (AdamBridge) steps.
    """
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is one
        return
    state, groups = optimizer.state, optimizer.param_groups
    for group in groups:
        params = group.get("params", ()) if isinstance(group, dict) else ()
        for p in islice(params, _CHECKED_PER_GROUP):
            entry = state.get(p)
            if entry:
                if isinstance(entry, dict) and _FP8_MARK in entry and "exp_avg" not in entry:
                    raise RuntimeError(UNCONVERTED.format(name=type(optimizer).__name__))
                break


register_optimizer_step_pre_hook(refuse_unconverted)
