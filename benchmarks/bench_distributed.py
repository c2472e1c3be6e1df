"""Host bytes per rank and step time against the number of ranks: FSDP2 + CPUOffloadPolicy.

    python benchmarks/bench_distributed.py --ranks 1 2 4 --layers 8 --width 1024

Each run spawns N gloo ranks on this machine; every rank shards the same fp32 MLP with
``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (sharded parameters and gradients in
host memory), then times ``opt.step()`` alone (the median of --steps after one warm step) for
AdamBridge (fp32 and bf16 moments) and for ``torch.optim.AdamW`` (foreach, fused) on the
same sharded model. Host state per rank is what the optimizer holds beyond the shard.
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
    """Bytes of this rank's optimizer state beyond its parameter shards (an fp32 master
    that is the shard itself, as AdamBridge's is here, costs nothing extra)."""
    shards = {_local(p).data_ptr() for p in params}
    tensors = [_local(t) for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors if t.data_ptr() not in shards)


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(args.layers, args.width)
    x = torch.randn(4, args.width)
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
        rows[name] = (_host_bytes(opt, params), statistics.median(times[1:]))
    torch.save(rows, os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    numel = args.layers * (args.width * args.width + args.width)
    print(f"{numel / 1e6:.1f}M fp32 parameters, FSDP2 + CPUOffloadPolicy, gloo, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'ranks':>5}  {'optimizer':<22}{'host MB/rank':>13}{'step ms (max rank)':>20}")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_rank, args=(world, _port(), args, out), nprocs=world,
                               start_method="spawn")
            ranks = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]
        for name in ranks[0]:
            host = max(r[name][0] for r in ranks) / 1e6
            step = max(r[name][1] for r in ranks) * 1e3
            print(f"{world:>5}  {name:<22}{host:>13.1f}{step:>20.1f}")


if __name__ == "__main__":
    main()
