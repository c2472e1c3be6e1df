"""Sharded host state for data parallelism (ZeRO-2 style): ``AdamBridge(..., shard_state=True)``.

Under DDP every rank holds the whole model and, after DDP's all-reduce, the whole averaged
gradient. With ``shard_state`` each rank keeps the master and moments of one contiguous
range of every parameter only, updates that range, and an all-gather of the new
low-precision parameter bytes gives every rank the whole updated model: host state per node
is one copy whatever the number of ranks.

Ranges: parameter i's elements are cut into N chunks of whole 128-element blocks (fp8's
scale blocks stay whole; torch.chunk's split of the blocks, the last chunks possibly empty),
and rank r owns chunk (r - i) mod N, so small parameters spread over the ranks instead of all
landing on rank 0. The update item's offset is the chunk's start, so the stochastic rounding
is keyed by the element's index in the whole parameter and the bits equal the unsharded
optimizer's, whatever N.

Checkpoints: ``state_dict()`` is a collective (every rank calls it) that gathers the whole
state, in the unsharded layout, on every rank (a batch of parameters per exchange);
``load_state_dict()`` takes that layout (ours, an unsharded AdamBridge's or torch AdamW's)
and builds this rank's ranges only, one parameter at a time. So a checkpoint saved on N
ranks (plain torch.save or torch.distributed.checkpoint) loads on any M, sharded or not.
A save holds the whole state per rank while it runs; a load, the loaded dict (all of it
from ``torch.load``, this rank's ranges of it with ``mmap=True``). ``sharded_state_dict()``
(zero_saved.py) is the same dict for torch.distributed.checkpoint with this rank's ranges
only: its save and its load hold no whole tensor.

Asynchronous mode (``attach_hooks`` on a DDP model) is distributed/zero_async.py: the ranges are
updated in backward from DDP's reduced buckets, and ``step()`` runs this module's
all-gather (``sync_step`` with those parameters skipped).

Refused in one line: DTensor parameters (FSDP2 shards already), ``offload_dir``,
parameters on several devices, non-contiguous ones, and ranks that disagree on which
parameters have a gradient.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _validation as check
from .. import checkpoint
from ..update import state as host_state
from ..update.codecs import FP8_BLOCK
from ..update.functional import adamw_update

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_ALIGN = 8  # byte alignment of each piece in an exchange buffer (any dtype can view it)


# --------------------------------------------------------------------------- the option


def process_group(shard_state: Any, offload: Any) -> Optional[Any]:
    """The process group ``shard_state`` names (None when off), or a one-line error."""
    if shard_state is False or shard_state is None:
        return None
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("shard_state needs torch.distributed initialized: call "
                         "dist.init_process_group() before AdamBridge(..., shard_state=True)")
    if offload is not None:
        raise ValueError("shard_state=True with offload_dir is not supported; "
                         "remove one of them")
    if shard_state is True:
        return dist.group.WORLD
    if isinstance(shard_state, dist.ProcessGroup):
        return shard_state
    raise ValueError(f"Invalid shard_state: {shard_state!r} (expected False, True or a "
                     f"torch.distributed ProcessGroup)")


# --------------------------------------------------------------------------- ranges


def chunk_range(numel: int, index: int, rank: int, world: int) -> tuple[int, int]:
    """Elements [start, end) of parameter ``index`` (``numel`` elements) that ``rank`` owns."""
    blocks = -(-numel // FP8_BLOCK)
    per_chunk = -(-blocks // world) * FP8_BLOCK
    chunk = (rank - index) % world
    return min(chunk * per_chunk, numel), min((chunk + 1) * per_chunk, numel)


def _owners_in_order(index: int, world: int) -> list[int]:
    """The ranks owning chunks 0, 1, ... of parameter ``index``, in element order."""
    return [(index + chunk) % world for chunk in range(world)]


def _blocks(start: int, end: int) -> tuple[int, int]:
    return start // FP8_BLOCK, -(-end // FP8_BLOCK)


class _Group:
    """The process group with this rank's coordinates, and the device its collectives use:
    the parameters' GPU when they are on one (an NCCL-only group has no CPU collectives),
    else the CPU."""

    def __init__(self, group: Any, opt: OptimizerDoor) -> None:
        import torch.distributed as dist
        self.group, self.dist = group, dist
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        devices = [p.device for g in opt.param_groups for p in g["params"]]
        self.device = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))

    def range(self, opt: OptimizerDoor, p: torch.Tensor, rank: Optional[int] = None) -> tuple[int, int]:
        return chunk_range(p.numel(), opt.index(p), self.rank if rank is None else rank,
                           self.world)


# --------------------------------------------------------------------------- the exchange


def _offsets(sizes: list) -> tuple[list, int]:
    offsets, at = [], 0
    for numel, dtype in sizes:
        offsets.append(at)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        at += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, at


def all_gather(g: _Group, out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` (all the same size) into ``out``, in rank order."""
    gather = getattr(g.dist, "all_gather_single", None) or g.dist.all_gather_into_tensor
    gather(out, mine, group=g.group)


def exchange(g: _Group, sizes: list, local: list, device: torch.device) -> list:
    """All-gather pieces of known sizes: ``sizes[r]`` is rank r's list of (numel, dtype),
    ``local`` this rank's tensors in that order. Returns every rank's pieces (views).

    One collective of one byte buffer: each rank's pieces packed at 8-byte offsets, padded
    to the largest rank's bytes.
    """
    layout = [_offsets(s) for s in sizes]
    slot = max(max(total for _, total in layout), _ALIGN)
    send = torch.empty(slot, dtype=torch.uint8)  # the padding is gathered, never read
    for tensor, offset in zip(local, layout[g.rank][0]):
        flat = tensor.detach().reshape(-1).to("cpu")
        send[offset:offset + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8))
    send = send.to(device)
    received = torch.empty(g.world * slot, dtype=torch.uint8, device=device)
    all_gather(g, received, send)
    pieces = []
    for rank, (offsets, _) in enumerate(layout):
        base = rank * slot
        pieces.append([received[base + o:base + o + n * torch.empty((), dtype=d).element_size()]
                       .view(d) for (n, d), o in zip(sizes[rank], offsets)])
    return pieces


# --------------------------------------------------------------------------- the step


def sync_step(opt: OptimizerDoor, stats: Any, began: float, skip: frozenset = frozenset()) -> None:
    """``opt.step()`` with sharded state: update this rank's ranges, all-gather the rest.

    ``skip``: parameters whose range was already updated in this step (asynchronous mode,
    distributed/zero_async.py); they are checked and gathered like the others.
    """
    from . import fsdp
    if fsdp.holds_dtensors(opt):
        raise ValueError("shard_state=True with FSDP2 (DTensor) parameters is not supported: "
                         "FSDP2 shards the state already; drop shard_state")
    g = _Group(opt.shard_group, opt)
    work = _collect(opt, g)
    ranges = [(p, group, *g.range(opt, p)) for p, group in work if p not in skip]
    done = update_ranges(opt, [(p, group, a, b, _host_range(p.grad, a, b))
                               for p, group, a, b in ranges if a < b])
    mine = {p: (state, a, b) for p, state, a, b in done}
    for p, _ in work:
        if p in skip and opt.state.get(p):
            a, b = g.range(opt, p)
            mine[p] = (opt.state[p], a, b)
    _gather_params(opt, g, [p for p, _ in work], mine)
    stats.num_params, stats.num_batches = len(done), int(bool(done))
    stats.host_update_s = stats.wall_s = time.perf_counter() - began


def update_ranges(opt: OptimizerDoor, work: list) -> list:
    """Update each (p, group, start, end, host gradient of the range) of ``work`` in one
    batch: the state of p's range is made or refreshed, ``state["step"]`` committed after.
    Returns (p, state, start, end) of each."""
    from . import fsdp
    items, done = [], []
    for p, group, start, end, grad in work:
        state = fsdp.ensure_range_state(opt, p, p.detach().reshape(-1)[start:end], p)
        step = int(state["step"].item()) + 1
        out = _out(opt, p, start, end)
        items.append(fsdp._item(opt, p, group, state, step, grad, out, start))
        done.append((p, state, step, start, end))
    if items:
        adamw_update(items, opt.resolve_backend())
    for _, state, step, _, _ in done:
        state["step"].fill_(step)
    return [(p, state, start, end) for p, state, _, start, end in done]


def _collect(opt: OptimizerDoor, g: _Group) -> list:
    """(p, group) of every parameter with a gradient, checked, and the same on every rank."""
    work, flags = [], []
    for i, group in enumerate(opt.param_groups):
        check.group_flags(group, f"param_groups[{i}]")  # set after construction or load
        for p in group["params"]:
            flags.append(p.grad is not None)
            if p.grad is None:
                continue
            opt.check_gradient(p)
            if not p.is_contiguous():
                raise ValueError(f"Invalid parameter {opt.index(p)}: not contiguous, which "
                                 f"shard_state=True does not support; make it contiguous")
            work.append((p, group))
    devices = {p.device for p, _ in work}
    if len(devices) > 1:
        raise ValueError(f"shard_state=True with parameters on several devices "
                         f"({sorted(map(str, devices))}) is not supported; use one device")
    agreed = torch.tensor(flags, dtype=torch.int32, device=g.device)
    g.dist.all_reduce(agreed, group=g.group)
    differ = [i for i, (n, mine) in enumerate(zip(agreed.tolist(), flags))
              if n not in (0, g.world)]
    if differ:
        raise ValueError(f"shard_state=True: ranks disagree on which parameters have a "
                         f"gradient (parameter {differ[0]} among others); give every rank the "
                         f"same set (DDP's find_unused_parameters, or zero_grad(set_to_none))")
    return work


def _host_range(grad: torch.Tensor, start: int, end: int) -> torch.Tensor:
    flat = grad.detach().reshape(-1)[start:end]  # only this rank's range crosses the link
    return flat if flat.is_cpu else flat.to("cpu")


def _aliases(p: torch.Tensor) -> bool:
    return host_state.can_alias_master(p)


def _out(opt: OptimizerDoor, p: torch.Tensor, start: int, end: int) -> Optional[torch.Tensor]:
    if _aliases(p) or (p.dtype == torch.float32 and not p.is_cpu):
        return None  # the master is p's range itself, or the fp32 copy to send
    if p.is_cpu:
        return p.detach().view(-1)[start:end]  # the kernel writes p's range in place
    return opt.writeback_buffer(p, end - start, p.dtype)


def _new_values(opt: OptimizerDoor, p: torch.Tensor, state: dict, start: int, end: int) -> torch.Tensor:
    if p.is_cpu:
        return p.detach().view(-1)[start:end]
    return state["master"] if p.dtype == torch.float32 else opt.kept_writeback(p)


def _gather_params(opt: OptimizerDoor, g: _Group, params: list, mine: dict) -> None:
    """Every rank's new values of its ranges into every rank's parameters."""
    if not params:
        return
    if g.world == 1 and all(p.is_cpu for p in params):
        _record_written(opt, params, mine)  # the kernel wrote every range in place
        return
    sizes = [[(b - a, p.dtype) for p in params for a, b in [g.range(opt, p, r)] if b > a]
             for r in range(g.world)]
    local = [_new_values(opt, p, *mine[p]) for p in params if p in mine]
    pieces = exchange(g, sizes, local, g.device)
    for rank in range(g.world):
        ranged = [p for p in params if g.range(opt, p, rank)[1] > g.range(opt, p, rank)[0]]
        for p, piece in zip(ranged, pieces[rank]):
            if rank == g.rank and p.is_cpu:
                continue  # the kernel wrote this rank's range of p in place
            a, b = g.range(opt, p, rank)
            p.detach().view(-1)[a:b].copy_(piece)
    _record_written(opt, params, mine)


def _record_written(opt: OptimizerDoor, params: list, mine: dict) -> None:
    cpu = [p for p in params if p.is_cpu and p in mine]
    if cpu:
        torch.autograd.graph.increment_version(cpu)  # the kernel wrote through them
    for p in params:
        opt.note_written(p, p)


# --------------------------------------------------------------------------- checkpoints


def _state_keys(precision: str) -> list:
    keys = [("master", torch.float32), ("exp_avg", host_state.MOMENT_DTYPES[precision][0]),
            ("exp_avg_sq", host_state.MOMENT_DTYPES[precision][1])]
    if precision == "fp8":
        keys += [("exp_avg_scale", torch.float32), ("exp_avg_sq_scale", torch.float32)]
    return keys


def _piece_numel(key: str, start: int, end: int) -> int:
    if key.endswith("_scale"):
        first, last = _blocks(start, end)
        return last - first
    return end - start


_GATHER_BYTES = 64 << 20  # a save's exchanges move at most this much, or one parameter


def saved_state(opt: OptimizerDoor) -> dict:
    """{index: entry} of every parameter with state, whole (a collective: every rank calls).

    The whole state is gathered on every rank (the checkpoint's form); the exchanges go a
    batch of parameters at a time, so the buffers beside it stay within one batch."""
    g = _Group(opt.shard_group, opt)
    held = held_steps(opt, g)
    per_param = host_state.HOST_BYTES_PER_PARAM[opt.precision]
    out, batch, batch_bytes = {}, [], 0.0
    for p, step in held:  # the same batches on every rank: they depend on shapes only
        if batch and batch_bytes + per_param * p.numel() > _GATHER_BYTES:
            out.update(_gathered(opt, g, batch))
            batch, batch_bytes = [], 0.0
        batch.append((p, step))
        batch_bytes += per_param * p.numel()
    if batch:
        out.update(_gathered(opt, g, batch))
    return out


def held_steps(opt: OptimizerDoor, g: _Group) -> list:
    """(p, step) of every parameter that some rank holds state of (a collective: a rank
    whose range of p is empty has none of its own)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    steps = torch.tensor([float(opt.state[p]["step"].item()) if opt.state.get(p) else -1.0
                          for p in params], dtype=torch.float64, device=g.device)
    g.dist.all_reduce(steps, op=g.dist.ReduceOp.MAX, group=g.group)
    return [(p, step) for p, step in zip(params, steps.tolist()) if step >= 0]


def _gathered(opt: OptimizerDoor, g: _Group, batch: list) -> dict:
    """{index: whole entry} of the (parameter, step) pairs of ``batch``: one exchange."""
    keys = _state_keys(opt.precision)
    sizes = [[(_piece_numel(k, a, b), d) for p, _ in batch for a, b in [g.range(opt, p, r)]
              if b > a for k, d in keys] for r in range(g.world)]
    local = [opt.state[p][k] for p, _ in batch for a, b in [g.range(opt, p)] if b > a
             for k, _ in keys]
    pieces = exchange(g, sizes, local, g.device)
    by_rank = [iter(rank_pieces) for rank_pieces in pieces]
    parts: dict = {}
    for p, _ in batch:
        for rank in range(g.world):
            a, b = g.range(opt, p, rank)
            if b > a:
                parts[p, rank] = {k: next(by_rank[rank]) for k, _ in keys}
    out = {}
    for p, step in batch:
        owners = [r for r in _owners_in_order(opt.index(p), g.world) if (p, r) in parts]
        whole = {k: torch.cat([parts[p, r][k] for r in owners]).cpu() for k, _ in keys}
        whole["step"] = torch.tensor(step, dtype=torch.float32)
        out[opt.index(p)] = checkpoint.saved_entry(p, whole)
    return out
