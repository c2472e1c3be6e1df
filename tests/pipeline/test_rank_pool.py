"""NUMA per rank (pipeline/rank_pool.py, topology.cpus_for_local_rank) on fake sysfs trees."""
from __future__ import annotations

import pytest
import torch

from adambridge.pipeline import rank_pool
from adambridge.host import topology
from adambridge.pipeline.worker import worker_cpus

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


BUSES = ("0000:1a:00.0", "0000:1b:00.0", "0000:3b:00.0", "0000:3c:00.0")  # nodes 0 0 1 1


def _four_gpus(root, monkeypatch, nodes=(0, 0, 1, 1)) -> list:
    for bus, node in zip(BUSES, nodes):
        _write(root, f"sys/bus/pci/devices/{bus}/numa_node", f"{node}\n")
    asked = []
    monkeypatch.setattr(topology, "cuda_pci_bus_id", lambda i: asked.append(i) or BUSES[i])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(topology, "allowed_cpus", lambda: EIGHT)
    return asked


def test_plan_of_a_gpu_rank_follows_its_device(tmp_path, monkeypatch):
    _write(tmp_path, "sys/devices/system/node/node0/cpulist", "0-3\n")
    _write(tmp_path, "sys/devices/system/node/node1/cpulist", "4-7\n")
    asked = _four_gpus(tmp_path, monkeypatch)
    # cuda:3 is on node 1 with cuda:2: the two ranks split node 1, pinned.
    assert rank_pool.plan(torch.device("cuda", 3), True, _env(0, 4), str(tmp_path)) == \
        ((6, 7), None)
    assert rank_pool.plan(torch.device("cuda", 2), True, _env(0, 4), str(tmp_path)) == \
        ((4, 5), None)
    assert 3 in asked  # the device of the parameters decides, not LOCAL_RANK (0 here)


def test_plan_of_gpu_ranks_on_one_node_splits_it_unpinned(tmp_path, monkeypatch):
    _write(tmp_path, "sys/devices/system/node/node0/cpulist", "0-7\n")
    _four_gpus(tmp_path, monkeypatch, nodes=(0, 0, 0, 0))
    # Two CPUs each; one node: unpinned, one thread short (cuda_policy.pool_plan's rule).
    assert rank_pool.plan(torch.device("cuda", 1), True, _env(1, 4), str(tmp_path)) == \
        ((), 1)


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
