"""Per-tensor cost of the host update: N fp32 parameters against one of the same total.

    python benchmarks/bench_kernels.py --numel 10M --tensors 10000 --threads 2
    python benchmarks/bench_kernels.py --numel 10M --tensors 1000 --threads 2

fp32 parameters, fp32 gradients and fp32 moments (the master is the parameter, no copy), as in
Rows, interleaved, medians:
- native, one tensor: one range of numel elements, one call;
- native, N tensors, NativeBatch: the descriptors built once, per step only the stream keys
  and hyperparameters refreshed (what a caller that caches its batch pays);
- native, N tensors, adamw_update: N UpdateItems built and packed every step (what the
  optimizer's full path pays below its own per-parameter Python, before the cached step plan);
- AdamBridge.step(), N parameters: the whole optimizer step, its gradients the same tensors
  every step (the cached step plan refreshes keys and hyperparameters only), and the same with
  the plan's checks made by its Python passes instead of the native ones (csrc_torch/), as on
  a machine without a C++ compiler;
- AdamBridge.step(), N parameters, new grad tensors: every step sees new p.grad tensors (as
  after zero_grad(set_to_none=True) and backward), so the plan takes in their pointers; the
  row includes its own N ``p.grad = g``, timed alone in the row after it;
- torch.optim.AdamW(fused=True) on the N parameters and on one of the same total.

Then the async pipeline's per-gradient cost: a chain of N/2 Linear(16, 16) layers (N small
parameter tensors) on the CPU, every parameter hooked (small_param_threshold=0); rows, again
interleaved: forward + backward without hooks; forward + backward + step() through plain
AdamBridge (the sync step); forward + backward with hooks attached + step_sync(). Reported:
gradients handled per second and the hooks' cost per gradient over the plain backward.
"""
from __future__ import annotations

import sys

import torch

from adambridge import AdamBridge
from adambridge.update import codecs
from adambridge.sync import step_plan
from adambridge.update import state as host_state
from adambridge.update.functional import Hyper, NativeBatch, UpdateItem, adamw_update, stream_keys

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


def optimizer_variant(params: Params, python_checks: bool = False):
    """python_checks: the plan built with its Python passes, as where no C++ compiler is."""
    ps = [torch.nn.Parameter(m.clone()) for m in params.masters]
    for p, g in zip(ps, params.grads):
        p.grad = g.clone()
    opt = AdamBridge(ps, lr=1e-4, weight_decay=0.01, precision="fp32", backend="native")
    if python_checks:  # the plan is built by the first step and keeps its checks
        kept, step_plan.FACTS_MIN_PARAMS = step_plan.FACTS_MIN_PARAMS, 1 << 62
        try:
            opt.step()
        finally:
            step_plan.FACTS_MIN_PARAMS = kept
        if opt._plan is None or opt._plan.native is not None:
            sys.exit("benchmark setup failed: no plan with Python checks")
    return opt.step


def optimizer_new_grads_variant(params: Params):
    ps = [torch.nn.Parameter(m.clone()) for m in params.masters]
    grad_sets = [[g.clone() for g in params.grads] for _ in range(2)]
    opt = AdamBridge(ps, lr=1e-4, weight_decay=0.01, precision="fp32", backend="native")
    turn = [0]

    def run() -> None:
        turn[0] ^= 1
        for p, g in zip(ps, grad_sets[turn[0]]):
            p.grad = g
        opt.step()
    return run


def grad_assignment_variant(params: Params):
    """Only the new-grads row's own loop: N ``p.grad = g`` (torch's setter checks each)."""
    ps = [torch.nn.Parameter(m.clone()) for m in params.masters]
    grad_sets = [[g.clone() for g in params.grads] for _ in range(2)]
    turn = [0]

    def run() -> None:
        turn[0] ^= 1
        for p, g in zip(ps, grad_sets[turn[0]]):
            p.grad = g
    return run


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
    from adambridge.lab.trust import time_interleaved
    from adambridge._native import loader, plan_checks
    validate(min(count, 500))
    # Built (or loaded from the cache) now, so every plan below starts with native checks.
    if plan_checks.load() is None:
        print(f"note: no native plan checks here ({plan_checks.unavailable_reason()})")
    many, one = Params(numel, count), Params(numel, 1)
    variants = {
        "native, one tensor": rebuilt_variant(one),
        f"native, {count} tensors, NativeBatch": batch_variant(many),
        f"native, {count} tensors, adamw_update": rebuilt_variant(many),
        f"AdamBridge.step(), {count} params": optimizer_variant(Params(numel, count)),
        f"  the same, Python checks": optimizer_variant(Params(numel, count), python_checks=True),
        f"AdamBridge.step(), {count} params, new grads": optimizer_new_grads_variant(many),
        f"  of which setting {count} p.grad": grad_assignment_variant(many),
        f"torch AdamW(fused), {count} params": torch_fused_variant(many),
        "torch AdamW(fused), one param": torch_fused_variant(one),
    }
    medians, verdict = time_interleaved(variants, repeats, threads)
    per = numel // count
    print(f"\nsetup: {loader.isa_name()}, {threads} threads, {count} fp32 tensors of {per} elements "
          f"({per * count / 1e6:.1f}M) against one of the same total, torch {torch.__version__}")
    print(verdict.line)
    base = medians["native, one tensor"]
    fused = medians[f"torch AdamW(fused), {count} params"]
    print(f"{'variant':44s} {'ms':>9s} {'vs native one':>14s} {'vs torch fused N':>17s}")
    for name, seconds in medians.items():
        print(f"{name:44s} {seconds * 1e3:9.2f} {seconds / base:13.2f}x {fused / seconds:16.2f}x")
    print("\n'vs native one': this row's time / one tensor's time (target: <= 2 at 10,000, "
          "<= 1.3 at 1,000); 'vs torch fused N': torch's time / this row's (> 1: faster)")
    pipeline_main(count, repeats)


# -- the async pipeline: hooks per second ------------------------------------------------------

LAYER = 16


class Chain:
    """The chain, its input and, for the optimizer rows, the optimizer; ``run`` is one step."""

    def __init__(self, count: int, mode: str):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(LAYER, LAYER) for _ in range(max(1, count // 2))]
        self.model = torch.nn.Sequential(*layers)
        self.x = torch.randn(8, LAYER)
        self.opt = None
        if mode != "plain":
            self.opt = AdamBridge(self.model.parameters(), lr=1e-4, backend="native",
                                  small_param_threshold=0)
        if mode == "hooks":
            self.opt.attach_hooks(self.model)
        self.mode = mode

    def run(self) -> None:
        self.model(self.x).square().mean().backward()
        if self.mode == "hooks":
            self.opt.step_sync()
            return
        if self.opt is not None:
            self.opt.step()
        self.model.zero_grad(set_to_none=True)


def validate_pipeline(count: int) -> None:
    """Hooks + step_sync equal the sync step bit for bit on the chain, or we stop."""
    sync, hooked = Chain(count, "sync"), Chain(count, "hooks")
    for chain in (sync, hooked, sync, hooked):
        chain.run()
    pairs = zip(sync.model.parameters(), hooked.model.parameters())
    if not all(torch.equal(a, b) for a, b in pairs):
        sys.exit("validation failed: hooks + step_sync != sync step()")
    hooked.opt.detach_hooks()
    print(f"validated: hooks + step_sync == sync step() bit for bit ({count} tensors, 2 steps)")


def pipeline_main(count: int, repeats: int) -> None:
    from adambridge.lab.trust import time_interleaved
    validate_pipeline(min(count, 200))
    chains = {
        "forward + backward, no hooks": Chain(count, "plain"),
        "forward + backward + sync step()": Chain(count, "sync"),
        "forward + backward with hooks + step_sync()": Chain(count, "hooks"),
    }
    medians, verdict = time_interleaved({name: chain.run for name, chain in chains.items()}, repeats,
                                        torch.get_num_threads())
    grads = 2 * max(1, count // 2)
    print(f"\nasync pipeline: {count // 2} Linear({LAYER}, {LAYER}) layers, {grads} gradients "
          f"({LAYER * LAYER} and {LAYER} elements), every one hooked, CPU")
    print(verdict.line)
    base = medians["forward + backward, no hooks"]
    print(f"{'variant':44s} {'ms':>9s} {'grads/s':>10s} {'us/grad over plain':>19s}")
    for name, seconds in medians.items():
        over = (seconds - base) / grads * 1e6
        print(f"{name:44s} {seconds * 1e3:9.2f} {grads / seconds:10.0f} {over:19.2f}")
    stats = chains["forward + backward with hooks + step_sync()"].opt.last_step_stats
    print(f"hooks: the last step made {stats.num_batches} native calls for {stats.num_params} "
          f"gradients ({stats.num_params / max(1, stats.num_batches):.0f} rows a call)")
