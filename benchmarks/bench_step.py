"""Training-step time and memory: all-device AdamW vs AdamBridge step() vs attach_hooks.

A small GPT-style transformer. Every variant holds its own copy of the model; the timed
steps are interleaved (variant A, B, C, ..., A, B, C, ...) so a noisy machine slows all of
them alike, and each is reported as the median of its steps. Before any timing, the async
path is checked against step() bit for bit on the same model.

  python benchmarks/bench_step.py --preset cpu            # 4 blocks, width 256
  python benchmarks/bench_step.py --preset gpu --json out.json   # 8 blocks, width 1024

GPU memory is the peak allocated during 3 steps with only that variant resident (measured
before the interleaved timing). On the CPU the table reports optimizer-state bytes instead.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import adambridge
from adambridge import AdamBridge

PRESETS = {
    #        blocks width heads vocab batch seq  warmup timed
    "cpu": dict(blocks=4, width=256, heads=4, vocab=512, batch=4, seq=64, warmup=3, timed=8),
    "gpu": dict(blocks=8, width=1024, heads=16, vocab=4096, batch=4, seq=1024, warmup=3,
                timed=10),
}
PRECISIONS = ("fp32", "bf16", "fp8")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """8 blocks of width 1024 with a 2x MLP: 67M parameters in the blocks (GPU preset)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["width"])
        self.blocks = nn.ModuleList(Block(cfg["width"], cfg["heads"]) for _ in range(cfg["blocks"]))
        self.ln = nn.LayerNorm(cfg["width"])
        self.head = nn.Linear(cfg["width"], cfg["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass
class Variant:
    name: str
    model: nn.Module
    step: Callable[[torch.Tensor], None]
    opt: object


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build(name: str, cfg: dict, device: torch.device, init: dict) -> Variant:
    """``name``: 'torch AdamW' or 'adambridge {sync,async} {precision}[ clip=MAX_NORM]'."""
    model = GPT(cfg)
    model.load_state_dict(init)
    on_gpu = device.type == "cuda"
    if name == "torch AdamW":
        model.to(device)  # fp32 weights (bf16 autocast on the GPU): the all-device baseline
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu or None)

        def step(tokens: torch.Tensor) -> None:
            with torch.autocast(device.type, torch.bfloat16, enabled=on_gpu):
                loss = _loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Variant(name, model, step, opt)
    _, mode, precision, *clip = name.split()
    max_grad_norm = float(clip[0].split("=")[1]) if clip else None
    model.to(device, torch.bfloat16 if on_gpu else torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-4, precision=precision,
                     max_grad_norm=max_grad_norm)
    if mode == "async":
        opt.attach_hooks(model)

        def step(tokens: torch.Tensor) -> None:
            _loss(model, tokens).backward()
            opt.step_sync()
    else:
        def step(tokens: torch.Tensor) -> None:
            _loss(model, tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return Variant(name, model, step, opt)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def validate(cfg: dict, device: torch.device, init: dict) -> None:
    """Async == sync bit for bit on this model (a loss linear in the weights, so the
    gradients are exact and identical in both: only the optimizer paths are compared)."""
    results = []
    for mode in ("sync", "async"):
        variant = build(f"adambridge {mode} bf16", cfg, device, init)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(p.shape, generator=gen).to(device, p.dtype)
                   for p in variant.model.parameters()]
        for _ in range(2):
            sum((p * w).sum() for p, w in zip(variant.model.parameters(), weights)).backward()
            if mode == "async":
                variant.opt.step_sync()
            else:
                variant.opt.step()
                variant.opt.zero_grad()
        _sync(device)
        results.append([p.detach().cpu() for p in variant.model.parameters()])
        if mode == "async":
            variant.opt.detach_hooks()
    if not all(torch.equal(a, b) for a, b in zip(*results)):
        sys.exit("validation failed: attach_hooks and step() disagree; not timing anything")


def peak_memory(name: str, cfg: dict, device: torch.device, init: dict,
                tokens: torch.Tensor) -> Optional[float]:
    """GiB allocated at the peak of 3 steps, this variant alone on the device."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    variant = build(name, cfg, device, init)
    for _ in range(3):
        variant.step(tokens)
    _sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if isinstance(variant.opt, AdamBridge) and variant.opt._pipeline is not None:
        variant.opt.detach_hooks()
    del variant
    return peak


def state_mib(variant: Variant) -> float:
    opt = variant.opt
    if isinstance(opt, AdamBridge):
        return opt.host_state_bytes() / 2**20
    return sum(t.numel() * t.element_size() for s in opt.state.values()
               for t in s.values() if torch.is_tensor(t)) / 2**20


def run(preset: str, names: list, max_seconds: float) -> dict:
    cfg = PRESETS[preset]
    device = torch.device("cuda" if preset == "gpu" else "cpu")
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=device)
    validate(cfg, device, init)
    peaks = {name: peak_memory(name, cfg, device, init, tokens) for name in names}
    variants = [build(name, cfg, device, init) for name in names]
    times: dict = {v.name: [] for v in variants}
    host: dict = {v.name: [] for v in variants}   # (host update, step_sync wait) per step
    began = time.perf_counter()
    for round_index in range(cfg["warmup"] + cfg["timed"]):
        for variant in variants:
            _sync(device)
            start = time.perf_counter()
            variant.step(tokens)
            _sync(device)
            if round_index >= cfg["warmup"]:
                times[variant.name].append(time.perf_counter() - start)
                stats = getattr(variant.opt, "last_step_stats", None)
                if stats is not None:
                    host[variant.name].append((stats.host_update_s, stats.sync_wait_s))
        if time.perf_counter() - began > max_seconds and round_index > cfg["warmup"]:
            break  # the time budget is spent; report what was measured
    rows = []
    for variant in variants:
        measured = host[variant.name]
        median = (lambda i: statistics.median(m[i] for m in measured) * 1e3) if measured else None
        rows.append(dict(variant=variant.name, median_ms=statistics.median(times[variant.name]) * 1e3,
                         steps=len(times[variant.name]), peak_gib=peaks[variant.name],
                         state_mib=state_mib(variant),
                         host_update_ms=median(0) if median else None,
                         sync_wait_ms=median(1) if median else None))
    params = sum(p.numel() for p in variants[0].model.parameters())
    backend = next((v.opt.backend for v in variants if isinstance(v.opt, AdamBridge)), "-")
    return dict(preset=preset, params=params, tokens_per_step=cfg["batch"] * cfg["seq"],
                backend=backend, rows=rows, setup=setup_line(device))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def setup_line(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return (f"{where + ', ' if where else ''}{_cpu_name()}, torch {torch.__version__}, adambridge "
            f"{adambridge.__version__}, Python {platform.python_version()}, "
            f"{torch.get_num_threads()} torch threads")


def table(result: dict) -> str:
    rows = {r["variant"]: r for r in result["rows"]}
    base = rows.get("torch AdamW")
    lines = [f"Setup: {result['setup']}; backend {result['backend']}; {result['params'] / 1e6:.1f}M "
             f"params, {result['tokens_per_step']} tokens/step, median of "
             f"{min(r['steps'] for r in result['rows'])}+ interleaved steps.", "",
             "| variant | step ms | vs torch AdamW | async vs sync | host update ms | "
             "step_sync wait ms | GPU peak GiB | optimizer state MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        vs_base = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else "-"
        sync = rows.get(name.replace("async", "sync")) if "async" in name else None
        unclipped = rows.get(name.split(" clip=")[0]) if " clip=" in name else None
        if unclipped:
            name = f"{name} ({r['median_ms'] / unclipped['median_ms']:.2f}x unclipped)"
        vs_sync = f"{r['median_ms'] / sync['median_ms']:.2f}x" if sync else "-"
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {name} | {r['median_ms']:.1f} | {vs_base} | {vs_sync} | "
                     f"{fmt(r['host_update_ms'], '.1f')} | {fmt(r['sync_wait_ms'], '.1f')} | "
                     f"{fmt(r['peak_gib'], '.2f')} | {r['state_mib']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="stop the timed rounds once this much time is spent")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--clip-costs", action="store_true",
                        help="time max_grad_norm off, on but never firing (1e9) and firing "
                             "every step (1e-3), sync and async, first of --precisions")
    args = parser.parse_args(argv)
    if args.preset == "gpu" and not torch.cuda.is_available():
        parser.error("the gpu preset needs a CUDA device")
    names = ["torch AdamW"]
    for precision in args.precisions.split(","):
        names += [f"adambridge sync {precision}", f"adambridge async {precision}"]
        if args.clip_costs:
            names += [f"adambridge {mode} {precision} clip={limit}"
                      for limit in ("1e9", "1e-3") for mode in ("sync", "async")]
            break
    result = run(args.preset, names, args.max_seconds)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
