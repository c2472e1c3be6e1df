"""The machine a plan is for: a GPU from a documented table (or the CUDA card found) and the
host measured here (memory bandwidth with the native probe, RAM, NUMA nodes), each number
overridable.

Table values (docs/planning.md lists their sources): memory is the vendor's figure in GB;
``tflops`` is the bf16 throughput a training step achieves, assumed at 40% of the dense bf16
tensor peak (the offload article's 400 TFLOP/s for a card of ~1 PFLOP/s peak), except where
a measurement says otherwise; ``hbm_gbps`` is 80% of the memory's peak bandwidth, what a
fused, memory-bound AdamW reaches; the link is an x16 slot of the PCIe generation given, at
the achievable figures of LINK_GBPS (the article's ~25 GB/s for Gen4, doubled for Gen5).
"""
from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass, replace
from typing import Optional

from .errors import PlanError

LINK_GBPS = {3: 12.0, 4: 25.0, 5: 50.0}   # achievable GB/s of pinned copies, x16, per PCIe gen
HBM_EFFICIENCY = 0.8
# NOTE: a dual-channel desktop board streams 50-100 GB/s; the low end is the planning value
# when the probe cannot run (no native library), and the output says it was not measured.
DEFAULT_HOST_BW_GBPS = 50.0
PROBE_ELEMENTS = 16_000_000   # 448 MB streamed per pass: past the last-level cache of common CPUs
PROBE_PASSES = 5


@dataclass(frozen=True)
class TableGpu:
    key: str
    pattern: str           # regex on the lowercased CUDA device name
    memory_gb: float
    peak_tflops: Optional[float]
    tflops: float
    hbm_peak_gbps: float
    pcie_gen: int
    note: str = ""


GPU_TABLE = (
    TableGpu("H200", r"h200", 141, 989, 400, 4800, 5),
    TableGpu("H100-PCIe", r"h100.*pcie", 80, 756, 300, 2000, 5),
    TableGpu("H100", r"h100", 80, 989, 400, 3350, 5, "SXM"),
    TableGpu("A100-80GB", r"a100.*80", 80, 312, 125, 2039, 4),
    TableGpu("A100-40GB", r"a100", 40, 312, 125, 1555, 4),
    TableGpu("L40S", r"l40s", 48, 362, 145, 864, 4),
    TableGpu("L4", r"\bl4\b", 24, 121, 48, 300, 4),
    TableGpu("RTX4090", r"4090", 24, 165, 66, 1008, 4),
    TableGpu("RTX5090-Laptop", r"5090.*laptop", 24, None, 50, 896, 5,
             "tflops measured: a Qwen2.5-0.5B forward+backward of 4,096 tokens, 6 x 494M x "
             "4096 FLOPs in 251 ms"),
)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the plan sees it; ``source`` says where each number came from."""
    name: str
    memory_gb: float
    tflops: float
    link_gbps: float
    hbm_gbps: float
    pcie_gen: Optional[int]
    source: str


@dataclass(frozen=True)
class HostSpec:
    """The host: memory bandwidth (GB/s), RAM (GB), NUMA nodes and the CPUs of each, the CPUs
    this process may use; where the bandwidth and RAM came from."""
    bw_gbps: float
    bw_source: str
    ram_gb: float
    ram_source: str
    numa_nodes: int
    cpus_per_node: tuple
    threads: int
    # Nanoseconds per element of the kernel's arithmetic alone (its buffers in cache), per
    # precision, measured with the bandwidth; empty where the host was given, not measured.
    update_ns: tuple = ()
    update_source: str = "not measured: the update is taken as memory-bound"

    def update_ns_of(self, precision: str) -> Optional[float]:
        """The arithmetic ceiling of ``precision`` in ns per element, or None."""
        return dict(self.update_ns).get(precision)


def known_gpus() -> str:
    return ", ".join(g.key for g in GPU_TABLE)


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def table_gpu(name: str) -> Optional[TableGpu]:
    """The table row for a name: its key in any spelling ("rtx 4090"), or a CUDA device name."""
    wanted = _normal(name)
    for gpu in GPU_TABLE:
        if _normal(gpu.key) == wanted:
            return gpu
    lowered = name.lower()
    return next((gpu for gpu in GPU_TABLE if re.search(gpu.pattern, lowered)), None)


def _from_table(gpu: TableGpu, source: str, memory_gb: Optional[float] = None) -> GpuSpec:
    return GpuSpec(name=gpu.key, memory_gb=memory_gb or gpu.memory_gb, tflops=gpu.tflops,
                   link_gbps=LINK_GBPS[gpu.pcie_gen], hbm_gbps=gpu.hbm_peak_gbps * HBM_EFFICIENCY,
                   pcie_gen=gpu.pcie_gen, source=source)


def cuda_device() -> Optional[tuple[str, float]]:
    """(name, memory GB) of cuda:0, or None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 1e9


def resolve_gpu(name: Optional[str] = None, *, memory_gb: Optional[float] = None,
                tflops: Optional[float] = None, link_gbps: Optional[float] = None,
                hbm_gbps: Optional[float] = None, label: Optional[str] = None) -> GpuSpec:
    """The GPU: ``name`` from the table, else the CUDA card found, else (``memory_gb`` given)
    a card of that memory with GENERIC's figures; then the overrides, and ``label`` as its name."""
    overrides = dict(memory_gb=memory_gb, tflops=tflops, link_gbps=link_gbps, hbm_gbps=hbm_gbps)
    if name is not None:
        found = table_gpu(name)
        if found is None:
            raise PlanError(f"Unknown gpu (--gpu): {name!r} (known: {known_gpus()}; for another "
                            "card give --gpu-memory GB and --gpu-name instead of --gpu)")
        spec = _from_table(found, f"table ({found.key})")
    elif memory_gb is not None and cuda_device() is None:
        spec = _generic(overrides)
    else:
        spec = _detected(overrides)
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        spec = replace(spec, **given, source=spec.source + "; given: " + ", ".join(
            f"--{_FLAGS[k]} {v:g}" for k, v in given.items()))
    if label is not None:
        spec = replace(spec, name=label, source=spec.source + "; named by --gpu-name")
    return spec


_FLAGS = dict(memory_gb="gpu-memory", tflops="gpu-tflops", link_gbps="link-gbps", hbm_gbps="hbm-gbps")
# NOTE: a card given only by its memory is planned as a mid-range one: the achieved bf16
# throughput measured on the RTX 5090 Laptop row, 600 GB/s of memory and a PCIe Gen4 x16 slot.
# The output names each figure taken from here, so the user can replace it with theirs.
GENERIC = TableGpu("a GPU given by its memory", "", 0, None, 50, 600, 4)


def _generic(overrides: dict) -> GpuSpec:
    spec = _from_table(GENERIC, "", memory_gb=overrides["memory_gb"])
    spec = replace(spec, name=f"a {overrides['memory_gb']:g} GB GPU")
    defaults = dict(tflops=f"{spec.tflops:g} TFLOP/s", hbm_gbps=f"memory {spec.hbm_gbps:g} GB/s",
                    link_gbps=f"link {spec.link_gbps:g} GB/s (PCIe Gen4 x16)")
    taken = [(k, text) for k, text in defaults.items() if overrides[k] is None]
    source = "not in the table"
    if taken:
        source += ("; defaults, not this card's: " + ", ".join(text for _, text in taken) +
                   " (give " + ", ".join(f"--{_FLAGS[k]}" for k, _ in taken) + " for yours)")
    return replace(spec, source=source, pcie_gen=4 if overrides["link_gbps"] is None else None)


def _detected(overrides: dict) -> GpuSpec:
    device = cuda_device()
    if device is None:
        raise PlanError(f"Invalid gpu (--gpu): none given and torch sees no CUDA device here; "
                        f"choose one of {known_gpus()}, or give --gpu-memory GB for another card")
    device_name, device_gb = device
    found = table_gpu(device_name)
    if found is not None:
        return _from_table(found, f"cuda:0 {device_name} ({device_gb:.1f} GB), table row "
                                  f"{found.key}", memory_gb=device_gb)
    missing = [f"--{_FLAGS[k]}" for k in ("tflops", "link_gbps", "hbm_gbps") if overrides[k] is None]
    if missing:
        raise PlanError(f"Invalid gpu (--gpu): cuda:0 {device_name!r} is not in the table; give "
                        f"{', '.join(missing)} or --gpu with one of {known_gpus()}")
    return GpuSpec(name=device_name, memory_gb=device_gb, tflops=0.0, link_gbps=0.0, hbm_gbps=0.0,
                   pcie_gen=None, source=f"cuda:0 {device_name} ({device_gb:.1f} GB)")


# ---------------------------------------------------------------------------- the host

def measure_bandwidth(numel: int = PROBE_ELEMENTS, passes: int = PROBE_PASSES) -> tuple[float, str]:
    """(GB/s, how it was found): the median of ``passes`` native probe passes (probes.py).
    Where the native library cannot run, DEFAULT_HOST_BW_GBPS and the reason."""
    from . import probes
    reason = probes.native_unavailable()
    if reason is not None:
        return DEFAULT_HOST_BW_GBPS, (f"default {DEFAULT_HOST_BW_GBPS:g} GB/s, NOT measured: the "
                                      f"native probe cannot run ({reason})")
    items = probes.bandwidth_buffers(numel)
    probes.bandwidth_gbps(items)  # warm-up: page faults and the pool's start are not bandwidth
    gbps = statistics.median(probes.bandwidth_gbps(items) for _ in range(passes))
    return gbps, (f"measured: native probe, {numel / 1e6:g}M elements x 28 B, median of "
                  f"{passes} passes, {loader_threads()} threads")


def measure_update_ns(precisions: tuple = ("fp32", "bf16", "fp8"), trials: int = 6) -> tuple:
    """((precision, ns per element), ...): the kernel's arithmetic ceiling (probes.py),
    the median of ``trials`` calls after one that warms the caches; empty where the native
    library cannot run."""
    from . import probes
    if probes.native_unavailable() is not None:
        return ()
    measured = []
    for precision in precisions:
        batch = probes.ceiling_batch(precision)
        probes.ceiling_ns(batch, 1)
        measured.append((precision, statistics.median(probes.ceiling_ns(batch, step)
                                                      for step in range(2, trials + 2))))
    return tuple(measured)


def host_ram_gb() -> Optional[float]:
    """Physical RAM in GB, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (AttributeError, ValueError, OSError):
        return None


def resolve_host(*, bw_gbps: Optional[float] = None, ram_gb: Optional[float] = None,
                 numa_nodes: Optional[int] = None, update_ns: Optional[tuple] = None) -> HostSpec:
    """This host, measured where a number is not given."""
    from ..host import topology
    host = topology.host_topology()
    cpus = tuple(len(node.cpus) for node in host.nodes) or (len(host.allowed_cpus) or os.cpu_count() or 1,)
    if bw_gbps is None:
        bw_gbps, bw_source = measure_bandwidth()
    else:
        bw_source = "given: --host-bw"
    update_ns, update_source = _update_ceiling(update_ns, measured=bw_source.startswith("measured"))
    if ram_gb is None:
        ram_gb, ram_source = host_ram_gb(), "this host"
        if ram_gb is None:
            raise PlanError("Invalid host_ram (--host-ram): this platform does not report its "
                            "RAM; give it in GB")
    else:
        ram_source = "given: --host-ram"
    nodes = numa_nodes if numa_nodes is not None else max(1, len(host.nodes))
    return HostSpec(bw_gbps=bw_gbps, bw_source=bw_source, ram_gb=ram_gb, ram_source=ram_source,
                    numa_nodes=nodes, cpus_per_node=cpus,
                    threads=len(host.allowed_cpus) or os.cpu_count() or 1,
                    update_ns=update_ns, update_source=update_source)


def _update_ceiling(given: Optional[tuple], *, measured: bool) -> tuple[tuple, str]:
    """(the arithmetic ceiling per precision, where it came from): given, else measured
    beside a measured bandwidth; a host described by its bandwidth alone is memory-bound."""
    if given is not None:
        return given, "given: --host-update-ns"
    if not measured:
        return (), "not measured (host bandwidth given): the update is taken as memory-bound"
    update_ns = measure_update_ns()
    if not update_ns:
        return (), "not measured (no native kernel): the update is taken as memory-bound"
    return update_ns, f"measured: native kernel on buffers in cache, {loader_threads()} threads"


def loader_threads() -> int:
    """Threads of the native pool (the measurement's), 0 where it is not loaded."""
    from .._native import loader
    try:
        return loader.num_threads()
    except (AttributeError, OSError, ValueError):
        return 0
