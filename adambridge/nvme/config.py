"""The NVMe tier's arguments and placement: ``offload_dir`` / ``host_budget`` checked, and
which parameters' state goes to files (smallest first into RAM while it fits the budget).

nvme/tier.py re-exports these names; the Tier there keeps each decision once it is made.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from ..update import state as host_state
from ..update.codecs import FP8_BLOCK
from .engine import check_engine

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

PathArg = Union[str, os.PathLike]


@dataclass(frozen=True)
class OffloadConfig:
    """Where and how the tier streams: ``paths`` (one per drive, striped), ``page_size``
    (elements per page, a multiple of 128), ``queue_depth`` (I/O requests in flight) and
    ``io_engine``: 'auto' (io_uring where the kernel allows it, else a thread pool; the
    ADAMBRIDGE_NVME_IO environment variable can decide), 'io_uring' or 'threads'
    (nvme/engine.py)."""

    paths: Sequence[PathArg]
    page_size: int = 1 << 18
    queue_depth: int = 8
    io_engine: str = "auto"


@dataclass(frozen=True)
class Placed:
    """Where one parameter's state lives: ``where`` is 'ram' or 'file'; ``io`` is the engine
    that moves a file's pages ('io_uring' or 'threads'), '' for RAM."""

    index: int
    numel: int
    where: str
    state_bytes: int
    io: str = ""


# --------------------------------------------------------------------------- arguments


def check_offload(offload_dir: Any, host_budget: Any,
                  autotune_config: Any) -> Optional[OffloadConfig]:
    """Validate offload_dir and host_budget together; None means no tier."""
    if offload_dir is None:
        if host_budget is not None:
            raise ValueError(f"host_budget={host_budget!r} needs offload_dir: pass the "
                             f"directory where state beyond the budget goes")
        return None
    config = offload_dir if isinstance(offload_dir, OffloadConfig) else OffloadConfig(
        [offload_dir] if isinstance(offload_dir, (str, os.PathLike)) else list(offload_dir))
    if isinstance(host_budget, bool) or not (host_budget is None or
                                             (isinstance(host_budget, int) and host_budget >= 0)):
        raise ValueError(f"Invalid host_budget: {host_budget!r} (expected bytes, an int >= 0)")
    _check_config(config)
    if autotune_config is not None and autotune_config.tune_precision:
        raise ValueError("offload_dir cannot be combined with autotune precision step-down "
                         "(file-backed state keeps one precision); pass "
                         "autotune=AutoTuneConfig(tune_precision=False)")
    # Absolute, so the manifest's directory list still resolves after a chdir (read_committed).
    paths = tuple(Path(os.path.abspath(p)) for p in config.paths)
    return dataclasses.replace(config, paths=paths)


def _check_config(config: OffloadConfig) -> None:
    if not config.paths:
        raise ValueError("Invalid offload_dir: an empty list (pass at least one directory)")
    for path in config.paths:
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"Invalid offload_dir entry: {path!r} (expected a path)")
        if not Path(path).is_dir():
            raise ValueError(f"offload_dir {str(path)!r} is not an existing directory; create "
                             f"it first (one directory per drive)")
    if len({os.path.realpath(p) for p in config.paths}) != len(config.paths):
        raise ValueError(f"offload_dir lists a directory twice: {[str(p) for p in config.paths]}")
    size = config.page_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % FP8_BLOCK:
        raise ValueError(f"Invalid page_size: {size!r} (expected a positive multiple of "
                         f"{FP8_BLOCK} elements, so fp8 block scales are whole)")
    depth = config.queue_depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
        raise ValueError(f"Invalid queue_depth: {depth!r} (expected an int >= 2: one read "
                         f"and one write in flight)")
    check_engine(config.io_engine)


# --------------------------------------------------------------------------- placement


def place(params: Sequence[tuple[int, int]], precision: str, budget: Optional[int]) -> dict:
    """{index: 'ram' | 'file'} for (index, numel) pairs: smallest first into RAM while the
    state fits ``budget`` (None: none in RAM). Small parameters (norms, biases) are the
    many cheap ones; the big matrices are what the budget cannot hold."""
    per_param = host_state.HOST_BYTES_PER_PARAM[precision]
    where, used = {}, 0.0
    for index, numel in sorted(params, key=lambda pair: (pair[1], pair[0])):
        cost = per_param * numel
        fits = budget is not None and used + cost <= budget
        where[index] = "ram" if fits else "file"
        used += cost if fits else 0.0
    return where


def all_in_ram(opt: OptimizerDoor) -> list[Placed]:
    """The placement of an optimizer without a tier: every state in RAM."""
    per_param = host_state.HOST_BYTES_PER_PARAM[opt.precision]
    return [Placed(i, p.numel(), "ram", int(per_param * p.numel()))
            for p, i in sorted(opt.param_index.items(), key=lambda kv: kv[1])]
