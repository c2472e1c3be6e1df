"""What each rank of tests/test_distributed*.py runs (spawned processes import this module).

``launch(scenario, world, out_dir)`` starts ``world`` gloo ranks on a free 127.0.0.1 port,
each runs ``SCENARIOS[scenario](rank, world, out_dir)`` and saves its result (a dict) as
``out_dir/<rank>.pt``; a rank that fails or runs past the timeout fails the launch.
"""
from __future__ import annotations

import importlib
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60.0
DCP_DTYPES = (torch.float32, torch.bfloat16)
FSDP2_SETUPS = ("plain", "cpu_offload", "mixed_precision")
LR, WD = 1e-2, 1e-2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, world: int, out_dir: str, timeout_s: float = TIMEOUT_S) -> list:
    context = mp.start_processes(_main, args=(world, free_port(), scenario, str(out_dir)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"scenario {scenario!r} on {world} ranks ran past {timeout_s} s")
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def _main(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _scenario(scenario)(rank, world, out_dir)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # no rank closes its sockets while a peer still finishes a collective
    finally:
        dist.destroy_process_group()
    # NOTE: once in a few full runs a rank aborted after this point ("terminate called
    # without an active exception": a C++ thread of torch's still joinable while the
    # interpreter tore down), failing a test whose results were all saved. Nothing of the
    # scenario runs in that teardown, so a rank that got here leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _scenario(name: str):
    """SCENARIOS[name], or function f of module m for a name "m:f" (another workers file)."""
    if ":" not in name:
        return SCENARIOS[name]
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


# --------------------------------------------------------------------------- models and data


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)  # uneven row splits: 37 rows over 2 ranks, 5 over 2, 5 over 4
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(),
                               torch.nn.Linear(37, 5)).to(dtype)


def full_grads(step: int, shapes: list) -> list:
    """The same full gradients on every rank (and in the single-process run)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g) for shape in shapes]


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 13, generator=torch.Generator().manual_seed(100 * step + rank))


def train(model, opt, rank: int, steps: int = 4) -> None:
    for step in range(steps):
        model(batch(rank, step)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def shard(model, setup: str = "plain"):
    """fully_shard each Linear and the whole; setup: plain, cpu_offload or mixed_precision."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kwargs = {}
    if setup == "cpu_offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif setup == "mixed_precision":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
    return model


# --------------------------------------------------------------------------- scenarios


def fsdp2_vs_adamw(rank: int, world: int, out_dir: str) -> dict:
    """AdamBridge and torch AdamW on the same FSDP2 model, real backward, both backends."""
    from adambridge import AdamBridge
    result = {}
    for setup in FSDP2_SETUPS:
        for backend in ("torch", "auto"):
            model = shard(make_model(), setup)
            opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, backend=backend)
            train(model, opt, rank)
            result[setup, backend] = [_full(p) for p in model.parameters()]
            result[setup, "bytes", backend] = opt.host_state_bytes()
        theirs = shard(make_model(), setup)
        train(theirs, torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WD), rank)
        result[setup, "adamw"] = [_full(p) for p in theirs.parameters()]
    return result


def fsdp2_clipping(rank: int, world: int, out_dir: str) -> dict:
    """max_grad_norm, and torch's clip_grad_norm_ before step(), against AdamW + the clip."""
    from adambridge import AdamBridge
    result = {}
    for name in ("max_grad_norm", "clip_grad_norm_", "adamw"):
        model = shard(make_model())
        params = list(model.parameters())
        opt = (torch.optim.AdamW(params, lr=LR, weight_decay=WD) if name == "adamw" else
               AdamBridge(params, lr=LR, weight_decay=WD,
                          max_grad_norm=0.05 if name == "max_grad_norm" else None))
        for step in range(3):
            model(batch(rank, step)).square().mean().backward()
            if name != "max_grad_norm":
                torch.nn.utils.clip_grad_norm_(params, 0.05)
            opt.step()
            opt.zero_grad()
        result[name] = [_full(p) for p in params]
    return result


def fsdp2_given_grads(rank: int, world: int, out_dir: str) -> dict:
    """Set full gradients by hand: the result must not depend on the number of ranks."""
    result = {}
    for dtype, precision in ((torch.float32, "bf16"), (torch.bfloat16, "bf16")):
        model = shard(make_model(dtype))
        opt = run_given_grads(model, precision, _as_dtensor_grad)
        result[precision, dtype] = [_full(p) for p in model.parameters()]
        result[precision, dtype, "bytes"] = opt.host_state_bytes()
    model = shard(make_model())  # a gradient in another layout is brought to the shard's
    run_given_grads(model, "bf16", _as_replicated_grad)
    result["replicated grads"] = [_full(p) for p in model.parameters()]
    return result


def hsdp_given_grads(rank: int, world: int, out_dir: str) -> dict:
    """HSDP on 4 ranks, a 2 x 2 mesh (Replicate, Shard(0)): the same bits as one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    run_given_grads(model, "bf16", _as_dtensor_grad)
    return {"params": [_full(p) for p in model.parameters()],
            "placements": str(model[0].weight.placements)}


def _as_replicated_grad(p, g):
    from torch.distributed.tensor import Replicate, distribute_tensor
    return distribute_tensor(g.to(p.dtype), p.device_mesh, [Replicate()])


def run_given_grads(model, precision: str, as_grad, steps=range(4), opt=None) -> object:
    from adambridge import AdamBridge
    params = list(model.parameters())
    if opt is None:
        opt = AdamBridge(params, lr=LR, weight_decay=WD, precision=precision, seed=7)
    for step in steps:
        for p, g in zip(params, full_grads(step, [p.shape for p in params])):
            p.grad = as_grad(p, g)
        opt.step()
    return opt


def _as_dtensor_grad(p, g):
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements)


def _ckpt(out_dir: str, name: str) -> str:
    return os.path.join(os.path.dirname(out_dir), name)


def dcp_save(rank: int, world: int, out_dir: str) -> dict:
    """2 steps, then DCP save (sharded) and a full state dict, then 2 more steps."""
    return {dtype: _save_and_go_on(rank, out_dir, dtype) for dtype in DCP_DTYPES}


def _save_and_go_on(rank: int, out_dir: str, dtype: torch.dtype) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    model = shard(make_model(dtype))
    opt = run_given_grads(model, "bf16", _as_dtensor_grad, steps=range(2))
    dcp.save({"model": sd.get_model_state_dict(model),
              "optim": sd.get_optimizer_state_dict(model, opt)},
             checkpoint_id=_ckpt(out_dir, f"dcp-{dtype}"))
    full_options = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {"model": sd.get_model_state_dict(model, options=full_options),
            "optim": sd.get_optimizer_state_dict(model, opt, options=full_options)}
    if rank == 0:
        torch.save(full, _ckpt(out_dir, f"full-{dtype}.pt"))
    run_given_grads(model, "bf16", _as_dtensor_grad, steps=range(2, 4), opt=opt)
    return [_full(p) for p in model.parameters()]


def dcp_load(rank: int, world: int, out_dir: str) -> dict:
    """Resume on another number of ranks, from the DCP checkpoint and from the full one."""
    return {(dtype, source): _load_and_go_on(out_dir, dtype, source)
            for dtype in DCP_DTYPES for source in ("dcp", "full")}


def _load_and_go_on(out_dir: str, dtype: torch.dtype, source: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    from adambridge import AdamBridge
    model = shard(make_model(dtype))
    opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16", seed=3)
    if source == "dcp":
        loaded = {"model": sd.get_model_state_dict(model),
                  "optim": sd.get_optimizer_state_dict(model, opt)}
        dcp.load(loaded, checkpoint_id=_ckpt(out_dir, f"dcp-{dtype}"))
        options = None
    else:
        loaded = torch.load(_ckpt(out_dir, f"full-{dtype}.pt"), weights_only=False)
        options = sd.StateDictOptions(full_state_dict=True)
    sd.set_model_state_dict(model, loaded["model"], options=options)
    sd.set_optimizer_state_dict(model, opt, loaded["optim"], options=options)
    assert opt.seed == 7, opt.seed  # the checkpoint's seed, not the constructor's
    run_given_grads(model, "bf16", _as_dtensor_grad, steps=range(2, 4), opt=opt)
    return [_full(p) for p in model.parameters()]


def refusals(rank: int, world: int, out_dir: str) -> dict:
    """The one-line errors for what is not handled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP
    from adambridge import AdamBridge
    errors = {}
    mesh = init_device_mesh("cpu", (world,))
    column = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    errors["shard1"] = _error(lambda: AdamBridge([column]))
    ddp = DDP(make_model())
    ddp.register_comm_hook(None, _noop_hook)
    errors["ddp_comm_hook"] = _error(lambda: AdamBridge(ddp.parameters()).attach_hooks(ddp))
    errors["fsdp1"] = _error(lambda: AdamBridge(_fsdp1(make_model()).parameters()))
    return errors


def _noop_hook(state, bucket):
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def ddp_sync(rank: int, world: int, out_dir: str) -> dict:
    """DDP + synchronous AdamBridge against DDP + torch AdamW, both backends."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from adambridge import AdamBridge
    result = {}
    for name in ("torch", "auto", "adamw"):
        model = DDP(make_model())
        opt = (torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD) if name == "adamw"
               else AdamBridge(model.parameters(), lr=LR, weight_decay=WD, backend=name))
        train(model, opt, rank)
        result[name] = [p.detach().clone() for p in model.parameters()]
    return result


def ddp_async(rank: int, world: int, out_dir: str) -> dict:
    """DDP + attach_hooks: hooks on the DDP model, and on its module (bound at its forward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from adambridge import AdamBridge
    result = {}
    for backend, target in (("torch", "ddp"), ("auto", "module")):
        model = DDP(make_model())
        opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, backend=backend,
                         small_param_threshold=100)  # the weights are hooked, biases not
        opt.attach_hooks({"ddp": model, "module": model.module}[target])
        train(model, opt, rank)
        result[backend, target] = [p.detach().clone() for p in model.parameters()]
        opt.detach_hooks()
    return result


# --------------------------------------------------------------------------- shard_state (distributed/zero.py)

ZERO_CASES = ((torch.float32, "fp32"), (torch.float32, "bf16"), (torch.bfloat16, "bf16"),
              (torch.float32, "fp8"))


def _sharded(model, precision: str = "bf16", shard_state=True, **kwargs):
    from adambridge import AdamBridge
    return AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision=precision, seed=7,
                      shard_state=shard_state, **kwargs)


def zero_given_grads(rank: int, world: int, out_dir: str) -> dict:
    """The same full gradients on every rank (what DDP's all-reduce leaves): the result, the
    whole state_dict and the host bytes of this rank's ranges."""
    result = {}
    for dtype, precision in ZERO_CASES:
        model = make_model(dtype)
        opt = run_given_grads(model, precision, _same_grad, opt=_sharded(model, precision))
        result[dtype, precision] = [p.detach().clone() for p in model.parameters()]
        result[dtype, precision, "state"] = opt.state_dict()["state"]
        result[dtype, precision, "bytes"] = opt.host_state_bytes()
    for dtype in DCP_DTYPES:  # weights written between steps: the masters take them
        model = make_model(dtype)
        result[dtype, "written"] = [p.detach().clone() for p in
                                    written_between_steps(model, _sharded(model)).parameters()]
    # A ProcessGroup of this rank alone: the one-rank path (no exchange on CPU).
    alone = [dist.new_group([r]) for r in range(world)][rank]
    for dtype in DCP_DTYPES:
        model = make_model(dtype)
        run_given_grads(model, "bf16", _same_grad, opt=_sharded(model, shard_state=alone))
        result[dtype, "bf16", "one-rank group"] = [p.detach().clone() for p in model.parameters()]
    return result


def _same_grad(p, g):
    return g.to(p.dtype)


def written_between_steps(model, opt):
    """2 steps, every weight halved by hand, 2 more steps."""
    run_given_grads(model, "bf16", _same_grad, steps=range(2), opt=opt)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    run_given_grads(model, "bf16", _same_grad, steps=range(2, 4), opt=opt)
    return model


def zero_ddp(rank: int, world: int, out_dir: str) -> dict:
    """DDP, real backward, shard_state=True, both backends (compared with DDP + AdamW)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    result = {}
    for backend in ("torch", "auto"):
        model = DDP(make_model())
        train(model, _sharded(model, "fp32", backend=backend), rank)
        result[backend] = [p.detach().clone() for p in model.parameters()]
    return result


def zero_save(rank: int, world: int, out_dir: str) -> dict:
    """2 steps, a DCP checkpoint and a whole one (torch.save), then 2 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    from adambridge.distributed import zero
    zero._GATHER_BYTES = 1  # one parameter per exchange, as the batches of a large state go
    result = {}
    for dtype in DCP_DTYPES:
        model = make_model(dtype)
        opt = run_given_grads(model, "bf16", _same_grad, steps=range(2),
                              opt=_sharded(model))
        dcp.save({"model": sd.get_model_state_dict(model),
                  "optim": sd.get_optimizer_state_dict(model, opt)},
                 checkpoint_id=_ckpt(out_dir, f"zero-dcp-{dtype}"))
        whole = {"model": model.state_dict(), "optim": opt.state_dict()}
        if rank == 0:
            torch.save(whole, _ckpt(out_dir, f"zero-full-{dtype}.pt"))
        run_given_grads(model, "bf16", _same_grad, steps=range(2, 4), opt=opt)
        result[dtype] = [p.detach().clone() for p in model.parameters()]
    return result


def zero_load(rank: int, world: int, out_dir: str, sharded: bool = True) -> dict:
    """Resume a zero_save checkpoint (of another number of ranks), DCP's and the whole one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd
    from adambridge import AdamBridge
    result = {}
    for dtype in DCP_DTYPES:
        for source in ("dcp", "full"):
            model = make_model(dtype)
            opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16",
                             seed=3, shard_state=sharded)
            if source == "dcp":
                loaded = {"model": sd.get_model_state_dict(model),
                          "optim": sd.get_optimizer_state_dict(model, opt)}
                dcp.load(loaded, checkpoint_id=_ckpt(out_dir, f"zero-dcp-{dtype}"))
                sd.set_model_state_dict(model, loaded["model"])
                sd.set_optimizer_state_dict(model, opt, loaded["optim"])
            else:
                loaded = torch.load(_ckpt(out_dir, f"zero-full-{dtype}.pt"), weights_only=False)
                model.load_state_dict(loaded["model"])
                opt.load_state_dict(loaded["optim"])
            assert opt.seed == 7, opt.seed  # the checkpoint's seed, not the constructor's
            run_given_grads(model, "bf16", _same_grad, steps=range(2, 4), opt=opt)
            result[dtype, source] = [p.detach().clone() for p in model.parameters()]
    return result


def zero_refusals(rank: int, world: int, out_dir: str) -> dict:
    errors = {}
    model = make_model()
    fsdp2 = shard(make_model())
    errors["fsdp2"] = _error(lambda: _step_once(fsdp2, _sharded(fsdp2)))
    model = make_model()
    opt = _sharded(model)
    model[0].weight.grad = torch.ones_like(model[0].weight) if rank == 0 else None
    errors["grads_differ"] = _error(opt.step)
    return errors


def _step_once(model, opt):
    model(batch(0, 0)).square().mean().backward()
    opt.step()


def zero_four(rank: int, world: int, out_dir: str) -> dict:
    """On 4 ranks: the given-gradient run, and the resume of the 2-rank checkpoint."""
    return {"zero_given_grads": zero_given_grads(rank, world, out_dir),
            "zero_load": zero_load(rank, world, out_dir)}


def zero_async(rank: int, world: int, out_dir: str) -> dict:
    """attach_hooks on DDP with shard_state=True against synchronous shard_state, every
    model dtype and moment precision; then accumulation under no_sync, and the refusals."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    result = {}
    for dtype, precision in ZERO_CASES:
        for mode in ("sync", "async"):
            model = DDP(make_model(dtype))
            opt = _sharded(model, precision)
            if mode == "async":
                opt.attach_hooks(model)
            in_backward = []
            for step in range(4):
                model(batch(rank, step).to(dtype)).float().square().mean().backward()
                if mode == "async":
                    in_backward.append(_ranges_in_backward(opt))
                opt.step()
                opt.zero_grad()
            result[dtype, precision, mode] = [p.detach().clone() for p in model.parameters()]
            result[dtype, precision, mode, "bytes"] = opt.host_state_bytes()
            result[dtype, precision, mode, "in backward"] = in_backward
            opt.detach_hooks()
    for mode in ("sync", "async"):
        result["accumulated", mode] = _zero_accumulated(rank, mode)
        result["loaded", mode] = _zero_loaded(rank, mode)
        for option in ("find_unused_parameters", "static_graph"):
            result[option, mode] = _zero_unused(rank, mode, option)
        # The unsharded DDP pipeline, every parameter hooked.
        result["unsharded", mode] = _zero_unused(rank, mode, "find_unused_parameters",
                                                 shard_state=False, small_param_threshold=1)
    result["errors"] = _zero_async_errors(rank)
    return result


def _ranges_in_backward(opt) -> int:
    updater = opt.pipeline
    updater._wait()  # the worker's batches of this backward, before step() runs
    return len(updater._done)


def _zero_accumulated(rank: int, mode: str) -> list:
    """Two passes per step, the first under DDP's no_sync (no all-reduce, no comm hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model())
    opt = _sharded(model, "bf16")
    if mode == "async":
        opt.attach_hooks(model)
    for step in range(3):
        with model.no_sync():
            model(batch(rank, 2 * step)).square().mean().backward()
        model(batch(rank, 2 * step + 1)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    return [p.detach().clone() for p in model.parameters()]


def _zero_loaded(rank: int, mode: str) -> list:
    """2 steps, load_state_dict of the state with a tenth of the lr (new param_groups), 2 more."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model())
    opt = _sharded(model, "bf16")
    if mode == "async":
        opt.attach_hooks(model)
    for step in range(4):
        if step == 2:
            saved = opt.state_dict()
            saved["param_groups"][0]["lr"] = LR / 10
            opt.load_state_dict(saved)
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    return [p.detach().clone() for p in model.parameters()]


class _PartlyUsed(torch.nn.Module):
    """make_model's layers and one more that rank 1 uses at odd steps (``varying``: unused
    by one rank, then by both), else no rank ever (static_graph needs the same graph)."""

    def __init__(self, varying: bool) -> None:
        super().__init__()
        self.body, self.extra = make_model(), torch.nn.Linear(5, 5)
        self.varying, self.step = varying, 0

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        y = self.body(x)
        return self.extra(y) if self.varying and rank == 1 and self.step % 2 else y


def _zero_unused(rank: int, mode: str, option: str, **kwargs) -> list:
    """A parameter unused by some ranks (locally) or by all (globally) in some steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    inner = _PartlyUsed(varying=option == "find_unused_parameters")
    model = DDP(inner, **{option: True})
    opt = _sharded(model, "bf16", **kwargs)
    if mode == "async":
        opt.attach_hooks(model)
    for step in range(4):
        inner.step = step
        model(batch(rank, step), rank).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    return [p.detach().clone() for p in model.parameters()]


def _zero_async_errors(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    errors = {}
    model = DDP(make_model())
    opt = _sharded(model)
    opt.attach_hooks(model)
    before = [p.detach().clone() for p in model.parameters()]
    model(batch(rank, 0)).square().mean().backward()
    errors["clip in the first step"] = _error(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    errors["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step()
    opt.zero_grad()
    model(batch(rank, 1)).square().mean().backward()
    errors["clip in a later step"] = _error(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    opt.step()
    opt.zero_grad()
    for step in (2, 3):  # a second reduced backward before step()
        model(batch(rank, step)).square().mean().backward()
    errors["second reduce"] = _error(opt.step)
    errors["accumulate"] = _error(opt.accumulate)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(batch(rank, 4)).square().mean()).backward()
    errors["GradScaler"] = _error(lambda: scaler.unscale_(opt))
    opt.zero_grad()
    opt.detach_hooks()
    errors["max_grad_norm"] = _error(
        lambda: _sharded(model, max_grad_norm=1.0).attach_hooks(model))
    errors["accumulation_steps"] = _error(
        lambda: _sharded(model).attach_hooks(model, accumulation_steps=2))
    plain = make_model()
    errors["no ddp"] = _error(lambda: _sharded(plain).attach_hooks(plain))

    return errors


# --------------------------------------------------------------------------- FSDP2 async


def fsdp2_async(rank: int, world: int, out_dir: str) -> dict:
    """attach_hooks on FSDP2 models against synchronous step(), bf16 moments (SR on)."""
    from adambridge import AdamBridge
    result = {}
    for setup in FSDP2_SETUPS:
        for mode in ("sync", "async"):
            model = shard(make_model(), setup)
            opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16", seed=7)
            if mode == "async":
                opt.attach_hooks(model)
            in_backward = []
            for step in range(4):
                model(batch(rank, step)).square().mean().backward()
                if mode == "async":
                    in_backward.append(_updated_in_backward(opt))
                opt.step()
                opt.zero_grad()
            result[setup, mode] = [_full(p) for p in model.parameters()]
            result[setup, mode, "in backward"] = in_backward
            opt.detach_hooks()
    for mode in ("sync", "async"):
        result["accumulated", mode] = _accumulated(rank, mode)
        result["loaded", mode] = _fsdp2_loaded(rank, mode)
    result["errors"] = _fsdp2_async_errors(rank)
    return result


def _updated_in_backward(opt) -> int:
    updater = opt.pipeline
    updater._wait()  # the worker's batches of this backward, before step() runs
    return len(updater._done)


def _accumulated(rank: int, mode: str) -> list:
    """Two passes per step, the first without gradient sync (FSDP2's accumulation)."""
    from adambridge import AdamBridge
    model = shard(make_model(), "cpu_offload")
    opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16", seed=7)
    if mode == "async":
        opt.attach_hooks(model)
    for step in range(3):
        model.set_requires_gradient_sync(False)
        model(batch(rank, 2 * step)).square().mean().backward()
        model.set_requires_gradient_sync(True)
        model(batch(rank, 2 * step + 1)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    return [_full(p) for p in model.parameters()]


def _fsdp2_loaded(rank: int, mode: str) -> list:
    """2 steps, load_state_dict with a tenth of the lr (new param_groups), 2 more."""
    from torch.distributed.checkpoint import state_dict as sd
    from adambridge import AdamBridge
    model = shard(make_model(), "cpu_offload")
    opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16", seed=7)
    if mode == "async":
        opt.attach_hooks(model)
    for step in range(4):
        if step == 2:
            saved = sd.get_optimizer_state_dict(model, opt)
            for group in saved["param_groups"]:
                group["lr"] = LR / 10
            sd.set_optimizer_state_dict(model, opt, saved)
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.detach_hooks()
    return [_full(p) for p in model.parameters()]


def _fsdp2_async_errors(rank: int) -> dict:
    from adambridge import AdamBridge
    errors = {}
    model = shard(make_model())
    opt = AdamBridge(model.parameters(), lr=LR)
    opt.attach_hooks(model)
    before = [_full(p) for p in model.parameters()]
    model(batch(rank, 0)).square().mean().backward()
    errors["clip in the first step"] = _error(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    errors["unchanged"] = all(torch.equal(a, _full(b)) for a, b in zip(before, model.parameters()))
    opt.step()
    opt.zero_grad()
    for step in (1, 2):  # a second synced backward before step()
        model(batch(rank, step)).square().mean().backward()
    errors["second reduce"] = _error(opt.step)
    errors["accumulate"] = _error(opt.accumulate)
    opt.zero_grad()
    opt.detach_hooks()
    errors["max_grad_norm"] = _error(
        lambda: AdamBridge(model.parameters(), max_grad_norm=1.0).attach_hooks(model))
    errors["accumulation_steps"] = _error(
        lambda: AdamBridge(model.parameters()).attach_hooks(model, accumulation_steps=2))
    return errors


def nvme_ranks(rank: int, world: int, out_dir: str) -> dict:
    """DDP with offload_dir: a directory per rank (sync and async, against state in RAM),
    one directory for every rank, and the combinations refused (FSDP2, shard_state)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from adambridge import AdamBridge
    from adambridge.nvme.tier import OffloadConfig
    result = {}
    for mode in ("sync", "async"):
        for where in ("ram", "files"):
            folder = os.path.join(out_dir, f"{mode}-rank{rank}")
            os.makedirs(folder, exist_ok=True)
            # budget 100 bytes: the 5-element bias stays in RAM, the rest streams in pages.
            tier = {} if where == "ram" else dict(
                offload_dir=OffloadConfig([folder], page_size=128, queue_depth=2),
                host_budget=100)
            model = DDP(make_model())
            opt = AdamBridge(model.parameters(), lr=LR, weight_decay=WD, precision="bf16",
                             backend="torch", small_param_threshold=16, **tier)
            if mode == "async":
                opt.attach_hooks(model)
            train(model, opt, rank)
            opt.detach_hooks()
            result[mode, where] = ([p.detach().clone() for p in model.parameters()],
                                   opt.state_dict()["state"], {x.where for x in opt.placement()})
            del opt
    shared, kept = os.path.join(out_dir, "shared"), []
    os.makedirs(shared, exist_ok=True)
    dist.barrier()  # both ranks try the one directory after it exists
    result["one directory"] = _error(
        lambda: kept.append(AdamBridge(make_model().parameters(), offload_dir=shared)))
    dist.barrier()  # the rank that got it holds it until both have tried
    own = os.path.join(out_dir, f"own{rank}")
    os.makedirs(own, exist_ok=True)
    result["shard_state"] = _error(
        lambda: AdamBridge(make_model().parameters(), shard_state=True, offload_dir=own))
    result["fsdp2"] = _error(lambda: AdamBridge(shard(make_model()).parameters(), offload_dir=own))
    opt = AdamBridge([torch.nn.Parameter(torch.randn(3))], offload_dir=own)
    result["fsdp2 add_param_group"] = _error(
        lambda: opt.add_param_group({"params": list(shard(make_model()).parameters())}))
    result["groups after the refusal"] = len(opt.param_groups)
    return result


def two_ranks(rank: int, world: int, out_dir: str) -> dict:
    """Every two-rank scenario in one launch (each launch costs seconds of imports)."""
    return {f.__name__: f(rank, world, out_dir)
            for f in (fsdp2_vs_adamw, fsdp2_clipping, fsdp2_given_grads, refusals, ddp_sync,
                      ddp_async, zero_given_grads, zero_ddp, zero_save, zero_refusals,
                      zero_async, fsdp2_async)}


SCENARIOS = {f.__name__: f for f in (two_ranks, fsdp2_vs_adamw, fsdp2_clipping,
                                     fsdp2_given_grads, refusals, ddp_sync, ddp_async,
                                     dcp_save, dcp_load, hsdp_given_grads, zero_given_grads,
                                     zero_ddp, zero_save, zero_refusals, zero_four,
                                     zero_async, fsdp2_async, nvme_ranks)}
