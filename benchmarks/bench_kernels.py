"""Host AdamW kernels: validate against the torch backend, then time every variant in one run.

    python benchmarks/bench_kernels.py --numel 64M --threads 2
    python benchmarks/bench_kernels.py --numel 10M --tensors 10000 --threads 2

The model is bf16 (bf16 gradients in, bf16 weights out), as in mixed-precision fine-tuning.
Variants are interleaved (A B C ... A B C ...) and the median is reported, because memory
bandwidth on a shared VM drifts by up to 2x within seconds. GB/s counts the minimum bytes a
variant must move. Each precision has its own floor: a plain native pass over buffers of the
same layout moving that precision's bytes (AVX-512 where the CPU has it), in the same process
(its own buffers: the pass scrambles them).
With --tensors N the same total is split into N fp32 parameters (see bench_tensors.py).
"""
from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from adambridge.update import codecs, state as host_state
from adambridge._native import loader
from adambridge.update.functional import Hyper, UpdateItem, adamw_update
from adambridge.lab import trust
from adambridge.lab.demo_peers import held_bytes, held_tensors
from adambridge.lab.trust import medians, time_samples

# Bytes per parameter each variant must move (read + write).
#   native:  p 4+4, g 2, m/v (4+4)*2 | (2+2)*2 | (1+1)*2 + scales, out 2
BYTES = {"fp32": 4 + 4 + 2 + 16 + 2, "bf16": 4 + 4 + 2 + 8 + 2, "fp8": 4 + 4 + 2 + 4 + 2}
# grad cast (read 2, write 4), fused AdamW (p, g, m, v read; p, m, v write), master -> bf16 (4+2)
ALTERNATIVE_BYTES = 6 + 28 + 6


def parse_numel(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


@dataclass
class Buffers:
    master: torch.Tensor
    grad: torch.Tensor
    out: torch.Tensor
    moments: dict


def make_buffers(numel: int, precisions) -> Buffers:
    gen = torch.Generator().manual_seed(0)
    master = host_state.host_empty(numel, torch.float32)
    master.copy_(torch.randn(numel, generator=gen))
    grad = host_state.host_empty(numel, torch.bfloat16)
    grad.copy_(torch.randn(numel, generator=gen) * 1e-2)
    out = host_state.host_empty(numel, torch.bfloat16)
    moments = {}
    for precision in precisions:
        state = host_state.new_state(master, precision, alias=True)
        moments[precision] = state
    return Buffers(master, grad, out, moments)


def items_for(buffers: Buffers, precision: str, step: int) -> list:
    state = buffers.moments[precision]
    hyper = Hyper.for_step(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step)
    return [UpdateItem(master=buffers.master, grad=buffers.grad, exp_avg=state["exp_avg"],
                       exp_avg_sq=state["exp_avg_sq"], exp_avg_scale=state.get("exp_avg_scale"),
                       exp_avg_sq_scale=state.get("exp_avg_sq_scale"), out=buffers.out, offset=0,
                       key=codecs.stream_key(0, step, 0), precision=precision,
                       stochastic_rounding=True, hyper=hyper)]


def validate(precisions) -> None:
    """Native equals the torch backend bit for bit on a small problem, or we stop."""
    for precision in precisions:
        results = []
        for backend in ("native", "torch"):
            buffers = make_buffers(40_000 + 17, [precision])
            for step in (1, 2, 3):
                adamw_update(items_for(buffers, precision, step), backend)
            state = buffers.moments[precision]
            results.append([buffers.master, buffers.out, state["exp_avg"], state["exp_avg_sq"]])
        for ours, ref in zip(*results):
            if not torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)):
                sys.exit(f"validation failed: native != torch backend for {precision} moments")
    print(f"validated: native == torch backend bit for bit ({', '.join(precisions)} moments)")


class FusedTorchAlternative:
    """What a bf16 model needs without adambridge, all on the CPU: cast the gradient to fp32,
    torch.optim.AdamW(fused=True) on the fp32 master, cast the master into the bf16 weight."""

    def __init__(self, buffers: Buffers):
        self.buffers = buffers
        self.master = torch.nn.Parameter(buffers.master.clone())
        self.master.grad = torch.empty_like(self.master)
        self.opt = torch.optim.AdamW([self.master], lr=1e-4, fused=True)

    def __call__(self) -> None:
        self.master.grad.copy_(self.buffers.grad)
        self.opt.step()
        self.buffers.out.copy_(self.master.detach())


class DeepSpeedAlternative:
    """DeepSpeed's CPU Adam on the same update, with its states in the master's dtype (as its
    ZeRO-Offload keeps them): fp32 states on an fp32 master with an fp32 gradient, or bf16 states
    on a bf16 master with a bf16 gradient. It writes no low-precision copy: its master is it."""

    def __init__(self, buffers: Buffers, states: torch.dtype):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        self.master = torch.nn.Parameter(buffers.master.to(states, copy=True))
        self.master.grad = buffers.grad.to(states, copy=True)
        self.opt = DeepSpeedCPUAdam([self.master], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.01, adamw_mode=True,
                                    fp32_optimizer_states=states == torch.float32)

    def __call__(self) -> None:
        self.opt.step()

    def held_bytes(self) -> int:
        return held_bytes(held_tensors(self.opt) + [self.master])


DEEPSPEED = {torch.float32: ("DeepSpeed CPU Adam (fp32 update)", 4 + 4 + 4 + 16),  # p r/w, g, m v r/w
             torch.bfloat16: ("DeepSpeed CPU Adam (bf16 states)", 2 + 2 + 2 + 8)}


def deepspeed_variants(buffers: Buffers) -> dict:
    """DeepSpeed's fp32 and bf16-state updates, by row name; none where it cannot run."""
    try:
        return {DEEPSPEED[dtype][0]: DeepSpeedAlternative(buffers, dtype) for dtype in DEEPSPEED}
    except Exception as exc:  # not installed, or its JIT build failed: report, don't fail
        print(f"DeepSpeed CPU Adam: not measured ({type(exc).__name__}: {str(exc)[:120]})")
        return {}


def _tensors(state: dict) -> list:
    return [t for t in state.values() if torch.is_tensor(t)]


def native_variant(buffers: Buffers, precision: str) -> Callable[[], None]:
    step = [0]

    def run() -> None:
        step[0] += 1
        loader.update(items_for(buffers, precision, step[0]))
    return run


def floor_variant(scratch: Buffers, precision: str) -> Callable[[], None]:
    """The floor pass scrambles what it streams over (ab_memory_pass), so it gets buffers of its
    own: run on the kernel's, it would leave NaN and inf codes in the fp8 moments and random bf16
    moments for the next timed update."""
    items = items_for(scratch, precision, 1)
    return lambda: loader.memory_pass(items)


def report(numel: int, threads: int, medians: dict, bytes_per: dict, verdict: trust.Trust) -> None:
    print(f"\nsetup: {platform.machine()} {loader.isa_name()}, {threads} threads, "
          f"{numel / 2**20:.0f}M params, bf16 grads and weights, torch {torch.__version__}")
    print(verdict.line)
    print(f"{'variant':36s} {'ms':>9s} {'GB/s':>7s} {'vs all-CPU':>11s} {'of own floor':>13s}")
    alternative = medians[ALTERNATIVE]
    for name, seconds in medians.items():
        gbs = bytes_per[name] * numel / seconds / 1e9
        own = ""
        if name.startswith("native "):
            precision = name.split()[1]
            own = f"{medians[f'floor {precision} (same bytes)'] / seconds:12.2f}x"
        row = f"{name:36s} {seconds * 1e3:9.2f} {gbs:7.1f} {alternative / seconds:10.2f}x {own}"
        print(row.rstrip())
    print("\n'of own floor': the floor's time / the kernel's time (1.00 = at the memory floor)")


# Which of our rows each DeepSpeed row is set beside: the same master, or the same bytes held.
PAIRS = [(DEEPSPEED[torch.float32][0], "native fp32 moments"),
         (DEEPSPEED[torch.bfloat16][0], "native bf16 moments"),
         (DEEPSPEED[torch.bfloat16][0], "native fp8 moments")]


def beside_deepspeed(medians: dict, bytes_per: dict, verdict: trust.Trust, held: dict,
                     numel: int) -> None:
    """DeepSpeed's time over ours, with the bytes each moves and holds per parameter counted
    the same way; a pair with a row whose repeats spread past the trust limit gets no ratio."""
    pairs = [(ds, ours) for ds, ours in PAIRS if ds in medians and ours in medians]
    if not pairs:
        return
    spread, limit = verdict.figures["spread"], verdict.figures["spread_limit"]
    print("\nbeside DeepSpeed (its time / ours; B/param moved, and held: master + moments):")
    for ds, ours in pairs:
        wide = [n for n in (ds, ours) if spread.get(n, 0) > limit]
        ratio = (f"{medians[ds] / medians[ours]:.2f}x" if not wide else
                 f"no ratio ({', '.join(f'{n} spread {spread[n]:.0%}' for n in wide)})")
        kept = " ".join(f"{held[n] / numel:.2f}" if n in held else "?" for n in (ds, ours))
        print(f"  {ds} / {ours}: {ratio}; moved {bytes_per[ds]} vs {bytes_per[ours]}; "
              f"held {kept.replace(' ', ' vs ')}")


ALTERNATIVE = "all-CPU torch AdamW(fused) + casts"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="64M", help="parameters, e.g. 8M or 64M")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-torch-backend", action="store_true",
                        help="skip the (slow) pure-torch backend row")
    parser.add_argument("--tensors", type=int, default=1,
                        help="split --numel into this many fp32 parameters (per-tensor cost)")
    args = parser.parse_args(argv)
    numel = parse_numel(args.numel)
    threads = args.threads or torch.get_num_threads()
    loader.set_num_threads(threads)  # before either bench: both print this count
    torch.set_num_threads(threads)
    if args.tensors > 1:
        import bench_tensors
        bench_tensors.main(numel, args.tensors, threads, args.repeats)
        return
    precisions = ("fp32", "bf16", "fp8")
    validate(precisions)
    buffers = make_buffers(numel, precisions)
    scratch = make_buffers(numel, precisions)          # the same layout, for the floor to scramble
    variants, bytes_per = {}, {}
    for precision in precisions:
        variants[f"floor {precision} (same bytes)"] = floor_variant(scratch, precision)
        variants[f"native {precision} moments"] = native_variant(buffers, precision)
        bytes_per[f"floor {precision} (same bytes)"] = BYTES[precision]
        bytes_per[f"native {precision} moments"] = BYTES[precision]
    variants[ALTERNATIVE] = FusedTorchAlternative(buffers)
    bytes_per[ALTERNATIVE] = ALTERNATIVE_BYTES
    deepspeed = deepspeed_variants(buffers)
    variants.update(deepspeed)
    bytes_per.update({name: moved for name, moved in DEEPSPEED.values() if name in deepspeed})
    monitor = trust.LoadMonitor(threads)
    samples = time_samples(variants, args.repeats, monitor)
    if not args.no_torch_backend:
        torch_items = items_for(buffers, "fp32", 1)
        samples["torch backend fp32 moments"] = time_samples(
            {"t": lambda: adamw_update(torch_items, "torch")}, 2, monitor)["t"]
        bytes_per["torch backend fp32 moments"] = BYTES["fp32"]
    verdict = trust.judge(samples, monitor)
    # NOTE: after the timed runs: DeepSpeed creates its moments at its first step.
    held = {f"native {p} moments": held_bytes(_tensors(buffers.moments[p])) for p in precisions}
    held.update({name: ds.held_bytes() for name, ds in deepspeed.items()})
    report(numel, threads, medians(samples), bytes_per, verdict)
    beside_deepspeed(medians(samples), bytes_per, verdict, held, numel)


if __name__ == "__main__":
    main()
