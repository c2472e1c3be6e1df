"""Memory a demo run costs: peak device memory on CUDA, growth of the resident set on the host."""
from __future__ import annotations

import ctypes
import gc
import resource
import sys
from typing import Optional

import torch


def _status_bytes(field: str) -> Optional[int]:
    """A size field of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _trim_heap() -> None:
    # NOTE: glibc keeps freed memory of earlier runs in its arenas; hand it back first so that
    # the next run's growth is its own.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryProbe:
    """Measures one run: call start() before building anything, stop() after the last step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rss_start = self.hwm_reset = self.device_start = None

    def start(self) -> None:
        gc.collect()
        _trim_heap()
        self.hwm_reset = _reset_peak_rss()
        self.rss_start = _status_bytes("VmRSS") if self.hwm_reset else _maxrss_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.device_start = torch.cuda.memory_allocated(self.device)

    def stop(self) -> dict:
        """peak_device_bytes (CUDA only) and rss_growth_bytes (peak resident set over the start)."""
        peak_rss = _status_bytes("VmHWM") if self.hwm_reset else _maxrss_bytes()
        result = dict(rss_growth_bytes=max(0, peak_rss - self.rss_start), peak_device_bytes=None)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            result["peak_device_bytes"] = peak - self.device_start
        return result
