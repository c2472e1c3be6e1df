"""Per-tensor cost of the host update: N fp32 parameters against one of the same total.

    python benchmarks/bench_kernels.py --numel 10M --tensors 10000 --threads 2
    python benchmarks/bench_kernels.py --numel 10M --tensors 1000 --threads 2

fp32 parameters, fp32 gradients and fp32 moments (the master is the parameter, no copy), as in
issue 13. Rows, interleaved, medians:
- native, one tensor: one range of numel elements, one call;
- native, N tensors, NativeBatch: the descriptors built once, per step only the stream keys
  and hyperparameters refreshed (what a caller that caches its batch pays);
- native, N tensors, adamw_update: N UpdateItems built and packed every step (what the
  optimizer pays today below its own per-parameter Python);
- AdamBridge.step(), N parameters: the whole optimizer step;
- torch.optim.AdamW(fused=True) on the N parameters and on one of the same total.
"""
from __future__ import annotations

import sys

import torch

from adambridge import AdamBridge, codecs
from adambridge import state as host_state
from adambridge.functional import Hyper, NativeBatch, UpdateItem, adamw_update, stream_keys

SEED = 0


def _hyper(step: int) -> Hyper:
    return Hyper.for_step(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step)


class Params:
    """N fp32 parameters (views of one buffer, as a model's flat parameters would not be:
    each has its own moments, allocated separately) with fixed gradients."""

    def __init__(self, numel: int, count: int):
        per = numel // count
        gen = torch.Generator().manual_seed(0)
        self.flat = torch.randn(per * count, generator=gen)
        self.grad = torch.randn(per * count, generator=gen) * 1e-2
        self.masters = list(self.flat.view(count, per).unbind(0))
        self.grads = list(self.grad.view(count, per).unbind(0))
        self.states = [host_state.new_state(m, "fp32", alias=True) for m in self.masters]

    def items(self, step: int) -> list:
        hyper = _hyper(step)
        return [UpdateItem(master=st["master"], grad=g, exp_avg=st["exp_avg"],
                           exp_avg_sq=st["exp_avg_sq"], exp_avg_scale=None, exp_avg_sq_scale=None,
                           out=None, offset=0, key=codecs.stream_key(SEED, step, i),
                           precision="fp32", stochastic_rounding=True, hyper=hyper)
                for i, (st, g) in enumerate(zip(self.states, self.grads))]


def rebuilt_variant(params: Params):
    step = [0]

    def run() -> None:
        step[0] += 1
        adamw_update(params.items(step[0]), "native")
    return run


def batch_variant(params: Params):
    batch = NativeBatch(params.items(1))
    indices = torch.arange(len(batch))
    step = [0]

    def run() -> None:
        step[0] += 1
        batch.set_step(stream_keys(SEED, step[0], indices), _hyper(step[0]))
        batch.run()
    return run


def torch_fused_variant(params: Params):
    ps = [torch.nn.Parameter(m.clone()) for m in params.masters]
    for p, g in zip(ps, params.grads):
        p.grad = g.clone()
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    return opt.step


def optimizer_variant(params: Params):
    ps = [torch.nn.Parameter(m.clone()) for m in params.masters]
    for p, g in zip(ps, params.grads):
        p.grad = g.clone()
    opt = AdamBridge(ps, lr=1e-4, weight_decay=0.01, precision="fp32", backend="native")
    return opt.step


def validate(count: int) -> None:
    """NativeBatch over many small tensors equals the torch backend bit for bit, or we stop."""
    results = []
    for backend in ("native", "torch"):
        params = Params(count * 37, count)
        for step in (1, 2):
            if backend == "native":
                batch = NativeBatch(params.items(step))
                batch.run()
            else:
                adamw_update(params.items(step), "torch")
        results.append([t for st in params.states for t in (st["master"], st["exp_avg"], st["exp_avg_sq"])])
    if not all(torch.equal(a, b) for a, b in zip(*results)):
        sys.exit("validation failed: NativeBatch != torch backend")
    print(f"validated: NativeBatch over {count} tensors == torch backend bit for bit (fp32)")


def main(numel: int, count: int, threads: int, repeats: int) -> None:
    from bench_kernels import time_interleaved
    from adambridge._native import loader
    validate(min(count, 500))
    many, one = Params(numel, count), Params(numel, 1)
    variants = {
        "native, one tensor": rebuilt_variant(one),
        f"native, {count} tensors, NativeBatch": batch_variant(many),
        f"native, {count} tensors, adamw_update": rebuilt_variant(many),
        f"AdamBridge.step(), {count} params": optimizer_variant(Params(numel, count)),
        f"torch AdamW(fused), {count} params": torch_fused_variant(many),
        "torch AdamW(fused), one param": torch_fused_variant(one),
    }
    medians = time_interleaved(variants, repeats)
    per = numel // count
    print(f"\nsetup: {loader.isa_name()}, {threads} threads, {count} fp32 tensors of {per} elements "
          f"({per * count / 1e6:.1f}M) against one of the same total, torch {torch.__version__}")
    base = medians["native, one tensor"]
    fused = medians[f"torch AdamW(fused), {count} params"]
    print(f"{'variant':44s} {'ms':>9s} {'vs native one':>14s} {'vs torch fused N':>17s}")
    for name, seconds in medians.items():
        print(f"{name:44s} {seconds * 1e3:9.2f} {seconds / base:13.2f}x {fused / seconds:16.2f}x")
    print("\n'vs native one': this row's time / one tensor's time (target: <= 2 at 10,000, "
          "<= 1.3 at 1,000); 'vs torch fused N': torch's time / this row's (> 1: faster)")
