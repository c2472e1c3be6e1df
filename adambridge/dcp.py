"""torch.distributed.checkpoint: a load planner for checkpoints that lack AdamBridge's own keys or hold the moments in the other form.

DCP loads a checkpoint into the tensors of a state_dict the loading side made, and refuses
one that lacks any of its keys. An AdamBridge state_dict holds keys torch.optim.AdamW's does
not (``master``, ``ab_step``, the ``ab_`` moments, each group's ``seed``, ``precision`` and
``numerics``, opt.state_dict()'s top-level ``adambridge``), and another precision's ``ab_``
keys differ, so an AdamW checkpoint, or one of AdamBridge in another precision, cannot load
into it with DCP's default planner::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from adambridge.dcp import LoadPlanner

    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"optim": osd}, checkpoint_id=path, planner=LoadPlanner())
    set_optimizer_state_dict(model, opt, osd)

``LoadPlanner`` is DCP's DefaultLoadPlanner that lets exactly those keys be missing, and
torch.optim.AdamW's group flags (``amsgrad``, ``foreach``, ...; AdamBridge's checkpoints carry
them for torch, and torch fills in their defaults itself). Every other missing key fails as
with the default planner: never a step, a moment or a hyperparameter. The moments are served
in either form: a dict that wants ``exp_avg`` / ``exp_avg_sq`` (torch.optim.AdamW's, or an
AdamBridge of fp32 or bf16 moments) from a checkpoint of fp8 codes gets them decoded as the
codes land; an fp8 AdamBridge's dict from a checkpoint of torch's form (AdamW's, or ours in
fp32 or bf16) gets that form loaded beside its own keys, for load_state_dict() to convert.
A missing key is taken out of the dict being loaded, so load_state_dict() sees the
checkpoint's own form, never a value left over from the optimizer that made the dict. An entry that lacks any of them is
loaded without its ``ab_step`` too, which is written -1 instead, so the same load without
load_state_dict() is refused at the next step (checkpoint.HandedOut).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import GROUP_META, NOT_OURS_STEP, OURS, torch_group_flags
from .update.codecs import fp8_decode, fp8_decode_v


def _split(path: tuple) -> tuple:
    """(kind, key) of the key at ``path``: DCP flattens ('optim', 'state', 'w', 'master') and
    ('optim', 'param_groups', 0, 'seed'); flatten_optimizer_state_dict=True makes the last
    part 'state.w.master' or 'param_groups.w.seed'. kind is '' for anything else."""
    last = str(path[-1])
    if last.startswith(("state.", "param_groups.")):
        return last.partition(".")[0], last.rpartition(".")[2]
    return (str(path[-3]) if len(path) >= 3 else ""), last


def _sibling(path: tuple, key: str) -> tuple:
    """The path of ``key`` in the same saved entry as ``path``."""
    last = str(path[-1])
    if last.startswith("state."):
        return (*path[:-1], f"{last.rpartition('.')[0]}.{key}")
    return (*path[:-1], key)


def _ours(path: tuple) -> bool:
    """Whether the key at ``path`` is one that only AdamBridge's state_dict holds."""
    kind, key = _split(path)
    parts = [str(x) for x in path]
    if kind != "state" and "adambridge" in parts[-3:-1]:
        return True  # the top-level 'adambridge' entry of opt.state_dict() (DCP's helpers drop it)
    if kind == "state":
        return key == "master" or key.startswith(OURS)
    return kind == "param_groups" and (key in GROUP_META or key in torch_group_flags())


def _remove(root: Any, path: tuple) -> Any:
    """Take the value at ``path`` out of nested dicts and lists; returns it."""
    for key in path[:-1]:
        root = root[_key_in(root, key)]
    return root.pop(_key_in(root, path[-1]))


def _key_in(root: Any, key: Any) -> Any:
    # DCP's paths spell every dict key as a string: opt.state_dict()'s ids are ints.
    if isinstance(root, dict) and key not in root:
        return next(k for k in root if str(k) == str(key))
    return key


class _Decode:
    """One moment that a loading dict wants in torch's form (``exp_avg`` of AdamW, or of an
    AdamBridge in fp32 or bf16) from a checkpoint holding our fp8 codes and scales: both are
    read into buffers of their own, decoded into the target once both have landed, and let
    go (one parameter's codes at a time)."""

    def __init__(self, target: torch.Tensor, decode: Callable, codes: str, scale: str) -> None:
        self.target, self.decode, self.codes, self.scale = target, decode, codes, scale
        self.buffers: dict = {}
        self.pending: dict = {}  # fqn -> read items still to land

    def commit(self, fqn: str) -> None:
        self.pending[fqn] -= 1
        if any(self.pending.get(k, 1) for k in (self.codes, self.scale)):
            return
        codes, scale = self.buffers.pop(self.codes), self.buffers.pop(self.scale)
        self.target.copy_(self.decode(codes.reshape(-1), scale.reshape(-1)).view(self.target.shape))


class LoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, where AdamBridge's own keys may be missing (module doc), and
    either form of the moments serves a dict that wants the other: torch's ``exp_avg`` /
    ``exp_avg_sq`` decoded from our fp8 codes, or our fp8 keys' place taken by torch's form,
    which load_state_dict() converts."""

    def create_local_plan(self):  # noqa: ANN201 - torch's LoadPlan
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        self._decodes: dict = {}
        entries = set()  # of parameters whose saved entry lacks some of our keys
        for fqn in [k for k in self.state_dict if k not in saved]:
            path = self._path(fqn)
            if _ours(path):
                if _split(path)[0] == "state":
                    entries.add(_sibling(path, "ab_step"))
                    self._add_torch_form(fqn, path, saved)
                self._drop(fqn)
            elif _split(path)[0] == "state" and _split(path)[1] in _FP8_SOURCES:
                self._decode_from_codes(fqn, saved)
        # NOTE: an entry's ab_step says its AdamBridge keys are whole and current: where some
        # are missing it stays out of the load too, written -1 (the value nothing saves).
        steps = {self._path(fqn): fqn for fqn in self.state_dict}
        for path in entries:
            if path in steps:
                self._drop(steps[path])
        return super().create_local_plan()

    def finish_plan(self, new_plan):  # noqa: ANN001, ANN201 - torch's LoadPlan
        for item in new_plan.items:
            decode = self._decodes.get(item.dest_index.fqn)
            if decode is not None:
                decode.pending[item.dest_index.fqn] = decode.pending.get(item.dest_index.fqn, 0) + 1
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item):  # noqa: ANN001, ANN201 - torch's ReadItem, Tensor
        fqn = read_item.dest_index.fqn
        decode = self._decodes.get(fqn)
        if decode is None:
            return super().resolve_tensor(read_item)
        if fqn not in decode.buffers:  # allocated when its first piece lands, not at planning
            placeholder = self.state_dict[fqn]
            decode.buffers[fqn] = torch.empty(placeholder.shape, dtype=placeholder.dtype)
        return self.transform_tensor(read_item, decode.buffers[fqn])

    def commit_tensor(self, read_item, tensor) -> None:  # noqa: ANN001 - torch's types
        decode = self._decodes.get(read_item.dest_index.fqn)
        if decode is not None:
            decode.commit(read_item.dest_index.fqn)
        super().commit_tensor(read_item, tensor)

    def _decode_from_codes(self, fqn: str, saved: dict) -> None:
        """``exp_avg`` (or ``exp_avg_sq``) wanted, our fp8 codes and scale saved instead."""
        key = fqn.rpartition(".")[2]
        codes, scale = [fqn[:-len(key)] + OURS + name for name in _FP8_SOURCES[key][:2]]
        target = self.state_dict[fqn]
        if codes not in saved or scale not in saved or not isinstance(target, torch.Tensor) \
                or type(target) is not torch.Tensor or codes in self.state_dict:
            return  # DCP's own error names the missing key
        decode = _Decode(target, _FP8_SOURCES[key][2], codes, scale)
        for name in (codes, scale):
            meta = saved[name]
            self.state_dict[name] = torch.empty(meta.size, dtype=meta.properties.dtype,
                                                device="meta")  # planned, filled in buffers
            self.mappings[name] = _sibling(self._path(fqn), name.rpartition(".")[2])
            self._decodes[name] = decode
        del self.state_dict[fqn]  # the target stays in the dict being loaded: decoded into

    def _add_torch_form(self, fqn: str, path: tuple, saved: dict) -> None:
        """Our fp8 keys wanted, torch's form saved instead (a checkpoint of AdamW or of
        another precision): load that too, into tensors of its own in the dict, for
        load_state_dict() to convert."""
        for key in ("exp_avg", "exp_avg_sq"):
            name = fqn[:-len(fqn.rpartition(".")[2])] + key
            if name in saved and name not in self.state_dict and \
                    isinstance(saved[name], TensorStorageMetadata):
                meta = saved[name]
                value = torch.empty(meta.size, dtype=meta.properties.dtype)
                self.state_dict[name] = value
                if self.flatten_state_dict:
                    self.mappings[name] = _sibling(path, key)
                    _insert(self.original_state_dict, self.mappings[name], value)

    def _path(self, fqn: str) -> tuple:
        return tuple(self.mappings.get(fqn, (fqn,))) if self.flatten_state_dict else (fqn,)

    def _drop(self, fqn: str) -> None:
        path = self._path(fqn)
        value = self.state_dict.pop(fqn)
        if self.flatten_state_dict:
            _remove(self.original_state_dict, path)
            self.mappings.pop(fqn, None)
        if _split(path)[1] == "ab_step" and hasattr(value, "fill_"):
            value.fill_(NOT_OURS_STEP)  # a load with no load_state_dict is refused at the step


# torch's moment -> (our codes, our scale, the decode of one into the other)
_FP8_SOURCES = {"exp_avg": ("exp_avg", "exp_avg_scale", fp8_decode),
                "exp_avg_sq": ("exp_avg_sq", "exp_avg_sq_scale", fp8_decode_v)}


def _insert(root: Any, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts and lists (its parent exists)."""
    for key in path[:-1]:
        root = root[_key_in(root, key)]
    root[path[-1]] = value
