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
