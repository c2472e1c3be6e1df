"""The optimizer's time on the training thread's critical path, async / sync, per training loop.

For each loop (what it does to gradients between backward and step()), the same model is
trained in sync mode (step() does the whole update) and in async mode (attach_hooks: the
update overlaps backward where the loop lets it). The critical path is what the optimizer
adds to the training thread: from backward's end to step()'s return (the loop's own code
included, in both modes), plus, in async mode, the optimizer's own time inside backward
(its gradient hooks, StepStats.hook_s). A second ratio also counts what forward and
backward took beyond sync mode's (the hooks, and the worker competing with backward for the
CPUs: a difference of medians): on a CPU-only host backward and the update share the cores,
so that ratio says what async mode costs there; on a GPU backward runs on the device. The two modes run interleaved (sync, async, sync, async, ...)
on a noisy machine, each reported as the median of its steady-state steps.

Before timing, each loop is run a few steps in both modes and must give the same
parameters and optimizer state bit for bit. The table also says, from StepStats, which
share of the updated elements ran during backward (off the critical path), why a step's
updates waited for step() (held_by), and how many updates were done twice (redone).

  python benchmarks/bench_loops.py                      # 6-layer MLP, width 1024, fp32
  python benchmarks/bench_loops.py --precision fp8 --rounds 12
  python benchmarks/bench_step.py --loops               # the same, from bench_step
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from adambridge import AdamBridge

LAYERS = 6
# The clipping limit: far under this model's gradient norm (~1e-4), so every clip fires.
CLIP = 1e-8


@dataclass
class Loop:
    """One training loop: ``between(params)`` runs between backward and step()."""

    name: str
    between: Callable[[list], None]
    options: dict  # extra AdamBridge arguments
    scaler: bool = False


def _nothing(params: list) -> None:
    pass


def _clip_fires(params: list) -> None:
    torch.nn.utils.clip_grad_norm_(params, CLIP)


def _titan_clip_fires(params: list) -> None:
    # torchtitan's: the total norm taken by the loop, then clip_grads_with_norm_
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, total, None)


def _halve(params: list) -> None:
    for p in params:
        p.grad.mul_(0.5)


def _clip_value_never_changes(params: list) -> None:
    torch.nn.utils.clip_grad_value_(params, 1e9)


LOOPS = [
    Loop("plain", _nothing, {}),
    Loop("clip_grad_norm_ firing", _clip_fires, {}),
    Loop("get_total_norm + clip_grads_with_norm_ firing", _titan_clip_fires, {}),
    Loop("AdamBridge(max_grad_norm=...) firing", _nothing, {"max_grad_norm": CLIP}),
    Loop("p.grad.mul_(0.5)", _halve, {}),
    Loop("clip_grad_value_(1e9), no value changed", _clip_value_never_changes, {}),
    Loop("GradScaler, no overflow", _nothing, {}, scaler=True),
]


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list = []
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class Run:
    """One loop in one mode: its own model, optimizer and (for GradScaler) scaler."""

    def __init__(self, loop: Loop, hooks: bool, width: int, batch: int, precision: str) -> None:
        self.loop, self.hooks = loop, hooks
        self.model = _model(width)
        self.params = list(self.model.parameters())
        self.opt = AdamBridge(self.params, lr=1e-4, weight_decay=0.01, precision=precision,
                              small_param_threshold=0, **loop.options)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if loop.scaler else None
        if hooks:
            self.opt.attach_hooks(self.model)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, width, generator=gen)

    def step(self) -> tuple[float, float, Optional[object]]:
        """One training step: (seconds of forward and backward, seconds from backward's end
        to step()'s return, its StepStats or None in sync mode)."""
        began = time.perf_counter()
        loss = self.model(self.x).square().mean()
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        backward_s = time.perf_counter() - began
        began = time.perf_counter()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        self.loop.between(self.params)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        spent = time.perf_counter() - began
        stats = self.opt.last_step_stats
        self.opt.zero_grad()
        return backward_s, spent, stats if self.hooks else None

    def close(self) -> None:
        if self.hooks:
            self.opt.detach_hooks()


def validate(loop: Loop, width: int, batch: int, precision: str, steps: int = 3) -> None:
    """Both modes, ``steps`` steps: parameters and state must be equal bit for bit."""
    runs = [Run(loop, hooks, width, batch, precision) for hooks in (False, True)]
    for _ in range(steps):
        for run in runs:
            run.step()
    for run in runs:
        run.close()
    sync, hooked = runs
    for i, (a, b) in enumerate(zip(sync.params, hooked.params)):
        if not torch.equal(a, b):
            raise SystemExit(f"{loop.name}: parameter {i} differs between sync and async mode")
        for key, value in sync.opt.state[a].items():
            if not torch.equal(value, hooked.opt.state[b][key]):
                raise SystemExit(f"{loop.name}: state[{key!r}] of parameter {i} differs")


def measure(loop: Loop, width: int, batch: int, precision: str, warmup: int,
            rounds: int) -> dict:
    """Interleaved sync and async steps of ``loop``: medians and the async step's counts."""
    runs = [Run(loop, hooks, width, batch, precision) for hooks in (False, True)]
    backward: list[list[float]] = [[], []]
    after: list[list[float]] = [[], []]
    counts = []
    for i in range(warmup + rounds):
        for k, run in enumerate(runs):
            backward_s, spent, stats = run.step()
            if i >= warmup:
                backward[k].append(backward_s)
                after[k].append(spent)
                if stats is not None:
                    counts.append(stats)
    for run in runs:
        run.close()
    sync_s = statistics.median(after[0])
    hooks = [getattr(s, "hook_s", None) for s in counts]  # (None before StepStats had it)
    hook_s = statistics.median(hooks) if hooks and None not in hooks else None
    # NOTE: what async mode adds to forward and backward is a difference of medians (the
    # hooks' own time and the worker's competition for the CPUs), never below zero.
    added_s = max(0.0, statistics.median(backward[1]) - statistics.median(backward[0]))
    async_s = statistics.median(after[1])
    backward_elems = sum(getattr(s, "elems_in_backward", 0) for s in counts)
    all_elems = backward_elems + sum(getattr(s, "elems_in_step", 0) for s in counts)
    held = sorted({s.held_by for s in counts if getattr(s, "held_by", None)})
    return {"loop": loop.name, "sync_ms": 1e3 * sync_s, "async_ms": 1e3 * async_s,
            "hook_ms": None if hook_s is None else 1e3 * hook_s, "added_ms": 1e3 * added_s,
            "ratio": None if hook_s is None else (async_s + hook_s) / sync_s,
            "ratio_cpus": (async_s + added_s) / sync_s,
            "off_path": backward_elems / all_elems if all_elems else 0.0,
            "redone": sum(getattr(s, "params_redone", 0) for s in counts) / len(counts),
            "params": len(runs[1].params), "held_by": held[0] if held else ""}


def table(rows: list, setup: str) -> str:
    lines = [setup, "",
             "| loop | sync ms | async ms | hooks ms | async / sync | added to fwd+bwd ms "
             "| async / sync with it | updated off the critical path | redone per step "
             "| held by |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['loop']} | {r['sync_ms']:.2f} | {r['async_ms']:.2f} | "
                     f"{fmt(r['hook_ms'])} | {fmt(r['ratio'])} | {r['added_ms']:.2f} | "
                     f"{r['ratio_cpus']:.2f} | {100 * r['off_path']:.0f}% | "
                     f"{r['redone']:.1f} of {r['params']} | {r['held_by'][:70]} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp8"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--loops", default="",
                        help="comma-separated substrings: only the loops whose name has one")
    args = parser.parse_args(argv)
    wanted = [s for s in args.loops.split(",") if s]
    loops = [loop for loop in LOOPS if not wanted or any(s in loop.name for s in wanted)]
    rows = []
    for loop in loops:
        validate(loop, args.width, args.batch, args.precision)
        rows.append(measure(loop, args.width, args.batch, args.precision, args.warmup,
                            args.rounds))
        print(f"{loop.name}: async / sync {rows[-1]['ratio_cpus']:.2f} with the CPUs shared",
              file=sys.stderr, flush=True)
    setup = (f"{LAYERS}-layer MLP, width {args.width}, batch {args.batch}, {args.precision} "
             f"moments, CPU ({torch.get_num_threads()} threads), every parameter hooked; "
             f"median of {args.rounds} interleaved steps after {args.warmup}")
    print(table(rows, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
