"""Memory soak: RSS and tracked objects over many steps with the cyclic GC off, AdamBridge vs torch.

Each variant runs in its own process (RSS is per process), on a ~3 MiB model, with
``gc.disable()``: whatever a step leaves in a reference cycle stays, so growth here is a
leak that only the cyclic collector would have hidden.

  python benchmarks/soak_memory.py --steps 5000 --every 1000
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

VARIANTS = ("torch AdamW", "adambridge sync", "adambridge async", "adambridge async clip")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def soak(variant: str, steps: int, every: int) -> list:
    import torch
    from torch import nn
    from adambridge import AdamBridge
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 512))
    if variant == "torch AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = AdamBridge(model.parameters(), lr=1e-4,
                         max_grad_norm=1.0 if variant.endswith("clip") else None)
        if "async" in variant:
            opt.attach_hooks(model)
    x = torch.randn(8, 256)
    curve = []
    for step in range(steps + 1):
        if step == 300:  # past warm-up (allocator pools, the per-step scalar cache)
            gc.collect()
            gc.disable()
        if step >= 300 and (step - 300) % every == 0:
            curve.append((step - 300, round(_rss_mib(), 1), len(gc.get_objects())))
        if step == steps:
            break
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return curve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(soak(args.variant, args.steps + 300, args.every)))
        return 0
    print("| variant | " + " | ".join(f"RSS MiB @{s}" for s in range(0, args.steps + 1, args.every))
          + " | objects growth |")
    print("|---|" + "---:|" * (args.steps // args.every + 2))
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--every",
                              str(args.every), "--variant", variant],
                             capture_output=True, text=True, check=True).stdout
        curve = json.loads(out)
        rss = " | ".join(f"{m:.1f}" for _, m, _ in curve)
        print(f"| {variant} | {rss} | {curve[-1][2] - curve[0][2]:+d} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
