"""What each gloo rank of tests/peers/test_peer_fsdp2.py runs (spawned through
tests/_distributed_workers.launch as "peers._peer_ranks:<function>").

torchao's FSDP2 tests shard a Linear whose rows do not split evenly and compare the sharded
optimizer with one process. Here the loss is linear in the weights (sum(model(x) * c)), so
every gradient is independent of the weights: the full gradients each rank's shards received
can be replayed in one process, by torch.optim.AdamW and by an unsharded AdamBridge.
"""
from __future__ import annotations

import torch

LR, WD = 1e-2, 1e-2
STEPS = 3
RUNS = [(precision, mode) for precision in ("fp32", "bf16", "fp8") for mode in ("sync", "async")]


def _batch(step: int, rank: int) -> tuple:
    gen = torch.Generator().manual_seed(100 * step + rank)
    # The scale of c varies per step so the moments see gradients from 1e-3 to 1.
    return torch.randn(4, 512, generator=gen), torch.randn(4, 33, generator=gen) * 10.0 ** -step


def fsdp2_uneven(rank: int, world: int, out_dir: str) -> dict:
    """fully_shard(Linear(512, 33)) on ``world`` ranks: 33 rows split 17 + 16, the second
    bias shard starting at element 17. Each (precision, mode): the full parameters after
    STEPS steps, this rank's state; sync runs also give the full gradients of every step."""
    from torch.distributed.fsdp import fully_shard

    from adambridge import AdamBridge

    result = {}
    for precision, mode in RUNS:
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(512, 33))
        params = list(model.parameters())
        opt = AdamBridge(params, lr=LR, weight_decay=WD, precision=precision, seed=5,
                         release_grads=mode == "async")
        if mode == "async":
            opt.attach_hooks(model)
        grads = []
        for step in range(STEPS):
            x, c = _batch(step, rank)
            (model(x) * c).sum().backward()
            if mode == "sync":
                grads.append([p.grad.full_tensor().clone() for p in params])
            opt.step()
            opt.zero_grad()
        opt.detach_hooks()
        result[precision, mode] = dict(
            full=[p.full_tensor().detach().clone() for p in params],
            local=[p.to_local().detach().clone() for p in params],
            state=[opt.state[p][key].clone() for p in params for key in sorted(opt.state[p])],
            grads=grads)
    torch.manual_seed(0)
    result["init"] = [p.detach().clone() for p in torch.nn.Linear(512, 33).parameters()]
    return result
