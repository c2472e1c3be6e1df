"""CudaTransport's ordering and bookkeeping on the CPU, against fake streams (fake_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from adambridge.host import pinned
from adambridge.pipeline.transport import CudaTransport
from fake_cuda import FakeCuda

CPU = torch.device("cpu")


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def _param(numel: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    p = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype))
    p.grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return p


def test_transport_stats_count_every_copy_of_the_step(cuda):
    big, small = _param(1000), _param(10, seed=2)
    t = CudaTransport(CPU)
    t.prepare([big], [small])
    host, tickets = t.grad_to_host(big, big.grad, [(0, 500), (500, 1000)], with_values=False)
    t.out(big).copy_(host)
    t.to_device(big, 0, 1000)  # the worker's copy back: still running when finish returns
    t.group_to_host([small], [small.grad], with_values=False)
    t.group_to_device([small])
    t.finish()
    stats = t.take_stats()
    assert stats.d2h_bytes == (1000 + 10) * 4 and stats.h2d_bytes == (1000 + 10) * 4
    assert t.take_stats().h2d_bytes == 0  # nothing is counted twice, in the next step


def test_transport_small_slots_are_made_once_and_copy_runs_of_present_grads(cuda):
    a, b, c = _param(7, seed=1), _param(9, seed=3), _param(5, seed=5)
    h = _param(6, torch.bfloat16, seed=7)
    t = CudaTransport(CPU)
    t.prepare([], [a, b, c, h])
    registered = len(cuda.register_threads)
    for present in ([a, b, c, h], [a, c], [b], [a, b, c, h]):
        copies_before = len(t._timings)
        grads, ticket = t.group_to_host(present, [p.grad for p in present], with_values=False)
        for p, grad in zip(present, grads):
            assert torch.equal(grad, p.grad)
        runs = t._slots.runs([p for p in present])
        assert len(t._timings) - copies_before == len(runs)
        for p, out in zip(present, t.group_out(present)):
            out.copy_(p.grad * 2)
        t.group_to_device(present)
        for p in present:
            assert torch.equal(p.detach(), p.grad * 2)
        t.finish()
        assert t.take_stats().d2h_bytes == sum(p.numel() * p.element_size() for p in present)
    assert len(cuda.register_threads) == registered  # no buffer made after prepare
    assert not cuda.waits("synchronize")               # and no stream ever synchronised
    assert t._slots.runs([a, c]) == [(torch.float32, 0, 7), (torch.float32, 16, 21)]


def test_transport_small_copies_and_finish_use_the_backward_stream(cuda):
    big, small = _param(100), _param(8, seed=4)
    t = CudaTransport(CPU)
    t.prepare([big], [small])
    side = cuda.stream()
    with torch.cuda.stream(side):  # backward ran on a side stream (its hooks see it)
        t.grad_to_host(big, big.grad, [(0, 100)], with_values=False)
    cuda.log.clear()
    t.group_to_host([small], [small.grad], with_values=False)  # step_sync on the default stream
    t.finish()
    assert ("d2h", side.name) in cuda.waits("wait_event")
    assert ("d2h", "default") not in cuda.waits("wait_event")
    assert set(cuda.waits("wait_stream")) == {("default", "h2d"), (side.name, "h2d")}


def test_transport_records_the_d2h_stream_on_every_gradient(cuda):
    big, small = _param(100), _param(8, seed=4)
    t = CudaTransport(CPU)
    t.prepare([big], [small])
    t.grad_to_host(big, big.grad, [(0, 100)], with_values=False)
    t.group_to_host([small], [small.grad], with_values=False)
    assert [(id(g), s) for g, s in cuda.recorded] == [(id(big.grad), "d2h"), (id(small.grad), "d2h")]


def test_transport_tickets_and_stats_events_block_instead_of_spinning(cuda):
    big = _param(100)
    t = CudaTransport(CPU)
    t.prepare([big], [])
    _, tickets = t.grad_to_host(big, big.grad, [(0, 50), (50, 100)], with_values=False)
    assert all(ticket.event.blocking for ticket in tickets)
    t.finish()
    assert all(event.blocking for event in t._step_end)


def test_transport_prepare_pins_everything_and_counts_staging_bytes(cuda):
    big, half, small = _param(100), _param(64, torch.bfloat16, seed=2), _param(8, seed=4)
    t = CudaTransport(CPU)
    t.prepare([big, half], [small])
    assert t.staging_bytes() == 2 * (100 * 4 + 64 * 2 + 8 * 4)
    assert len(cuda.register_threads) == 2 * 2 + 2  # grad+out per hooked, a pair per dtype
    t.close()


def test_transport_prepare_failure_is_raised_when_the_step_uses_it(cuda):
    cuda.fail_register = True
    big = _param(100)
    t = CudaTransport(CPU)
    t.prepare([big], [])  # no exception here: attach_hooks succeeds
    with pytest.raises(RuntimeError, match=r"could not be made at attach_hooks\(\).*ulimit -l"):
        t.grad_to_host(big, big.grad, [(0, 100)], with_values=False)


def test_transport_refuses_a_buffer_inherited_by_a_fork(cuda):
    big = _param(100)
    t = CudaTransport(CPU)
    t.prepare([big], [])
    pinned._after_fork_in_child()  # what os.register_at_fork runs in a child
    with pytest.raises(RuntimeError, match="forked after the optimizer pinned"):
        t.grad_to_host(big, big.grad, [(0, 100)], with_values=False)
