"""The saved form of a parameter's state: each stored value once, under torch's keys where torch can take it.

An entry holds ``step`` (torch's), ``master`` (fp32, the parameter's shape) and ``ab_step``
(the step our entries belong to). fp32 and bf16 moments are saved as they are stored, in the
parameter's shape, as ``exp_avg`` / ``exp_avg_sq``: torch.optim.AdamW takes them (its load
casts every float tensor to the parameter's dtype, as it casts its own). fp8 moments are
codes that mean nothing without their per-128 scales, so they are saved under our keys only
(``ab_exp_avg``, ``ab_exp_avg_sq``, ``ab_exp_avg_scale``, ``ab_exp_avg_sq_scale``), and
torch.optim.AdamW loads them through ``adambridge.checkpoint.to_torch_adamw``.

Every tensor but ``ab_step`` is a view of the state's own, as torch's state_dict() hands out
its live state: saving copies nothing. Views, never the state's tensors themselves: a load
tells a live optimizer's dict (whose storages have a second holder) from a loaded one by
that, and copies rather than shares the former (checkpoint/restore.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..update import state as host_state

NATIVE_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
OURS = "ab_"          # prefix of the entries torch.optim.AdamW does not know
GROUP_META = ("seed", "precision", "numerics")
MAX_STEP = 2 ** 24    # a float32 step (torch's and ours) counts exactly up to here
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def torch_takes(state: dict) -> bool:
    """Whether torch.optim.AdamW can take the stored moments as they are (fp32, bf16)."""
    return host_state.precision_of(state) != "fp8"


def saved_entry(p: torch.Tensor, state: dict) -> dict:
    """One parameter's checkpoint entry: views of the state's own tensors, plus ab_step."""
    entry = {
        "step": state["step"],
        "master": state["master"].view(p.shape),
        "ab_step": torch.tensor(int(state["step"].item()), dtype=torch.int64),
    }
    if torch_takes(state):
        entry["exp_avg"] = state["exp_avg"].view(p.shape)
        entry["exp_avg_sq"] = state["exp_avg_sq"].view(p.shape)
    else:
        entry.update({OURS + k: state[k].view(-1) for k in NATIVE_KEYS})
    return entry


@lru_cache(maxsize=1)
def _torch_adamw_flags() -> tuple:
    probe = torch.optim.AdamW([torch.zeros(1, dtype=torch.float32)])
    return tuple((k, v) for k, v in probe.defaults.items() if k not in HYPERPARAMETERS)


def torch_group_flags() -> dict:
    """torch.optim.AdamW's other group options (amsgrad, foreach, ...) at the installed
    torch's defaults, which is what AdamBridge computes.

    NOTE: torch.distributed.checkpoint loads only into keys the loading optimizer's own
    state_dict() has, and needs each of them in the checkpoint: saved in every group, they
    let a DCP checkpoint of ours load into torch.optim.AdamW.
    """
    return dict(_torch_adamw_flags())


def group_meta(seed: int, precision: str) -> dict:
    return {"seed": seed, "precision": precision, "numerics": host_state.NUMERICS_VERSION}
