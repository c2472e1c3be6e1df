"""Training-step time and memory: all-device AdamW vs AdamBridge step() vs attach_hooks.

A small GPT-style transformer. Every variant holds its own copy of the model; the timed
steps are interleaved (variant A, B, C, ..., A, B, C, ...) so a noisy machine slows all of
them alike, and each is reported as the median of its steps. Before any timing, the async
path is checked against step() bit for bit on the same model.

  python benchmarks/bench_step.py --preset cpu            # 4 blocks, width 256
  python benchmarks/bench_step.py --preset gpu --json out.json   # 8 blocks, width 1024
  python benchmarks/bench_step.py --preset gpu --precisions bf16 --sweep   # + crossover
  python benchmarks/bench_step.py --preset cpu --precisions bf16 --hyper-costs  # lr writes
  python benchmarks/bench_step.py --preset cpu --precisions bf16 --grad-costs   # p.grad use
  python benchmarks/bench_step.py --precisions fp32 --loops   # per loop: async / sync

"sync" is step() on the device's parameters: one pinned staging buffer each way and one
stream sync per step (sync/transfer.py). The sweep grows tokens per step (batch x 1024) and
reports where async comes within 1.05x of all-GPU AdamW, with its GPU peak as a fraction of
AdamW's; host MiB include the page-locked staging (opt.host_memory_bytes()).

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
from adambridge.lab import trust

PRESETS = {
    #        blocks width heads vocab batch seq  warmup timed
    "cpu": dict(blocks=4, width=256, heads=4, vocab=512, batch=4, seq=64, warmup=3, timed=8),
    "gpu": dict(blocks=8, width=1024, heads=16, vocab=4096, batch=4, seq=1024, warmup=3,
                timed=10),
}
PRECISIONS = ("fp32", "bf16", "fp8")
CROSSOVER = 1.05  # "hides behind backward": step time within this factor of all-GPU AdamW
SWEEP_BATCHES = {"cpu": [1, 2, 4], "gpu": [1, 2, 4, 8, 16, 32, 64]}  # x seq tokens per step


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
    _, mode, precision, *extra = name.split()
    options = dict(option.split("=") for option in extra)
    max_grad_norm = float(options["clip"]) if "clip" in options else None
    model.to(device, torch.bfloat16 if on_gpu else torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-4, precision=precision,
                     max_grad_norm=max_grad_norm)
    write_lr = _lr_writer(opt, options.get("lr"))
    touch = TOUCHES[options.get("touch", "none")]
    if mode == "async":
        opt.attach_hooks(model)

        def step(tokens: torch.Tensor) -> None:
            write_lr("before")
            _loss(model, tokens).backward()
            write_lr("after")
            touch(model)
            opt.step_sync()
    else:
        def step(tokens: torch.Tensor) -> None:
            write_lr("before")
            _loss(model, tokens).backward()
            write_lr("after")
            touch(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return Variant(name, model, step, opt)


def _read_grads(model: nn.Module) -> None:
    """What a loop that logs its gradients does: every gradient's norm, read back."""
    norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
    float(torch.stack(norms).norm())


def _edit_grads(model: nn.Module) -> None:
    """What a loop that edits its gradients does: every gradient changed in place."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


# touch=...: what the loop does to the gradients between backward and step()
TOUCHES: dict = {"none": lambda model: None, "read": _read_grads, "edit": _edit_grads}


def _lr_writer(opt: AdamBridge, when: Optional[str]) -> Callable[[str], None]:
    """write(at) sets a new lr in every group where ``when`` says: 'before' the backward of
    each step (a scheduler stepped after step()), 'after' it (llm.c's loop), 'once' after the
    first backward only (from then on async mode keeps what redoes an update: the watch)."""
    steps = [0]

    def write(at: str) -> None:
        if when == at or (when == "once" and at == "after" and steps[0] == 0):
            for group in opt.param_groups:
                group["lr"] = 1e-4 * (1.0 + 0.01 * (steps[0] % 7 + 1))
        if at == "after":
            steps[0] += 1
    return write


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


def state_mib(variant: Variant) -> tuple[float, float]:
    """(optimizer-held MiB, of which page-locked): AdamBridge counts its pinned staging."""
    opt = variant.opt
    if isinstance(opt, AdamBridge):
        memory = opt.host_memory_bytes()
        return memory["total"] / 2**20, memory["pinned_staging"] / 2**20
    return sum(t.numel() * t.element_size() for s in opt.state.values()
               for t in s.values() if torch.is_tensor(t)) / 2**20, 0.0


def time_variants(variants: list, cfg: dict, device: torch.device, tokens: torch.Tensor,
                  max_seconds: float, monitor: Optional[trust.LoadMonitor] = None) -> tuple[dict, dict]:
    """Interleaved steps: {name: [seconds]}, {name: [(host update, step_sync wait)]}."""
    times: dict = {v.name: [] for v in variants}
    host: dict = {v.name: [] for v in variants}
    began = time.perf_counter()
    for round_index in range(cfg["warmup"] + cfg["timed"]):
        for variant in variants:
            _sync(device)
            if monitor is not None and round_index >= cfg["warmup"]:
                monitor.sample()
            start = time.perf_counter()
            variant.step(tokens)
            _sync(device)
            if round_index >= cfg["warmup"]:
                times[variant.name].append(time.perf_counter() - start)
                stats = getattr(variant.opt, "last_step_stats", None)
                if stats is not None:
                    host[variant.name].append((stats.host_update_s, stats.sync_wait_s,
                                               stats.d2h_s, stats.h2d_s, stats.wall_s,
                                               stats.elems_in_backward, stats.elems_in_step))
        if time.perf_counter() - began > max_seconds and round_index > cfg["warmup"]:
            break  # the time budget is spent; report what was measured
    return times, host


def _row(variant: Variant, times: list, measured: list, peak: Optional[float]) -> dict:
    median = (lambda i: statistics.median(m[i] for m in measured) * 1e3) if measured else None
    host_mib, pinned_mib = state_mib(variant)
    row = dict(variant=variant.name, median_ms=statistics.median(times) * 1e3,
               steps=len(times), peak_gib=peak, state_mib=host_mib, pinned_mib=pinned_mib)
    for i, key in enumerate(("host_update_ms", "sync_wait_ms", "d2h_ms", "h2d_ms", "wall_ms")):
        row[key] = median(i) if median else None
    # The share of the updated elements that ran during backward (async rows: StepStats).
    overlapped, waited = (sum(m[i] for m in measured) for i in (5, 6))
    row["off_path"] = overlapped / (overlapped + waited) if overlapped + waited else None
    return row


def _detach(variants: list) -> None:
    for variant in variants:
        if isinstance(variant.opt, AdamBridge) and variant.opt._pipeline is not None:
            variant.opt.detach_hooks()


def run(preset: str, names: list, max_seconds: float, batch: Optional[int] = None,
        timed: Optional[int] = None) -> dict:
    cfg = dict(PRESETS[preset], **({"batch": batch} if batch else {}),
               **({"timed": timed} if timed else {}))
    device = torch.device("cuda" if preset == "gpu" else "cpu")
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=device)
    validate(cfg, device, init)
    peaks = {name: peak_memory(name, cfg, device, init, tokens) for name in names}
    variants = [build(name, cfg, device, init) for name in names]
    monitor = trust.LoadMonitor(torch.get_num_threads())
    times, host = time_variants(variants, cfg, device, tokens, max_seconds, monitor)
    verdict = trust.judge(times, monitor)
    rows = [_row(v, times[v.name], host[v.name], peaks[v.name]) for v in variants]
    params = sum(p.numel() for p in variants[0].model.parameters())
    backend = next((v.opt.backend for v in variants if isinstance(v.opt, AdamBridge)), "-")
    _detach(variants)
    return dict(preset=preset, params=params, tokens_per_step=cfg["batch"] * cfg["seq"],
                backend=backend, rows=rows, setup=setup_line(device), trust=verdict.figures,
                trust_line=verdict.line)


def sweep(preset: str, precision: str, batches: list, max_seconds: float) -> dict:
    """Does the host update hide behind backward? Step time of async vs all-GPU AdamW as
    tokens per step grow; the crossover is the size from which it stays within CROSSOVER."""
    names = ["torch AdamW", f"adambridge async {precision}"]
    points = []
    for batch in batches:
        result = run(preset, names, max_seconds / len(batches), batch=batch)
        base, ours = result["rows"]
        points.append(dict(tokens=result["tokens_per_step"], adamw_ms=base["median_ms"],
                           async_ms=ours["median_ms"], ratio=ours["median_ms"] / base["median_ms"],
                           peak_ratio=(ours["peak_gib"] / base["peak_gib"]
                                       if base["peak_gib"] else None),
                           host_mib=ours["state_mib"], pinned_mib=ours["pinned_mib"],
                           trust_line=result["trust_line"], trusted=result["trust"]["trusted"]))
        gc.collect()
    crossover = None  # the smallest size from which every larger one is within CROSSOVER
    for point in reversed(points):
        if point["ratio"] > CROSSOVER:
            break
        crossover = point["tokens"]
    return dict(precision=precision, points=points, crossover_tokens=crossover,
                threshold=CROSSOVER)


def sweep_table(result: dict) -> str:
    lines = [f"Tokens-per-step sweep ({result['precision']} moments): async step time against "
             f"all-GPU torch AdamW (fused), GPU peak of async as a fraction of AdamW's.", "",
             "| tokens/step | AdamW ms | async ms | async/AdamW | GPU peak ratio | "
             "host MiB (pinned) |", "|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        peak = "-" if p["peak_ratio"] is None else f"{p['peak_ratio']:.2f}"
        lines.append(f"| {p['tokens']} | {p['adamw_ms']:.1f} | {p['async_ms']:.1f} | "
                     f"{p['ratio']:.3f}x | {peak} | {p['host_mib']:.0f} ({p['pinned_mib']:.0f}) |")
    where = (f"at {result['crossover_tokens']} tokens/step" if result["crossover_tokens"]
             else "not reached in this sweep")
    lines += ["", f"Crossover (async within {result['threshold']:.2f}x of AdamW): {where}."]
    lines += [f"{p['tokens']} tokens/step: {p['trust_line']}" for p in result["points"]
              if not p.get("trusted", True)]
    return "\n".join(lines)


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
             f"{min(r['steps'] for r in result['rows'])}+ interleaved steps.",
             *([result["trust_line"]] if "trust_line" in result else []), "",
             "| variant | step ms | vs torch AdamW | async vs sync | host update ms | "
             "step_sync wait ms | d2h / h2d ms | update off the critical path | GPU peak GiB "
             "| host MiB (pinned) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for name, r in rows.items():
        vs_base = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else "-"
        sync = rows.get(name.replace("async", "sync")) if "async" in name else None
        plain = rows.get(" ".join(name.split()[:3])) if len(name.split()) > 3 else None
        if plain:
            without = ("unclipped" if " clip=" in name else "untouched" if " touch=" in name
                       else "no lr write")
            name = f"{name} ({r['median_ms'] / plain['median_ms']:.2f}x {without})"
        vs_sync = f"{r['median_ms'] / sync['median_ms']:.2f}x" if sync else "-"
        lines.append(f"| {name} | {r['median_ms']:.1f} | {vs_base} | {vs_sync} | "
                     f"{fmt(r['host_update_ms'], '.1f')} | {fmt(r['sync_wait_ms'], '.1f')} | "
                     f"{fmt(r.get('d2h_ms'), '.1f')} / {fmt(r.get('h2d_ms'), '.1f')} | "
                     f"{fmt(r.get('off_path') and 100 * r['off_path'], '.0f')}"
                     f"{'%' if r.get('off_path') is not None else ''} | "
                     f"{fmt(r['peak_gib'], '.2f')} | {r['state_mib']:.1f} "
                     f"({fmt(r.get('pinned_mib'), '.1f')}) |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="stop the timed rounds once this much time is spent")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--timed", type=int, default=None,
                        help="timed rounds (default: the preset's); more make the medians "
                             "steadier on a loaded machine")
    parser.add_argument("--sweep", action="store_true",
                        help="then sweep tokens per step (async vs torch AdamW, first of "
                             "--precisions) and print the crossover within 1.05x")
    parser.add_argument("--sweep-seconds", type=float, default=120.0,
                        help="time budget of the timed rounds of the whole sweep")
    parser.add_argument("--clip-costs", action="store_true",
                        help="time max_grad_norm off, on but never firing (1e9) and firing "
                             "every step (1e-3), sync and async, first of --precisions")
    parser.add_argument("--grad-costs", action="store_true",
                        help="time a loop that reads every gradient (logs its norm) and one "
                             "that edits every gradient in place, sync and async, against "
                             "the same loop touching none, first of --precisions")
    parser.add_argument("--hyper-costs", action="store_true",
                        help="time async mode with lr written before each backward, after the "
                             "first one only (the watch), and after each (llm.c's loop), "
                             "first of --precisions")
    parser.add_argument("--loops", action="store_true",
                        help="instead: the optimizer's critical-path time async / sync per "
                             "training loop (clipping, GradScaler, gradient edits), with the "
                             "share of the update that ran off it (bench_loops.py), first of "
                             "--precisions")
    args = parser.parse_args(argv)
    if args.loops:
        import bench_loops  # (beside this file: the script's own folder is on sys.path)
        return bench_loops.main(["--precision", args.precisions.split(",")[0]])
    if args.preset == "gpu" and not torch.cuda.is_available():
        parser.error("the gpu preset needs a CUDA device")
    names = ["torch AdamW"]
    for precision in args.precisions.split(","):
        names += [f"adambridge sync {precision}", f"adambridge async {precision}"]
        if args.clip_costs:
            names += [f"adambridge {mode} {precision} clip={limit}"
                      for limit in ("1e9", "1e-3") for mode in ("sync", "async")]
        if args.hyper_costs:
            names += [f"adambridge async {precision} lr={when}"
                      for when in ("before", "once", "after")]
            names.append(f"adambridge sync {precision} lr=after")
        if args.grad_costs:
            names += [f"adambridge {mode} {precision} touch={touch}"
                      for touch in ("read", "edit") for mode in ("sync", "async")]
        if args.clip_costs or args.hyper_costs or args.grad_costs:
            break
    result = run(args.preset, names, args.max_seconds, timed=args.timed)
    print(table(result), flush=True)
    _write(args.json, result)  # written as it goes: a later part that hangs loses nothing
    if args.sweep:
        precision = args.precisions.split(",")[0]
        result["sweep"] = sweep(args.preset, precision, SWEEP_BATCHES[args.preset],
                                args.sweep_seconds)
        print("\n" + sweep_table(result["sweep"]), flush=True)
        _write(args.json, result)
    return 0


def _write(path: Optional[str], result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
