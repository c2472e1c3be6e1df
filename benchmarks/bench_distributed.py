"""Host bytes per rank and step time against the number of ranks: FSDP2 and DDP.

    python benchmarks/bench_distributed.py --ranks 1 2 4 --layers 8 --width 1024 --wrapper ddp

Each run spawns N gloo ranks on this machine.

fsdp2: every rank shards the same fp32 MLP with ``fully_shard(..., offload_policy=
CPUOffloadPolicy())`` (sharded parameters and gradients in host memory), then times
``opt.step()`` alone (the median of --steps after one warm step) for AdamBridge (fp32 and
bf16 moments) and for ``torch.optim.AdamW`` (foreach, fused) on the same sharded model.

ddp: every rank wraps its own copy of the MLP in DDP, one copy per variant: AdamBridge with
and without ``shard_state=True`` (fp32 and bf16 moments). Each step runs backward on every
copy, then times each variant's ``opt.step()`` (the sharded ones include their all-gather),
variants interleaved in a rotating order; the ratio is each variant's median against
unsharded AdamBridge of the same precision in the same run. backward+step is the whole
iteration (backward with DDP's all-reduce, then the step), with its ratio likewise.

fsdp2_async (also part of fsdp2): backward+step of the FSDP2 + CPUOffloadPolicy model with
synchronous ``step()`` against ``attach_hooks`` (each shard updated by a worker thread as
its reduce-scatter lands), bf16 moments, interleaved; the step columns there hold the whole
iteration too (in async mode step() only waits).

ddp_async: backward+step of DDP + ``shard_state=True`` with synchronous ``step()`` against
``attach_hooks`` (each rank's ranges updated by a worker thread as DDP's buckets are
all-reduced; step() waits and all-gathers), bf16 moments, interleaved, the ratio against
the synchronous one.

Host state per rank is what the optimizer holds beyond the parameters (an fp32 master that
is the parameter's own storage costs nothing extra).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(layers: int, width: int):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def _optimizers(params: list) -> dict:
    from adambridge import AdamBridge
    return {
        "adambridge fp32": lambda: AdamBridge(params, lr=1e-4),
        "adambridge bf16": lambda: AdamBridge(params, lr=1e-4, precision="bf16"),
        "torch AdamW foreach": lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "torch AdamW fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _host_bytes(opt, params: list) -> int:
    """Bytes of this rank's optimizer state beyond its parameters (a master that is a
    parameter's own storage, or a range of it, costs nothing extra)."""
    own = {_local(p).untyped_storage().data_ptr() for p in params}
    tensors = [_local(t) for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors
               if t.untyped_storage().data_ptr() not in own)


def _ddp_variants() -> dict:
    """name -> (make optimizer from params, the baseline's name)."""
    from adambridge import AdamBridge
    variants = {}
    for precision in ("fp32", "bf16"):
        base = f"adambridge {precision}"
        variants[base] = (lambda ps, pr=precision: AdamBridge(ps, lr=1e-4, precision=pr), base)
        variants[base + " shard_state"] = (
            lambda ps, pr=precision: AdamBridge(ps, lr=1e-4, precision=pr, shard_state=True),
            base)
    return variants


def _ddp_rows(args, x: torch.Tensor) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    variants = _ddp_variants()
    models = {name: DDP(_plain_model(args.layers, args.width)) for name in variants}
    opts = {name: make(list(models[name].parameters())) for name, (make, _) in variants.items()}
    times: dict = {name: [] for name in variants}
    whole: dict = {name: [] for name in variants}
    names = list(variants)
    for step in range(args.steps + 1):
        order = names[step % len(names):] + names[:step % len(names)]  # rotate: A B, B A ...
        for name in order:
            dist.barrier()
            began = time.perf_counter()
            models[name](x).square().mean().backward()  # with DDP's all-reduce
            stepped = time.perf_counter()
            opts[name].step()
            ended = time.perf_counter()
            times[name].append(ended - stepped)
            whole[name].append(ended - began)
            opts[name].zero_grad()
    rows = {}
    for name, (_, base) in variants.items():
        median = statistics.median(times[name][1:])
        ratio = median / statistics.median(times[base][1:])
        iteration = statistics.median(whole[name][1:])
        rows["ddp " + name] = (_host_bytes(opts[name], list(models[name].parameters())),
                               median, ratio, iteration,
                               iteration / statistics.median(whole[base][1:]))
    return rows


def _plain_model(layers: int, width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _fsdp2_rows(args, x: torch.Tensor) -> dict:
    model = _model(args.layers, args.width)
    rows = {}
    params = list(model.parameters())
    for name, make in _optimizers(params).items():
        opt, times = make(), []
        for _ in range(args.steps + 1):
            model(x).square().mean().backward()
            dist.barrier()
            began = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - began)
            opt.zero_grad()
        rows["fsdp2 " + name] = (_host_bytes(opt, params), statistics.median(times[1:]), None,
                                 None, None)
    return rows


def _fsdp2_async_rows(args, x: torch.Tensor) -> dict:
    """backward+step of FSDP2 + CPUOffloadPolicy, synchronous step() against attach_hooks
    (each shard updated as its reduce-scatter lands), interleaved, bf16 moments."""
    from adambridge import AdamBridge
    models = {mode: _model(args.layers, args.width) for mode in ("sync", "async")}
    opts = {mode: AdamBridge(m.parameters(), lr=1e-4, precision="bf16")
            for mode, m in models.items()}
    opts["async"].attach_hooks(models["async"])
    whole: dict = {mode: [] for mode in models}
    for step in range(args.steps + 1):
        for mode in (("sync", "async") if step % 2 else ("async", "sync")):
            dist.barrier()
            began = time.perf_counter()
            models[mode](x).square().mean().backward()
            opts[mode].step()
            whole[mode].append(time.perf_counter() - began)
            opts[mode].zero_grad()
    opts["async"].detach_hooks()
    # The first async step is held (updated by step()): the medians skip two steps.
    sync, asynchronous = (statistics.median(whole[m][2:]) for m in ("sync", "async"))
    held = {mode: _host_bytes(opts[mode], list(m.parameters())) for mode, m in models.items()}
    return {"fsdp2 adambridge bf16 sync": (held["sync"], sync, 1.0, sync, 1.0),
            "fsdp2 adambridge bf16 attach_hooks": (held["async"],
                                                  asynchronous, asynchronous / sync,
                                                  asynchronous, asynchronous / sync)}


def _ddp_async_rows(args, x: torch.Tensor) -> dict:
    """backward+step of DDP + shard_state, synchronous step() against attach_hooks (each
    rank's ranges updated as DDP's buckets are reduced), interleaved, bf16 moments."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from adambridge import AdamBridge
    models = {mode: DDP(_plain_model(args.layers, args.width)) for mode in ("sync", "async")}
    opts = {mode: AdamBridge(m.parameters(), lr=1e-4, precision="bf16", shard_state=True)
            for mode, m in models.items()}
    opts["async"].attach_hooks(models["async"])
    whole: dict = {mode: [] for mode in models}
    for step in range(args.steps + 1):
        for mode in (("sync", "async") if step % 2 else ("async", "sync")):
            dist.barrier()
            began = time.perf_counter()
            models[mode](x).square().mean().backward()
            opts[mode].step()
            whole[mode].append(time.perf_counter() - began)
            opts[mode].zero_grad()
    opts["async"].detach_hooks()
    # The first async step is held (updated by step()): the medians skip two steps.
    sync, asynchronous = (statistics.median(whole[m][2:]) for m in ("sync", "async"))
    held = {mode: _host_bytes(opts[mode], list(m.parameters())) for mode, m in models.items()}
    return {"ddp shard_state bf16 sync": (held["sync"], sync, 1.0, sync, 1.0),
            "ddp shard_state bf16 attach_hooks": (held["async"],
                                                 asynchronous, asynchronous / sync,
                                                 asynchronous, asynchronous / sync)}


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randn(4, args.width)
    rows = {}
    if args.wrapper in ("fsdp2", "both"):
        rows.update(_fsdp2_rows(args, x))
    if args.wrapper in ("fsdp2", "fsdp2_async", "both"):
        rows.update(_fsdp2_async_rows(args, x))
    if args.wrapper in ("ddp", "both"):
        rows.update(_ddp_rows(args, x))
    if args.wrapper in ("ddp", "ddp_async", "both"):
        rows.update(_ddp_async_rows(args, x))
    torch.save(rows, os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--wrapper", choices=("fsdp2", "fsdp2_async", "ddp", "ddp_async",
                                                  "both"), default="both")
    args = parser.parse_args()
    numel = args.layers * (args.width * args.width + args.width)
    print(f"{numel / 1e6:.1f}M fp32 parameters, gloo, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'ranks':>5}  {'wrapper and optimizer':<34}{'host MB/rank':>13}"
          f"{'step ms (max rank)':>20}{'ratio':>8}{'backward+step ms':>18}{'ratio':>8}")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_rank, args=(world, _port(), args, out), nprocs=world,
                               start_method="spawn")
            ranks = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]
        for name in ranks[0]:
            host = max(r[name][0] for r in ranks) / 1e6
            step = max(r[name][1] for r in ranks) * 1e3
            extra = ""
            if ranks[0][name][2] is not None:  # ddp: the ratios and the whole iteration
                extra = (f"{max(r[name][2] for r in ranks):>8.2f}"
                         f"{max(r[name][3] for r in ranks) * 1e3:>18.1f}"
                         f"{max(r[name][4] for r in ranks):>8.2f}")
            print(f"{world:>5}  {name:<34}{host:>13.1f}{step:>20.1f}{extra}")
        print(f"       load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
