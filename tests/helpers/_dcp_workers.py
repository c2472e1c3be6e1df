"""What each rank of tests/distributed/test_dcp_ranks.py runs: DCP save and resume under FSDP2, 2 gloo ranks.

``launch(world, out_dir)`` starts ``world`` ranks on a free 127.0.0.1 port (as
tests/helpers/_distributed_workers.py does); each runs ``fsdp2_dcp`` and saves its result as
``out_dir/<rank>.pt``.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _distributed_workers as workers

TIMEOUT_S = 240.0
# (precision, parameter dtype): the middle one saves bf16 moments of fp32 parameters, which
# torch.optim.AdamW casts to fp32 on its load; every saved tensor is the state's own in all.
CONFIGS = (("fp32", torch.float32), ("bf16", torch.float32), ("bf16", torch.bfloat16))
WAYS = ("get/set_optimizer_state_dict", "get/set_state_dict", "Stateful", "in place")


def launch(world: int, out_dir) -> list:
    os.makedirs(out_dir, exist_ok=True)
    context = mp.start_processes(_main, args=(world, workers.free_port(), str(out_dir)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"fsdp2_dcp on {world} ranks ran past {TIMEOUT_S} s")
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
            for r in range(world)]


def _main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fsdp2_dcp(rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/helpers/_distributed_workers.py: no teardown of torch's threads


class AppState:
    """torchtitan's Stateful: state_dict() and load_state_dict() over DCP's helpers."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint import state_dict as sd
        model_sd, optim_sd = sd.get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint import state_dict as sd
        sd.set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"],
                          optim_state_dict=state_dict["optim"])


def _steps(model, opt, steps) -> None:
    workers.run_given_grads(model, opt.precision, workers._as_dtensor_grad, steps=steps, opt=opt)


def _fresh(precision: str, dtype: torch.dtype, seed: int):
    from adambridge import AdamBridge
    model = workers.shard(workers.make_model(dtype))
    return model, AdamBridge(model.parameters(), lr=workers.LR, weight_decay=workers.WD,
                             precision=precision, seed=seed)


def _outcome(model, opt) -> dict:
    return {"params": [workers._full(p) for p in model.parameters()],
            "state": [{k: v.clone() for k, v in opt.state[p].items()}
                      for p in model.parameters()]}


def _save(model, opt, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    dcp.save({"model": sd.get_model_state_dict(model),
              "optim": sd.get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(folder, "helpers"))
    dcp.save({"app": AppState(model, opt)}, checkpoint_id=os.path.join(folder, "stateful"))
    # torchao's FSDP2 test saves the modules' and the optimizer's own state_dict()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             checkpoint_id=os.path.join(folder, "own"))


def _resume(way: str, precision: str, dtype: torch.dtype, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    model, opt = _fresh(precision, dtype, seed=7 if way == "in place" else 0)
    if way == "get/set_optimizer_state_dict":
        target = {"model": sd.get_model_state_dict(model),
                  "optim": sd.get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=os.path.join(folder, "helpers"))
        sd.set_model_state_dict(model, target["model"])
        sd.set_optimizer_state_dict(model, opt, target["optim"])
    elif way == "get/set_state_dict":
        model_sd, optim_sd = sd.get_state_dict(model, opt)
        target = {"model": model_sd, "optim": optim_sd}
        dcp.load(target, checkpoint_id=os.path.join(folder, "helpers"))
        sd.set_state_dict(model, opt, model_state_dict=target["model"],
                          optim_state_dict=target["optim"])
    elif way == "Stateful":
        dcp.load({"app": AppState(model, opt)}, checkpoint_id=os.path.join(folder, "stateful"))
    else:
        _steps(model, opt, range(10, 11))  # state of its own, which the load must replace
        dcp.load({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(folder, "own"))
    try:
        _steps(model, opt, range(2, 4))
    except RuntimeError as exc:
        return {"error": str(exc)}
    return _outcome(model, opt)


def fsdp2_dcp(rank: int, out_dir: str) -> dict:
    """Per config: 2 steps, DCP saves, 2 more (the reference); then each way of resuming."""
    result = {}
    for precision, dtype in CONFIGS:
        folder = os.path.join(os.path.dirname(out_dir), f"ckpt-{precision}-{dtype}")
        model, opt = _fresh(precision, dtype, seed=7)
        _steps(model, opt, range(2))
        _save(model, opt, folder)
        _steps(model, opt, range(2, 4))
        result[precision, dtype, "uninterrupted"] = _outcome(model, opt)
        for way in WAYS:
            result[precision, dtype, way] = _resume(way, precision, dtype, folder)
    return result
