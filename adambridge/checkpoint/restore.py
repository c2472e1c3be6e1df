"""Restoring a checked checkpoint: each parameter's state built in turn, adopting the loaded tensors where it can.

``restore`` checks the whole checkpoint and changes nothing; the ``Restored`` it returns
builds one parameter's state at a time (``states()``), so a caller that writes each state
elsewhere (the NVMe tier's files, a rank's range) never holds more than one parameter's
worth beyond what it keeps. A loaded tensor that already has the state's dtype is taken as
it is (adopted), as torch.optim.AdamW takes its loaded tensors, unless something else holds
its memory: a file mapping (``torch.load(f, mmap=True)``: copied, and its pages handed back),
another tensor viewing its storage (a live optimizer's state_dict(), torch.save's shared
storages), or another entry of the same load. Anything else is copied or converted.
"""
from __future__ import annotations

import sys
from copy import deepcopy
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..host.alloc import collapse_huge_pages, host_empty
from ..host.mapped import Mappings, storage_shared
from ..host.sourced import plain
from ..update import state as host_state
from ..update.codecs import FP8_BLOCK
from .checks import Checked, check_groups, check_layout, checked_entry, saved_meta
from .saved import GROUP_META, torch_group_flags


def _reference_counts(entry: dict) -> dict:
    return {key: sys.getrefcount(value) for key, value in entry.items()}


# How many references sys.getrefcount sees, in _reference_counts, for a tensor that only the
# entry dict holds.
_ONLY_THE_ENTRY = _reference_counts({"probe": torch.empty(0)})["probe"]


def sole_tensors(entries: Iterable) -> set:
    """id() of every tensor of these entry dicts that nothing else references.

    NOTE: torch's Optimizer.load_state_dict keeps the loaded tensor objects themselves as its
    state (its cast returns a tensor that has the dtype and device already as it is), so a
    dict that a torch.optim.AdamW has loaded holds the very tensors that optimizer steps.
    Only its Python reference count tells such a tensor from one that torch.load made for
    this dict alone; adopting the former would make two optimizers step one state.
    """
    sole = set()
    for entry in entries:
        if isinstance(entry, dict):
            counts = _reference_counts(entry)
            sole.update(id(entry[k]) for k, n in counts.items()
                        if n <= _ONLY_THE_ENTRY and isinstance(entry[k], torch.Tensor))
    return sole


class Taker:
    """Takes loaded tensors into the state: adopts, or copies, each storage at most once."""

    def __init__(self, maps: Mappings, sole: set) -> None:
        self.maps, self.sole = maps, sole
        self.adopted: set = set()  # data_ptr of every storage adopted by this load
        self.passing = False  # the state is written elsewhere and dropped, not kept

    def take(self, value: torch.Tensor, dtype: torch.dtype, own: Optional[torch.Tensor],
             span: tuple) -> torch.Tensor:
        """Elements [start, end) of host tensor ``value`` as a flat ``dtype`` host tensor."""
        if own is not None and _same_memory(value, own):
            return own  # the optimizer's own tensor, loaded in place (dcp.load into it)
        whole = span == (0, value.numel())
        if self.passing and whole and value.dtype == dtype and value.is_contiguous():
            return value.view(-1)  # only read, page by page, then let go: no copy needed
        if whole and self._adoptable(value, dtype):
            self.adopted.add(value.untyped_storage().data_ptr())
            flat = value.view(-1)
            collapse_huge_pages(flat)  # as host_empty's state is: huge pages, read faster
            return flat
        flat = value.view(-1) if value.is_contiguous() else value.reshape(-1)
        out = host_empty(span[1] - span[0], dtype)
        for start, piece in self.maps.pieces(flat[span[0]:span[1]]):
            out[start:start + piece.numel()].copy_(piece)
        return out

    def _adoptable(self, value: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the state may keep ``value`` itself: nothing else holds it or its memory.

        NOTE: checked before any view of it is made here, since storage_shared counts the
        tensors that view a storage."""
        sole = id(value) in self.sole or getattr(value, "checkpoint_copy", False)
        return (sole and type(value) is torch.Tensor and value.dtype == dtype and value.is_cpu
                and value.is_contiguous() and not value.requires_grad
                and not value.is_inference()
                and value.untyped_storage().data_ptr() not in self.adopted
                and not storage_shared(value) and not self.maps.holds(value))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.numel() == b.numel() and a.device == b.device
            and a.data_ptr() == b.data_ptr())


def _scale_span(span: tuple) -> tuple:
    return span[0] // FP8_BLOCK, -(-span[1] // FP8_BLOCK)


def build_state(checked: Checked, p: torch.Tensor, precision: str, own: dict, taker: Taker,
                span: tuple) -> dict:
    """The state of elements ``span`` of p that ``checked`` describes, in ``precision``."""
    state = {"step": torch.tensor(float(checked.step), dtype=torch.float32)}
    if host_state.can_alias_master(p):
        state["master"] = p.detach().view(-1)[span[0]:span[1]]  # fp32 CPU params: p itself
    elif checked.master is not None:
        state["master"] = taker.take(checked.master, torch.float32, own.get("master"), span)
    else:  # without a master (a torch checkpoint) the parameter holds the weights
        values = p.detach().reshape(-1)[span[0]:span[1]]
        state["master"] = host_empty(span[1] - span[0], torch.float32)
        state["master"].copy_(values)
    if checked.precision == precision:
        dtypes = dict(zip(("exp_avg", "exp_avg_sq"), host_state.MOMENT_DTYPES[precision]))
        for key, value in checked.moments.items():
            part = _scale_span(span) if key.endswith("_scale") else span
            state[key] = taker.take(value, dtypes.get(key, torch.float32), own.get(key), part)
    else:
        _convert_moments(state, checked, precision, span, taker.maps)
    return state


def _convert_moments(state: dict, checked: Checked, precision: str, span: tuple,
                     maps: Mappings) -> None:
    """Decode the loaded moments of ``span`` (through fp32) and store them in ``precision``."""
    source = {}
    for key, value in checked.moments.items():
        first, end = _scale_span(span) if key.endswith("_scale") else span
        source[key] = value.reshape(-1)[first:end]
    if checked.precision is None:  # other float dtypes: torch's fp16 moments, say
        m, v = source["exp_avg"].float(), source["exp_avg_sq"].float()
    else:
        m, v = host_state.decode_moments(source)
    host_state.encode_moments(state, m, v, precision)
    for value in checked.moments.values():
        maps.release(value)


class Restored:
    """A checked checkpoint: its groups, its seed / precision / numerics (``meta``) and each
    parameter's state, built by ``states()`` one at a time."""

    def __init__(self, groups: list, meta: dict, order: list, checked: dict, keys: dict,
                 shards: dict, precision: str, own: Callable, span_of: Optional[Callable],
                 maps: Mappings, sole: set) -> None:
        self.groups, self.meta = groups, meta
        self._order, self._checked, self._keys, self._shards = order, checked, keys, shards
        self._precision, self._own, self._span_of, self._maps = precision, own, span_of, maps
        self._sole = sole

    def states(self, kept: Optional[Callable] = None) -> Iterator[tuple]:
        """(key, state) per saved entry, in saved order: a parameter's state (of the
        elements ``span_of(p)`` gives, all of them without it; an empty span yields
        nothing), or an entry that is not a parameter's, as it is. Each is built once, as it
        is asked for, and this object lets go of the loaded tensors it has taken.
        ``kept(p)`` False: p's state is only read and dropped (written into the NVMe tier's
        files), so it may be the loaded tensors themselves, wherever they live."""
        taker = Taker(self._maps, self._sole)
        for saved_id, entry in self._order:
            if saved_id in self._checked:
                key, shard = self._keys[saved_id], self._shards[saved_id]
                span = self._span_of(key) if self._span_of is not None else (0, shard.numel())
                checked = self._checked.pop(saved_id)
                taker.passing = kept is not None and not kept(key)
                if span[0] < span[1]:
                    yield key, build_state(checked, shard, self._precision,
                                           self._own(key) or {}, taker, span)
            elif saved_id not in self._keys:
                yield saved_id, entry  # not a parameter's: kept as is, as torch does


def restore(state_dict: Any, groups: list, params: list, precision: str, *,
            handed: Any = None, own: Optional[Callable] = None,
            shards: Optional[list] = None, span_of: Optional[Callable] = None) -> Restored:
    """The checkpoint, checked for ``params`` (each value; nothing is changed or built).

    ``shards``: the tensors whose elements each parameter's state holds (an FSDP2 rank's
    local shards), default ``params``; ``span_of(p)``: the (start, end) elements of p whose
    state to build (a shard_state rank's range), default all. ``own(p)``: the optimizer's
    current state of p, whose tensors a load into its own state_dict() (``dcp.load`` in
    place) hands back. ``handed``: what the last state_dict() handed out, whose stored
    moments an entry made from that same dict may have lost on the way
    (HandedOut.stored_of). Entries for ids that no group lists are kept as they are, as
    torch does.
    """
    check_layout(state_dict)
    saved_groups = deepcopy(state_dict["param_groups"])
    check_groups(saved_groups, groups)
    meta = saved_meta(state_dict, saved_groups)
    saved_ids = [i for g in saved_groups for i in g["params"]]
    state_dict = {**state_dict, "state": entries_by_id(state_dict["state"], saved_ids)}
    position = {saved_id: index for index, saved_id in enumerate(saved_ids)}
    keys = dict(zip(saved_ids, params))
    by_id = dict(zip(saved_ids, shards if shards is not None else params))
    maps, sole = Mappings(), sole_tensors(state_dict["state"].values())
    checked, order = {}, list(state_dict["state"].items())
    for saved_id, entry in order:
        if saved_id in keys and entry != {}:  # {}: a parameter without state yet
            if isinstance(entry, dict):
                # NOTE: set_optimizer_state_dict of a flattened dict writes {} for each key of
                # opt.state[p] the dict lacks (our master, from a torch.optim.AdamW checkpoint
                # through adambridge.dcp.LoadPlanner): such a key is absent.
                entry = {k: v for k, v in entry.items() if not (isinstance(v, dict) and not v)}
                if handed is not None:
                    entry = handed.stored_of(keys[saved_id], entry)
                # An NVMe tier's state_dict() entries read its files: their values, here.
                entry = {k: plain(v) for k, v in entry.items()}
            checked[saved_id] = checked_entry(position[saved_id], entry, by_id[saved_id],
                                              meta.get("precision"), maps)
    return Restored(_new_groups(saved_groups, groups), meta, order, checked, keys, by_id,
                    precision, own or (lambda p: None), span_of, maps, sole)


def entries_by_id(state: dict, saved_ids: list) -> dict:
    """``state`` with each parameter's entry under the id its group lists.

    NOTE: torch.distributed.checkpoint's dcp_to_torch_save (and any path through its
    flattening) writes the ids as strings ('0'); taken as those ids where the int is not
    there. An entry that is a parameter's state under a key no group lists (a name, another
    id) would otherwise be kept aside as torch keeps unknown entries, and the parameter
    silently start fresh: refused in one line."""
    listed = set(saved_ids)
    out = {}
    for key, entry in state.items():
        if isinstance(key, str) and key.lstrip("-").isdigit() and int(key) in listed \
                and int(key) not in state:
            key = int(key)
        elif key not in listed and _a_parameters_state(entry):
            shown = sorted(listed, key=str)[:8]
            raise ValueError(f"Checkpoint 'state' has a parameter's entry under {key!r}, which "
                             f"no param group lists (they list {shown}"
                             f"{' ...' if len(listed) > 8 else ''}); load a dict whose 'state' is "
                             f"keyed by the ids its param_groups list, as "
                             f"optimizer.state_dict() makes it")
        out[key] = entry
    return out


def _a_parameters_state(entry: Any) -> bool:
    return isinstance(entry, dict) and "step" in entry and any(
        k in entry for k in ("exp_avg", "master", "ab_exp_avg"))


def _new_groups(saved_groups: list, groups: list) -> list:
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
    return new_groups


def written_entry(index: int, entry: Any, p: torch.Tensor, precision: str) -> dict:
    """The state that a dict written into ``opt.state[p]`` from outside describes: a saved
    entry (as ZeroRedundancyOptimizer.load_state_dict writes them) or a live state, checked
    as a loaded entry is, in ``precision``. {} is no state yet."""
    if not isinstance(entry, dict):
        raise ValueError(f"Invalid opt.state[p] of parameter {index}: {type(entry).__name__} "
                         f"(expected a dict)")
    sole = sole_tensors([entry])
    entry = {k: v for k, v in entry.items() if not (isinstance(v, dict) and not v)}
    if not entry:
        return {}
    maps = Mappings()
    checked = checked_entry(index, entry, p, None, maps)
    return build_state(checked, p, precision, {}, Taker(maps, sole), (0, p.numel()))
