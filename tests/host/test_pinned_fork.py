"""host/pinned.py on a fake cudart: a failed registration clears the CUDA error; fork marks buffers."""
from __future__ import annotations

import os

import pytest
import torch

from adambridge.host import pinned
from conftest import NEEDS_FORK
from test_pinned import FakeCudart


class ErrorKeepingCudart(FakeCudart):
    """A cudart whose failed register leaves a pending error, as the real runtime does."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.pending = 0
        self.cleared: list[int] = []

    def cudaHostRegister(self, address, nbytes, flags):
        status = super().cudaHostRegister(address, nbytes, flags)
        self.pending = status
        return status

    def cudaGetLastError(self):
        error, self.pending = self.pending, 0
        self.cleared.append(error)
        return error


@pytest.fixture
def cudart(monkeypatch):
    fake = ErrorKeepingCudart(status=0)
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    return fake


def test_pinned_failed_register_clears_the_pending_cuda_error(cudart):
    cudart.status = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cudaHostRegister .* failed with cudaError 2"):
        pinned.pinned_empty(1 << 18, torch.float32)
    assert cudart.pending == 0 and cudart.cleared == [2]


def test_pinned_successful_register_leaves_the_error_state_alone(cudart):
    pinned.pinned_empty(1 << 18, torch.float32).close()
    assert cudart.cleared == []


def test_pinned_clear_error_falls_back_to_the_loaded_runtime(monkeypatch):
    calls = []
    monkeypatch.setattr(pinned, "_cudart", lambda: FakeCudart())  # binds no cudaGetLastError
    monkeypatch.setattr(pinned, "_loaded_get_last_error", lambda: lambda: calls.append(1) or 7)
    assert pinned.clear_cuda_error() == 7 and calls == [1]


@NEEDS_FORK
def test_pinned_fork_child_never_unregisters_and_refuses_use(cudart):
    buffer = pinned.pinned_empty(1 << 18, torch.float32)
    assert buffer.usable and pinned.live_registered_bytes() >= buffer.nbytes
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees through the pipe, never return to pytest
        code = 1
        try:
            cudart.unregistered.clear()
            buffer.close()
            try:
                buffer.check_usable()
            except RuntimeError as exc:
                ok = "forked" in str(exc) and not buffer.usable and not cudart.unregistered
                code = 0 if ok and pinned.live_registered_bytes() == 0 else 3
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    status = os.read(read, 1)
    os.waitpid(pid, 0)
    assert status == bytes([0])
    assert buffer.usable and buffer.registered  # the parent keeps its registration
    buffer.close()
    assert cudart.unregistered == [buffer.tensor.data_ptr()]
