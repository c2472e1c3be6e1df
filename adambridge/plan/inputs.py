"""A plan's checked inputs: the work per step, the drive, and everything a row is computed
from (the model, the GPU, the host), with the quantities every row shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import activations
from . import arithmetic as ar
from .hardware import GpuSpec, HostSpec
from .model import ModelFacts

GPU_RESERVE = 0.10     # of GPU memory left to the CUDA context and the allocator's slack


@dataclass(frozen=True)
class Work:
    """One GPU's work per optimizer step: tokens (all passes), passes, GPUs, parallelism,
    and the activations: given in GB, else estimated from the model's shape."""
    tokens_per_step: int
    accumulation: int = 1
    gpus: int = 1
    parallel: str = "ddp"          # "ddp" (every rank the whole model) or "fsdp2" (shards)
    activations_gb: Optional[float] = None   # per GPU, given; None: estimated where possible
    checkpointing: bool = False    # activation checkpointing (one region per decoder layer)

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens_per_step / self.accumulation


@dataclass(frozen=True)
class Nvme:
    gbps: float = 7.0        # one Gen4 drive, sequential
    drive_tb: float = 3.84   # capacity the state's writes spread over
    dwpd: float = 1.0        # rated drive writes per day over ar.WARRANTY_YEARS


@dataclass(frozen=True)
class Inputs:
    model: ModelFacts
    work: Work
    gpu: GpuSpec
    host: HostSpec
    nvme: Nvme
    host_reserve: float = 0.10   # of host RAM left to the OS, the data loader and the rest

    @property
    def gpu_usable(self) -> float:
        return ar.usable_bytes(self.gpu.memory_gb, GPU_RESERVE)

    @property
    def host_usable(self) -> float:
        return ar.usable_bytes(self.host.ram_gb, self.host_reserve)

    @property
    def host_bw(self) -> float:
        return ar.effective_host_bw(self.host.bw_gbps, self.work.gpus, self.host.numa_nodes)

    @property
    def activation_bytes(self) -> float:
        """Activation bytes per GPU at the peak of a backward pass: given, else estimated
        from the model's shape (activations.py), else 0 (the plan says so)."""
        if self.work.activations_gb is not None:
            return self.work.activations_gb * ar.GB
        estimated = activations.activation_bytes(self.model.shape, self.work.tokens_per_pass,
                                                 self.work.checkpointing)
        return 0.0 if estimated is None else estimated

    def activations_both(self) -> Optional[tuple[float, float]]:
        """(without, with checkpointing) estimated bytes, or None without a shape."""
        shape, tokens = self.model.shape, self.work.tokens_per_pass
        if shape is None:
            return None
        return (activations.activation_bytes(shape, tokens, False),
                activations.activation_bytes(shape, tokens, True))

    @property
    def compute_s(self) -> float:
        m, t = self.model, self.work.tokens_per_step
        flops = ar.forward_flops(m.total, t) + ar.backward_flops(m.total, m.trainable, t,
                                                                 self.work.checkpointing)
        return ar.compute_seconds(flops, self.gpu.tflops)

    @property
    def overlap_s(self) -> float:
        """The backward pass the host work can hide behind: the pass that closes the step
        (with checkpointing, the forward it recomputes is inside it)."""
        m = self.model
        return ar.compute_seconds(ar.backward_flops(m.total, m.trainable, self.work.tokens_per_pass,
                                                    self.work.checkpointing), self.gpu.tflops)
