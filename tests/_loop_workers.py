"""What each rank of tests/test_distributed_loops.py runs (launched as ``_loop_workers:<name>``
through _distributed_workers.launch, which gives each scenario its gloo group and timeout).

An FSDP2 shard whose fp8 blocks start off a multiple of 128, on both backends.
"""
from __future__ import annotations

import torch

from _distributed_workers import LR, WD


def fsdp2_fp8_uneven(rank: int, world: int, out_dir: str) -> dict:
    """fully_shard(Linear(512, 33)), fp8 moments: rank 1's bias shard starts at element 17.
    Both backends, sync and async: the shards, masters, moments and scales after 3 steps."""
    from torch.distributed.fsdp import fully_shard
    from adambridge import AdamBridge
    from adambridge.distributed import shard_offset
    result = {}
    for backend in ("torch", "native"):
        for mode in ("sync", "async"):
            torch.manual_seed(0)
            model = fully_shard(torch.nn.Linear(512, 33))
            params = list(model.parameters())
            opt = AdamBridge(params, lr=LR, weight_decay=WD, precision="fp8", seed=7,
                             backend=backend)
            if mode == "async":
                opt.attach_hooks(model)
            for step in range(3):
                x = torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            opt.detach_hooks()
            result[backend, mode] = [p.to_local().detach().clone() for p in params] + [
                opt.state[p][key].clone() for p in params for key in sorted(opt.state[p])]
    result["offsets"] = [shard_offset(p, i) for i, p in enumerate(params)]
    return result
