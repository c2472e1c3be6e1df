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
from typing import Callable, Optional

import torch

from adambridge.update import codecs, state as host_state
from adambridge._native import loader
from adambridge.update.functional import Hyper, UpdateItem, adamw_update
from adambridge.lab import trust
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
    """DeepSpeed's CPU Adam on the same fp32 update (fp32 master, fp32 gradient)."""

    def __init__(self, buffers: Buffers):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        self.master = torch.nn.Parameter(buffers.master.clone())
        self.master.grad = buffers.grad.float()
        self.opt = DeepSpeedCPUAdam([self.master], lr=1e-4, adamw_mode=True)

    def __call__(self) -> None:
        self.opt.step()


def deepspeed_variant(buffers: Buffers) -> Optional[Callable[[], None]]:
    try:
        return DeepSpeedAlternative(buffers)
    except Exception as exc:  # not installed, or its JIT build failed: report, don't fail
        print(f"DeepSpeed CPU Adam: not measured ({type(exc).__name__}: {str(exc)[:120]})")
        return None


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
        print(f"{name:36s} {seconds * 1e3:9.2f} {gbs:7.1f} {alternative / seconds:10.2f}x {own}")
    print("\n'of own floor': the floor's time / the kernel's time (1.00 = at the memory floor)")
    ds = medians.get("DeepSpeed CPU Adam (fp32 update)")
    if ds is not None:
        print(f"DeepSpeed CPU Adam / native fp32: {ds / medians['native fp32 moments']:.2f}x")


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
    ds = deepspeed_variant(buffers)
    if ds is not None:
        variants["DeepSpeed CPU Adam (fp32 update)"] = ds
        bytes_per["DeepSpeed CPU Adam (fp32 update)"] = 4 + 4 + 4 + 16  # p r/w, fp32 g, m and v r/w
    monitor = trust.LoadMonitor(threads)
    samples = time_samples(variants, args.repeats, monitor)
    if not args.no_torch_backend:
        torch_items = items_for(buffers, "fp32", 1)
        samples["torch backend fp32 moments"] = time_samples(
            {"t": lambda: adamw_update(torch_items, "torch")}, 2, monitor)["t"]
        bytes_per["torch backend fp32 moments"] = BYTES["fp32"]
    report(numel, threads, medians(samples), bytes_per, trust.judge(samples, monitor))


if __name__ == "__main__":
    main()
