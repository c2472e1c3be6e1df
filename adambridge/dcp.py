"""torch.distributed.checkpoint: a load planner for checkpoints that lack AdamBridge's own keys.

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
with the default planner: never a step, a moment or a hyperparameter. A missing key is taken
out of the dict being loaded, so load_state_dict() sees the checkpoint's own form, never a
value left over from the optimizer that made the dict. An entry that lacks any of them is
loaded without its ``ab_step`` too, which is written -1 instead, so the same load without
load_state_dict() is refused at the next step (checkpoint.HandedOut).
"""
from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner

from .checkpoint import GROUP_META, NOT_OURS_STEP, OURS, torch_group_flags


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


class LoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, where AdamBridge's own keys may be missing (module doc)."""

    def create_local_plan(self):  # noqa: ANN201 - torch's LoadPlan
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        entries = set()  # of parameters whose saved entry lacks some of our keys
        for fqn in [k for k in self.state_dict if k not in saved and _ours(self._path(k))]:
            path = self._path(fqn)
            if _split(path)[0] == "state":
                entries.add(_sibling(path, "ab_step"))
            self._drop(fqn)
        # NOTE: an entry's ab_step says its AdamBridge keys are whole and current: where some
        # are missing it stays out of the load too, written -1 (the value nothing saves).
        steps = {self._path(fqn): fqn for fqn in self.state_dict}
        for path in entries:
            if path in steps:
                self._drop(steps[path])
        return super().create_local_plan()

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
