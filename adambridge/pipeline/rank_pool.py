"""Where each rank's native thread pool runs under torch.distributed (NUMA per rank).

The pool is per process and each rank is a process, so without a plan every rank on a host
starts one pool thread per CPU and the ranks oversubscribe the cores (and touch remote
memory). The plan, made once per process when the backend is resolved and again by
``attach_hooks`` for its workers:

- a rank whose parameters are on a GPU takes the CPUs of that GPU's NUMA node (the device
  of its parameters, which under torchrun is ``cuda:LOCAL_RANK``), split with the ranks of
  the other visible GPUs on that node, with the one-node rule of cuda_policy.pool_plan;
- a CPU-only rank takes its share of the host: ranks spread over the NUMA nodes, and those
  of one node split its CPUs (topology.cpus_for_local_rank);
- a process whose CPUs the launcher has already restricted (``torchrun --numa-binding``,
  ``numactl``, ``taskset``) keeps them: the launcher chose.

Only under torchrun-style launches (``LOCAL_WORLD_SIZE`` > 1) and with ``numa_aware=True``;
one process alone keeps the pool as before.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

import torch

from . import cuda_policy
from ..host import topology

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


def local_ranks(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) without them."""
    try:
        world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        rank = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0, 1
    return (rank, world) if 0 <= rank < world else (0, 1)


def _restricted(allowed: tuple[int, ...], root: str) -> bool:
    known = {c for node in topology.numa_nodes(root) for c in node.cpus}
    total = len(known) if known else (os.cpu_count() or 0)
    return bool(allowed) and len(allowed) < total


def host_rank_cpus(numa_aware: bool, env: Mapping[str, str] = os.environ, root: str = "/",
                   allowed: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """The CPUs of this CPU-only rank (its share of the host); () means pin nothing."""
    rank, world = local_ranks(env)
    if not numa_aware or world <= 1:
        return ()
    allowed = topology.allowed_cpus() if allowed is None else allowed
    if _restricted(allowed, root):
        return allowed  # the launcher bound this rank already
    return topology.cpus_for_local_rank(rank, world, root, allowed)


def gpu_rank_cpus(index: int, root: str = "/") -> tuple[int, ...]:
    """The CPUs of CUDA device ``index``'s node, split among the visible devices on that
    node (one rank per GPU: the ranks sharing a node take disjoint parts of it)."""
    cpus = topology.cpus_for_cuda_device(index, root)
    if not cpus:
        return ()
    node = _node_of_cuda(index, root)
    peers = [d for d in range(torch.cuda.device_count()) if _node_of_cuda(d, root) == node]
    return topology.share_of(cpus, len(peers), peers.index(index)) if index in peers else cpus


def _node_of_cuda(index: int, root: str) -> int:
    bus_id = topology.cuda_pci_bus_id(index)
    return topology.pci_numa_node(bus_id, root) if bus_id else -1


def plan(device: torch.device, numa_aware: bool, env: Mapping[str, str] = os.environ,
         root: str = "/", allowed: Optional[tuple[int, ...]] = None
         ) -> tuple[tuple[int, ...], Optional[int]]:
    """(CPUs to pin the pool to, thread count or None) for a rank updating ``device``'s
    parameters; ((), None) leaves the pool as it is."""
    _, world = local_ranks(env)
    if not numa_aware or world <= 1:
        return (), None
    if device.type == "cuda":
        cpus = gpu_rank_cpus(device.index or 0, root)
        return cuda_policy.pool_plan(cpus, [device], root) if cpus else ((), None)
    cpus = host_rank_cpus(numa_aware, env, root, allowed)
    return cpus, (len(cpus) or None)


def configure(opt: OptimizerDoor) -> None:
    """Size and pin the native pool for this rank (called once, as the backend resolves)."""
    if opt.num_threads is not None:
        return  # the user's thread count wins
    devices = {p.device for group in opt.param_groups for p in group["params"]}
    if len(devices) != 1:
        return  # one pool for several devices' nodes: leave it unpinned
    cpus, threads = plan(devices.pop(), opt.numa_aware)
    if cpus or threads:
        from .._native import loader
        loader.set_num_threads(threads or len(cpus), cpus)
