"""Scratch update buffers: the layout one host update streams over, for the probe and --check."""
from __future__ import annotations

import dataclasses

import torch


def update_items(numel: int, precision: str, *, step: int = 1, seed: int = 0,
                 random: bool = True) -> list:
    """One UpdateItem of ``numel`` elements: fp32 master, bf16 gradient and weight copy, and
    the moments of ``precision``, as an optimizer with bf16 parameters hands the kernel
    (``random`` False: zeros, for the probe, which only streams the bytes)."""
    from ..update import codecs, state as host_state
    from ..update.functional import UpdateItem
    gen = torch.Generator().manual_seed(seed)
    master = host_state.host_empty(numel, torch.float32)
    grad = host_state.host_empty(numel, torch.bfloat16)
    if random:
        master.normal_(generator=gen)
        grad.normal_(std=1e-2, generator=gen)
    else:
        master.zero_()
        grad.zero_()
    state = host_state.new_state(master, precision, alias=True)
    out = host_state.host_empty(numel, torch.bfloat16)
    return [UpdateItem(master=master, grad=grad, exp_avg=state["exp_avg"],
                       exp_avg_sq=state["exp_avg_sq"], exp_avg_scale=state.get("exp_avg_scale"),
                       exp_avg_sq_scale=state.get("exp_avg_sq_scale"), out=out, offset=0,
                       key=codecs.stream_key(0, step, 0), precision=precision,
                       stochastic_rounding=True, hyper=_hyper(step))]


def next_step(items: list, step: int) -> list:
    """The same buffers for update number ``step`` (new bias corrections and rounding key)."""
    from ..update import codecs
    return [dataclasses.replace(item, hyper=_hyper(step), key=codecs.stream_key(0, step, 0))
            for item in items]


def _hyper(step: int):
    from ..update.functional import Hyper
    return Hyper.for_step(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step)
