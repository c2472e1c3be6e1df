"""Checkpoints: the saved form of the state (torch's, plus ours) and the checked restore of it.

A saved parameter entry is what ``torch.optim.AdamW`` keeps (``step``; ``exp_avg`` and
``exp_avg_sq`` decoded, in the parameter's shape and dtype), so the checkpoint loads into
torch, plus ours: ``master`` (fp32, the parameter's shape), ``ab_step`` and, only where
torch's form cannot hold the stored bits, the native moments ``ab_exp_avg``, ``ab_exp_avg_sq``
(and fp8's ``ab_exp_avg_scale``, ``ab_exp_avg_sq_scale``). Each param group carries
``seed``, ``precision`` and ``numerics`` (where torch.distributed.checkpoint keeps them). See
docs/checkpoints.md.

``restore`` never mutates the optimizer: every value is checked first and it returns the new
state and groups, so a checkpoint that does not fit is refused with everything as it was.

As torch's optimizers do, the saved form hands out the state's own tensors wherever they are
the saved form (``step``, ``master``, the ``ab_`` moments, and torch's moments when they are
stored in the parameter's dtype), so a checkpoint loaded into it in place (``dcp.load`` with
no ``load_state_dict``) reaches the optimizer; ``HandedOut`` sees such a load and says whether
it can be taken as it is (see docs/checkpoints.md).
"""
from __future__ import annotations

import math
import weakref
from copy import deepcopy
from functools import lru_cache
from typing import Any, Optional

import torch

from . import _validation as check
from .update import codecs, state as host_state

NATIVE_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
OURS = "ab_"          # prefix of the native entries
GROUP_META = ("seed", "precision", "numerics")
MAX_STEP = 2 ** 24    # a float32 step (torch's and ours) counts exactly up to here
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


# --------------------------------------------------------------------------- saving


def stored_as_torch(p: torch.Tensor, state: dict) -> bool:
    """Whether the stored moments are torch's form for p (held in p's dtype)."""
    return host_state.MOMENT_DTYPES[host_state.precision_of(state)] == (p.dtype, p.dtype)


def saved_entry(p: torch.Tensor, state: dict) -> dict:
    """One parameter's checkpoint entry: torch's form, our master and, if needed, our bits.

    Every tensor but ``ab_step`` is the state's own where the stored form is the saved one
    (as torch's state_dict() returns its live state); decoded moments are copies.
    """
    if stored_as_torch(p, state):
        m, v = state["exp_avg"], state["exp_avg_sq"]
    else:
        m, v = host_state.decode_moments(state)
    entry = {
        "step": state["step"],
        "exp_avg": m.to(p.dtype).view(p.shape),
        "exp_avg_sq": v.to(p.dtype).view(p.shape),
        "master": state["master"].view(p.shape),
        "ab_step": torch.tensor(int(state["step"].item()), dtype=torch.int64),
    }
    if not stored_as_torch(p, state):
        # torch's form rounds these moments: keep the stored bits for an exact resume.
        entry.update({OURS + k: state[k] for k in NATIVE_KEYS if k in state})
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


# --------------------------------------------------------------------------- checking


def _check_layout(state_dict: Any) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"Invalid checkpoint: {type(state_dict).__name__} (expected the dict "
                        f"returned by optimizer.state_dict())")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"Checkpoint lacks {key!r} (expected an optimizer state_dict "
                             f"with 'state' and 'param_groups')")


def _check_groups(saved_groups: list, groups: list) -> None:
    if len(saved_groups) != len(groups):
        raise ValueError(f"Checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                         f"has {len(groups)}; load it into an optimizer built the same way")
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(f"Checkpoint param_groups[{i}] lacks 'params'")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"Checkpoint parameter group {i} has {len(saved['params'])} "
                             f"parameters, the optimizer's has {len(group['params'])}")
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in saved:
                raise ValueError(f"Checkpoint param_groups[{i}] lacks {key!r}")
        where = f"checkpoint param_groups[{i}]"
        check.group_flags(saved, where)
        check.hyperparameters(saved["lr"], saved["betas"], saved["eps"],
                              saved["weight_decay"], where=where, finite=True)


def _saved_meta(state_dict: dict, saved_groups: list) -> dict:
    """seed / precision / numerics: from the groups (DCP keeps them), else the old entry."""
    meta, where = {}, {}
    for i, group in enumerate(saved_groups):
        for key in GROUP_META:
            if key not in group:
                continue
            if key in meta and group[key] != meta[key]:
                raise ValueError(f"Checkpoint param_groups[{i}][{key!r}] is {group[key]!r}, "
                                 f"{where[key]} is {meta[key]!r}; they must agree")
            meta.setdefault(key, group[key])
            where.setdefault(key, f"param_groups[{i}][{key!r}]")
    for key, value in (state_dict.get("adambridge") or {}).items():
        if key in GROUP_META and key not in meta:
            meta[key], where[key] = value, f"['adambridge'][{key!r}]"
    if "seed" in meta:
        check.seed(meta["seed"], name=f"checkpoint seed {where['seed']}")
    if "precision" in meta:
        meta["precision"] = check.precision(meta["precision"],
                                            name=f"checkpoint precision {where['precision']}")
    # NOTE: an older version whose stored state means the same (codecs.LOADABLE_NUMERICS)
    # loads; its later steps round as this version does.
    if meta.get("numerics", host_state.NUMERICS_VERSION) not in codecs.LOADABLE_NUMERICS:
        raise ValueError(f"Checkpoint {where['numerics']} is {meta['numerics']!r}, this "
                         f"adambridge computes numerics {host_state.NUMERICS_VERSION}; resume "
                         f"with the adambridge version that wrote it")
    return meta


def _step_of(index: int, value: Any) -> int:
    raw = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) \
            or raw != int(raw) or not 0 <= raw <= MAX_STEP:
        raise ValueError(f"Invalid checkpoint 'step' of parameter {index}: {value!r} "
                         f"(expected an integer in [0, {MAX_STEP}])")
    return int(raw)


def _same_step(value: Any, step: int) -> bool:
    # torch's load casts ab_step to the parameter's dtype (fp16 overflows past 65504): a
    # value that is not exactly ``step`` only means our entries are not the current ones.
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.item() == step


def _tensor(index: int, entry: dict, key: str, numel: int) -> torch.Tensor:
    value = entry[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"Invalid checkpoint {key!r} of parameter {index}: "
                         f"{type(value).__name__} (expected a tensor)")
    if value.numel() != numel:
        raise ValueError(f"Checkpoint {key!r} of parameter {index} has {value.numel()} "
                         f"elements, expected {numel}")
    return value


def _moment_dtypes_ok(moments: dict) -> Optional[str]:
    """The precision whose storage dtypes ``moments`` have, or None."""
    pair = (moments["exp_avg"].dtype, moments["exp_avg_sq"].dtype)
    return next((name for name, dtypes in host_state.MOMENT_DTYPES.items()
                 if dtypes == pair), None)


def _checked_moments(index: int, moments: dict, numel: int, where: str) -> dict:
    """Moments of one entry with their dtypes, sizes and (fp8) scales checked."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in moments:
            raise ValueError(f"Checkpoint state of parameter {index} lacks {where + key!r}")
        value = _tensor(index, moments, key, numel)
        if not value.is_floating_point():
            raise ValueError(f"Invalid checkpoint {where + key!r} of parameter {index}: dtype "
                             f"{value.dtype} (expected a floating-point tensor)")
    precision = _moment_dtypes_ok(moments)
    if precision is None:
        m, v = moments["exp_avg"], moments["exp_avg_sq"]
        if m.dtype != v.dtype or m.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"Checkpoint {where}exp_avg_sq of parameter {index} has dtype "
                             f"{v.dtype}, which does not go with an exp_avg of {m.dtype}")
        return {"exp_avg": m.float(), "exp_avg_sq": v.float()}  # e.g. torch's fp16 moments
    if precision == "fp8":
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            if key not in moments:
                raise ValueError(f"Checkpoint of parameter {index} has fp8 moments without "
                                 f"{where + key!r}")
            _tensor(index, moments, key, codecs.fp8_num_blocks(numel))
    return {k: moments[k] for k in NATIVE_KEYS if k in moments and
            (precision == "fp8" or not k.endswith("_scale"))}


def checked_entry(index: int, entry: Any, p: torch.Tensor, saved_precision: Optional[str]) -> dict:
    """The checked parts of one saved entry: step, moments in some precision, master or None.

    Our native moments are used when they are current and intact. They are not when
    torch.optim.AdamW loaded the checkpoint (it casts every float tensor to the parameter's
    dtype) or stepped after loading it (``ab_step`` then lags ``step``): torch's form is the
    truth then, and the parameter holds the weights.
    """
    if not isinstance(entry, dict):
        raise ValueError(f"Invalid checkpoint state of parameter {index}: "
                         f"{type(entry).__name__} (expected a dict)")
    if "step" not in entry:
        raise ValueError(f"Checkpoint state of parameter {index} lacks 'step'")
    step, numel = _step_of(index, entry["step"]), p.numel()
    fresh = "ab_step" not in entry or _same_step(entry["ab_step"], step)
    moments = _checked_moments(index, entry, numel, "")  # torch's form, checked always
    native = {k: entry[OURS + k] for k in NATIVE_KEYS if OURS + k in entry}
    _check_native_pairs(index, native)
    native_precision = _moment_dtypes_ok(native) if len(native) >= 2 else None
    if fresh and native_precision is not None and \
            native_precision == (saved_precision or native_precision):
        stored = _checked_moments(index, native, numel, OURS)
        # NOTE: torch's load casts every float tensor to the parameter's dtype and DCP
        # converts dtypes on load, so stored moments of one precision can arrive in another's
        # dtypes (fp8 codes as bf16 values). The stored bits are used only where they decode
        # to exactly the torch form saved beside them, as every AdamBridge save writes them.
        if _decodes_to(stored, entry):
            moments = stored
    master = None
    if "master" in entry:
        value = _tensor(index, entry, "master", numel)
        if not value.is_floating_point():
            raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: dtype "
                             f"{value.dtype} (expected torch.float32)")
        if fresh:  # else torch outdated it: the parameter holds the weights
            master = _checked_master(index, value)
    return {"step": step, "moments": moments, "master": master}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float tensors hold the same values bit for bit (NaN payloads, -0.0)."""
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.detach().reshape(-1).to("cpu"), b.detach().reshape(-1).to("cpu")
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _decodes_to(stored: dict, entry: dict) -> bool:
    """Whether stored moments decode to the entry's exp_avg / exp_avg_sq (in their dtype)."""
    flat = {k: v.detach().reshape(-1).to("cpu") for k, v in stored.items()}
    m, v = host_state.decode_moments(flat)
    return (_same_bits(m.to(entry["exp_avg"].dtype), entry["exp_avg"])
            and _same_bits(v.to(entry["exp_avg_sq"].dtype), entry["exp_avg_sq"]))


def _check_native_pairs(index: int, native: dict) -> None:
    """Our stored moments are saved together: one without the other is a damaged entry."""
    for key in ("exp_avg", "exp_avg_sq"):
        if native and key not in native:
            has = ", ".join(repr(OURS + k) for k in native)
            raise ValueError(f"Checkpoint state of parameter {index} lacks {OURS + key!r} "
                             f"(it has {has}, which AdamBridge saves together)")


def _checked_master(index: int, value: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 master a checkpoint holds, or None where torch cast it to the parameter's
    dtype (the parameter then holds the weights). A float64 master (a converted
    checkpoint) is taken when float32 holds each of its values exactly."""
    if value.dtype not in (torch.float32, torch.float64):
        return None
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: {bad} of "
                         f"{value.numel()} elements are inf or NaN; resume from a checkpoint "
                         f"written before the run diverged")
    if value.dtype == torch.float64:
        exact = value.float()
        inexact = exact.double() != value
        if inexact.any():
            raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: float64 "
                             f"values that float32 does not hold exactly (e.g. "
                             f"{value[inexact].flatten()[0].item()!r}); the master is float32: "
                             f"save it as float32")
        value = exact
    return value


# --------------------------------------------------------------------------- restoring


def _host_flat(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    flat = tensor.detach().to("cpu").reshape(-1)
    out = host_state.host_empty(flat.numel(), dtype or flat.dtype)
    return out.copy_(flat)


def _rebuild_entry(checked: dict, p: torch.Tensor, precision: str) -> dict:
    restored = {"step": torch.tensor(float(checked["step"]), dtype=torch.float32)}
    if host_state.can_alias_master(p):
        restored["master"] = p.detach().view(-1)  # fp32 CPU params are their own master
    else:  # without a master (a torch checkpoint) the parameter holds the weights
        source = checked["master"] if checked["master"] is not None else p
        restored["master"] = _host_flat(source, torch.float32)
    for key, value in checked["moments"].items():
        restored[key] = _host_flat(value)
    host_state.convert_precision(restored, precision)
    return restored


def restore(state_dict: Any, groups: list, params: list, precision: str,
            handed: Optional["HandedOut"] = None) -> tuple:
    """(state, param_groups, meta) a checkpoint describes for ``params``, or a ValueError.

    ``meta`` holds the checkpoint's seed (if it has one). Entries for ids that no group lists
    are kept as they are, as torch does. ``handed``: what the last state_dict() handed out,
    whose stored moments an entry made from that same dict may have lost on the way
    (HandedOut.stored_of).
    """
    _check_layout(state_dict)
    saved_groups = deepcopy(state_dict["param_groups"])
    _check_groups(saved_groups, groups)
    meta = _saved_meta(state_dict, saved_groups)
    saved_ids = [i for g in saved_groups for i in g["params"]]
    id_to_param = dict(zip(saved_ids, params))
    if not isinstance(state_dict["state"], dict):
        raise ValueError(f"Invalid checkpoint 'state': {type(state_dict['state']).__name__} "
                         f"(expected a dict of parameter id -> state)")
    checked = {}
    for saved_id, entry in state_dict["state"].items():
        if saved_id in id_to_param and entry != {}:  # {}: a parameter without state yet
            if isinstance(entry, dict):
                # NOTE: set_optimizer_state_dict of a flattened dict writes {} for each key of
                # opt.state[p] the dict lacks (our master, from a torch.optim.AdamW checkpoint
                # through adambridge.dcp.LoadPlanner): such a key is absent.
                entry = {k: v for k, v in entry.items() if not (isinstance(v, dict) and not v)}
                if handed is not None:
                    entry = handed.stored_of(id_to_param[saved_id], entry)
            checked[saved_id] = checked_entry(saved_ids.index(saved_id), entry,
                                              id_to_param[saved_id], meta.get("precision"))
    new_state = {}
    for saved_id, entry in state_dict["state"].items():
        if saved_id in checked:
            p = id_to_param[saved_id]
            new_state[p] = _rebuild_entry(checked[saved_id], p, precision)
        elif saved_id not in id_to_param:
            new_state[saved_id] = entry  # not a parameter's: kept as is, as torch does
    new_groups = []
    for saved, group in zip(saved_groups, groups):
        for key in GROUP_META:
            saved.pop(key, None)  # the optimizer's own settings, not group options
        for key, default in torch_group_flags().items():
            if key not in group and saved.get(key, default) == default:
                saved.pop(key, None)  # torch's defaults are what AdamBridge does anyway
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        new_groups.append(saved)
    return new_state, new_groups, meta


def written_entry(index: int, entry: Any, p: torch.Tensor, precision: str) -> dict:
    """The state that a dict written into ``opt.state[p]`` from outside describes: a saved
    entry (as ZeroRedundancyOptimizer.load_state_dict writes them) or a live state, checked
    as a loaded entry is, in ``precision``. {} is no state yet."""
    if not isinstance(entry, dict):
        raise ValueError(f"Invalid opt.state[p] of parameter {index}: {type(entry).__name__} "
                         f"(expected a dict)")
    entry = {k: v for k, v in entry.items() if not (isinstance(v, dict) and not v)}
    if not entry:
        return {}
    return _rebuild_entry(checked_entry(index, entry, p, None), p, precision)


# --------------------------------------------------------------------------- in-place loads

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
        # entry's exp_avg and stored moments; see stored_of.
        self.stored: dict = {}
        for (i, p, _), view in zip(entries, self.steps.unbind(0)):
            state[i]["ab_step"] = view
            ours = {k: weakref.ref(v) for k, v in state[i].items()
                    if k.startswith(OURS) and k != "ab_step" and isinstance(v, torch.Tensor)}
            if ours and isinstance(state[i].get("exp_avg"), torch.Tensor):
                self.stored[p] = (weakref.ref(state[i]["exp_avg"]), ours, view)
        self.version = self.steps._version

    def stored_of(self, p: torch.Tensor, entry: dict) -> dict:
        """``entry`` with the ab_ entries handed out beside its exp_avg, where it holds the
        very exp_avg tensor handed out for p but none of our entries.

        NOTE: get_optimizer_state_dict(flatten_optimizer_state_dict=True) hands DCP our
        whole entry, and dcp.load fills its tensors in place, but set_optimizer_state_dict
        rebuilds each entry from the keys of opt.state[p] only, dropping ab_step and the
        stored moments: they are still here, loaded. checked_entry uses them only where they
        are current and decode to exactly the entry's torch form.
        """
        found = self.stored.get(p)
        if found is None or any(k.startswith(OURS) for k in entry):
            return entry
        torch_m, ours, step = found
        stored = {k: ref() for k, ref in ours.items()}
        if torch_m() is not entry.get("exp_avg") or any(v is None for v in stored.values()):
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


def copied_because(p: torch.Tensor, state: dict) -> Optional[str]:
    """Why an in-place load into saved_entry(p, state) cannot be taken as it is, or None.

    Where torch's form is the stored one, every tensor is the state's own. Else the stored
    moments (ab_) are, and torch's form is a decoded copy; such a load is taken only for fp8,
    whose ab_ keys (with the scales) no other precision saves, so DCP's strict load proves
    they hold fp8 codes. A bf16 or fp32 ab_exp_avg could have been loaded from an fp8
    checkpoint's codes (DCP converts dtypes), which only load_state_dict() sees.
    """
    if stored_as_torch(p, state) or host_state.precision_of(state) == "fp8":
        return None
    return (f"saves its {state['exp_avg'].dtype} moments both as they are and decoded, and "
            f"only load_state_dict() can tell which of them the checkpoint filled")


def _in_place_problem(index: int, state: Optional[dict], ab_step: int) -> Optional[str]:
    if not state:
        return "has no state any more"
    if ab_step == NOT_OURS_STEP:
        return ("was loaded from a checkpoint without AdamBridge's entries (e.g. torch.optim."
                "AdamW's), which only load_state_dict() converts")
    try:
        step = _step_of(index, state["step"])
    except ValueError:
        return f"got an invalid 'step' {state['step'].item()!r}"
    if ab_step != step:
        return (f"got 'ab_step' {ab_step} with 'step' {step} (its AdamBridge entries are "
                f"older than torch's)")
    if not torch.isfinite(state["master"]).all():
        return "got a 'master' holding inf or NaN"
    return None
