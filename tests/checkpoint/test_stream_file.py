"""adambridge.checkpoint.save writes torch.save's format, one tensor at a time.

Whatever torch.save writes, torch.load reads back the same from ours (values, dtypes,
strides, storages shared between views), with ``weights_only=True`` and ``mmap=True`` too;
tensors whose values live elsewhere (host/sourced.py) are read and written one at a time.
"""
from __future__ import annotations

import io
import weakref

import pytest
import torch
from torch import nn

from adambridge.checkpoint import save
from adambridge.host.sourced import KeptSource, SourcedTensor


def _objects() -> dict:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen)
    return {
        "nested": {"a": [torch.arange(5), (torch.ones(2, dtype=torch.bool), 3)],
                   "b": {"c": torch.tensor(2.5), "d": "text", "e": None}},
        "views of one storage": {"whole": base, "rows": base[1:4], "col": base[:, 2],
                                 "t": base.t()},
        "dtypes": {str(d): torch.randn(33, generator=gen).to(d) for d in
                   (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                    torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.uint8)},
        "empty and 0-d": [torch.empty(0), torch.empty(3, 0), torch.tensor(7)],
        "a module's state_dict": nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4)).state_dict(),
    }


def _same(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if a.dtype.is_floating_point:  # bit for bit (NaN included)
            a, b = a.view(bits[a.itemsize]), b.view(bits[b.itemsize])
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", list(_objects()))
def test_torch_load_reads_back_what_torch_save_would_write(tmp_path, name):
    obj = _objects()[name]
    save(obj, tmp_path / "ours.pt")
    torch.save(obj, tmp_path / "torch.pt")
    theirs = torch.load(tmp_path / "torch.pt")
    for kwargs in ({}, {"weights_only": True}, {"mmap": True}):
        _same(torch.load(tmp_path / "ours.pt", **kwargs), theirs)
    buffer = io.BytesIO()
    save(obj, buffer)  # a file object, as torch.save takes
    buffer.seek(0)
    _same(torch.load(buffer), theirs)


def test_views_of_one_storage_still_share_it_after_loading(tmp_path):
    base = torch.zeros(4, 4)
    save({"base": base, "row": base[2]}, tmp_path / "ours.pt")
    loaded = torch.load(tmp_path / "ours.pt")
    loaded["row"].fill_(1.0)
    assert loaded["base"][2].eq(1.0).all() and loaded["base"].sum() == 4


class _Counted(KeptSource):
    """A source whose every read is a fresh tensor, tracked: what is still alive?"""

    __slots__ = ()
    fresh_snapshots = True
    made: list = []

    def snapshot(self) -> torch.Tensor:
        copy = self.tensor.clone()
        _Counted.made.append(weakref.ref(copy))
        return copy


def test_tensors_whose_values_live_elsewhere_are_written_one_at_a_time(tmp_path, monkeypatch):
    values = [torch.full((1000,), float(i)) for i in range(5)]
    views = [SourcedTensor(v, _Counted(v)) for v in values]
    written, alive_at_write = [], []
    from torch import serialization
    opener = serialization._open_zipfile_writer

    class Watching:
        def __init__(self, archive):
            self.archive = archive

        def write_record(self, name, data, nbytes):
            alive_at_write.append(sum(ref() is not None for ref in _Counted.made))
            written.append(name)
            return self.archive.write_record(name, data, nbytes)

        def __getattr__(self, name):
            return getattr(self.archive, name)

    class Opener:
        def __init__(self, f):
            self.inner = opener(f)

        def __enter__(self):
            return Watching(self.inner.__enter__())

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(serialization, "_open_zipfile_writer", Opener)
    save({"views": views, "plain": torch.ones(3)}, tmp_path / "ours.pt")
    assert alive_at_write[:5] == [1] * 5  # each read one is the only one alive
    loaded = torch.load(tmp_path / "ours.pt")
    for view, value in zip(loaded["views"], values):
        assert type(view) is torch.Tensor and torch.equal(view, value)


def test_meta_tensors_are_saved_as_torch_saves_them(tmp_path):
    save({"x": torch.empty(3, 2, device="meta")}, tmp_path / "ours.pt")
    loaded = torch.load(tmp_path / "ours.pt")["x"]
    assert loaded.device.type == "meta" and loaded.shape == (3, 2)
