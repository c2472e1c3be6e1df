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


def _sharded(precision: str, mode: str, seed: int):
    from torch.distributed.fsdp import fully_shard

    from adambridge import AdamBridge

    torch.manual_seed(seed)
    model = fully_shard(torch.nn.Linear(512, 33))
    opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision=precision, seed=5)
    if mode == "async":
        opt.attach_hooks(model)
    return model, opt


def _train(model, opt, steps: range, rank: int) -> None:
    for step in steps:
        x, c = _batch(step, rank)
        (model(x) * c).sum().backward()
        opt.step()
        opt.zero_grad()


def fsdp2_uneven_dcp_resume(rank: int, world: int, out_dir: str) -> dict:
    """The uneven shards saved by DCP after 2 of STEPS steps (get_state_dict), loaded into a
    freshly built and differently initialised model and optimizer (set_state_dict), trained
    on: this rank's shards and state, and those of the uninterrupted run. fp8 moments are
    refused by state_dict() on DTensor parameters, so fp32 and bf16."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    result = {}
    for precision in ("fp32", "bf16"):
        for mode in ("sync", "async"):
            folder = f"{out_dir}/ckpt-{precision}-{mode}"
            model, opt = _sharded(precision, mode, seed=0)
            _train(model, opt, range(2), rank)
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
            _train(model, opt, range(2, STEPS), rank)
            opt.detach_hooks()
            whole = _local(model, opt)
            model, opt = _sharded(precision, mode, seed=1)
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
            _train(model, opt, range(2, STEPS), rank)
            opt.detach_hooks()
            result[precision, mode] = dict(uninterrupted=whole, resumed=_local(model, opt))
    return result


def _local(model, opt) -> list:
    params = list(model.parameters())
    return [p.to_local().detach().clone() for p in params] + [
        opt.state[p][key].clone() for p in params for key in sorted(opt.state[p])]
