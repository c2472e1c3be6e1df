"""The training loop of llm.c's train_gpt2.py and build-nanogpt's train_gpt2.py, as written.

Both compute the step's learning rate after backward and the clip, write it into every
param group, then call ``optimizer.step()``:

    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr = get_lr(step)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    optimizer.step()

torch.optim.AdamW applies that lr to every parameter; so must AdamBridge in both modes.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from adambridge import AdamBridge

from ._twins import assert_elements_close, copies

STEPS, WARMUP, MAX_LR = 5, 2, 6e-3


def _get_lr(step: int) -> float:
    """build-nanogpt's schedule: linear warmup, then cosine down to a tenth."""
    if step < WARMUP:
        return MAX_LR * (step + 1) / WARMUP
    ratio = (step - WARMUP) / (STEPS - WARMUP)
    return MAX_LR / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (MAX_LR - MAX_LR / 10)


def _model() -> torch.nn.Module:
    # NOTE: the first weight (4096 x 64) is past the host worker's gathering size, so in
    # async mode it is updated during backward, before the loop writes the step's lr.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 16))


def _wait_for_update(opt, p, before: int, limit_s: float = 2.0) -> None:
    """Give the worker the time a real backward would (the loop's next lines are cheap):
    until p's step has moved, or ``limit_s`` (an optimizer that holds the update)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = opt.state.get(p)
        if state and int(state["step"]) > before:
            return
        time.sleep(0.01)


def _run(kind: str, max_norm: float) -> list:
    model = _model()
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=0.1)
    else:
        opt = AdamBridge(model.parameters(), lr=MAX_LR, weight_decay=0.1)
        if kind == "async":
            opt.attach_hooks(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if kind == "async":
            _wait_for_update(opt, model[0].weight, before=step)
        for param_group in opt.param_groups:
            param_group["lr"] = _get_lr(step)
        opt.step()
    return copies(model)


# The gradient norms of this loop are 4 to 9: llm.c's 1.0 clips every step, 100 never.
CLIPS = {"clip fires": 1.0, "clip does not fire": 100.0}


@pytest.mark.parametrize("max_norm", CLIPS.values(), ids=CLIPS.keys())
def test_lr_written_between_backward_and_step_reaches_every_parameter(max_norm):
    """Sync equals torch.optim.AdamW (five steps of a real backward: 1e-5); async equals
    sync to fp32 rounding, the weight updated during backward included."""
    ref, sync, hooked = (_run(kind, max_norm) for kind in ("adamw", "sync", "async"))
    for a, b in zip(sync, ref):
        assert_elements_close(a, b, rtol=1e-5, atol=1e-6, what="sync vs AdamW")
    for a, b in zip(hooked, sync):
        assert_elements_close(a, b, rtol=1e-6, atol=1e-7, what="async vs sync")
