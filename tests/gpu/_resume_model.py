"""The small bf16 model the GPU resume tests save, load and train on (CUDA only)."""
from __future__ import annotations

import torch


def cuda_model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 3)).to("cuda", torch.bfloat16)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` steps on seeded batches: the same seed gives the same batches."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 9, generator=gen).to("cuda", torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
