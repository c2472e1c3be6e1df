"""Who each parameter is to the optimizer: its index, its layout, its state and its writes.

The one owner of the parameter index (the state_dict order and a key of the rounding bits),
the layout each state was made for, lazy state creation and the record of each write-back;
the synchronous step, the async pipeline and later tiers (shards, NVMe pages) all call these
public methods rather than reaching into the optimizer (docs/architecture.md).
"""
from __future__ import annotations

from operator import is_
from typing import Optional, Sequence

import torch

from . import _validation as check
from .update import state as host_state
from .update.codecs import stream_key
from .update.functional import Hyper, UpdateItem
from .update.state import can_alias_master


class ParamOwner:
    """Mixin of AdamBridge; needs ``param_groups``, ``state``, ``seed``, ``_precision``,
    ``stochastic_rounding``, ``_tier`` (the NVMe tier or None), ``_plan`` (the cached
    step_plan.StepPlan or None), the dicts ``_param_index``, ``_layout``, ``_written``, and
    ``_handed`` (checkpoint.HandedOut of the last state_dict(), or None) with
    ``_in_place_refusal`` (str or None)."""

    def release_plan(self) -> None:
        """Drop the cached step plan (sync/step_plan.py), handing its write records back first:
        while a plan runs the steps it keeps them, and ``_written`` is stale for its params."""
        plan, self._plan = self._plan, None
        if plan is not None:
            self._written.update(plan.written_records())

    def written_records(self) -> dict:
        """``_written`` as it would be without the plan's deferral (for copies)."""
        if self._plan is None:
            return dict(self._written)
        return {**self._written, **self._plan.written_records()}

    def _index_params(self) -> None:
        self.release_plan()  # the indices key the rounding bits: a plan's keys would be stale
        # The parameter index seeds the stochastic-rounding hash; it is the state_dict order.
        flat = [p for group in self.param_groups for p in group["params"]]
        self._param_index = {p: i for i, p in enumerate(flat)}
        self._indexed = flat  # what follow_groups compares the groups with

    def groups_changed(self) -> bool:
        """Whether param_groups[i]['params'] hold other tensors than the index was made of
        (put in, taken out, replaced or reordered since add_param_group / load_state_dict).
        The same tensors listed again after their first listing (``param_groups.extend(
        param_groups)``, as torch's own optimizer tests do) is no change: each keeps the index
        of its first listing, which is the id torch's state_dict gives it too."""
        flat = [p for group in self.param_groups for p in group["params"]]
        indexed = getattr(self, "_indexed", None)
        if indexed is None:
            return True
        if len(flat) == len(indexed) and all(map(is_, flat, indexed)):
            return False
        firsts = first_listings(flat)
        return len(firsts) != len(indexed) or not all(map(is_, firsts, indexed))

    def repeated_param(self) -> Optional[int]:
        """The index of the first parameter param_groups list more than once, or None."""
        if sum(len(group["params"]) for group in self.param_groups) == len(self._indexed):
            return None  # (per step: one sum when nothing is repeated)
        seen: set = set()
        for p in (p for group in self.param_groups for p in group["params"]):
            if id(p) in seen:
                return self._param_index[p]
            seen.add(id(p))
        return None

    @property
    def param_index(self) -> dict:
        """p -> its index (state_dict order); read-only for everyone but this class."""
        return self._param_index

    def note_written(self, p: torch.Tensor, tensor: torch.Tensor) -> None:
        """This optimizer just wrote ``tensor`` (p, or p's shard) back."""
        self._written[p] = (tensor._version, tensor.data_ptr())

    def written_as(self, p: torch.Tensor, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is as this optimizer last wrote it back (no one wrote it since)."""
        return self._written.get(p) == (tensor._version, tensor.data_ptr())

    def note_layout(self, p: torch.Tensor) -> None:
        """Record p's shape and dtype, as its state was made."""
        self._layout[p] = (p.shape, p.dtype)

    def index(self, p: torch.Tensor) -> int:
        """p's index: its position in the state_dict and a key of its rounding bits."""
        try:
            return self._param_index[p]
        except KeyError:
            raise ValueError(f"Invalid parameter: a tensor of shape {tuple(p.shape)} that "
                             f"this optimizer does not own (add it with add_param_group)") from None

    def check_layout(self, p: torch.Tensor) -> None:
        """Raise if p's shape or dtype changed since its state was made."""
        check.unchanged_layout(p, self.index(p), self._layout.get(p))

    def check_gradient(self, p: torch.Tensor) -> None:
        """Raise if p's gradient cannot be used (sparse, shape, dtype, a changed layout), or
        if a checkpoint loaded in place cannot be stepped from (``settle_in_place``)."""
        if self._handed is not None or self._in_place_refusal is not None:
            self.settle_in_place()
        check.gradient(p, self.index(p), self._layout.get(p))

    def settle_in_place(self, strict: bool = True) -> None:
        """Take, or refuse until the next load_state_dict(), a checkpoint loaded in place
        into the last state_dict() (``dcp.load`` with no ``load_state_dict``).

        Taken when every entry handed out the state's own tensors and holds a current
        AdamBridge state (checkpoint.HandedOut.verdict): the next step then compares each
        parameter with its loaded master, as after load_state_dict(). Else, with ``strict``,
        a one-line RuntimeError (state_dict() only records it: DCP's own loading calls it
        between its in-place load and load_state_dict()).
        """
        handed = self._handed
        if handed is not None and handed.written():
            self._handed = None
            refusal = handed.verdict(self.state)
            if getattr(self, "_shard_group", None) is not None:
                refusal = self._refused_on_any_rank(refusal)
            if refusal is None:
                self.release_plan()  # its write records are dropped below
                for p in handed.params():
                    self._written.pop(p, None)
            else:
                self._in_place_refusal = refusal
        if strict and self._in_place_refusal is not None:
            raise RuntimeError(self._in_place_refusal)

    def _refused_on_any_rank(self, refusal: Optional[str]) -> Optional[str]:
        """shard_state: each rank judged the load on its own ranges; one refusing rank
        refuses it on all (a collective: a dcp.load wrote ab_step on every rank), or the
        others would go on into the step's all-gather and wait there for it forever."""
        import torch.distributed as dist
        devices = [p.device for g in self.param_groups for p in g["params"]]
        device = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
        flag = torch.tensor([0 if refusal is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._shard_group)
        if flag.item() and refusal is None:
            return ("A checkpoint loaded in place into opt.sharded_state_dict() was refused "
                    "on another rank (its ranges failed the checks; that rank's error says "
                    "which); load_state_dict() a checkpoint that every rank accepts")
        return refusal

    def in_files(self, p: torch.Tensor) -> bool:
        """Whether p's state lives in the NVMe tier's files (``offload_dir``)."""
        return self._tier is not None and self._tier.holds(p)

    def written_elsewhere(self, p: torch.Tensor) -> bool:
        """Whether p was written by anyone else since this optimizer last wrote it."""
        if can_alias_master(p) and not self.in_files(p):
            return False  # p's storage is the master: what anyone writes is the master
        self.release_plan()
        return self._written.get(p) != (p._version, p.data_ptr())

    def needs_values(self, p: torch.Tensor) -> bool:
        """Whether ``ensure_state(p, source)`` will read p's values (pass them as source)."""
        return not self.state.get(p) or self.written_elsewhere(p)

    def ensure_state(self, p: torch.Tensor, source: Optional[torch.Tensor] = None) -> dict:
        """p's state: made from p's values if it has none, its master refreshed if p was
        written by anyone else since the last write-back (docs/architecture.md).

        ``source``: p's values already copied to the host (async mode), else p is read.
        A parameter holding exactly the rounding of its master keeps the master.
        """
        self.release_plan()  # its write records are the ones compared below
        state = self.state[p]
        if self.in_files(p):
            # NOTE: the master lives in the files, so written weights are compared with it
            # when the tier streams p (nvme/tier.py, Tier.commit); here only ``step`` is made.
            if not state:
                self._layout[p] = (p.shape, p.dtype)
                state = self.state[p] = self._tier.new_state(p)
            return state
        if state:  # the common case: one dict lookup and one tuple compare
            if self._written.get(p) != (p._version, p.data_ptr()) and not can_alias_master(p):
                host_state.adopt_written(state, p.detach() if source is None else source)
            return state
        alias = can_alias_master(p)
        self._layout[p] = (p.shape, p.dtype)
        values = p.detach() if source is None or alias else source
        state.update(host_state.new_state(values, self._precision, alias=alias))
        return state

    def mark_written(self, params: Sequence[torch.Tensor]) -> None:
        """Record that this optimizer has just written ``params`` (after each write-back).

        Bumps the autograd version of those the kernel wrote through their data pointer, as
        torch's in-place ops do, so a graph that saved them refuses to run backward; then
        records every version, so a write by anyone else is seen at the next step.
        """
        self.release_plan()  # else its records would overwrite these when handed back
        direct = []
        for p in params:
            written = p.is_cpu and p.is_contiguous()  # else a torch copy_ wrote it: bumped
            if written:
                direct.append(p)
            self._written[p] = (p._version + written, p.data_ptr())
        if direct:
            torch.autograd.graph.increment_version(direct)

    def range_item(self, p: torch.Tensor, group: dict, state: dict, step: int,
                   grad: torch.Tensor, out: Optional[torch.Tensor], start: int) -> UpdateItem:
        """The UpdateItem of elements [start, start + grad.numel()) of p, with host views.

        The state is sliced (fp8 scales per 128-block; start is a multiple of 128), and the
        item's offset is ``start``, so a chunk draws the same rounding bits as the whole.
        """
        hyper = Hyper.for_group(group, step)
        if can_alias_master(p):
            if not _views(state.get("master"), p):
                state["master"] = p.detach().view(-1)  # p may have new storage (p.data = ...)
        elif _stale_alias(state.get("master"), p):
            # p.data = p.data.t(): the same storage, so no write is seen, but the master that
            # viewed it reads in the old order. It becomes a copy of p's values as they read
            # now (torch's AdamW, whose p is its master, sees those); sync and async alike.
            state["master"] = p.detach().reshape(-1).clone()
        return host_state.range_item(state, grad=grad, out=out, start=start,
                                     key=stream_key(self.seed, step, self._param_index[p]),
                                     hyper=hyper, stochastic_rounding=self.stochastic_rounding)

    _range_item = range_item  # the name pipeline code of before the seams used


def _stale_alias(master: Optional[torch.Tensor], p: torch.Tensor) -> bool:
    """Whether ``master`` views p's storage while p is no longer its own master (p was
    given a non-contiguous layout of the same storage)."""
    return (master is not None and not p.is_contiguous() and p.dtype == torch.float32
            and p.is_cpu and master.data_ptr() == p.data_ptr())


def _views(master: Optional[torch.Tensor], p: torch.Tensor) -> bool:
    """Whether ``master`` is already the flat view of fp32 contiguous ``p``'s elements.

    NOTE: a new view per parameter per step is one more object the cyclic GC
    tracks until the step ends. The same address means the same storage: the old view
    keeps its storage alive, so that memory cannot have been handed to another tensor.
    """
    return (master is not None and master.data_ptr() == p.data_ptr()
            and master.numel() == p.numel() and master.dtype == torch.float32)


def first_listings(flat: Sequence[torch.Tensor]) -> list:
    """``flat`` without the tensors listed before (each at its first listing)."""
    seen: set = set()
    firsts = []
    for p in flat:
        if id(p) not in seen:
            seen.add(id(p))
            firsts.append(p)
    return firsts
