"""Global gradient clipping in asynchronous mode equals sync clip_grad_norm_ + step() per element.

Four paths (pipeline/step_wide.py): clipping that does not fire (bit for bit), clipping that fires
on a held step (bit for bit), clipping that fires after some parameters were updated
speculatively while it was expected (redone from the kept state: bit for bit), and clipping
first used mid-training: redone bit for bit with ``attach_hooks(edits_grads=True)``, refused in
one line without it (no copy of the state was kept to redo from).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from _tiny import tiny_mlp

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md


def _model() -> nn.Module:
    return tiny_mlp((16, 48, 48, 6))


def _data(n: int) -> list:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 6, generator=gen))
            for _ in range(n)]


def _run(hooks: bool, *, clip: str, max_norm: float, precision: str = "fp32",
         steps: int = 6, torch_clip_from: int = 0, release_grads: bool = True,
         clip_fn=None, edits_grads: bool = False):
    """clip='arg' (max_grad_norm), 'torch' (clip_grad_norm_ each step from torch_clip_from).

    With hooks, the worker is let finish what has landed before each clip call, so the
    speculative updates the correction path is for have happened (deterministically)."""
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                     precision=precision, small_param_threshold=100, chunk_size=512,
                     max_grad_norm=max_norm if clip == "arg" else None,
                     release_grads=release_grads)
    if hooks:
        opt.attach_hooks(model, edits_grads=edits_grads)
    norms = []
    for i, (x, y) in enumerate(_data(steps)):
        (((model(x) - y) ** 2).mean() * 20).backward()
        if hooks:
            for lane in opt.pipeline.lanes.values():
                lane.wait(lane.call(lambda: None))
        if clip == "torch" and i >= torch_clip_from:
            clip_grad_norm_ = clip_fn or torch.nn.utils.clip_grad_norm_  # looked up now
            norms.append(float(clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        if clip == "arg":
            norms.append(opt.last_step_stats.grad_norm)
        opt.zero_grad()
    return model, opt, norms


def _compare(a, b, exact: bool):
    (model_a, opt_a, norms_a), (model_b, opt_b, norms_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            m, n = opt_a.state[p][key].float(), opt_b.state[q][key].float()
            if exact:
                assert torch.equal(m, n), key
            else:
                torch.testing.assert_close(m, n, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(norms_a), torch.tensor(norms_b), rtol=1e-6, atol=0)


CASES = [
    dict(desc="max_grad_norm never fires: bit for bit", clip="arg", max_norm=1e6, exact=True),
    dict(desc="max_grad_norm fires every step (watch holds, then redoes): bit for bit",
         clip="arg", max_norm=0.5, exact=True),
    dict(desc="torch clip_grad_norm_ never fires: bit for bit", clip="torch", max_norm=1e6,
         exact=True),
    dict(desc="torch clip_grad_norm_ fires at once (every piece held): bit for bit",
         clip="torch", max_norm=1e-3, exact=True),
    dict(desc="torch clip_grad_norm_ fires (pieces before the crossing redone): bit for bit",
         clip="torch", max_norm=0.5, exact=True),
    dict(desc="torch clip_grad_norm_ first used at step 3, edits_grads=True: redone",
         clip="torch", max_norm=0.5, exact=True, torch_clip_from=3, edits_grads=True),
    dict(desc="torch clip_grad_norm_, gradients kept in p.grad", clip="torch", max_norm=1e-3,
         exact=True, release_grads=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["desc"])
def test_clipping_async_equals_sync(case):
    kw = {k: v for k, v in case.items() if k not in ("desc", "exact")}
    sync, hooked = _run(False, **kw), _run(True, **kw)
    _compare(hooked, sync, case["exact"])
    assert all(n > 0 for n in hooked[2])  # torch's total norm, not the 0 of released grads


@pytest.mark.parametrize("max_norm", [1e-3, 0.5], ids=["fires at once", "fires later"])
def test_clipping_with_clip_grad_norm_bound_before_attach_hooks(max_norm):
    # `from torch.nn.utils import clip_grad_norm_` at the top of a script binds torch's own
    # function; with the gradients released it found none, returned the norm without them and
    # clipped nothing. It reaches the pipeline through clip_grad.py's helper instead.
    from adambridge.pipeline import interception
    bound = interception.original_clip_grad_norm_()  # what that import binds
    sync = _run(False, clip="torch", max_norm=max_norm, clip_fn=bound)
    hooked = _run(True, clip="torch", max_norm=max_norm, clip_fn=bound)
    _compare(hooked, sync, exact=True)
    assert all(n > 0 for n in hooked[2])


def test_clipping_sync_max_grad_norm_equals_torch_clip_then_adamw():
    model = _model()
    ref = _model()
    opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                     max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _data(5):
        for m in (model, ref):
            (((m(x) - y) ** 2).mean() * 20).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_opt.step()
        assert opt.last_step_stats.grad_norm == pytest.approx(float(norm), rel=1e-6)
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_clipping_speculative_correction_really_ran(monkeypatch):
    from adambridge.pipeline import corrections
    calls = []
    real = corrections.FactsMixin._correct
    monkeypatch.setattr(corrections.FactsMixin, "_correct",
                        lambda self, job: (calls.append(job.index), real(self, job)))
    _run(True, clip="torch", max_norm=0.5, torch_clip_from=3, edits_grads=True)
    assert calls, "clipping first used mid-training must redo the speculative updates"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("max_norm", [6.0, 9.0])
def test_clipping_low_precision_moments_redo_equals_sync(precision, max_norm):
    # The limit lies between the first gradients' norm and the total: some parameters are
    # updated speculatively, then clipping fires and they are redone from kept moments.
    sync = _run(False, clip="torch", max_norm=max_norm, precision=precision)
    hooked = _run(True, clip="torch", max_norm=max_norm, precision=precision)
    _compare(hooked, sync, exact=True)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_clipping_first_used_mid_training_is_refused_before_it_clips(precision):
    # The updates already made used the unclipped gradients and no copy of their state was
    # kept: they cannot be redone exactly, so the clip refuses before changing a gradient,
    # and the step says which parameters had taken it.
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", precision=precision,
                     small_param_threshold=100)
    opt.attach_hooks(model)
    for i, (x, y) in enumerate(_data(3)):
        (((model(x) - y) ** 2).mean() * 20).backward()
        if i == 2:  # first clip, after the worker has updated speculatively
            for lane in opt.pipeline.lanes.values():
                lane.wait(lane.call(lambda: None))
            with pytest.raises(RuntimeError, match=r"^adambridge: clipping changed the gradient "
                                                   r"of parameter \d+ after backward.*"
                                                   r"attach_hooks\(model, edits_grads=True\)"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with pytest.raises(RuntimeError, match="this step had already updated parameters"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    opt.detach_hooks()


def test_clipping_value_and_with_norm_equal_sync():
    runs = []
    for hooks in (False, True):
        model = _model()
        opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=100)
        if hooks:
            opt.attach_hooks(model)
        for x, y in _data(4):
            (((model(x) - y) ** 2).mean() * 20).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(4.0))
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(*[m.parameters() for m in runs]):
        assert torch.equal(p, q)


def test_clipping_over_parameters_of_another_optimizer_clips_them_like_torch():
    runs = []
    for hooks in (False, True):
        model = _model()
        ours = AdamBridge(model[0].parameters(), lr=1e-2, backend="torch",
                          small_param_threshold=0)
        other = torch.optim.SGD(list(model[2].parameters()) + list(model[4].parameters()),
                                lr=1e-2)
        if hooks:
            ours.attach_hooks(model)
        for x, y in _data(3):
            (((model(x) - y) ** 2).mean() * 20).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            ours.step()
            other.step()
            ours.zero_grad()
            other.zero_grad()
        runs.append(model)
    for p, q in zip(*[m.parameters() for m in runs]):
        assert torch.equal(p, q)


def test_clipping_nonfinite_norm_raises_like_torch():
    model = _model()
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    x, y = _data(1)[0]
    (((model(x) - y) ** 2).mean() * float("inf")).backward()
    with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* is non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()


def test_clipping_torch_functions_are_restored_after_detach():
    import gc
    import torch.nn.utils.clip_grad as clip_grad
    from adambridge.pipeline import interception
    gc.collect()  # optimizers of earlier tests, and their pipelines, are gone
    assert not list(interception._pipelines), "an earlier test keeps an optimizer alive"
    original, zero_grad = torch.nn.utils.clip_grad_norm_, torch.nn.Module.zero_grad
    model = _model()
    opt = AdamBridge(model.parameters(), backend="torch")
    opt.attach_hooks(model)
    assert torch.nn.utils.clip_grad_norm_ is not original
    assert torch.nn.Module.zero_grad is not zero_grad
    opt.detach_hooks()
    assert torch.nn.utils.clip_grad_norm_ is original
    assert clip_grad.clip_grad_norm_ is original
    assert torch.nn.Module.zero_grad is zero_grad
