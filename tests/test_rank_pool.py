"""NUMA per rank (rank_pool.py, topology.cpus_for_local_rank) on fake sysfs trees."""
from __future__ import annotations

import pytest
import torch

from adambridge import rank_pool, topology
from adambridge.worker import worker_cpus

EIGHT = tuple(range(8))


def _write(root, path, text):
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.fixture
def two_nodes(tmp_path):
    """Nodes 0 (cpus 0-3) and 1 (cpus 4-7); a GPU at 0000:3b:00.0 on node 1."""
    _write(tmp_path, "sys/devices/system/node/node0/cpulist", "0-3\n")
    _write(tmp_path, "sys/devices/system/node/node1/cpulist", "4-7\n")
    _write(tmp_path, "sys/bus/pci/devices/0000:3b:00.0/numa_node", "1\n")
    return str(tmp_path)


def _env(rank: int, world: int) -> dict:
    return {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}


@pytest.mark.parametrize("world, expected", [
    (2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (3, [(0, 1), (4, 5, 6, 7), (2, 3)]),
    (4, [(0, 1), (4, 5), (2, 3), (6, 7)]),
])
def test_cpu_ranks_spread_over_nodes_then_split_them(two_nodes, world, expected):
    got = [topology.cpus_for_local_rank(r, world, two_nodes, EIGHT) for r in range(world)]
    assert got == expected
    flat = [c for cpus in got for c in cpus]
    assert sorted(flat) == list(EIGHT)  # disjoint, and every CPU used


def test_without_numa_facts_the_allowed_cpus_are_split(tmp_path):
    root = str(tmp_path)  # no sys/devices/system/node at all
    assert [topology.cpus_for_local_rank(r, 2, root, (0, 1, 2, 3, 4)) for r in range(2)] == \
        [(0, 1, 2), (3, 4)]
    # More ranks than CPUs: one CPU each, shared round-robin.
    assert [topology.cpus_for_local_rank(r, 3, root, (0, 1)) for r in range(3)] == \
        [(0,), (1,), (0,)]
    assert topology.cpus_for_local_rank(0, 2, root, ()) == ()  # nothing known: pin nothing


def test_plan_of_a_cpu_rank_pins_the_pool_to_its_share(two_nodes):
    cpu = torch.device("cpu")
    assert rank_pool.plan(cpu, True, _env(1, 4), two_nodes, EIGHT) == ((4, 5), 2)
    assert rank_pool.plan(cpu, True, {}, two_nodes, EIGHT) == ((), None)  # one process
    assert rank_pool.plan(cpu, False, _env(1, 4), two_nodes, EIGHT) == ((), None)
    # torchrun --numa-binding / numactl restricted the process already: those CPUs are kept.
    bound = (4, 5, 6, 7)
    assert rank_pool.plan(cpu, True, _env(0, 4), two_nodes, bound) == (bound, 4)


def test_plan_of_a_gpu_rank_follows_its_device(two_nodes, monkeypatch):
    seen = []
    monkeypatch.setattr(topology, "cuda_pci_bus_id",
                        lambda index: seen.append(index) or "0000:3b:00.0")
    monkeypatch.setattr(topology, "allowed_cpus", lambda: EIGHT)
    cpus, threads = rank_pool.plan(torch.device("cuda", 3), True, _env(3, 4), two_nodes)
    assert (cpus, threads, seen) == ((4, 5, 6, 7), None, [3])  # cuda:3's node, not rank 3's


def test_worker_of_a_cpu_rank_and_the_pool_use_the_rank_share(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    share = rank_pool.host_rank_cpus(True)
    assert worker_cpus(torch.device("cpu"), True) == share
    assert worker_cpus(torch.device("cpu"), False) == ()
    from adambridge import AdamBridge
    from adambridge._native import loader
    calls = []
    monkeypatch.setattr(loader, "set_num_threads", lambda n, cpus=None: calls.append((n, cpus)))
    rank_pool.configure(AdamBridge([torch.nn.Parameter(torch.zeros(3))]))
    assert calls == ([(len(share), share)] if share else [])
    calls.clear()
    rank_pool.configure(AdamBridge([torch.nn.Parameter(torch.zeros(3))], num_threads=1))
    assert calls == []  # the user's thread count wins
