"""What `python -m adambridge info` reports, as (name, value) facts: versions, the native
backend, NUMA and CUDA devices, the NVMe tier's I/O. The lab's reports take them too."""
from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

from .host import platform_facts


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("adambridge")
    except Exception:  # noqa: BLE001 - a source checkout is not installed
        from ._version import __version__
        return __version__


Facts = List[Tuple[str, object]]  # (name, value) pairs, in the order `info` prints them


def environment_facts() -> Facts:
    """Versions of adambridge, torch and Python, and the platform."""
    import torch
    return [("adambridge", f"{_version()} ({Path(__file__).resolve().parent})"),
            ("torch", torch.__version__),
            ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
            ("platform", f"{platform.platform()} {platform.machine()}"),
            ("os calls", platform_facts.describe())]


def native_facts() -> tuple[Facts, bool]:
    """The native backend's facts, and False when it is unavailable (the reason is a fact)."""
    from ._native import build, loader
    facts = [("compiler", loader.compiler_description()), ("cache", build.cache_root()),
             ("isa forced", os.environ.get("ADAMBRIDGE_ISA") or "no (ADAMBRIDGE_ISA unset)")]
    try:
        native = loader.load()
    except (build.NativeBuildError, ValueError) as exc:
        return facts + [("backend", "torch"), ("native", f"unavailable: {exc}")], False
    facts += [("backend", loader.backend_name()), ("isa detected", loader.detected_isa()),
              ("isa active", loader.isa_name()), ("isa compiled", ", ".join(loader.compiled_isas())),
              ("isa supported", ", ".join(loader.supported_isas()))]
    facts += [("isa dropped", f"{isa}: {why}") for isa, why in sorted(native.built.dropped.items())]
    facts += [("library", f"{native.path}{' (private build)' if native.built.private else ''}"),
              ("threads", loader.num_threads()), ("l2 cache", f"{loader.l2_cache_bytes()} bytes"),
              ("plan checks", plan_checks())]
    return facts, True


def plan_checks() -> str:
    """How a step plan over many parameters checks its tensors: natively, or in Python."""
    from .sync import step_plan
    from ._native import plan_checks as native_checks
    found = native_checks.load()
    if found is None:
        return f"python ({native_checks.unavailable_reason()})"
    return f"native from {step_plan.FACTS_MIN_PARAMS} parameters ({found.path})"


def topology_facts() -> Facts:
    """NUMA nodes, the CPUs this process may use, and the CUDA devices with their local CPUs."""
    import torch
    from .host import topology
    host = topology.host_topology()
    nodes = " ".join(f"node{n.index}: {topology.format_cpulist(n.cpus)}" for n in host.nodes)
    facts = [("numa nodes", nodes or "unknown"),
             ("allowed cpus", topology.format_cpulist(host.allowed_cpus) or "unknown")]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts.append(("cuda devices", count or "none"))
    for i in range(count):
        cpus = topology.format_cpulist(topology.cpus_for_cuda_device(i)) or "unknown"
        facts.append((f"  cuda:{i}", f"{torch.cuda.get_device_name(i)}, pci "
                                     f"{topology.cuda_pci_bus_id(i)}, local cpus {cpus}"))
    return facts


def tier_facts() -> Facts:
    """The NVMe tier: whether O_DIRECT works under $TMPDIR, and the I/O engine."""
    from .nvme.engine import describe_tier_io
    # (gettempdir: $TMPDIR, else the system's own, which on Windows is no "/tmp")
    return [("nvme tier", describe_tier_io(tempfile.gettempdir()))]


