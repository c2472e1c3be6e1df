"""adambridge: AdamW whose optimizer state lives in host RAM, updated by fused SIMD C kernels.

Importing this package compiles nothing and touches no CUDA device; the native kernel is
built on first use.
"""
from .autotune import AutoTuneConfig
from .optimizer import AdamBridge, OptiComputeAdamW
from .stats import StepStats
from ._version import __version__

__all__ = ["AdamBridge", "OptiComputeAdamW", "StepStats", "AutoTuneConfig", "__version__"]
