"""A torch.compile'd model trained by AdamBridge, as torchao's compile tests and torchtitan's
loop (which compiles each block) do: in sync and async mode, the optimizer sees the
gradients the compiled backward produced and updates them as torch.optim.AdamW would.

A compiled backward delivers every gradient at its end, so async mode's hooks all fire
together; the result must still be that of step() bit for bit.

NOTE: the model is one tiny block. Most tests compile it with the "aot_eager" backend: the
same dynamo capture and AOTAutograd joint graph (so the same one-graph backward the hooks see)
without inductor's C++ code generation, which costs about half a minute on this 2-core
machine; one test pays that once for the default backend, both modes. The reference is fed
the very gradients the subject saw, so the comparison holds the optimizer to the fp32
contract rather than to the drift of two trainings.

Also here: torch.compile(opt.step) itself, and blocks compiled one by one (torchtitan's way).
"""
from __future__ import annotations

import pytest
import torch

from ._twins import (MODES, adamw_twin, assert_identical, assert_matches_adamw, bridge,
                     state_tensors, step_reference)

STEPS = 4
BACKEND = "aot_eager"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _run(mode: str, precision: str = "fp32", backend: str = BACKEND):
    model = _model()
    params = list(model.parameters())
    ref, ref_opt = adamw_twin(params, lr=1e-2, weight_decay=0.1)
    # release_grads=False keeps p.grad after the hooks took it, for the reference's step.
    opt = bridge(params, mode, model=model, lr=1e-2, weight_decay=0.1, precision=precision,
                 release_grads=False)
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        step_reference(ref, ref_opt, [p.grad for p in params], torch.float32)
        opt.step()
        opt.zero_grad()
    return params, opt, ref, ref_opt


@pytest.mark.parametrize("mode", MODES)
def test_compiled_model_steps_equal_adamw(mode):
    params, opt, ref, ref_opt = _run(mode)
    assert_matches_adamw(opt, params, ref, ref_opt, what=f"compiled, {mode}")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_compiled_model_async_equals_sync(precision):
    sync_params, sync_opt, _, _ = _run("sync", precision)
    async_params, async_opt, _, _ = _run("async", precision)
    assert_identical([p.detach() for p in async_params] + state_tensors(async_opt, async_params),
                     [p.detach() for p in sync_params] + state_tensors(sync_opt, sync_params),
                     what=f"compiled {precision}: async vs sync")


def test_compiled_model_by_inductor_equals_adamw_in_both_modes():
    """The default backend, as users call it: both modes equal AdamW, async equals sync."""
    runs = {mode: _run(mode, backend="inductor") for mode in MODES}
    for mode, (params, opt, ref, ref_opt) in runs.items():
        assert_matches_adamw(opt, params, ref, ref_opt, what=f"inductor, {mode}")
    (sp, so, _, _), (ap, ao, _, _) = runs["sync"], runs["async"]
    assert_identical([p.detach() for p in ap] + state_tensors(ao, ap),
                     [p.detach() for p in sp] + state_tensors(so, sp), what="inductor async")


def _steps_with(step_of, mode: str, precision: str) -> list:
    """Four steps of the tiny model, the optimizer's step called as ``step_of(opt)()``."""
    model = _model()
    opt = bridge(model.parameters(), mode, model=model, lr=1e-2, precision=precision)
    step = step_of(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()
        opt.zero_grad()
    params = list(model.parameters())
    return [p.detach() for p in params] + state_tensors(opt, params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_compiled_optimizer_step_equals_eager_step(precision, mode):
    """torch.compile(opt.step), as torch's own optimizers are often compiled: the step runs
    as written (it leaves the graph), so every bit equals the eager step's, in both modes and
    past the first step (where dynamo recompiles for a changing step count)."""
    assert_identical(_steps_with(lambda opt: torch.compile(opt.step), mode, precision),
                     _steps_with(lambda opt: opt.step, mode, precision),
                     what=f"compiled step, {precision} {mode}")


class _Block(torch.nn.Module):
    """A pre-norm residual block, the unit torchtitan compiles one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


def _blocks_run(mode: str, precision: str, compiled: bool) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(3)], torch.nn.Linear(32, 8))
    if compiled:
        for block in list(model)[:3]:
            block.compile(backend=BACKEND)
    opt = bridge(model.parameters(), mode, model=model, lr=1e-2, precision=precision)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    return [p.detach() for p in params] + state_tensors(opt, params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_blocks_with_clipping_equal_eager_sync(precision, mode):
    """Each block compiled on its own (several backward graphs, gradients landing per block)
    with torch's clip_grad_norm_ between backward and step: equal to the eager sync run."""
    assert_identical(_blocks_run(mode, precision, compiled=True),
                     _blocks_run("sync", precision, compiled=False),
                     what=f"compiled blocks, {precision} {mode}")
