"""Makes the async worker keep up with backward on the CPU, as it does behind a GPU's backward.

On the CPU the host transport gathers landed gradients until they are worth a wake-up of the
worker, so a small model's whole step is one batch: nothing is updated before the step's
last gradient, and the paths for updates made before a step-wide fact is known (clipping
that fires after some gradients were updated) are never taken. ``keep_up`` waits, after each
of the optimizer's hooks, until the worker has handled that gradient: each is its own batch,
updated before backward goes on, deterministically.
"""
from __future__ import annotations

import torch


def keep_up(opt, model: torch.nn.Module) -> None:
    """After each of ``opt``'s hooks on ``model``, wait until the worker has handled it."""
    lanes = list(opt.pipeline.lanes.values())

    def wait(_: torch.Tensor) -> None:
        for lane in lanes:
            lane.wait(lane.call(lambda: None))
    for p in model.parameters():  # registered after attach_hooks: runs after its hook
        p.register_post_accumulate_grad_hook(wait)
