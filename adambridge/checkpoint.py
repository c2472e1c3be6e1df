"""Checkpoint restore: validate a saved optimizer state against the parameters, then rebuild it.

``restore`` never mutates the optimizer: it returns the new state and groups, so a checkpoint
that does not fit is refused with everything left as it was.
"""
from __future__ import annotations

from copy import deepcopy

import torch

from . import codecs, state as host_state


def _check_groups(saved_groups: list, groups: list) -> None:
    if len(saved_groups) != len(groups):
        raise ValueError(f"Checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                         f"has {len(groups)}; load it into an optimizer built the same way")
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"Checkpoint parameter group {i} has {len(saved['params'])} "
                             f"parameters, the optimizer's has {len(group['params'])}")


def _check_entry(index: int, entry: dict, p: torch.Tensor) -> None:
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in entry:
            raise ValueError(f"Checkpoint state of parameter {index} lacks {key!r}")
    numel = p.numel()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        if key in entry and entry[key].numel() != numel:
            raise ValueError(f"Checkpoint {key!r} of parameter {index} has "
                             f"{entry[key].numel()} elements, the parameter has {numel} "
                             f"(shape {tuple(p.shape)})")
    precision = host_state.precision_of(entry)
    if precision == "fp8":
        blocks = codecs.fp8_num_blocks(numel)
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            if key not in entry or entry[key].numel() != blocks:
                raise ValueError(f"Checkpoint of parameter {index} has fp8 moments without "
                                 f"{blocks} {key!r} values")
    expected_v = host_state.MOMENT_DTYPES[precision][1]
    if entry["exp_avg_sq"].dtype != expected_v:
        raise ValueError(f"Checkpoint exp_avg_sq of parameter {index} has dtype "
                         f"{entry['exp_avg_sq'].dtype}, expected {expected_v} next to an "
                         f"exp_avg of {entry['exp_avg'].dtype}")


def _host_flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().to("cpu").reshape(-1)
    out = host_state.host_empty(flat.numel(), flat.dtype)
    return out.copy_(flat)


def _rebuild_entry(entry: dict, p: torch.Tensor, precision: str, alias: bool) -> dict:
    restored = {"step": torch.tensor(float(entry["step"]))}
    if alias:
        restored["master"] = p.detach().view(-1)  # fp32 CPU params are their own master
    elif "master" in entry:
        restored["master"] = _host_flat(entry["master"]).float()
    else:  # a torch.optim.AdamW checkpoint: the parameter holds the weights
        restored["master"] = _host_flat(p).float()
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        if key in entry:
            restored[key] = _host_flat(entry[key])
    host_state.convert_precision(restored, precision)
    return restored


def restore(state_dict: dict, groups: list, params: list, precision: str) -> tuple[dict, list]:
    """The (state, param_groups) a checkpoint describes for ``params``, or a ValueError."""
    from .optimizer import _can_alias_master
    saved_groups = deepcopy(state_dict["param_groups"])
    _check_groups(saved_groups, groups)
    saved_ids = [i for g in saved_groups for i in g["params"]]
    id_to_param = dict(zip(saved_ids, params))
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in id_to_param:
            raise ValueError(f"Checkpoint has state for parameter id {saved_id}, which no "
                             f"parameter group lists")
        _check_entry(saved_ids.index(saved_id), entry, id_to_param[saved_id])
    new_state = {}
    for saved_id, entry in state_dict["state"].items():
        p = id_to_param[saved_id]
        new_state[p] = _rebuild_entry(entry, p, precision, _can_alias_master(p))
    new_groups = []
    for saved, group in zip(saved_groups, groups):
        saved["params"] = group["params"]
        new_groups.append(saved)
    return new_state, new_groups
