"""What ``p.grad`` is in asynchronous mode once a hook has taken the gradient: a GradView.

A hook copies each gradient to the host as soon as backward produces it and the worker may
update the parameter before ``step()`` (docs/async.md). Whatever the loop then does to
``p.grad`` (read a norm, scale, mask, add noise, clip, all-reduce, zero it) must act on the
gradient the update uses, as it would in sync mode. Rather than recognising the functions a
loop calls (the next framework always brings another), ``p.grad`` becomes a tensor whose
every operation reaches that gradient: a ``SourcedTensor`` (host/sourced.py, which says how
reads, writes and views reach a source) over the step's gradient, its ``StepSource``:

- a read is answered from the values the step holds: on the CPU the host gradient itself,
  on a GPU a device copy made for the operation, or the kept device gradient with
  ``release_grads=False`` (a norm of a GPU gradient is taken on its host copy instead, as
  the routed clip takes it: its last bit may differ from the GPU's);
- a write asks the pipeline first (pipeline/grad_edits.py ``allow_grad_write``: it may
  refuse in one line before anything changed) and hands the written values to the step;
- a ``_foreach_`` call over released GPU gradients runs in batches, so it never brings every
  gradient back to the device at once;
- with ADAMBRIDGE_VERIFY_ASYNC, every operation runs once more on the sync-mode shadows.

After ``step()`` the views a step made are retired: a reference kept past the step raises
on use instead of showing the next step's buffers.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..host.sourced import (KeptSource, Source, SourcedTensor, dispatch_views, run,
                            written_args, written_views)

aten = torch.ops.aten

# Reductions answered from the host copy of a released GPU gradient, without copying it back
# to the device (a loop or framework that logs or clips by the norm reads every gradient).
_HOST_NORMS = {aten.linalg_vector_norm.default}
# A _foreach_ call over released GPU gradients is split into calls over at most this many
# bytes of them, so it never brings every gradient back to the device at once.
FOREACH_BATCH_BYTES = 1 << 28


class StepSource(Source):
    """The gradient a step holds for ``p``: its flat host copy ``host`` (landed once every
    ticket has) and, with ``release_grads=False``, the device gradient ``kept`` as well.
    ``owner`` (the pipeline, weakly) is asked before any write. One per parameter, armed by
    each step's hook and disarmed when the step ends."""

    __slots__ = ("_owner", "p", "host", "kept", "tickets", "shadow_grad")

    def __init__(self, owner: Any, p: torch.Tensor) -> None:
        self._owner, self.p, self.device = weakref.ref(owner), p, p.device
        self.disarm()

    def arm(self, host: torch.Tensor, kept: Optional[torch.Tensor], tickets: Sequence[Any],
            shadow: Optional[torch.Tensor] = None) -> None:
        self.host, self.kept, self.tickets, self.shadow_grad = host, kept, tickets, shadow

    def disarm(self) -> None:
        """Let go of the step's gradients (a new step arms it again)."""
        self.host = self.kept = self.shadow_grad = None
        self.tickets = ()

    def shadow(self) -> Optional[torch.Tensor]:
        return self.shadow_grad

    def step_source(self) -> Optional["StepSource"]:
        return self

    @property
    def owner(self) -> Any:
        return self._owner()

    def _landed(self) -> torch.Tensor:
        for ticket in self.tickets:
            ticket.wait()
        return self.host.view(self.p.shape)

    @property
    def host_values(self) -> Optional[torch.Tensor]:
        if self.kept is not None or self.device.type == "cpu":
            return None  # read() has the values where they are already
        return self._landed()

    def read(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        host = self._landed()
        return host if self.device.type == "cpu" else host.to(self.device)

    def open_write(self) -> torch.Tensor:
        self.owner.allow_grad_write(self.p)  # may refuse: nothing has been written yet
        return self.read()

    def close_write(self, written: torch.Tensor) -> None:
        if written.data_ptr() != self.host.data_ptr():  # a device tensor: back to the host
            self.host.copy_(written.reshape(-1))


class ZeroSource(Source):
    """zero_grad(set_to_none=False) after a step that consumed the gradient: zeros, made only
    when something writes to them (backward accumulating into them, for instance)."""

    __slots__ = ("_view",)

    def __init__(self, view: "GradView") -> None:
        self._view, self.device = view, view.device

    def read(self) -> torch.Tensor:
        return torch.zeros(self._view.shape, dtype=self._view.dtype, device=self.device)

    def open_write(self) -> torch.Tensor:
        zeros = self.read()
        self._view.source = KeptSource(zeros)  # written: from now on these values
        return zeros


class RetiredSource(Source):
    """A view kept past the step that made it."""

    __slots__ = ()
    why = ("adambridge: this p.grad belonged to a step that has finished (step() consumed "
           "it); read or change gradients between backward and step()")

    def read(self) -> torch.Tensor:
        raise RuntimeError(self.why)

    def open_write(self) -> torch.Tensor:
        raise RuntimeError(self.why)


RETIRED = RetiredSource()


class GradView(SourcedTensor):
    """``p.grad`` after the hook: every operation on it reaches the step's gradient."""

    __slots__ = ()

    @staticmethod
    def __new__(cls, like: torch.Tensor, source: Optional[Source] = None,
                device: Any = None) -> "GradView":
        view = SourcedTensor.__new__(cls, like, source, device)
        view.source = source if source is not None else ZeroSource(view)
        return view

    SHAPE_CHANGE_REFUSAL = ("adambridge: p.grad.{name}() changes the gradient tensor's shape "
                            "in place, which async mode cannot follow once a hook has taken "
                            "the gradient; make a new tensor instead "
                            "(p.grad = p.grad.{call}(...))")

    @classmethod
    def _dispatch(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        early = dispatch_views(func, args, kwargs)
        if early is not NotImplemented:
            return early
        if func.overloadpacket.__name__.startswith("_foreach_") and _spans_host_copies(args):
            return _foreach_in_batches(func, args, kwargs)
        if func in _HOST_NORMS and isinstance(args[0], GradView):
            host = getattr(args[0].source, "host_values", None)
            if host is not None:
                return func(host, *args[1:], **kwargs).to(args[0].device)
        return _run(func, args, kwargs, written_views(func, args, kwargs))


def zeros_like(p: torch.Tensor) -> GradView:
    """A view of zeros shaped as ``p``'s gradient (no memory until written)."""
    return GradView(p)


def plain(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A real tensor with ``grad``'s values (``grad`` itself unless it is a GradView)."""
    return grad.source.read() if isinstance(grad, GradView) else grad


def retire(view: GradView) -> None:
    """From now on any use of ``view`` raises (RetiredSource.why)."""
    view.source = RETIRED


# --------------------------------------------------------------------------- dispatch


def current_write() -> Optional[str]:
    """The name of the operation now writing a view on this thread (None outside one)."""
    return getattr(_writing, "op", None)


_writing = threading.local()


def _run(func: Any, args: tuple, kwargs: dict, written: list) -> Any:
    if written and _can_try_first(func, args, kwargs, written):
        return _unless_unchanged(func, args, kwargs, written)
    _writing.op = func.overloadpacket.__name__
    try:
        return run(func, args, kwargs, written, after=_verified)
    finally:
        _writing.op = None


# --------------------------------------------------------------------------- no-op writes


def _can_try_first(func: Any, args: tuple, kwargs: dict, written: list) -> bool:
    """Whether a write can be run on copies first, to see if it changes anything: every
    written tensor is a view of a step's gradient (no two of the same one), not checked
    against sync mode, and the operation has no effect but its result (no collective, no
    random numbers)."""
    if func.namespace == "c10d" or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    if len(written) != len(written_args(func, args, kwargs)):
        return False  # a plain tensor is written too
    roots = set()
    for view in written:
        root = view.source.step_source() if isinstance(view, GradView) else None
        if root is None or root.host is None or view.source.shadow() is not None \
                or view.dtype.itemsize not in _BITS or not view.dtype.is_floating_point:
            return False
        if root.owner.changed_grads_this_step():
            return False  # the step already waits for the loop's edits: a try saves nothing
        if id(root) in roots:
            return False  # two views of one gradient written at once: they alias
        roots.add(id(root))
    return True


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _unless_unchanged(func: Any, args: tuple, kwargs: dict, written: list) -> Any:
    """``func`` run aside first: on copies of the written gradients, or (an in-place op
    with an out-of-place twin) as that twin. A write that changes no bit
    (``clip_grad_value_`` under its limit, ``nan_to_num_`` of finite values) is not a write:
    the step goes on as if it never happened, updates keep overlapping backward. One that
    changes a value is made as any write is (asked first, so it may be refused), with the
    values computed here."""
    before = [view.source.read() for view in written]
    twin = _out_of_place_twin(func, args, written)
    if twin is not None:
        call_args, call_kwargs = _values(args, kwargs, {})
        out = twin(*call_args, **call_kwargs)
        after = [x.to(b.dtype) for x, b in zip(out if isinstance(out, (list, tuple))
                                               else [out], before)]
        out = args[0] if isinstance(args[0], torch.Tensor) else None  # what func_ returns
        if any(a.shape != b.shape for a, b in zip(after, before)):
            twin = None  # (a broadcast the in-place op would refuse: run it as written)
    if twin is None:
        after = [b.clone() for b in before]
        call_args, call_kwargs = _values(args, kwargs, {id(v): a for v, a in zip(written, after)})
        out = func(*call_args, **call_kwargs)
    if not all(_same_bits(a, b) for a, b in zip(after, before)):
        _writing.op = func.overloadpacket.__name__
        try:
            opened = [(view, view.source.open_write()) for view in written]  # may refuse
        finally:
            _writing.op = None
        for (view, tensor), values in zip(opened, after):
            tensor.copy_(values)
            view.source.close_write(tensor)
    by_tensor = {id(a): view for view, a in zip(written, after)}
    out_flat, out_spec = tree_flatten(out)
    return tree_unflatten([by_tensor.get(id(x), x) for x in out_flat], out_spec)


def _values(args: tuple, kwargs: dict, replaced: dict) -> tuple:
    """(args, kwargs) with each view read, or replaced by ``replaced[id(view)]``."""
    flat, spec = tree_flatten((args, kwargs))
    return tree_unflatten([replaced[id(x)] if id(x) in replaced else x.source.read()
                           if isinstance(x, SourcedTensor) else x for x in flat], spec)


def _out_of_place_twin(func: Any, args: tuple, written: list) -> Any:
    """The out-of-place overload of an in-place ``func_`` that writes only its first
    argument (a tensor, or a _foreach_ list), or None: running it costs one pass fewer than
    a copy and the in-place op."""
    name = func.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_") and not name.startswith("_foreach_"):
        return None
    first = args[0] if args else None
    targets = list(first) if isinstance(first, (list, tuple)) else [first]
    if len(targets) != len(written) or any(a is not b for a, b in zip(targets, written)):
        return None
    return getattr(getattr(aten, name[:-1], None), func._overloadname, None)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit for bit: -0.0 is not 0.0, and a NaN replaced by another NaN is a change.
    kind = _BITS[a.dtype.itemsize]
    return torch.equal(a.view(kind), b.view(kind))


def _verified(func: Any, flat: list, spec: Any, written: list, out: Any) -> None:
    if any(isinstance(x, GradView) and x.source.shadow() is not None for x in flat):
        _mirror(func, flat, spec, written, out)


def _spans_host_copies(args: tuple) -> bool:
    """Whether a _foreach_ call reaches released GPU gradients (each read needs a copy)."""
    first = args[0] if args else None
    return isinstance(first, (list, tuple)) and any(
        isinstance(x, GradView) and x.device.type != "cpu" for x in first)


def _foreach_in_batches(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` over slices of its tensor lists of at most FOREACH_BATCH_BYTES of views each;
    the outputs (a list per call, or None for in-place ones) are put back together."""
    n = len(args[0])
    bounds, start, size = [], 0, 0
    for i, x in enumerate(args[0]):
        size += x.numel() * x.element_size()
        if size > FOREACH_BATCH_BYTES and i > start:
            bounds.append((start, i))
            start, size = i, x.numel() * x.element_size()
    bounds.append((start, n))
    outs = []
    for lo, hi in bounds:
        part = tuple(a[lo:hi] if isinstance(a, (list, tuple)) and len(a) == n else a
                     for a in args)
        outs.append(_run(func, part, kwargs, written_views(func, part, kwargs)))
    if all(out is None for out in outs):
        return None
    return [x for out in outs for x in out]


# --------------------------------------------------------------------------- verification


def _mirror(func: Any, flat: list, spec: Any, written: list, out: Any) -> None:
    """ADAMBRIDGE_VERIFY_ASYNC: the operation once more in sync mode's world, where each
    view is its shadow. A read must give the same bits; a write moves the shadows as sync
    mode's gradients would move. An operation with effects beyond its result (random
    numbers, a collective, a plain tensor written) is not run twice: its written shadows
    take the values it wrote, which do not depend on the world it ran in."""
    effects = (func.namespace == "c10d" or torch.Tag.nondeterministic_seeded in func.tags
               or len(written) < len(written_args(func, *tree_unflatten(flat, spec))))
    if effects:
        for view in written:
            shadow = view.source.shadow()
            if shadow is not None:
                shadow.copy_(view.source.read())
        return
    values = [_shadow_or_read(x) for x in flat]
    call_args, call_kwargs = tree_unflatten(values, spec)
    sync_out = func(*call_args, **call_kwargs)
    if written:
        return
    from .verify import same_read  # (verify imports nothing of this module's callers)
    if not same_read(out, sync_out):
        view = next(x for x in flat if isinstance(x, GradView) and x.source.shadow() is not None)
        root = view.source.step_source()
        raise RuntimeError(root.owner.read_mismatch(root.p, func, out, sync_out))


def _shadow_or_read(x: Any) -> Any:
    if not isinstance(x, GradView):
        return x
    shadow = x.source.shadow()
    return x.source.read() if shadow is None else shadow

