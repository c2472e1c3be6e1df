"""A CUDA stand-in for CPU tests of CudaTransport: streams and events that record who waits.

Tensors stay on the CPU (copies are immediate); what is faked is the ordering machinery.
An event completes when someone synchronises it or a later event on its stream (streams
are in order), so a ``take_stats`` that only polls sees unfinished copies, as on a GPU.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from adambridge.host import pinned
from adambridge.pipeline import transport


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.events = name, log, []

    def wait_event(self, event) -> None:
        self.log.append((self.name, "wait_event", event.stream))

    def wait_stream(self, other) -> None:
        self.log.append((self.name, "wait_stream", other.name))

    def synchronize(self) -> None:
        self.log.append((self.name, "synchronize", None))
        for event in self.events:
            event.done = True

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.timing, self.blocking, self.done, self.stream = enable_timing, blocking, False, None
        self._on = None

    def record(self, stream) -> None:
        self.stream, self._on = stream.name, stream
        stream.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        for event in self._on.events[:self._on.events.index(self) + 1]:
            event.done = True

    def elapsed_time(self, end) -> float:
        return 1.0  # milliseconds


class FakeCuda:
    """Installs the fakes; ``current`` is the stream torch.cuda.current_stream() returns."""

    def __init__(self, monkeypatch) -> None:
        self.log: list = []
        self.recorded: list = []      # (tensor, stream name) from record_stream
        self.register_threads: list = []
        self.fail_register = False
        self.default = FakeStream("default", self.log)
        self._local = threading.local()
        self._names = iter(("d2h", "h2d") + tuple(f"s{i}" for i in range(100)))
        cuda = self

        class Cudart:
            def cudaHostRegister(self, address, nbytes, flags):
                cuda.register_threads.append(threading.current_thread().name)
                return 2 if cuda.fail_register else 0

            def cudaHostUnregister(self, address):
                return 0

            def cudaGetLastError(self):
                return 0

        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.stream())
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "stream", self._stream_context)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(transport, "_record_stream",
                            lambda t, s: self.recorded.append((t, s.name)))
        monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
        monkeypatch.setattr(pinned, "_cudart", lambda: Cudart())
        monkeypatch.setattr(pinned, "REGISTER_MIN_BYTES", 0)  # no pin_memory without a GPU

    def stream(self) -> FakeStream:
        return FakeStream(next(self._names), self.log)

    @property
    def current(self) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def _stream_context(self, stream):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def waits(self, kind: str) -> list:
        return [(who, what) for who, k, what in self.log if k == kind]
