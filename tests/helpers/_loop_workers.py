"""What each rank of tests/distributed/test_distributed_loops.py runs (launched as ``_loop_workers:<name>``
through _distributed_workers.launch, which gives each scenario its gloo group and timeout).

The loops are the ones users write: the documented asynchronous loop (``backward()`` then
``step_sync()``, no ``zero_grad()``: the hooks release what they take) under DDP, shard_state
and FSDP2, against the synchronous loop with ``zero_grad()``; the DDP wrapper found from what
attach_hooks is given; and an FSDP2 shard whose fp8 blocks start off a multiple of 128.
"""
from __future__ import annotations

import logging

import torch
# torch's own, bound before any attach_hooks (torchtitan imports it so)
from torch.nn.utils import clip_grads_with_norm_ as _torch_clip_grads_with_norm_

from _distributed_workers import LR, WD, _error, _full, batch, make_model, shard

STEPS = 5


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _loop(model, opt, rank: int, mode: str, zero_grad: bool = True) -> list:
    """STEPS steps; ``mode`` "async": backward then step_sync() and nothing else. Returns
    how many gradients the hooks had taken when each backward ended (async)."""
    taken = []
    for step in range(STEPS):
        model(batch(rank, step)).square().mean().backward()
        if mode == "async":
            # What the comm hook handed over in this backward (pipeline/hooks.py's pipeline only).
            record = getattr(opt.pipeline, "_record", None)
            taken.append(len(record.jobs) if record is not None else 0)
            opt.step_sync()
        else:
            opt.step()
            if zero_grad:
                opt.zero_grad()
    return taken


def _ours(model, **kwargs):
    from adambridge import AdamBridge
    # small_param_threshold=100: the two weights are hooked, the biases go at the step
    return AdamBridge(model.parameters(), lr=LR, weight_decay=WD, small_param_threshold=100,
                      **kwargs)


def _weights(model) -> list:
    return [_full(p) for p in model.parameters()]


def seed_loop(rank: int, world: int, out_dir: str) -> dict:
    """The async loop without zero_grad() against sync with it: DDP (both bucket layouts,
    hooks through the wrapper and through .module), shard_state, FSDP2; release_grads=False
    keeps p.grad, so both loops without zero_grad() add the backward passes up alike."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    result = {}
    for view in (False, True):
        for sharded in (False, True):
            for mode, target in (("sync", None), ("async", "ddp"), ("async", "module")):
                if sharded and target == "module":
                    continue  # shard_state takes the DDP model itself (refused otherwise)
                model = DDP(make_model(), gradient_as_bucket_view=view)
                opt = _ours(model, shard_state=sharded)
                if target is not None:
                    opt.attach_hooks(model if target == "ddp" else model.module)
                taken = _loop(model, opt, rank, mode)
                result["ddp", view, sharded, target] = _weights(model)
                result["ddp", view, sharded, target, "taken"] = taken
                opt.detach_hooks()
    for mode in ("sync", "async"):  # kept gradients: both loops accumulate, the same way
        model = DDP(make_model())
        opt = _ours(model, release_grads=False)
        if mode == "async":
            opt.attach_hooks(model)
        _loop(model, opt, rank, mode, zero_grad=False)
        result["kept", mode] = _weights(model)
        opt.detach_hooks()
    for setup in ("plain", "cpu_offload"):
        for mode in ("sync", "async"):
            model = shard(make_model(), setup)
            opt = _ours(model, precision="bf16", seed=7)
            if mode == "async":
                opt.attach_hooks(model)
            _loop(model, opt, rank, mode)
            result["fsdp2", setup, mode] = _weights(model)
            opt.detach_hooks()
    return result


def wrapper_lookup(rank: int, world: int, out_dir: str) -> dict:
    """attach_hooks on what is not the DDP model, with 2 ranks: a module wrapped after
    attach_hooks, a model no DDP wraps, no model at all."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    records = _Records()
    logging.getLogger("adambridge").addHandler(records)
    result = {}
    for mode in ("sync", "async"):
        inner = make_model()
        opt = _ours(inner)
        if mode == "async":
            opt.attach_hooks(inner)  # before DDP wraps it
        model = DDP(inner)
        result["wrapped after", mode, "taken"] = _loop(model, opt, rank, mode)
        result["wrapped after", mode] = _weights(model)
        opt.detach_hooks()
    for mode in ("sync", "async"):  # no DDP: each rank trains on its own gradients
        model = make_model()
        opt = _ours(model)
        if mode == "async":
            opt.attach_hooks(model)
        result["alone", mode, "taken"] = _loop(model, opt, rank, mode)
        result["alone", mode] = _weights(model)
        opt.detach_hooks()
    result["warnings"] = list(records.messages)
    model = DDP(make_model())
    result["no model"] = _error(lambda: _ours(model).attach_hooks())
    result["no model, shard_state"] = _error(lambda: _ours(model, shard_state=True).attach_hooks())
    result[".module, shard_state"] = _error(
        lambda: _ours(model, shard_state=True).attach_hooks(model.module))
    return result


def fsdp2_fp8_uneven(rank: int, world: int, out_dir: str) -> dict:
    """fully_shard(Linear(512, 33)), fp8 moments: rank 1's bias shard starts at element 17.
    Both backends, sync and async: the shards, masters, moments and scales after 3 steps."""
    from torch.distributed.fsdp import fully_shard
    from adambridge import AdamBridge
    from adambridge.distributed.fsdp import shard_offset
    result = {}
    for backend in ("torch", "native"):
        for mode in ("sync", "async"):
            torch.manual_seed(0)
            model = fully_shard(torch.nn.Linear(512, 33))
            params = list(model.parameters())
            opt = AdamBridge(params, lr=LR, weight_decay=WD, precision="fp8", seed=7,
                             backend=backend)
            if mode == "async":
                opt.attach_hooks(model)
            for step in range(3):
                x = torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            opt.detach_hooks()
            result[backend, mode] = [p.to_local().detach().clone() for p in params] + [
                opt.state[p][key].clone() for p in params for key in sorted(opt.state[p])]
    result["offsets"] = [shard_offset(p, i) for i, p in enumerate(params)]
    return result


def _hyper_loop(model, opt, rank: int, mode: str, write_from) -> list:
    """STEPS steps writing lr and weight_decay each step: after the backward from step
    ``write_from`` on (llm.c writes lr there), before it where ``write_from`` is None.
    Returns how many parameters the hooks had updated when each backward ended (async)."""
    from _distributed_workers import _updated_in_backward

    def write(step: int) -> None:
        for group in opt.param_groups:
            group["lr"] = LR * (1.0 + 0.1 * (step + 1))
            group["weight_decay"] = WD * (1.0 + 0.2 * (step + 1))

    in_backward = []
    for step in range(STEPS):
        late = write_from is not None and step >= write_from
        if not late:
            write(step)
        model(batch(rank, step)).square().mean().backward()
        if mode == "async":
            in_backward.append(_updated_in_backward(opt))
        if late:
            write(step)
        opt.step()
        opt.zero_grad()
    return in_backward


def hyper_after_backward(rank: int, world: int, out_dir: str) -> dict:
    """FSDP2 and shard_state async with lr and weight_decay written after backward (from
    the first step, from the third) and before it, against the synchronous loop."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    records = _Records()
    logging.getLogger("adambridge").addHandler(records)
    result = {}
    for kind in ("fsdp2", "shard_state"):
        for write_from in (None, 0, 2):
            for mode in ("sync", "async"):
                if kind == "fsdp2":
                    model = shard(make_model())
                    opt = _ours(model, precision="bf16", seed=7)
                else:
                    model = DDP(make_model())
                    opt = _ours(model, shard_state=True)
                if mode == "async":
                    opt.attach_hooks(model)
                del records.messages[:]
                taken = _hyper_loop(model, opt, rank, mode, write_from)
                result[kind, write_from, mode] = _weights(model)
                result[kind, write_from, mode, "in backward"] = taken
                result[kind, write_from, mode, "warnings"] = list(records.messages)
                opt.detach_hooks()
    return result


def _edit(kind: str, model, step: int, first: int) -> None:
    """What a loop does to the gradients between backward and step, from step ``first``."""
    if step < first:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    if kind == "scale":
        for p in params:
            p.grad.mul_(0.5)
    else:  # torchtitan's clip: its own total norm, torch's clip bound before attach_hooks
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        _torch_clip_grads_with_norm_(params, 1e-3, total)


def _edit_loop(model, opt, rank: int, kind: str, first: int) -> str:
    for step in range(STEPS):
        model(batch(rank, step)).square().mean().backward()
        _edit(kind, model, step, first)
        try:
            opt.step()
        except RuntimeError as exc:
            return f"step {step}: {exc}"
        opt.zero_grad()
    return "no error"


def grad_edits(rank: int, world: int, out_dir: str) -> dict:
    """Gradients changed between backward and step (scaled in place, torchtitan's clip) under
    DDP, shard_state and FSDP2, from the first step or from the third, async against sync."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    result = {}
    for where in ("ddp", "shard_state", "fsdp2"):
        for kind in ("scale", "titan"):
            for first in (0, 2):
                for mode in ("sync", "async"):
                    if where == "fsdp2":
                        model = shard(make_model())
                        opt = _ours(model)
                    else:
                        model = DDP(make_model())
                        opt = _ours(model, shard_state=where == "shard_state")
                    if mode == "async":
                        opt.attach_hooks(model)
                    error = _edit_loop(model, opt, rank, kind, first)
                    result[where, kind, first, mode] = _weights(model), error
                    opt.detach_hooks()
    return result



class _Routed(torch.nn.Module):
    """Two experts; on odd steps every token goes to the first (the second gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(13, 37)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(37, 5) for _ in range(2))
        self.first_only = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        out = self.experts[0](h)
        return out if self.first_only else out + self.experts[1](h)


def kept_zeros(rank: int, world: int, out_dir: str) -> dict:
    """zero_grad(set_to_none=False) with an expert idle every other step, under DDP,
    shard_state and FSDP2: the idle expert steps on zeros in async mode as in sync mode."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    result = {}
    for where in ("ddp", "shard_state", "fsdp2"):
        for mode in ("sync", "async"):
            inner = _Routed()
            if where == "fsdp2":
                for expert in inner.experts:
                    fully_shard(expert)
                model = fully_shard(inner)
                opt = _ours(model)
            else:
                model = DDP(inner, find_unused_parameters=True)
                opt = _ours(model, shard_state=where == "shard_state")
            if mode == "async":
                opt.attach_hooks(model)
            for step in range(4):
                inner.first_only = step % 2 == 1
                model(batch(rank, step)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
            result[where, mode] = _weights(model)
            opt.detach_hooks()
    return result
