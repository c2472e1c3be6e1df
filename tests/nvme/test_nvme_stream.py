"""The tier's paged loop keeps the disk fed (nvme_stream.PageStream): a write that
lands while page i's read is awaited frees a buffer, which is read into at once, so the
disk has work while the kernel updates page i. A disk model that completes one request per
wait, in submission order, makes it deterministic."""
from __future__ import annotations

from collections import deque

import torch

from adambridge import AdamBridge
from adambridge.nvme import stream as nvme_stream
from adambridge.nvme.tier import OffloadConfig
from adambridge.nvme.direct_io import IOPool


class _Queued:
    """One request of the model disk: done once the disk has reached it."""

    def __init__(self, disk: "FifoDisk", run):
        self.disk, self.run, self.finished, self.error = disk, run, False, None

    def done(self) -> bool:
        return self.finished

    def result(self):
        while not self.finished:
            self.disk.complete_one()
        if self.error is not None:
            raise self.error

    def exception(self):
        try:
            self.result()
        except BaseException as exc:  # noqa: BLE001 - returned, as Future.exception does
            return exc
        return None


class FifoDisk(IOPool):
    """Requests are queued and carried out one per wait, oldest first (the real pread and
    pwrite of IOPool, on the tier's own files); helper work (fsyncs) runs as usual."""

    def __init__(self, queue_depth: int):
        super().__init__(queue_depth)
        self.queue: deque = deque()

    def read(self, file, buffer, offset, nbytes):
        return self._enqueue(lambda: self._read(file, buffer, offset, nbytes))

    def write(self, file, buffer, offset, nbytes):
        return self._enqueue(lambda: self._write(file, buffer, offset, nbytes))

    def _enqueue(self, run) -> _Queued:
        request = _Queued(self, run)
        self.queue.append(request)
        return request

    def complete_one(self) -> None:
        request = self.queue.popleft()
        try:
            request.run()
        except BaseException as exc:  # noqa: BLE001 - raised by its result()
            request.error = exc
        request.finished = True

    def _wait_any(self, first, others) -> None:
        if self.queue:
            self.complete_one()


def _tier(directory, queue_depth: int):
    directory.mkdir()
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, generator=gen)) for _ in range(3)]
    opt = AdamBridge(params, lr=1e-2, offload_dir=OffloadConfig([directory], page_size=512,
                                                                 queue_depth=queue_depth),
                     host_budget=0)
    return params, opt


def _step(params, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def test_the_disk_has_work_while_each_page_is_updated(tmp_path, monkeypatch):
    params, opt = _tier(tmp_path / "model", queue_depth=2)
    reference, ref_opt = _tier(tmp_path / "ref", queue_depth=2)
    for step in range(3):
        _step(reference, ref_opt, step)
    for step in range(2):  # the first step makes fresh pages on helper threads
        _step(params, opt, step)
    disk = FifoDisk(queue_depth=2)
    tier = opt.nvme_tier
    tier.pool = tier.stream.pool = disk
    tier.stream.buffers = []  # the ring is registered with the engine that uses it
    in_flight = []
    update = nvme_stream.PageStream._update

    def counted(*args):
        in_flight.append(len(disk.queue))
        update(*args)

    monkeypatch.setattr(nvme_stream.PageStream, "_update", staticmethod(counted))
    _step(params, opt, 2)
    pages = len(in_flight)
    ring = disk.queue_depth + 1
    assert pages == 3 * 4096 // 512
    # Every page but the last few has a request queued behind it while it is updated.
    assert all(n > 0 for n in in_flight[:pages - ring]), in_flight
    for p, q in zip(params, reference):  # and the model disk moved the same bytes
        assert torch.equal(p, q)
