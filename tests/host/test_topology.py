"""Topology from a fake sysfs tree: NUMA nodes, a GPU's node, cpulists, and graceful unknowns."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from adambridge.host import topology

CPULISTS = [
    dict(desc="ranges and singles", text="0-3,8,10-11", cpus=(0, 1, 2, 3, 8, 10, 11)),
    dict(desc="empty (a memory-only node)", text="", cpus=()),
    dict(desc="newline from sysfs", text="5\n", cpus=(5,)),
    dict(desc="unsorted with overlap", text="4-5,0,5", cpus=(0, 4, 5)),
    dict(desc="stride", text="0-7:2", cpus=(0, 2, 4, 6)),
]


@pytest.mark.parametrize("case", CPULISTS, ids=[c["desc"] for c in CPULISTS])
def test_parse_cpulist_values(case):
    assert topology.parse_cpulist(case["text"]) == case["cpus"]


def test_parse_cpulist_rejects_garbage():
    with pytest.raises(ValueError, match=r"Invalid cpulist entry: 'a-b'"):
        topology.parse_cpulist("0,a-b")


def test_format_cpulist_inverts_parse():
    for text in ("0-3,8,10-11", "0", "", "1,3,5"):
        assert topology.format_cpulist(topology.parse_cpulist(text)) == text


def _write(root, path, text):
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """Two nodes (cpus 0-3 and 4-7), a GPU on node 1, a NIC with numa_node -1, an L2 of 1 MiB."""
    _write(tmp_path, "sys/devices/system/node/node0/cpulist", "0-3\n")
    _write(tmp_path, "sys/devices/system/node/node1/cpulist", "4-7\n")
    _write(tmp_path, "sys/devices/system/node/online", "0-1\n")        # not a node directory
    (tmp_path / "sys/devices/system/node/node9").mkdir()                # no cpulist: skipped
    _write(tmp_path, "sys/bus/pci/devices/0000:3b:00.0/numa_node", "1\n")
    _write(tmp_path, "sys/bus/pci/devices/0000:af:00.0/numa_node", "-1\n")
    _write(tmp_path, "sys/devices/system/cpu/cpu0/cache/index0/level", "1\n")
    _write(tmp_path, "sys/devices/system/cpu/cpu0/cache/index0/size", "48K\n")
    _write(tmp_path, "sys/devices/system/cpu/cpu0/cache/index2/level", "2\n")
    _write(tmp_path, "sys/devices/system/cpu/cpu0/cache/index2/size", "1024K\n")
    monkeypatch.setattr(topology, "allowed_cpus", lambda: tuple(range(8)))
    return str(tmp_path)


def test_numa_nodes_from_sysfs(sysfs):
    assert topology.numa_nodes(sysfs) == (topology.NumaNode(0, (0, 1, 2, 3)),
                                          topology.NumaNode(1, (4, 5, 6, 7)))
    host = topology.host_topology(sysfs)
    assert host.node_of_cpu(5) == 1 and host.node_of_cpu(99) == -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        host.nodes = ()


def test_pci_device_on_node_one(sysfs):
    assert topology.pci_numa_node("0000:3b:00.0", sysfs) == 1
    assert topology.pci_numa_node("00000000:3B:00.0", sysfs) == 1   # NVML spelling
    assert topology.cpus_for_pci_device("0000:3b:00.0", sysfs) == (4, 5, 6, 7)


def test_pci_device_cpus_limited_to_allowed(sysfs, monkeypatch):
    monkeypatch.setattr(topology, "allowed_cpus", lambda: (0, 1, 4))
    assert topology.cpus_for_pci_device("0000:3b:00.0", sysfs) == (4,)


@pytest.mark.parametrize("bus_id", ["0000:af:00.0", "0000:00:01.0"], ids=["numa_node -1", "missing"])
def test_pci_device_unknown_node_pins_nothing(sysfs, bus_id):
    assert topology.pci_numa_node(bus_id, sysfs) == -1
    assert topology.cpus_for_pci_device(bus_id, sysfs) == ()


def test_missing_sysfs_is_unknown(tmp_path):
    root = str(tmp_path / "no-sysfs")
    assert topology.numa_nodes(root) == ()
    assert topology.l2_cache_bytes(root) == 0
    assert topology.cpus_for_pci_device("0000:3b:00.0", root) == ()


def test_l2_cache_bytes_from_sysfs(sysfs):
    assert topology.l2_cache_bytes(sysfs) == 1 << 20


def test_cuda_device_maps_to_its_node(sysfs, monkeypatch):
    props = types.SimpleNamespace(pci_bus_id=0x3B, pci_device_id=0, pci_domain_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert topology.cuda_pci_bus_id(0) == "0000:3b:00.0"
    assert topology.cpus_for_cuda_device(0, sysfs) == (4, 5, 6, 7)
    assert topology.cuda_pci_bus_id(1) is None  # out of range


def test_cuda_absent_pins_nothing(sysfs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert topology.cuda_pci_bus_id(0) is None
    assert topology.cpus_for_cuda_device(0, sysfs) == ()


def test_cuda_driver_error_pins_nothing(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert topology.cuda_pci_bus_id(0) is None


def test_allowed_cpus_unknown_without_affinity(monkeypatch):
    monkeypatch.delattr(topology.os, "sched_getaffinity", raising=False)
    assert topology.allowed_cpus() == ()


def test_host_topology_of_this_machine():
    host = topology.host_topology()
    assert isinstance(host.nodes, tuple) and isinstance(host.allowed_cpus, tuple)
    assert topology.host_topology() is host  # read once
