"""What ``p.grad`` is in asynchronous mode once a hook has taken the gradient: a GradView.

A hook copies each gradient to the host as soon as backward produces it and the worker may
update the parameter before ``step()`` (docs/async.md). Whatever the loop then does to
``p.grad`` (read a norm, scale, mask, add noise, clip, all-reduce, zero it) must act on the
gradient the update uses, as it would in sync mode. Rather than recognising the functions a
loop calls (the next framework always brings another), ``p.grad`` becomes a tensor whose
every operation reaches that gradient: a ``torch.Tensor`` wrapper subclass with the
gradient's shape, dtype and device and no storage of its own. Every aten operation on it
comes to ``__torch_dispatch__`` here (``__torch_function__`` is disabled), which

- answers a read from the values the step holds (its ``Source``): on the CPU the host
  gradient itself, on a GPU a device copy made for the operation, or the kept device
  gradient with ``release_grads=False``; the operation itself runs as torch runs it, so the
  result has sync mode's bits (a norm of a GPU gradient is taken on its host copy instead,
  as the routed clip takes it: its last bit may differ from the GPU's);
- lets a write (any argument the operator's schema marks as written: in place, ``out=``,
  ``_foreach_*_``, c10d collectives) reach the step only through ``Source.open_write``, which
  asks the pipeline first (pipeline/grad_edits.py ``allow_grad_write``: it may refuse in one line
  before anything changed) and ``Source.close_write``, which hands the written values back;
- returns, for a view operation (``view``, ``detach``, ``.data``, indexing, ``split``), a
  GradView of that view, so writes through it are seen too.

What reads memory rather than calling an operator (``numpy()``, ``tolist()``, ``print``,
``torch.save``) gets the values; what needs the storage itself (``data_ptr()``) raises,
loudly, as for any storage-less tensor. After ``step()`` the views a step made are retired:
a reference kept past the step raises on use instead of showing the next step's buffers.
"""
from __future__ import annotations

import abc
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

# Operations that change a tensor's own shape or strides in place: a view cannot follow.
_METADATA_WRITES = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_",
                    "swapaxes_", "resize_", "resize_as_", "set_", "_resize_output_"}
# Reductions answered from the host copy of a released GPU gradient, without copying it back
# to the device (a loop or framework that logs or clips by the norm reads every gradient).
_HOST_NORMS = {aten.linalg_vector_norm.default}
# A _foreach_ call over released GPU gradients is split into calls over at most this many
# bytes of them, so it never brings every gradient back to the device at once.
FOREACH_BATCH_BYTES = 1 << 28


class Source(abc.ABC):
    """Where a GradView's values are: how an operation reads them and writes them.

    (Sources and views have __slots__: a view is made per gradient per step, and each is one
    object for the cyclic GC to track, not two.)"""

    __slots__ = ("device",)

    @property
    def host_values(self) -> Optional[torch.Tensor]:
        """The values on the host without a copy, where a GPU view's values live there."""
        return None

    @abc.abstractmethod
    def read(self) -> torch.Tensor:
        """The values, as a tensor on the view's device (a copy where they live elsewhere)."""

    @abc.abstractmethod
    def open_write(self) -> torch.Tensor:
        """A tensor on the view's device that an operation may write in place."""

    def close_write(self, written: torch.Tensor) -> None:
        """The operation has written ``written`` (what open_write returned)."""

    def shadow(self) -> Optional[torch.Tensor]:
        """The gradient as sync mode would hold it, where ADAMBRIDGE_VERIFY_ASYNC keeps one
        (pipeline/verify.py); None elsewhere (both worlds then share these values)."""
        return None

    def step_source(self) -> Optional["StepSource"]:
        """The StepSource these values come from, if any."""
        return None


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


class KeptSource(Source):
    """Values held in one plain tensor (what a write to a zero view leaves)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.device = tensor, tensor.device

    def read(self) -> torch.Tensor:
        return self.tensor

    def open_write(self) -> torch.Tensor:
        return self.tensor


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


class DerivedSource(Source):
    """A view (``view``, ``detach``, indexing, ...) of another GradView, replayed on its values."""

    __slots__ = ("parent", "_func", "_args", "_kwargs", "_index", "_open")

    def __init__(self, parent: "GradView", func: Any, args: tuple, kwargs: dict,
                 index: Optional[int]) -> None:
        self.parent, self.device = parent, parent.device
        self._func, self._args, self._kwargs, self._index = func, args, kwargs, index
        self._open: Optional[torch.Tensor] = None

    def _replay(self, base: torch.Tensor) -> torch.Tensor:
        out = self._func(base, *self._args[1:], **self._kwargs)
        return out if self._index is None else out[self._index]

    def read(self) -> torch.Tensor:
        return self._replay(self.parent.source.read())

    def open_write(self) -> torch.Tensor:
        self._open = self.parent.source.open_write()
        return self._replay(self._open)

    def close_write(self, written: torch.Tensor) -> None:
        base, self._open = self._open, None
        self.parent.source.close_write(base)

    def shadow(self) -> Optional[torch.Tensor]:
        base = self.parent.source.shadow()
        return None if base is None else self._replay(base)

    def step_source(self) -> Optional["StepSource"]:
        return self.parent.source.step_source()


class GradView(torch.Tensor):
    """``p.grad`` after the hook: every operation on it reaches the step's gradient."""

    __slots__ = ("source",)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, source: Optional[Source] = None) -> "GradView":
        view = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device,
            requires_grad=False)
        view.source = source if source is not None else ZeroSource(view)
        return view

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.source.read())

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save / deepcopy / pickle: the values, as a plain tensor (as sync has them)
        return self.source.read().clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.source.read().clone()

    # What reads a tensor's memory rather than going through an operator: the values.
    def numpy(self, *, force: bool = False) -> Any:
        return self.source.read().numpy(force=force)

    def tolist(self) -> Any:
        return self.source.read().tolist()

    def __array__(self, dtype: Any = None) -> Any:
        return self.source.read().__array__(dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        return _dispatch(func, args, kwargs or {})


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


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    name = func.overloadpacket.__name__
    if func is aten.detach_.default:
        return args[0]
    if name in _METADATA_WRITES:
        raise RuntimeError(f"adambridge: p.grad.{name}() changes the gradient tensor's shape in "
                           f"place, which async mode cannot follow once a hook has taken the "
                           f"gradient; make a new tensor instead "
                           f"(p.grad = p.grad.{name[:-1]}(...))")
    if func.is_view and isinstance(args[0], GradView):
        return _derived(func, args, kwargs)
    written = _written_views(func, args, kwargs)
    if name.startswith("_foreach_") and _spans_host_copies(args):
        return _foreach_in_batches(func, args, kwargs)
    if func in _HOST_NORMS and isinstance(args[0], GradView):
        host = args[0].source.host_values
        if host is not None:
            return func(host, *args[1:], **kwargs).to(args[0].device)
    return _run(func, args, kwargs, written)


def _run(func: Any, args: tuple, kwargs: dict, written: list) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    opened: dict = {}
    for view in written:
        if id(view) not in opened:
            opened[id(view)] = (view, view.source.open_write())
    values = [opened[id(x)][1] if id(x) in opened else x.source.read()
              if isinstance(x, GradView) else x for x in flat]
    call_args, call_kwargs = tree_unflatten(values, spec)
    out = func(*call_args, **call_kwargs)
    _wait_for_collective(func, out)
    for view, tensor in opened.values():
        view.source.close_write(tensor)
    if any(isinstance(x, GradView) and x.source.shadow() is not None for x in flat):
        _mirror(func, flat, spec, [view for view, _ in opened.values()], out)
    by_tensor = {id(tensor): view for view, tensor in opened.values()}
    out_flat, out_spec = tree_flatten(out)
    return tree_unflatten([by_tensor.get(id(x), x) for x in out_flat], out_spec)


def _written_views(func: Any, args: tuple, kwargs: dict) -> list:
    """The GradViews in the arguments the operator's schema marks as written."""
    return [x for x in _written_args(func, args, kwargs) if isinstance(x, GradView)]


def _derived(func: Any, args: tuple, kwargs: dict) -> Any:
    parent = args[0]
    sample = _view_metadata(func, parent, args, kwargs)
    if isinstance(sample, torch.Tensor):
        return GradView(sample, DerivedSource(parent, func, args, kwargs, None))
    return type(sample)(GradView(s, DerivedSource(parent, func, args, kwargs, i))
                        for i, s in enumerate(sample))


def _view_metadata(func: Any, parent: "GradView", args: tuple, kwargs: dict) -> Any:
    """The view's shape and strides, from a meta tensor laid out as ``parent`` (no read of
    its values: on a GPU that would copy the gradient to the device for nothing)."""
    meta = torch.empty_strided(parent.shape, parent.stride(), dtype=parent.dtype, device="meta")
    try:
        return func(meta, *args[1:], **kwargs)
    except (RuntimeError, NotImplementedError, TypeError):  # an argument on another device
        return func(parent.source.read(), *args[1:], **kwargs)


def _wait_for_collective(func: Any, out: Any) -> None:
    # A c10d collective on a gradient (dist.all_reduce(p.grad)) returns its Work: the values
    # are final only once it has run, and close_write hands them to the step now.
    if func.namespace != "c10d":
        return
    for x in tree_flatten(out)[0]:
        wait: Optional[Callable[[], Any]] = getattr(x, "wait", None)
        if wait is not None and not isinstance(x, torch.Tensor):
            wait()


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
        outs.append(_run(func, part, kwargs, _written_views(func, part, kwargs)))
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
               or len(written) < len(_written_args(func, *tree_unflatten(flat, spec))))
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


def _written_args(func: Any, args: tuple, kwargs: dict) -> list:
    """Every tensor (view or not) the schema marks as written."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [x for x in values if isinstance(x, torch.Tensor)]
    return found
