"""The NVMe tier: the optimizer state beyond host RAM, in files (docs/nvme.md).

``OffloadConfig`` configures it; ``read_committed`` reads a committed state back from its
files, without an optimizer.
"""
from .config import OffloadConfig
from .layout import read_committed

__all__ = ["OffloadConfig", "read_committed"]
