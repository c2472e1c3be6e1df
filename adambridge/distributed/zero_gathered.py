"""shard_state's gathered save: torch.save's file of the whole state, one tensor in RAM at a time.

``opt.state_dict()`` under shard_state gathers the whole state on every rank, so
``torch.save`` of it holds all of it on every rank. ``save(opt, obj, f)`` writes the same
file from ``obj`` holding entries of ``opt.sharded_state_dict()`` (each rank's ranges,
views of its state): every rank calls it, the one rank given a file writes it with
``adambridge.checkpoint.save``, and each ``RankPiece`` it pickles is gathered as it is met
(the writer asks for it by its position, every other rank sends its range of it straight
from its state), written and dropped. Peak host RAM beyond the state: one tensor of one
parameter's state on the writer, nothing on the others. ``torch.load`` +
``load_state_dict`` read the file as they read ``torch.save(opt.state_dict())``'s.

``obj`` may hold other things (a framework's checkpoint: the model's weights, counters);
they are written as ``checkpoint.save`` writes them. Every rank must pass the same structure
(the same call of the same code): the ranks check that they hold the same number of pieces
before anything moves.
"""
from __future__ import annotations

import os
from typing import IO, TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from .. import checkpoint
from ..host.sourced import Source, SourcedTensor
from . import zero
from .zero_saved import RankPiece, agree

if TYPE_CHECKING:
    from ..door import OptimizerDoor

_DONE = -1  # the writer's last request: every piece is written (or the write failed)


def save(opt: OptimizerDoor, obj: Any, f: Optional[Union[str, os.PathLike, IO[bytes]]]) -> None:
    """Write ``obj`` (holding entries of ``opt.sharded_state_dict()``) to ``f``, its pieces
    gathered one at a time (a collective: every rank of shard_state's group calls it; exactly
    one passes a file, the others None)."""
    g = zero._Group(opt.shard_group, opt)
    places: list = []
    swap(obj, places.append)
    writer, ranges = _agree_on(g, f is not None, places)
    if g.rank != writer:
        _serve(g, writer, places)
        agree(g, False, "save_gathered() failed to write the file")
        return
    failed: Optional[BaseException] = None
    try:
        pieces = _Pieces(g, places, ranges)
        checkpoint.save(swap(obj, pieces.gathering), f)
    except BaseException as error:  # the other ranks wait for _DONE: they must hear it
        failed = error
    finally:
        _broadcast(g, writer, _DONE)
    agree(g, failed is not None, "save_gathered() failed to write the file")
    if failed is not None:
        raise failed


def swap(obj: Any, make: Callable[[RankPiece], Any]) -> Any:
    """``obj`` with each RankPiece in dicts, lists and tuples replaced by ``make(piece)``,
    called in the walk's order, the same on every rank for the same structure (containers
    without one are kept as they are; a RankPiece anywhere else refuses to be pickled)."""
    if isinstance(obj, RankPiece):
        return make(obj)
    if type(obj) is dict:  # (a subclass may pickle otherwise: left as it is)
        out = {k: swap(v, make) for k, v in obj.items()}
        return out if any(out[k] is not v for k, v in obj.items()) else obj
    if type(obj) in (list, tuple):
        items = [swap(v, make) for v in obj]
        return type(obj)(items) if any(a is not b for a, b in zip(items, obj)) else obj
    return obj


# --------------------------------------------------------------------------- agreement


def _agree_on(g: zero._Group, writes: bool, places: list) -> tuple:
    """(the writing rank, every rank's (start, end) of every piece): refused in one line on
    every rank unless exactly one rank writes and all hold the same number of pieces."""
    mine = torch.tensor([int(writes), len(places)], dtype=torch.int64, device=g.device)
    every = torch.empty(g.world * 2, dtype=torch.int64, device=g.device)
    zero.all_gather(g, every, mine)
    flags, counts = every.view(g.world, 2).cpu().unbind(1)
    writers = [r for r, w in enumerate(flags.tolist()) if w]
    if len(writers) != 1:
        raise ValueError(f"save_gathered(f): {len(writers)} ranks passed a file (ranks "
                         f"{writers}); pass f on exactly one rank and None on the others")
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"save_gathered(): the ranks hold {counts.tolist()} pieces of "
                         f"sharded_state_dict(); every rank must save the same structure")
    local = torch.tensor([[p.start, p.end] for p in places] or [[0, 0]], dtype=torch.int64,
                         device=g.device)
    gathered = torch.empty(g.world * local.numel(), dtype=torch.int64, device=g.device)
    zero.all_gather(g, gathered, local.reshape(-1))
    return writers[0], gathered.view(g.world, -1, 2).cpu()


# --------------------------------------------------------------------------- moving pieces


def _global(g: zero._Group, rank: int) -> int:
    return g.dist.get_global_rank(g.group, rank) if g.group is not g.dist.group.WORLD else rank


def _broadcast(g: zero._Group, writer: int, request: int) -> int:
    message = torch.tensor([request], dtype=torch.int64, device=g.device)
    g.dist.broadcast(message, src=_global(g, writer), group=g.group)
    return int(message.item())


def _serve(g: zero._Group, writer: int, places: list) -> None:
    """A rank that does not write: send its range of each piece the writer asks for."""
    while (position := _broadcast(g, writer, 0)) != _DONE:
        piece = places[position]
        if piece.end > piece.start:
            data = piece.piece.view(torch.uint8)
            g.dist.send(data.to(g.device), dst=_global(g, writer), group=g.group)


class _Pieces:
    """The writer's side: a tensor per piece whose snapshot gathers it."""

    def __init__(self, g: zero._Group, places: list, ranges: torch.Tensor) -> None:
        self.g, self.places, self.ranges = g, places, ranges
        self._positions = {id(piece): i for i, piece in enumerate(places)}
        # NOTE: one buffer, the largest piece's bytes, holds each piece in turn (the
        # pickler writes a piece before it meets the next). A fresh tensor per piece left
        # the freed ones in glibc's heap, unreused (each aligned allocation a little larger
        # than the hole): measured up to the whole state on the writer.
        largest = max((p.numel() * p.element_size() for p in places), default=0)
        self._buffer = torch.empty(largest, dtype=torch.uint8)

    def gathering(self, piece: RankPiece) -> SourcedTensor:
        like = torch.empty(piece.shape, dtype=piece.dtype, device="meta")
        return _Gathered(like, _GatherSource(self, self._positions[id(piece)]),
                         torch.device("cpu"))

    def gather(self, position: int) -> torch.Tensor:
        """The whole tensor of piece ``position``: this rank's range copied, every other
        rank's received into its place."""
        g, piece = self.g, self.places[position]
        size = piece.element_size()
        # A DLPack alias of the buffer's first bytes: its storage is exactly the piece's
        # bytes, which is what the file gets (a pickled tensor writes its whole storage).
        whole = torch.from_dlpack(self._buffer[:piece.numel() * size]).view(piece.dtype)
        _broadcast(g, g.rank, position)
        for rank, (start, end) in enumerate(self.ranges[:, position].tolist()):
            if end <= start:
                continue
            if rank == g.rank:
                whole[start:end].copy_(piece.piece)
            else:
                _receive(g, whole.view(torch.uint8)[start * size:end * size], rank)
        return whole.view(piece.shape)


def _receive(g: zero._Group, into: torch.Tensor, rank: int) -> None:
    if g.device.type == "cpu":
        g.dist.recv(into, src=_global(g, rank), group=g.group)  # straight into its place
        return
    arrived = torch.empty_like(into, device=g.device)
    g.dist.recv(arrived, src=_global(g, rank), group=g.group)
    into.copy_(arrived)


class _GatherSource(Source):
    """Piece ``position`` of a save in progress, gathered when pickled."""

    __slots__ = ("pieces", "position")
    fresh_snapshots = True

    def __init__(self, pieces: _Pieces, position: int) -> None:
        self.pieces, self.position, self.device = pieces, position, torch.device("cpu")

    def read(self) -> torch.Tensor:
        raise RuntimeError("a piece of save_gathered() is read only by its save")

    def open_write(self) -> torch.Tensor:
        raise RuntimeError("a piece of save_gathered() is read only by its save")

    def snapshot(self) -> torch.Tensor:
        return self.pieces.gather(self.position)


class _Gathered(SourcedTensor):
    """A tensor of save_gathered()'s file: its values are gathered when it is written."""

    __slots__ = ()
