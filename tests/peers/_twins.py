"""What every peer test shares: twin parameters with their own storage, element-wise checks.

NOTE: DeepSpeed's CPU Adam test builds its reference parameter as ``Parameter(data.to(dev))``;
on a CPU-only machine ``.to("cpu")`` returns the same tensor, so the optimizer under test and
the reference update one storage and the comparison holds whatever the optimizer computes.
Every comparison here first checks that the two sides own different memory.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def own_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A leaf parameter holding a copy of ``t`` (in ``dtype``) in memory of its own."""
    copy = t.detach().to(dtype or t.dtype, copy=True)
    return torch.nn.Parameter(copy, requires_grad=True)


def assert_separate(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """The two sides of a comparison must not share storage (see the module's NOTE)."""
    a, b = ours.untyped_storage(), ref.untyped_storage()
    if a.nbytes() and b.nbytes():
        assert a.data_ptr() != b.data_ptr(), "the compared tensors share one storage"


def assert_elements_close(ours: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float,
                          what: str = "") -> None:
    """Element by element: |ours - ref| <= atol + rtol * |ref| everywhere (never a norm)."""
    assert_separate(ours, ref)
    ours, ref = ours.detach().float().reshape(-1), ref.detach().float().reshape(-1)
    assert ours.shape == ref.shape, f"{what}: {tuple(ours.shape)} vs {tuple(ref.shape)}"
    gap = (ours - ref).abs()
    bound = atol + rtol * ref.abs()
    bad = ~(gap <= bound)  # NaN anywhere fails too
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {ours.numel()} elements differ "
                             f"(first at {i}: {ours[i].item()!r} vs {ref[i].item()!r}, "
                             f"largest gap {gap.max().item():.3g})")


def assert_identical(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor],
                     what: str = "") -> None:
    """Bit for bit, pair by pair (dtypes included), each pair with its own storage."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} vs {len(ref)} tensors"
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_separate(a, b)
        assert a.dtype == b.dtype, f"{what}[{i}]: {a.dtype} vs {b.dtype}"
        same = (a.detach() == b.detach()) | (a.detach().isnan() & b.detach().isnan())
        if not bool(same.all()):
            gap = (a.detach().float() - b.detach().float()).abs().nan_to_num(float("inf"))
            raise AssertionError(f"{what}[{i}]: {int((~same).sum())} of {a.numel()} elements "
                                 f"differ, largest gap {gap.max().item():.3g}")


def fixed_grads(shapes: Iterable, steps: int, seed: int = 1) -> list:
    """Gradients that do not depend on the weights, one list per step, spanning 1e-4 to 1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = [10.0 ** -int(torch.randint(0, 5, (1,), generator=gen)) for _ in shapes]
        out.append([torch.randn(s, generator=gen) * c for s, c in zip(shapes, scale)])
    return out


def copies(model: torch.nn.Module) -> list:
    """The model's parameter values, each in memory of its own."""
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- shared settings

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md: fp32 moments equal torch.optim.AdamW
PRECISIONS = ("fp32", "bf16", "fp8")
MODES = ("sync", "async")


def bridge(params, mode: str, model: torch.nn.Module | None = None, **kwargs):
    """An AdamBridge over ``params`` in ``mode``. Async mode hooks every parameter (threshold
    0), so even a one-element tensor travels through the pipeline rather than the step."""
    from adambridge import AdamBridge
    if mode == "async":
        kwargs.setdefault("small_param_threshold", 0)
    opt = AdamBridge(params, **kwargs)
    if mode == "async":
        opt.attach_hooks(model)
    elif mode != "sync":
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    return opt


def backward_with(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """A real backward whose gradient for each parameter is exactly ``g`` (in p's dtype):
    d/dp sum(p * g) = g, so the hooks of async mode fire as they would in training."""
    loss = sum((p * g.to(p.dtype)).sum() for p, g in zip(params, grads))
    loss.backward()


def adamw_twin(values: Sequence[torch.Tensor], **kwargs):
    """torch.optim.AdamW over fp32 copies of ``values`` (the reference for any param dtype)."""
    ref = [own_copy(v, torch.float32) for v in values]
    return ref, torch.optim.AdamW(ref, **kwargs)


def step_reference(ref: Sequence[torch.Tensor], opt, grads: Sequence[torch.Tensor],
                   dtype: torch.dtype) -> None:
    """One AdamW step on the fp32 reference with the gradient the subject saw (rounded to
    the subject's dtype first, as its backward produced it)."""
    for r, g in zip(ref, grads):
        r.grad = g.to(dtype).float()
    opt.step()


def master_of(opt, p: torch.Tensor) -> torch.Tensor:
    """The fp32 value AdamBridge holds for ``p``: its master, shaped like ``p``."""
    state = opt.state[p]
    if "master" in state:
        return state["master"].view(p.shape)
    return p.detach()


def assert_matches_adamw(opt, params, ref, ref_opt, *, moments: bool = True,
                         what: str = "") -> None:
    """fp32 moments: master (and the parameter, where fp32) and both moments equal AdamW's
    element by element within the tolerance of docs/numerics.md; a low-precision parameter is its
    master rounded to nearest even, bit for bit."""
    for i, (p, r) in enumerate(zip(params, ref)):
        master = master_of(opt, p)
        assert_elements_close(master, r, rtol=RTOL, atol=ATOL, what=f"{what} master[{i}]")
        if p.dtype != torch.float32:
            assert_identical([p.detach()], [master.to(p.dtype)], what=f"{what} write-back[{i}]")
        if moments:
            for key in ("exp_avg", "exp_avg_sq"):
                assert_elements_close(opt.state[p][key], ref_opt.state[r][key], rtol=RTOL,
                                      atol=ATOL, what=f"{what} {key}[{i}]")
        assert int(opt.state[p]["step"]) == int(ref_opt.state[r]["step"]), what


def state_tensors(opt, params) -> list:
    """Every tensor of the optimizer's state for ``params``, in a fixed order, copied."""
    return [opt.state[p][key].detach().clone() for p in params for key in sorted(opt.state[p])]
