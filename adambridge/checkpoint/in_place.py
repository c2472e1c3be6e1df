"""Checkpoints loaded in place: what the last state_dict() handed out, and whether a load into it can be taken.

As torch's optimizers do, state_dict() hands out the state's own tensors, so a checkpoint
loaded into that dict in place (``dcp.load`` with no ``load_state_dict``) reaches the
optimizer. ``HandedOut`` sees such a load and says whether it can be taken as it is: where
every entry was the state's own and holds a current AdamBridge state (see
docs/checkpoints.md).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .checks import step_of
from .saved import OURS

NOT_OURS_STEP = -1  # written into ab_step where a load found no AdamBridge entries (dcp.py)
REFUSED_AFTER_IN_PLACE = (
    "load_state_dict() refused a checkpoint that had been loaded in place into "
    "opt.state_dict(), whose tensors are the optimizer's own: load_state_dict() one that "
    "it accepts before the next step")


class HandedOut:
    """What the last state_dict() handed out, to see a checkpoint loaded into it in place.

    Every entry's ``ab_step`` is a 0-d view of one int64 tensor kept here, so a load into the
    dict (``dcp.load`` writes each tensor with ``copy_``) moves that tensor's version counter
    even after the dict itself is gone: one compare per step sees it.
    """

    def __init__(self, state: dict, entries: list) -> None:
        """``entries``: (index, p, why its saved tensors are copies, or None) per entry of
        the saved ``state``, whose ab_step tensors become views of ``self.steps``."""
        self.entries = entries
        self.steps = torch.tensor([int(state[i]["ab_step"]) for i, _, _ in entries],
                                  dtype=torch.int64)
        # Weak references (a saved dict, once dropped, must not stay alive here) to each
        # entry's master and stored moments; see stored_of.
        self.stored: dict = {}
        for (i, p, _), view in zip(entries, self.steps.unbind(0)):
            state[i]["ab_step"] = view
            ours = {k: weakref.ref(v) for k, v in state[i].items()
                    if k.startswith(OURS) and k != "ab_step" and isinstance(v, torch.Tensor)}
            if ours and isinstance(state[i].get("master"), torch.Tensor):
                self.stored[p] = (weakref.ref(state[i]["master"]), ours, view)
        self.version = self.steps._version

    def stored_of(self, p: torch.Tensor, entry: dict) -> dict:
        """``entry`` with the ab_ entries handed out beside its master, where it holds the
        very master tensor handed out for p but none of our entries.

        NOTE: get_optimizer_state_dict(flatten_optimizer_state_dict=True) hands DCP our
        whole entry, and dcp.load fills its tensors in place, but set_optimizer_state_dict
        rebuilds each entry from the keys of opt.state[p] only, dropping ab_step and the
        stored (fp8) moments: they are still here, loaded. checked_entry uses them only where
        they are current.
        """
        found = self.stored.get(p)
        if found is None or any(k.startswith(OURS) for k in entry):
            return entry
        master, ours, step = found
        stored = {k: ref() for k, ref in ours.items()}
        if master() is not entry.get("master") or any(v is None for v in stored.values()):
            return entry
        return {**entry, **stored, OURS + "step": step}

    def written(self) -> bool:
        return self.steps._version != self.version

    def params(self) -> list:
        return [p for _, p, _ in self.entries]

    def verdict(self, states: dict) -> Optional[str]:
        """None when what was loaded in place is a whole, current AdamBridge state that the
        optimizer's own tensors now hold; else the one-line refusal."""
        for (index, p, copied), ab_step in zip(self.entries, self.steps.tolist()):
            problem = copied or _in_place_problem(index, states.get(p), ab_step)
            if problem:
                return (f"A checkpoint was loaded in place into opt.state_dict() (dcp.load "
                        f"with no load_state_dict): parameter {index} {problem}; pass the "
                        f"loaded dict to opt.load_state_dict(), or load with torch.distributed"
                        f".checkpoint.state_dict.set_optimizer_state_dict")
        return None


def _in_place_problem(index: int, state: Optional[dict], ab_step: int) -> Optional[str]:
    if not state:
        return "has no state any more"
    if ab_step == NOT_OURS_STEP:
        return ("was loaded from a checkpoint without AdamBridge's entries (e.g. torch.optim."
                "AdamW's), which only load_state_dict() converts")
    try:
        step = step_of(index, state["step"])
    except ValueError:
        return f"got an invalid 'step' {state['step'].item()!r}"
    if ab_step != step:
        return (f"got 'ab_step' {ab_step} with 'step' {step} (its AdamBridge entries are "
                f"older than torch's)")
    if not torch.isfinite(state["master"]).all():
        return "got a 'master' holding inf or NaN"
    return None
