"""Host topology: NUMA nodes, the node a GPU hangs off, the CPUs we may run on. Read once, frozen.

Everything comes from Linux sysfs, read only on Linux (elsewhere "/sys" may be anything, e.g.
the Linux host's own under wine). Each reader takes ``root`` (default "/") so tests can point
it at a fake tree. Where a fact is missing (not Linux, a VM without NUMA, an old kernel) the
answer is "unknown": an empty tuple or -1, and callers then pin nothing.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import platform_facts


@dataclass(frozen=True)
class NumaNode:
    index: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class HostTopology:
    nodes: tuple[NumaNode, ...]        # empty when unknown
    allowed_cpus: tuple[int, ...]      # sched_getaffinity; empty when unknown

    def node_of_cpu(self, cpu: int) -> int:
        """The NUMA node that holds cpu, -1 when unknown."""
        return next((node.index for node in self.nodes if cpu in node.cpus), -1)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11), sorted and unique; "" -> ()."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        found = re.fullmatch(r"(\d+)(?:-(\d+))?(?::(\d+)(?:/\d+)?)?", part)
        if not found:
            raise ValueError(f"Invalid cpulist entry: {part!r} in {text!r}")
        first = int(found.group(1))
        last = int(found.group(2) or first)
        stride = int(found.group(3) or 1)  # "0-15:2" (every second CPU), as the kernel allows
        cpus.update(range(first, last + 1, stride))
    return tuple(sorted(cpus))


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8", the inverse of parse_cpulist."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _sysfs(root: str) -> bool:
    """Whether root/sys is Linux's sysfs for this host (a test's fake tree always is)."""
    return root != "/" or platform_facts.facts().system == "linux"


def _read(root: str, *parts: str) -> Optional[str]:
    if not _sysfs(root):
        return None
    try:
        return Path(root, *parts).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=None)
def numa_nodes(root: str = "/") -> tuple[NumaNode, ...]:
    """The NUMA nodes with their CPUs, by index; () when sysfs does not say."""
    base = Path(root, "sys/devices/system/node")
    nodes = []
    if not _sysfs(root):
        return ()
    try:
        entries = [p.name for p in base.iterdir()]
    except OSError:
        return ()
    for name in entries:
        found = re.fullmatch(r"node(\d+)", name)
        text = _read(root, "sys/devices/system/node", name, "cpulist") if found else None
        if text is None:
            continue
        try:
            nodes.append(NumaNode(int(found.group(1)), parse_cpulist(text)))
        except ValueError:
            continue
    return tuple(sorted(nodes, key=lambda node: node.index))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on; () where the OS does not say (macOS, Windows)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return ()
    try:
        return tuple(sorted(getaffinity(0)))
    except OSError:
        return ()


@functools.lru_cache(maxsize=None)
def host_topology(root: str = "/") -> HostTopology:
    return HostTopology(numa_nodes(root), allowed_cpus())


@functools.lru_cache(maxsize=None)
def pci_numa_node(bus_id: str, root: str = "/") -> int:
    """The NUMA node of PCI device bus_id ("0000:3b:00.0"); -1 when unknown."""
    text = _read(root, "sys/bus/pci/devices", normalize_bus_id(bus_id), "numa_node")
    try:
        return int(text) if text is not None else -1
    except ValueError:
        return -1


def normalize_bus_id(bus_id: str) -> str:
    """sysfs spelling of a PCI address: lower case, 4-digit domain ("00000000:3B:00.0" from NVML)."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and rest.count(":") == 1 and len(domain) > 4:
        bus_id = f"{int(domain, 16):04x}:{rest}"
    return bus_id


def cpus_for_pci_device(bus_id: str, root: str = "/") -> tuple[int, ...]:
    """The CPUs of the node the device hangs off that we may run on; () when unknown."""
    node = pci_numa_node(bus_id, root)
    cpus = next((n.cpus for n in numa_nodes(root) if n.index == node), ())
    allowed = set(allowed_cpus())
    return tuple(c for c in cpus if c in allowed) if allowed else cpus


def cuda_pci_bus_id(index: int) -> Optional[str]:
    """The PCI address of CUDA device index (as CUDA_VISIBLE_DEVICES numbers it), None if unknown."""
    try:
        import torch
        if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
            return None
        props = torch.cuda.get_device_properties(index)
    except Exception:  # noqa: BLE001 - a broken driver must not break the optimizer
        return None
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str):
        return normalize_bus_id(bus)
    if isinstance(bus, int):
        domain = getattr(props, "pci_domain_id", 0) or 0
        device = getattr(props, "pci_device_id", 0) or 0
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    return None


def cpus_for_cuda_device(index: int, root: str = "/") -> tuple[int, ...]:
    """The allowed CPUs on the NUMA node of CUDA device index; () when unknown (pin nothing)."""
    bus_id = cuda_pci_bus_id(index)
    return cpus_for_pci_device(bus_id, root) if bus_id else ()


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(root: str = "/") -> int:
    """The L2 size of cpu0 from sysfs ("1024K"), 0 when unknown."""
    base = "sys/devices/system/cpu/cpu0/cache"
    for index in range(8):
        if _read(root, base, f"index{index}", "level") != "2":
            continue
        size = _read(root, base, f"index{index}", "size") or ""
        found = re.fullmatch(r"(\d+)\s*([KMG]?)", size.upper())
        if found:
            return int(found.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[found.group(2)]
    return 0


def cpus_for_local_rank(local_rank: int, local_world: int, root: str = "/",
                        allowed: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """This rank's CPUs when ``local_world`` ranks share the host and none follows a GPU.

    Ranks spread round-robin over the NUMA nodes (rank r on node r mod n), and the ranks of
    one node split its allowed CPUs into disjoint contiguous runs (sizes differing by at most
    one; a rank gets one CPU, shared, where a node has fewer CPUs than ranks). Without NUMA
    facts the allowed CPUs are one node. () when nothing is known.
    """
    allowed = allowed_cpus() if allowed is None else allowed
    keep = set(allowed)
    nodes = [tuple(c for c in node.cpus if not keep or c in keep) for node in numa_nodes(root)]
    nodes = [cpus for cpus in nodes if cpus] or ([tuple(sorted(keep))] if keep else [])
    if not nodes or not 0 <= local_rank < local_world:
        return ()
    mates = len(range(local_rank % len(nodes), local_world, len(nodes)))
    return share_of(nodes[local_rank % len(nodes)], mates, local_rank // len(nodes))


def share_of(cpus: tuple[int, ...], parts: int, position: int) -> tuple[int, ...]:
    """Part ``position`` of ``cpus`` cut into ``parts`` contiguous runs whose sizes differ by
    at most one; one CPU, shared round-robin, where there are fewer CPUs than parts."""
    if not cpus or parts <= 0:
        return ()
    if parts > len(cpus):
        return (cpus[position % len(cpus)],)
    base, extra = divmod(len(cpus), parts)
    start = position * base + min(position, extra)
    return cpus[start:start + base + (position < extra)]
