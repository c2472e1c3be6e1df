"""torch.distributed: FSDP2 local shards, and refusals of what is not handled (docs/architecture.md).

FSDP2 (``fully_shard``) turns each parameter into a DTensor whose local tensor is this rank's
rows of it (``Shard(0)``, torch.chunk's split, the last ranks possibly empty). AdamBridge keeps
host state for the local shard only: the state of a parameter is the state of elements
[offset, offset + local.numel()) of the full parameter, and the update item's offset, which
keys the stochastic rounding, is that global offset, so the bits do not depend on the number
of ranks (fp8's per-128 scale blocks start at the shard, so fp8 is rank-independent only
where each shard starts at a multiple of 128 elements).

FSDP2 in asynchronous mode is distributed/fsdp_async.py; DDP in asynchronous mode is distributed/ddp.py; DDP
with sharded host state is distributed/zero.py (and distributed/zero_async.py).

Refused, in one line each: DTensor layouts other than ``Shard(0)``/``Replicate`` per mesh
dimension, and FSDP1 (``FullyShardedDataParallel``).
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _validation as check
from .. import checkpoint
from ..update import state as host_state
from ..update.codecs import stream_key
from ..update.functional import Hyper, adamw_update

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_FSDP1_MARK = "_fsdp_flattened"  # torch.distributed.fsdp._common_utils.FSDP_FLATTENED


def _dtensor_type() -> Optional[type]:
    # No DTensor can exist before torch.distributed.tensor is imported: skip the import.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def holds_dtensors(opt: OptimizerDoor) -> bool:
    """Whether any parameter of ``opt`` is a DTensor (FSDP2 or tensor parallelism)."""
    if _dtensor_type() is None:
        return False
    return any(is_dtensor(p) for group in opt.param_groups for p in group["params"])


# --------------------------------------------------------------------------- refusals


def check_parameter(p: torch.Tensor, index: int) -> None:
    """Refuse FSDP1 parameters and DTensor layouts that are not a flat range per rank."""
    if getattr(p, _FSDP1_MARK, False):
        raise ValueError(f"Invalid parameter {index}: it is managed by FSDP1 "
                         f"(FullyShardedDataParallel), which AdamBridge does not support; "
                         f"shard the model with FSDP2 (torch.distributed.fsdp.fully_shard)")
    if is_dtensor(p):
        shard_offset(p, index)


def shard_offset(p: torch.Tensor, index: int) -> int:
    """The global element offset of this rank's local shard of DTensor ``p``.

    Handles one ``Shard(0)`` mesh dimension (FSDP2, HSDP) and any ``Replicate`` ones; the
    local tensor is then rows [start, start + rows) of p, a flat range of its elements.
    """
    from torch.distributed.tensor import Replicate, Shard
    sharded = [(dim, pl) for dim, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(sharded) > 1 or any(type(pl) is not Shard or pl.dim != 0 for _, pl in sharded):
        raise ValueError(f"Invalid parameter {index}: DTensor placements {tuple(p.placements)} "
                         f"are not supported (AdamBridge handles Shard(0) and Replicate, as "
                         f"FSDP2's default fully_shard gives; drop shard_placement_fn or TP)")
    if not sharded:
        return 0
    mesh_dim = sharded[0][0]
    ranks, coordinate = p.device_mesh.size(mesh_dim), p.device_mesh.get_coordinate()
    rows = p.shape[0] if p.dim() else 1
    per_rank = -(-rows // ranks)  # torch.chunk's split, as FSDP2 and DTensor use
    start_row = min(coordinate[mesh_dim] * per_rank, rows)
    return start_row * (p.numel() // rows if rows else 0)


class GroupLookup:
    """p -> its param group in ``opt.param_groups`` as they are now, for updaters that run
    from hooks: load_state_dict (and users) may replace the groups with new dicts, and the
    loaded hyperparameters must reach the update, as in the synchronous step."""

    def __init__(self, opt: OptimizerDoor) -> None:
        import weakref
        self._opt_ref = weakref.ref(opt)
        self._seen: list = []
        self._of: dict = {}

    def __call__(self, p: torch.Tensor) -> dict:
        groups = self._opt_ref().param_groups
        if len(groups) != len(self._seen) or any(a is not b for a, b in zip(groups, self._seen)):
            self._of = {q: g for g in groups for q in g["params"]}
            self._seen = list(groups)
        return self._of[p]


# --------------------------------------------------------------------------- sync step


def local_of(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank updates: a DTensor's local shard, else p itself."""
    return p.to_local() if is_dtensor(p) else p


def sync_step(opt: OptimizerDoor, stats: Any, began: float, skip: frozenset = frozenset()) -> None:
    """``opt.step()`` over DTensor (and plain) parameters: each rank updates its shard.

    ``skip``: parameters already updated in this step (FSDP2 async mode, distributed/fsdp_async.py).
    """
    work = []
    for i, group in enumerate(opt.param_groups):
        check.group_flags(group, f"param_groups[{i}]")  # set after construction or load
        for p in group["params"]:
            if p.grad is None or p in skip:
                continue
            opt.check_gradient(p)
            work.append(shard_work(opt, p, group))
    done = update_shards(opt, work)
    stats.num_params, stats.num_batches = len(done), int(bool(done))
    stats.host_update_s = stats.wall_s = time.perf_counter() - began


def shard_work(opt: OptimizerDoor, p: torch.Tensor, group: dict) -> tuple:
    """(p, group, global offset, local gradient) of a parameter whose gradient is checked."""
    sharded = is_dtensor(p)
    offset = shard_offset(p, opt.index(p)) if sharded else 0
    return p, group, offset, _local_grad(p, opt.index(p)) if sharded else p.grad


def update_shards(opt: OptimizerDoor, work: list) -> list:
    """Update each (p, group, offset, grad) of ``work`` in one batch; returns what was done."""
    items, done = [], []
    for p, group, offset, grad in work:
        local, grad = local_of(p).detach(), grad.detach()
        state = ensure_range_state(opt, p, local, local)
        step = int(state["step"].item()) + 1
        out = _out(opt, p, local)
        items.append(_item(opt, p, group, state, step, _flat_host(grad), out, offset))
        done.append((p, local, state, step))
    if items:
        adamw_update(items, opt.resolve_backend())
    for p, local, state, step in done:
        state["step"].fill_(step)
        _write_back(opt, p, local, state)
        opt.note_written(p, local)
    return done


def _local_grad(p: torch.Tensor, index: int) -> torch.Tensor:
    """The local shard of DTensor p's gradient, laid out as p's own."""
    grad = p.grad
    if not is_dtensor(grad):
        raise ValueError(f"Invalid gradient of parameter {index}: a plain tensor for a DTensor "
                         f"parameter; set distribute_tensor(grad, p.device_mesh, p.placements)")
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


def _item(opt: OptimizerDoor, p: torch.Tensor, group: dict, state: dict, step: int,
          grad: torch.Tensor, out: Optional[torch.Tensor], offset: int) -> Any:
    """The shard's UpdateItem: state-local views, rounding bits keyed by the global offset."""
    hyper = Hyper.for_group(group, step)
    item = host_state.range_item(state, grad=grad, out=out, start=0,
                                 key=stream_key(opt.seed, step, opt.index(p)), hyper=hyper,
                                 stochastic_rounding=opt.stochastic_rounding)
    item.offset = offset  # the state holds the shard only; the rounding bits are global
    return item


def _aliases(local: torch.Tensor) -> bool:
    return host_state.can_alias_master(local)


def ensure_range_state(opt: OptimizerDoor, p: torch.Tensor, values: torch.Tensor,
                       owner: torch.Tensor) -> dict:
    """ParamOwner.ensure_state for part of p (an FSDP2 shard, a shard_state range): the state
    of ``values``, made from them and refreshed from them when ``owner`` (the tensor they
    are part of) was written since the last update."""
    state = opt.state[p]
    if state:
        if _aliases(owner):
            state["master"] = values.view(-1)  # owner may have a new storage (p.data = ...)
        elif not opt.written_as(p, owner):
            host_state.adopt_written(state, values)
        return state
    opt.note_layout(p)
    state.update(host_state.new_state(values, opt.precision, alias=_aliases(owner)))
    return state


def _out(opt: OptimizerDoor, p: torch.Tensor, local: torch.Tensor) -> Optional[torch.Tensor]:
    if _aliases(local) or (local.dtype == torch.float32 and not local.is_cpu):
        return None  # the master is the shard itself, or the fp32 copy to send
    if local.is_cpu and local.is_contiguous():
        return local.view(-1)  # CPUOffloadPolicy: the kernel writes the shard in place
    return opt.writeback_buffer(p, local.numel(), local.dtype)


def _write_back(opt: OptimizerDoor, p: torch.Tensor, local: torch.Tensor, state: dict) -> None:
    if local.is_cpu and local.is_contiguous():
        torch.autograd.graph.increment_version([local])  # the kernel wrote through it
        return
    source = state["master"] if local.dtype == torch.float32 else opt.kept_writeback(p)
    local.copy_(source.view(local.shape))


def _flat_host(grad: torch.Tensor) -> torch.Tensor:
    grad = grad if grad.is_cpu else grad.to("cpu")
    return grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)


# --------------------------------------------------------------------------- checkpoints


def saved_entry(p: torch.Tensor, state: dict) -> dict:
    """checkpoint.saved_entry; for a DTensor p, every per-element tensor is a DTensor laid
    out as p (what torch.distributed.checkpoint reshards), built from the local shard."""
    if not is_dtensor(p):
        return checkpoint.saved_entry(p, state)
    if host_state.precision_of(state) == "fp8":
        raise ValueError("state_dict() of fp8 moments on FSDP2 (DTensor) parameters is not "
                         "supported (the per-128 scales do not shard as rows); use "
                         "precision='bf16' or 'fp32'")
    from torch.distributed.tensor import DTensor
    local = local_of(p).detach()
    entry = checkpoint.saved_entry(local, state)
    for key, value in entry.items():
        if value.numel() == local.numel() and value.dim() > 0:
            entry[key] = DTensor.from_local(value.reshape(local.shape), p.device_mesh,
                                            p.placements, shape=p.shape, stride=p.stride())
    return entry


def restore(state_dict: Any, groups: list, params: list, precision: str,
            handed: Any = None, own: Any = None) -> Any:
    """checkpoint.restore, where each DTensor parameter stands for its local shard.

    The checkpoint's DTensor entries are brought to the parameter's placements (DCP already
    did when it loaded them) and taken as their local tensors, so the checks and the built
    state are the shard's; the states come back keyed by the DTensor parameters.
    """
    if not any(is_dtensor(p) for p in params):
        return checkpoint.restore(state_dict, groups, params, precision, handed=handed,
                                  own=own)
    shards = [local_of(p).detach() if is_dtensor(p) else p for p in params]
    state_dict = dict(state_dict, state=_localized(state_dict, params))
    return checkpoint.restore(state_dict, groups, params, precision, own=own, shards=shards)


def _localized(state_dict: Any, params: list) -> Any:
    saved = state_dict.get("state") if isinstance(state_dict, dict) else None
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, dict) or not isinstance(groups, list):
        return saved  # checkpoint.restore names what is wrong
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    by_id = dict(zip(ids, params))
    out = {}
    for saved_id, entry in saved.items():
        p = by_id.get(saved_id)
        if p is None or not is_dtensor(p) or not isinstance(entry, dict):
            out[saved_id] = entry
            continue
        out[saved_id] = {k: _local_value(v, p) for k, v in entry.items()}
    return out


def _local_value(value: Any, p: torch.Tensor) -> Any:
    if not is_dtensor(value):
        return value
    if tuple(value.placements) != tuple(p.placements):
        value = value.redistribute(p.device_mesh, p.placements)
    return value.to_local()
