"""On-disk layout of the NVMe tier: page records, A/B slots, per-parameter files, the manifest.

A parameter's state is cut into pages of ``page_size`` elements (a multiple of 128, so fp8
block scales are whole). Page k lives in directory ``k % len(dirs)`` (several drives are
striped), in that directory's file for the parameter, as two 4096-aligned records: slot A
and slot B. One record holds the page's master, m, v and (fp8) scales. Generation g of a
parameter is in slot ``g % 2``; a step reads slot g and writes slot g+1, and only the
manifest, replaced atomically after the new pages are fsynced, says which is committed. A
crash at any moment therefore leaves every parameter at the generation the manifest names.

A parameter smaller than a page gets pages of its own size (rounded up to 128 elements), so
its files take space in proportion to its state. Each record ends in a trailer: the CRC-32
of the record's state bytes, its page number and generation, written with the page and
checked whenever a committed page is read, so a page damaged on the drive (or a stale one
left by a lost write) is refused in one line naming the file and offset.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..update import codecs
from ..host import platform_facts
from ..update.codecs import FP8_BLOCK
from .direct_io import AlignedBuffer, DataFile, ReadOnlyFile, TierError, align_up, describe_os_error
from ..update.state import MOMENT_DTYPES

MANIFEST = "adambridge-manifest.json"
FORMAT = 2  # 2: pages fitted to small parameters, a checksummed trailer per record
# The record trailer: magic, CRC-32 of the state bytes, page number, generation.
_TRAILER = struct.Struct("<4sIQQ")
_MAGIC = b"ABpg"


@dataclass(frozen=True)
class PageLayout:
    """Byte offsets of master, m, v and the two fp8 scale arrays inside one page record."""

    precision: str
    page_size: int

    @property
    def parts(self) -> tuple[tuple[str, torch.dtype, int, int], ...]:
        """(state key, dtype, elements per full page, byte offset) in record order."""
        return _parts(self.precision, self.page_size)

    @property
    def state_bytes(self) -> int:
        """Bytes of one record's state (master, moments, scales), before the trailer."""
        key, dtype, count, offset = self.parts[-1]
        return offset + count * dtype.itemsize

    @property
    def record_bytes(self) -> int:
        return align_up(self.state_bytes + _TRAILER.size)

    def seal(self, buffer: AlignedBuffer, k: int, generation: int) -> None:
        """Write the trailer of page ``k`` of ``generation`` after the state in ``buffer``."""
        crc = zlib.crc32(buffer.memory[:self.state_bytes])
        _TRAILER.pack_into(buffer.memory, self.state_bytes, _MAGIC, crc, k, generation)

    def check(self, buffer: AlignedBuffer, k: int, generation: int, path: Any,
              offset: int) -> None:
        """Refuse a record read into ``buffer`` that is not page ``k`` of ``generation`` as
        it was written."""
        magic, crc, page, written = _TRAILER.unpack_from(buffer.memory, self.state_bytes)
        if magic == _MAGIC and (page, written) == (k, generation) and \
                crc == zlib.crc32(buffer.memory[:self.state_bytes]):
            return
        what = ("fails its checksum" if magic == _MAGIC and (page, written) == (k, generation)
                else f"holds no trailer of page {k}, generation {generation}")
        raise TierError(f"NVMe tier: the record at byte {offset} of {path} {what}: the drive "
                        f"or something outside adambridge changed it; restore the optimizer "
                        f"from a checkpoint with opt.load_state_dict()")

    def views(self, buffer: AlignedBuffer, numel: int) -> dict[str, torch.Tensor]:
        """The state of a page of ``numel`` elements, as views into ``buffer``."""
        full = buffer.cached_views(self, self._full_views)
        blocks = codecs.fp8_num_blocks(numel)
        return {key: view[:blocks if key.endswith("_scale") else numel]
                for key, view in full.items()}

    def _full_views(self, buffer: AlignedBuffer) -> dict[str, torch.Tensor]:
        return {key: buffer.view(offset, count, dtype) for key, dtype, count, offset in self.parts}


def fitted(precision: str, page_size: int, numel: int) -> PageLayout:
    """The layout of a parameter of ``numel`` elements: pages of ``page_size``, or one page
    of its own size (a multiple of 128) where it is smaller."""
    return PageLayout(precision, min(page_size, -(-max(numel, 1) // FP8_BLOCK) * FP8_BLOCK))


@lru_cache(maxsize=None)
def _parts(precision: str, page_size: int) -> tuple:
    m_dtype, v_dtype = MOMENT_DTYPES[precision]
    parts = [("master", torch.float32, page_size), ("exp_avg", m_dtype, page_size),
             ("exp_avg_sq", v_dtype, page_size)]
    if precision == "fp8":
        blocks = page_size // FP8_BLOCK
        parts += [("exp_avg_scale", torch.float32, blocks),
                  ("exp_avg_sq_scale", torch.float32, blocks)]
    placed, offset = [], 0
    for key, dtype, count in parts:
        placed.append((key, dtype, count, offset))
        offset += count * dtype.itemsize  # page_size is a multiple of 128: offsets stay aligned
    return tuple(placed)


class ParamFiles:
    """The files of one parameter's state, one per directory, with two slots per page."""

    def __init__(self, dirs: tuple[Path, ...], index: int, numel: int, layout: PageLayout,
                 opener: Callable[[Path, int], Any] = DataFile) -> None:
        self.index, self.numel, self.layout = index, numel, layout
        self.num_pages = -(-numel // layout.page_size)
        self.files: list = []
        try:
            for d, directory in enumerate(dirs):
                pages_here = len(range(d, self.num_pages, len(dirs)))
                if pages_here:
                    self.files.append(opener(directory / f"adambridge-p{index}.bin",
                                             2 * pages_here * layout.record_bytes))
        except (TierError, OSError):
            self.close()
            raise

    def page(self, k: int) -> tuple[int, int]:
        """(first element, element count) of page k."""
        start = k * self.layout.page_size
        return start, min(self.layout.page_size, self.numel - start)

    def locate(self, k: int, generation: int) -> tuple[DataFile, int]:
        """The file and byte offset of page k's record for ``generation``."""
        file = self.files[k % len(self.files)]
        local = k // len(self.files)
        return file, (2 * local + generation % 2) * self.layout.record_bytes

    def check(self, k: int, generation: int, buffer: AlignedBuffer) -> None:
        """Refuse page ``k`` of ``generation``, read into ``buffer``, if it is damaged."""
        file, offset = self.locate(k, generation)
        self.layout.check(buffer, k, generation, file.path, offset)

    def part_shapes(self) -> list[tuple[str, torch.dtype, int]]:
        """(state key, dtype, elements) of each tensor of this parameter's state."""
        return [(key, dtype, self.numel if count == self.layout.page_size
                 else codecs.fp8_num_blocks(self.numel))
                for key, dtype, count, _ in self.layout.parts]

    def check_sizes(self) -> None:
        for file in self.files:
            file.check_size()

    def sync(self) -> None:
        for file in self.files:
            file.sync()

    def close(self) -> None:
        for file in self.files:
            file.close()


def stage_manifest(directory: Path, page_size: int, dirs: tuple[Path, ...],
                   entries: dict[int, dict]) -> None:
    """The new manifest written and fsynced under its temp name, where nothing reads it. It
    may run while the pages it names are still being fsynced: only ``rename_manifest``, after
    both, makes it the committed one. The rename is durable once ``sync_directory`` has run;
    the caller must do that before overwriting any page the old manifest names (the tier does
    it before the next step's first write)."""
    temp = directory / (MANIFEST + ".tmp")
    body = json.dumps({"format": FORMAT, "page_size": page_size, "dirs": [str(d) for d in dirs],
                       "params": {str(i): e for i, e in sorted(entries.items())}})
    try:
        with open(temp, "w") as handle:
            handle.write(body)
            handle.flush()
            platform_facts.data_sync(handle.fileno())
    except OSError as exc:
        raise TierError(describe_os_error("publishing the manifest", directory / MANIFEST,
                                          exc)) from None


def rename_manifest(directory: Path) -> None:
    """The staged manifest replaces the committed one, atomically."""
    path = directory / MANIFEST
    try:
        platform_facts.replace(directory / (MANIFEST + ".tmp"), path)
    except OSError as exc:
        raise TierError(describe_os_error("publishing the manifest", path, exc)) from None


def sync_directory(directory: Path) -> None:
    try:
        platform_facts.sync_directory(directory)
    except OSError as exc:
        raise TierError(describe_os_error("syncing the directory", directory, exc)) from None


def read_manifest(directory: Path) -> Optional[dict]:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    with open(path) as handle:
        manifest = json.load(handle)
    if manifest.get("format") != FORMAT:
        raise TierError(f"NVMe tier: {path} has format {manifest.get('format')!r}, this "
                        f"adambridge reads format {FORMAT}; use the adambridge that wrote it")
    return manifest


def read_committed(offload_dir: os.PathLike | str) -> dict[int, dict]:
    """Every parameter's committed state in a tier directory: {parameter index: state dict}.

    Needs no optimizer: after a crash this is the last completed step's state (the manifest
    names it), with the keys of ``opt.state[p]`` (``step``, ``master``, ``exp_avg``, ...).
    """
    manifest = read_manifest(Path(offload_dir))
    if manifest is None:
        return {}
    dirs = tuple(Path(d) for d in manifest["dirs"])
    states = {}
    for key, entry in manifest["params"].items():
        layout = PageLayout(entry["precision"], entry["page_size"])
        try:
            files = ParamFiles(dirs, int(key), entry["numel"], layout, ReadOnlyFile)
        except OSError as exc:
            raise TierError(describe_os_error("opening", exc.filename, exc)) from None
        buffer = AlignedBuffer(layout.record_bytes)
        try:
            states[int(key)] = read_state(files, buffer, entry["generation"], entry["step"])
        finally:
            files.close()
    return states


def _returned_when_freed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor in a mapping of its own, unmapped when it is freed.

    NOTE: a save reads the file-placed state one parameter at a time and lets each go; from
    malloc, freed blocks of a few MiB stay in the heap (glibc raises its mmap threshold to
    the size of the last one freed, up to 32 MiB) and the next reads fragment it, so the
    process kept several parameters' worth. A mapping of its own goes back at once."""
    nbytes = numel * dtype.itemsize
    if nbytes < (1 << 20):
        return torch.empty(numel, dtype=dtype)
    memory = platform_facts.anonymous_map(nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes].view(dtype)


def read_state(files: ParamFiles, buffer: AlignedBuffer, generation: int, step: int) -> dict:
    """One parameter's state at ``generation``, read page by page into fresh host tensors."""
    files.check_sizes()
    layout = files.layout
    state = {"step": torch.tensor(float(step), dtype=torch.float32)}
    for key, dtype, total in files.part_shapes():
        state[key] = _returned_when_freed(total, dtype)
    for k in range(files.num_pages):
        start, numel = files.page(k)
        file, offset = files.locate(k, generation)
        got = platform_facts.preadv(file.fd, [buffer.memory[:layout.record_bytes]], offset)
        if got != layout.record_bytes:
            raise TierError(f"NVMe tier: reading {file.path} at byte {offset} returned {got} "
                            f"bytes: it was truncated outside adambridge; restore the optimizer "
                            f"from a checkpoint with opt.load_state_dict()")
        files.check(k, generation, buffer)
        for key, view in layout.views(buffer, numel).items():
            first = start // FP8_BLOCK if key.endswith("_scale") else start
            state[key][first:first + view.numel()].copy_(view)
    return state
