"""What an earlier run left in a tier's directories: found at construction, refused before it is overwritten, or resumed.

A run killed mid-training leaves its files and the manifest of its last commit (the last
completed step of every file-placed parameter). A new optimizer on the same directories
must not start over those files without a word: its first step refuses in one line, until
the user resumes them (``opt.nvme_tier.resume()``), loads a checkpoint
(``opt.load_state_dict()``, which replaces them) or discards them
(``opt.nvme_tier.discard()``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .direct_io import TierError
from .layout import MANIFEST, fitted, read_manifest

HOW = ("resume it with opt.nvme_tier.resume() before the first step, load a checkpoint with "
       "opt.load_state_dict(), or start fresh with opt.nvme_tier.discard() (or another "
       "directory)")


@dataclass(frozen=True)
class Found:
    """An earlier run's committed state in a tier directory (its manifest), or why it
    cannot be read (``unreadable``)."""

    path: Path
    manifest: Optional[dict]
    unreadable: str = ""

    def describe(self) -> str:
        if self.manifest is None:
            return f"{self.path} holds an earlier run's state that this adambridge cannot read " \
                   f"({self.unreadable})"
        steps = sorted({entry["step"] for entry in self.manifest["params"].values()})
        shown = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        return (f"{self.path} holds the committed state of an earlier run ({shown} of "
                f"{len(self.manifest['params'])} parameters)")


def found(directory: Path) -> Optional[Found]:
    """The earlier run's state in ``directory`` (the tier's first), or None where it has none."""
    path = directory / MANIFEST
    try:
        manifest = read_manifest(directory)
    except (TierError, OSError, ValueError) as exc:
        return Found(path, None, str(exc))
    if manifest is None or not manifest.get("params"):
        return None
    return Found(path, manifest)


def refusal(earlier: Found) -> TierError:
    return TierError(f"NVMe tier: {earlier.describe()}, which this step would overwrite; {HOW}")


def resume(tier: Any, earlier: Optional[Found]) -> int:
    """Take the earlier run's committed state as the optimizer's of ``tier`` (nvme/tier.py's
    Tier); return its step.

    Every parameter must be file-placed, with an entry of its size and precision, all at one
    step; each committed page is read (and its checksum checked) and the parameters are set
    to their masters' rounding, as the uninterrupted run's write-back left them."""
    opt = tier.opt()
    if earlier is None:
        raise ValueError(f"opt.nvme_tier.resume(): {tier.dirs[0]} holds no earlier run's state "
                         f"(no {MANIFEST}); nothing to resume")
    if earlier.manifest is None:
        raise ValueError(f"opt.nvme_tier.resume(): {earlier.describe()}; load a checkpoint "
                         f"with opt.load_state_dict() or start fresh with "
                         f"opt.nvme_tier.discard()")
    params = [p for group in opt.param_groups for p in group["params"]]
    if any(opt.state.get(p) for p in params):
        raise ValueError("opt.nvme_tier.resume() must come before the first step or load: "
                         "this optimizer already has state; build a new AdamBridge to resume")
    plan = [(p, _entry(tier, earlier, p)) for p in params]
    _check_same_step(earlier, plan)
    _check_dirs(tier, earlier)
    for p, entry in plan:
        _resume_param(tier, p, entry)
    return plan[0][1]["step"] if plan else 0


def _entry(tier: Any, earlier: Found, p: torch.Tensor) -> dict:
    opt, index = tier.opt(), tier.opt().index(p)
    entry = earlier.manifest["params"].get(str(index))
    where = f"opt.nvme_tier.resume(): parameter {index}"
    if not tier.holds(p):
        raise ValueError(f"{where} keeps its state in RAM (host_budget), which the earlier "
                         f"run lost with its process; load a checkpoint with "
                         f"opt.load_state_dict(), or resume with host_budget=0")
    if entry is None:
        raise ValueError(f"{where} has no state in {earlier.path}; resume with the model and "
                         f"parameter groups of the earlier run")
    layout = fitted(opt.precision, tier.config.page_size, p.numel())
    # (the seed keys the stochastic rounding: another one would not go on bit for bit)
    wanted = {"numel": p.numel(), "precision": opt.precision, "page_size": layout.page_size,
              "seed": opt.seed}
    for key, value in wanted.items():
        if entry.get(key) != value:
            raise ValueError(f"{where} has {key} {value!r}, the earlier run's state in "
                             f"{earlier.path} has {entry.get(key)!r}; resume with the model, "
                             f"precision, seed and page_size of the earlier run")
    return entry


def _check_same_step(earlier: Found, plan: list) -> None:
    steps = {entry["step"] for _, entry in plan}
    if len(steps) > 1:
        raise ValueError(f"opt.nvme_tier.resume(): the parameters in {earlier.path} are at steps "
                         f"{sorted(steps)} (a kill during an asynchronous step); load a "
                         f"checkpoint with opt.load_state_dict() or start fresh with "
                         f"opt.nvme_tier.discard()")


def _check_dirs(tier: Any, earlier: Found) -> None:
    saved = [str(d) for d in earlier.manifest["dirs"]]
    if saved != [str(d) for d in tier.dirs]:
        raise ValueError(f"opt.nvme_tier.resume(): the earlier run striped its pages over "
                         f"{saved}, this optimizer over {[str(d) for d in tier.dirs]}; give "
                         f"offload_dir the same directories in the same order")


def _resume_param(tier: Any, p: torch.Tensor, entry: dict) -> None:
    opt = tier.opt()
    state = tier.state_of_earlier(p, entry["generation"], entry["step"])
    with torch.no_grad():
        p.copy_(state["master"].view(p.shape))  # the write-back's rounding (nearest even)
    opt.mark_written([p])
    opt.note_layout(p)
