"""Checking a loaded checkpoint before anything changes: its layout, groups, settings and each entry.

Nothing here allocates more than one parameter's worth at a time, and nothing on a device:
a tensor a check must read is brought to the host first, and a tensor in a file mapping
(``torch.load(f, mmap=True)``) hands its pages back once read (host/mapped.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _validation as check
from ..host.mapped import Mappings
from ..update import codecs, state as host_state
from .saved import GROUP_META, MAX_STEP, NATIVE_KEYS, OURS


@dataclass
class Checked:
    """One entry's checked parts, still the loaded tensors (on the host): nothing converted.

    ``precision`` is the one whose storage dtypes ``moments`` have, or None for other float
    dtypes (torch's fp16 moments, say), which go through fp32. ``master`` is None where the
    parameter holds the weights (a torch checkpoint, or one torch cast or outdated).
    """

    step: int
    moments: dict
    precision: Optional[str]
    master: Optional[torch.Tensor]


def check_layout(state_dict: Any) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"Invalid checkpoint: {type(state_dict).__name__} (expected the dict "
                        f"returned by optimizer.state_dict())")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"Checkpoint lacks {key!r} (expected an optimizer state_dict "
                             f"with 'state' and 'param_groups')")
    if not isinstance(state_dict["state"], dict):
        raise ValueError(f"Invalid checkpoint 'state': {type(state_dict['state']).__name__} "
                         f"(expected a dict of parameter id -> state)")


def check_groups(saved_groups: list, groups: list) -> None:
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


def saved_meta(state_dict: dict, saved_groups: list) -> dict:
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


def step_of(index: int, value: Any) -> int:
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


def _tensor(index: int, entry: dict, key: str, numel: int,
            shape: Optional[torch.Size] = None) -> torch.Tensor:
    """entry[key], checked to be a tensor of ``numel`` elements (of ``shape`` where it has
    more than one dimension), on the host."""
    value = entry[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"Invalid checkpoint {key!r} of parameter {index}: "
                         f"{type(value).__name__} (expected a tensor)")
    if value.numel() != numel:
        raise ValueError(f"Checkpoint {key!r} of parameter {index} has {value.numel()} "
                         f"elements, expected {numel}")
    # NOTE: a flat tensor of the right size is a parameter's state laid out as we store it;
    # one of another shape with as many elements belongs to another parameter (a (20, 30)
    # weight's into a (30, 20) one), whose values would land on the wrong elements.
    if shape is not None and value.dim() > 1 and value.shape != shape:
        raise ValueError(f"Checkpoint {key!r} of parameter {index} has shape "
                         f"{tuple(value.shape)}, the parameter has {tuple(shape)}; load the "
                         f"checkpoint of this model")
    # NOTE: a checkpoint mapped to a device (torch.load's map_location) is read on the host:
    # nothing of a load is allocated on a device. A host tensor is kept as it is (no
    # detached view) so that restore.Taker can tell whether anything else holds it.
    if value.device.type == "cpu" and not value.requires_grad:
        return value
    copy = value.detach().to("cpu", copy=True)
    copy.checkpoint_copy = True  # made here, for the load alone: restore.Taker may keep it
    return copy


def _precision_of_pair(moments: dict) -> Optional[str]:
    """The precision whose storage dtypes ``moments`` have, or None."""
    pair = (moments["exp_avg"].dtype, moments["exp_avg_sq"].dtype)
    return next((name for name, dtypes in host_state.MOMENT_DTYPES.items()
                 if dtypes == pair), None)


def _checked_moments(index: int, moments: dict, numel: int, where: str,
                     shape: Optional[torch.Size] = None) -> tuple:
    """(moments, their precision or None) of one entry: dtypes, sizes and fp8 scales checked."""
    found = {}
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in moments:
            raise ValueError(f"Checkpoint state of parameter {index} lacks {where + key!r}")
        found[key] = _tensor(index, moments, key, numel, shape)
        if not found[key].is_floating_point():
            raise ValueError(f"Invalid checkpoint {where + key!r} of parameter {index}: dtype "
                             f"{found[key].dtype} (expected a floating-point tensor)")
    precision = _precision_of_pair(found)
    if precision is None:
        m, v = found["exp_avg"], found["exp_avg_sq"]
        if m.dtype != v.dtype or m.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"Checkpoint {where}exp_avg_sq of parameter {index} has dtype "
                             f"{v.dtype}, which does not go with an exp_avg of {m.dtype}")
    if precision == "fp8":
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            if key not in moments:
                raise ValueError(f"Checkpoint of parameter {index} has fp8 moments without "
                                 f"{where + key!r}")
            found[key] = _tensor(index, moments, key, codecs.fp8_num_blocks(numel))
    return found, precision


def _check_native_pairs(index: int, native: dict) -> None:
    """Our stored moments are saved together: one without the other is a damaged entry."""
    for key in ("exp_avg", "exp_avg_sq"):
        if native and key not in native:
            has = ", ".join(repr(OURS + k) for k in native)
            raise ValueError(f"Checkpoint state of parameter {index} lacks {OURS + key!r} "
                             f"(it has {has}, which AdamBridge saves together)")


def checked_entry(index: int, entry: Any, p: torch.Tensor, saved_precision: Optional[str],
                  maps: Mappings) -> Checked:
    """The checked parts of one saved entry (see Checked).

    Our stored (``ab_``) moments are used when they are current and intact. They are not
    when torch.optim.AdamW loaded the checkpoint (it casts every float tensor to the
    parameter's dtype) or stepped after loading it (``ab_step`` then lags ``step``): torch's
    ``exp_avg`` / ``exp_avg_sq`` are the truth then, and the parameter holds the weights.
    """
    if not isinstance(entry, dict):
        raise ValueError(f"Invalid checkpoint state of parameter {index}: "
                         f"{type(entry).__name__} (expected a dict)")
    if "step" not in entry:
        raise ValueError(f"Checkpoint state of parameter {index} lacks 'step'")
    step, numel = step_of(index, entry["step"]), p.numel()
    fresh = "ab_step" not in entry or _same_step(entry["ab_step"], step)
    native = {k: entry[OURS + k] for k in NATIVE_KEYS if OURS + k in entry}
    _check_native_pairs(index, native)
    stored = None
    if fresh and len(native) >= 2:
        stored = _stored_moments(index, native, entry, p.shape, saved_precision, maps)
    if not fresh and native and "exp_avg" not in entry and "exp_avg_sq" not in entry:
        # Only our stored moments, which 'ab_step' says belong to another step than 'step'.
        raise ValueError(f"Checkpoint state of parameter {index} has 'step' {step} but "
                         f"'ab_step' {_shown(entry['ab_step'])}, and its moments are only "
                         f"the stored ({OURS}) ones of step 'ab_step'; save 'step' and "
                         f"'ab_step' together, as optimizer.state_dict() does")
    if stored is None or "exp_avg" in entry or "exp_avg_sq" in entry:
        # torch's form (an AdamW checkpoint, ours of fp32 or bf16 moments): checked wherever
        # it is saved, even beside stored moments that are used instead
        torch_form = _checked_moments(index, entry, numel, "", p.shape)
    moments, precision = stored if stored is not None else torch_form
    check_moment_values(index, moments, maps, OURS if stored is not None else "")
    master = None
    if "master" in entry:
        value = _tensor(index, entry, "master", numel, p.shape)
        if not value.is_floating_point():
            raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: dtype "
                             f"{value.dtype} (expected torch.float32)")
        if fresh:  # else torch outdated it: the parameter holds the weights
            master = _checked_master(index, value, maps)
    return Checked(step, moments, precision, master)


def _stored_moments(index: int, native: dict, entry: dict, shape: torch.Size,
                    saved_precision: Optional[str], maps: Mappings) -> Optional[tuple]:
    """(moments, precision) of the ab_ entries where they are the stored state, else None.

    NOTE: torch's load casts every float tensor to the parameter's dtype and DCP converts
    dtypes on load, so stored moments of one precision can arrive in another's dtypes (fp8
    codes as bf16 values). They are taken only in the dtypes of the group's precision and,
    where torch's form is saved beside them (checkpoints of adambridge before the stored
    form was saved once), only where they decode to exactly that form.
    """
    found = {k: v for k, v in native.items() if isinstance(v, torch.Tensor)}
    for key, value in found.items():
        if not value.is_floating_point():
            raise ValueError(f"Invalid checkpoint {OURS + key!r} of parameter {index}: dtype "
                             f"{value.dtype} (expected a floating-point tensor)")
    if len(found) < 2 or _precision_of_pair(found) is None:
        return None
    if _precision_of_pair(found) != (saved_precision or _precision_of_pair(found)):
        return None
    numel = shape.numel()
    moments, precision = _checked_moments(index, native, numel, OURS)
    if "exp_avg" in entry and "exp_avg_sq" in entry:
        torch_form, _ = _checked_moments(index, entry, numel, "", shape)
        if not _decodes_to(moments, torch_form, maps):
            return None
    return moments, precision


# What each loaded moment may hold: (key, lowest allowed value or None, what it means).
_VALUE_RULES = (("exp_avg", None, "finite values"),
                ("exp_avg_sq", 0.0, "finite values >= 0"),
                ("exp_avg_scale", 0.0, "finite scales >= 0"),
                ("exp_avg_sq_scale", 0.0, "finite scales >= 0"))


def _shown(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def check_moment_values(index: int, moments: dict, maps: Mappings, where: str = "") -> None:
    """Refuse moments no run can reach (NaN or inf in fp32 / bf16 moments, a negative second
    moment, a NaN, inf or negative fp8 scale): the step after such a load turns the
    parameters NaN. One pass of min and max per tensor, a piece at a time; the offending
    value is looked for only on a refusal."""
    for key, lowest, expected in _VALUE_RULES:
        if key not in moments or moments[key].element_size() == 1:
            # NOTE: fp8 codes are not read here (no aminmax kernel: a float32 copy of each
            # chunk would make the load several times slower); their scales are.
            continue
        flat = moments[key].reshape(-1)
        for _, piece in maps.pieces(flat):
            if piece.numel() and not _within(piece, lowest):
                bad = _first_outside(piece, lowest)
                raise ValueError(f"Invalid checkpoint {where + key!r} of parameter {index}: holds "
                                 f"{bad!r} (expected {expected}); resume from a checkpoint "
                                 f"written before the run diverged")
        maps.release(flat)


def _within(piece: torch.Tensor, lowest: Optional[float]) -> bool:
    # NOTE: min and max of a whole piece are one pass with no temporary; they are inf or
    # NaN exactly when an element is.
    low, high = (float(end) for end in torch.aminmax(piece))
    return math.isfinite(low) and math.isfinite(high) and (lowest is None or low >= lowest)


def _first_outside(piece: torch.Tensor, lowest: Optional[float]) -> float:
    for chunk in _chunks(piece):
        values = chunk.float()
        bad = ~torch.isfinite(values)
        if lowest is not None:
            bad |= values < lowest
        if bad.any():
            return values[bad][0].item()
    return float("nan")  # (not reached: _within found one)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host float tensors hold the same values bit for bit (NaN payloads, -0.0)."""
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.reshape(-1), b.reshape(-1)
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _decodes_to(stored: dict, torch_form: dict, maps: Mappings) -> bool:
    """Whether stored moments decode to torch's form saved beside them (in its dtype)."""
    m, v = host_state.decode_moments({k: t.reshape(-1) for k, t in stored.items()})
    same = (same_bits(m.to(torch_form["exp_avg"].dtype), torch_form["exp_avg"])
            and same_bits(v.to(torch_form["exp_avg_sq"].dtype), torch_form["exp_avg_sq"]))
    for tensor in (*stored.values(), *torch_form.values()):
        maps.release(tensor)
    return same


_CHUNK = 1 << 18  # elements a check reads at once: its temporaries stay a few MiB


def _chunks(value: torch.Tensor):
    flat = value.reshape(-1)
    return (flat[i:i + _CHUNK] for i in range(0, flat.numel(), _CHUNK))


def _checked_master(index: int, value: torch.Tensor, maps: Mappings) -> Optional[torch.Tensor]:
    """The fp32 master a checkpoint holds, or None where torch cast it to the parameter's
    dtype (the parameter then holds the weights). A float64 master (a converted
    checkpoint) is taken when float32 holds each of its values exactly."""
    if value.dtype not in (torch.float32, torch.float64):
        return None
    ends = [torch.aminmax(piece) for _, piece in maps.pieces(value.reshape(-1))
            if piece.numel()]
    if not all(math.isfinite(end) for pair in ends for end in pair):
        # NOTE: min and max, one pass with no temporary, are inf or NaN exactly when an
        # element is; only then is the count (the message's) worth its passes.
        bad = sum(int((~torch.isfinite(chunk)).sum()) for chunk in _chunks(value))
        raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: {bad} of "
                         f"{value.numel()} elements are inf or NaN; resume from a checkpoint "
                         f"written before the run diverged")
    inexact = None
    for chunk in _chunks(value) if value.dtype == torch.float64 else ():
        wrong = chunk.float().double() != chunk
        if wrong.any():
            inexact = chunk[wrong][0].item()
            break
    if inexact is not None:
        raise ValueError(f"Invalid checkpoint 'master' of parameter {index}: float64 "
                         f"values that float32 does not hold exactly (e.g. {inexact!r}); the "
                         f"master is float32: save it as float32")
    maps.release(value)  # read again, a piece at a time, when it is taken
    return value
