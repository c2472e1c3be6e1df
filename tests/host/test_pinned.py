"""Exact-size page-locked buffers (host/pinned.py); the CUDA path runs against a fake cudart here."""
from __future__ import annotations

import gc

import pytest
import torch

from adambridge.host import pinned


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; ``status`` is what register returns."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address, nbytes, flags):
        if self.status == 0:
            self.registered[address] = nbytes
        return self.status

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: cudart)
    return cudart


def test_pinned_without_cuda_is_a_plain_exact_size_tensor(monkeypatch):
    monkeypatch.setattr(pinned, "_cuda_available", lambda: False)
    buffer = pinned.pinned_empty(17, torch.bfloat16)
    assert buffer.kind == "pageable" and not buffer.registered
    assert buffer.tensor.shape == (17,) and buffer.tensor.dtype == torch.bfloat16
    buffer.close()  # a no-op, and idempotent
    buffer.close()


@pytest.mark.parametrize("numel,dtype", [(1 << 18, torch.float32), ((3 << 19) + 1, torch.bfloat16)],
                         ids=["1 MiB fp32", "3 MiB + 2 B bf16"])
def test_pinned_registers_exactly_the_buffer_size(fake_cuda, numel, dtype):
    buffer = pinned.pinned_empty(numel, dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    assert buffer.kind == "registered" and buffer.registered and buffer.nbytes == nbytes
    # Whole pages of its own, from a page boundary: no two registrations share a page.
    assert buffer.tensor.data_ptr() % pinned._PAGE == 0
    assert fake_cuda.registered == {buffer.tensor.data_ptr(): -(-nbytes // pinned._PAGE) * pinned._PAGE}
    address = buffer.tensor.data_ptr()
    buffer.close()
    buffer.close()
    assert fake_cuda.unregistered == [address] and not buffer.registered


def test_pinned_unregisters_when_collected(fake_cuda):
    buffer = pinned.pinned_empty(1 << 18, torch.float32)
    address = buffer.tensor.data_ptr()
    view = buffer.tensor[:10]  # a view may outlive the buffer: still valid memory
    del buffer
    gc.collect()
    assert fake_cuda.unregistered == [address]
    view.fill_(1.0)


def test_pinned_register_failure_is_a_clear_error(fake_cuda):
    fake_cuda.status = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of a 1048576-byte buffer failed "
                                           r"with cudaError 2.*ulimit -l"):
        pinned.pinned_empty(1 << 18, torch.float32)
