"""shard_state's sharded checkpoint: ``opt.sharded_state_dict()`` for torch.distributed.checkpoint.

``opt.state_dict()`` under shard_state gathers the whole state on every rank (zero.py). This
is the same dict, the same keys and whole shapes, where each per-element entry (``master``,
the moments, fp8 codes and scales) is a ``RankPiece``: a tensor that presents the whole
entry's shape and dtype and holds this rank's range of it only, a view of the state's own
tensor. It speaks DCP's checkpointable protocol (the three methods DTensor has), so
``dcp.save`` writes each rank's range once and ``dcp.load`` writes into it in place, and
the checkpoint's metadata is the one a gathered save writes: it loads anywhere that one
loads. ``step`` and ``ab_step`` stay plain (replicated: DCP writes them once).

A rank's range [a, b) of a row-major tensor is not one box of it: it is cut into the few
boxes (a partial first row, whole rows, a partial last row; recursively for more
dimensions), each contiguous in the range, and each is a chunk of the checkpoint.

Loading (``restore``: every load_state_dict() under shard_state): ``restore_input`` turns
such entries into this rank's pieces for checkpoint.restore, which checks and takes them as
it takes an FSDP2 rank's local shards (the state's own tensors after an in-place
``dcp.load``: taken as they are; anyone else's: copied). Nothing whole is built. A
``dcp.load`` with no load_state_dict() wrote into the state itself: the next step takes it
or refuses it in one line (checkpoint.HandedOut, as for an unsharded state_dict()).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .. import checkpoint
from ..checkpoint import OURS
from ..update import state as host_state
from ..update.codecs import FP8_BLOCK
from . import zero

if TYPE_CHECKING:
    from ..door import OptimizerDoor

_FP8_KEYS = ("exp_avg", "exp_avg_sq")
_SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")


# --------------------------------------------------------------------------- boxes


def flat_boxes(shape: tuple, start: int, end: int) -> list:
    """(offsets, sizes, first element) of the boxes that elements [start, end) of a
    row-major tensor of ``shape`` make, in flat order, each contiguous in memory."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start)]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, last = start // inner, (end - 1) // inner  # the rows the range touches
    if start % inner == 0 and end % inner == 0:
        return [((first, *[0] * (len(shape) - 1)), (last + 1 - first, *shape[1:]), start)]
    if first == last:  # within one row: that row's boxes, one row high
        return [((first, *offsets), (1, *sizes), first * inner + at)
                for offsets, sizes, at in flat_boxes(shape[1:], start - first * inner,
                                                     end - first * inner)]
    whole_from, whole_to = -(-start // inner), end // inner
    return (flat_boxes(shape, start, whole_from * inner)
            + flat_boxes(shape, whole_from * inner, whole_to * inner)
            + flat_boxes(shape, whole_to * inner, end))


# --------------------------------------------------------------------------- the piece


class RankPiece(torch.Tensor):
    """A whole entry's shape and dtype over this rank's elements [start, end) of it only.

    ``piece`` is the flat view of those elements (the state's own tensor). DCP reads and
    writes the piece's boxes; any other operation is refused in one line: the elements of
    the other ranks are not here.
    """

    piece: torch.Tensor
    start: int
    end: int
    rank: int

    @staticmethod
    def __new__(cls, piece: torch.Tensor, shape: tuple, start: int, end: int,
                rank: int) -> "RankPiece":
        if piece.numel() != end - start or piece.dim() != 1:
            raise ValueError(f"Invalid piece: {tuple(piece.shape)} for elements [{start}, "
                             f"{end}) (expected a flat tensor of {end - start})")
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=piece.dtype,
                                                   device=piece.device, requires_grad=False)
        self.piece, self.start, self.end, self.rank = piece, start, end, rank
        boxes = flat_boxes(tuple(shape), start, end)
        self._boxes = {tuple(o): (tuple(s), at - start) for o, s, at in boxes}
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        piece = next((a for a in args if isinstance(a, RankPiece)), None)
        where = (f"rank {piece.rank}'s elements [{piece.start}, {piece.end}) of a "
                 f"{tuple(piece.shape)} tensor") if piece is not None else "one rank's range"
        raise RuntimeError(f"{func} on an entry of opt.sharded_state_dict(), which holds only "
                           f"{where}; read it through torch.distributed.checkpoint, or call "
                           f"opt.state_dict() for a gathered copy")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"RankPiece(shape={tuple(self.shape)}, dtype={self.dtype}, rank {self.rank}'s "
                f"elements [{self.start}, {self.end}))")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # NOTE: torch.save of a tensor subclass pickles its attributes: it would write this
        # rank's piece under the whole shape, a file that looks whole and is not.
        raise TypeError(f"An entry of opt.sharded_state_dict() holds only rank {self.rank}'s "
                        f"elements [{self.start}, {self.end}) of a {tuple(self.shape)} tensor "
                        f"and is not pickled; save it with torch.distributed.checkpoint, or "
                        f"torch.save(opt.state_dict()) (a gathered copy)")

    def _box(self, offsets: tuple) -> torch.Tensor:
        sizes, at = self._boxes[offsets]
        numel = 1
        for size in sizes:
            numel *= size
        return self.piece[at:at + numel].view(sizes)

    # DCP's checkpointable protocol (torch.distributed.checkpoint.planner_helpers, utils)

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        # NOTE: SHARD items: DCP's global plan takes several chunks of one key only so.
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                              properties=properties, size=self.shape))
                for offsets, (sizes, _) in self._boxes.items()]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for offsets, (sizes, _) in self._boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else ()
        if offsets not in self._boxes:
            raise ValueError(f"{index.fqn}: rank {self.rank} holds no chunk at {offsets} "
                             f"(its chunks: {sorted(self._boxes)})")
        # NOTE: DCP's writer clones a tensor whose storage is larger than it (torch.save
        # writes whole storages), which a box of a piece always is but for a range of whole
        # rows: measured 4 B/param on a save. A DLPack alias of the box has a storage of
        # exactly its bytes, the same memory: written as it is, and loaded into in place.
        return torch.from_dlpack(self._box(offsets))


# --------------------------------------------------------------------------- the save


def sharded_states(opt: OptimizerDoor) -> tuple:
    """(the saved 'state' of RankPiece entries, (index, p, None) per entry this rank holds
    state for): a collective (one all-reduce of the steps)."""
    g = zero._Group(opt.shard_group, opt)
    state, handed = {}, []
    for p, step in zero.held_steps(opt, g):
        start, end = g.range(opt, p)
        own = opt.state.get(p) or None
        if own is None and start < end:
            raise RuntimeError(f"shard_state: rank {g.rank} holds no state of parameter "
                               f"{opt.index(p)} while another rank does; step every rank "
                               f"before sharded_state_dict()")
        state[opt.index(p)] = _entry(p, own, step, start, end, g.rank, opt.precision)
        if own is not None:
            handed.append((opt.index(p), p, None))  # its pieces are the state's own
    return state, handed


def _entry(p: torch.Tensor, own: Optional[dict], step: float, start: int, end: int,
           rank: int, precision: str) -> dict:
    def piece(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return own[key].view(-1) if own is not None else torch.empty(numel, dtype=dtype)

    shape, numel = tuple(p.shape), p.numel()
    entry = {
        "step": own["step"] if own is not None else torch.tensor(step, dtype=torch.float32),
        "master": RankPiece(piece("master", torch.float32, 0), shape, start, end, rank),
        "ab_step": torch.tensor(int(step), dtype=torch.int64),
    }
    dtypes = dict(zip(_FP8_KEYS, host_state.MOMENT_DTYPES[precision]))
    if precision != "fp8":  # torch's keys, p's shape (checkpoint.saved_entry)
        for key in _FP8_KEYS:
            entry[key] = RankPiece(piece(key, dtypes[key], 0), shape, start, end, rank)
        return entry
    for key in _FP8_KEYS:
        entry[OURS + key] = RankPiece(piece(key, dtypes[key], 0), (numel,), start, end, rank)
    first, last = _scale_range(start, end)
    blocks = -(-numel // FP8_BLOCK)
    for key in _SCALE_KEYS:
        entry[OURS + key] = RankPiece(piece(key, torch.float32, 0), (blocks,), first, last, rank)
    return entry


def _scale_range(start: int, end: int) -> tuple:
    """The fp8 scales of elements [start, end): none for an empty range (whose start may
    sit inside the last block)."""
    first, last = zero._blocks(start, end)
    return (first, last) if start < end else (first, first)


# --------------------------------------------------------------------------- the load


def restore(opt: OptimizerDoor, state_dict: Any) -> Any:
    """checkpoint.restore of a whole (unsharded-layout) checkpoint, whose states() build this
    rank's ranges only: a range is copied or converted out of the loaded tensors, never a
    whole parameter's state. Nothing is changed before every value is checked. Entries of
    sharded_state_dict() are checked and taken as this rank's pieces (restore_input)."""
    g = zero._Group(opt.shard_group, opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    index = {p: i for i, p in enumerate(params)}
    refusal: Optional[BaseException] = None
    try:
        state_dict, shards, span_of = restore_input(
            state_dict, params, lambda p: zero.chunk_range(p.numel(), index[p], g.rank,
                                                           g.world))
        # own: a piece dcp.load wrote into is the state's own tensor, kept as it is.
        restored = checkpoint.restore(state_dict, opt.param_groups, params, opt.precision,
                                      own=opt.state.get, shards=shards, span_of=span_of)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        refusal = error
    agree(g, refusal is not None, "load_state_dict() refused the checkpoint")
    if refusal is not None:
        raise refusal
    return restored


def agree(g: Any, refused: bool, what: str) -> None:
    """Raise on every rank when any rank ``refused`` (a collective): each rank checks only
    its own ranges of a sharded checkpoint, and a rank that went on alone would wait in the
    next collective for the one that stopped, forever."""
    flag = torch.tensor([1 if refused else 0], dtype=torch.int32, device=g.device)
    g.dist.all_reduce(flag, op=g.dist.ReduceOp.MAX, group=g.group)
    if flag.item() and not refused:
        raise ValueError(f"{what} on another rank (its ranges of the state failed the "
                         f"checks; that rank's error says which); this rank stops with it")


def restore_input(state_dict: Any, params: list, span_of: Any) -> tuple:
    """(state_dict, shards, span_of) for checkpoint.restore: each entry holding RankPiece
    values becomes this rank's piece of every per-element value (a whole plain one, which
    adambridge.dcp.LoadPlanner may add beside them, a view of its range), with p's range
    as its shard and (0, its length) as its span. Anything else is passed on as it is."""
    try:
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        entries = state_dict["state"]
    except (TypeError, KeyError):
        return state_dict, None, span_of  # checkpoint.restore says what is wrong
    of_id = dict(zip(ids, params))
    local, ranged = {}, {}
    for saved_id, entry in entries.items():
        p = of_id.get(saved_id)
        if p is not None and isinstance(entry, dict) and \
                any(isinstance(v, RankPiece) for v in entry.values()):
            span = span_of(p)
            local[saved_id] = {k: _local(saved_id, k, v, p, span) for k, v in entry.items()}
            ranged[p] = span
        else:
            local[saved_id] = entry
    if not ranged:
        return state_dict, None, span_of
    shards = [p.detach().reshape(-1)[ranged[p][0]:ranged[p][1]] if p in ranged else p
              for p in params]
    spans = {p: (0, span[1] - span[0]) for p, span in ranged.items()}
    return ({**state_dict, "state": local}, shards,
            lambda p: spans[p] if p in spans else span_of(p))


def _local(saved_id: Any, key: str, value: Any, p: torch.Tensor, span: tuple) -> Any:
    """This rank's piece of ``entry[key]``: a RankPiece's own piece (checked to be this
    rank's range), a view of a whole tensor's range; anything else as it is."""
    scale = key.endswith("_scale")
    first, last = _scale_range(*span) if scale else span
    numel = -(-p.numel() // FP8_BLOCK) if scale else p.numel()
    if isinstance(value, RankPiece):
        if (value.start, value.end) != (first, last) or value.numel() != numel:
            raise ValueError(f"Checkpoint {key!r} of parameter {saved_id} holds elements "
                             f"[{value.start}, {value.end}) of {value.numel()}, this rank's "
                             f"range is [{first}, {last}) of {numel}; pass the dict this "
                             f"optimizer's sharded_state_dict() returned")
        return value.piece
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
        return value.detach().reshape(-1)[first:last]
    return value
