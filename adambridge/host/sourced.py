"""Tensors whose values live elsewhere: every aten operation on one reaches its ``Source``.

Two things in adambridge hand out a tensor whose values are not in its own memory:
``p.grad`` in asynchronous mode (pipeline/grad_views.py: the gradient the step holds) and
the NVMe tier's ``state_dict()`` entries (nvme/filed.py: pages in the tier's files, read
when something reads them). Both are a ``SourcedTensor``: a ``torch.Tensor`` wrapper
subclass with the values' shape, dtype and device and no storage of its own, whose every
aten operation comes to ``__torch_dispatch__`` here (``__torch_function__`` is disabled).

- A read gets the values from ``Source.read`` and runs the operation as torch runs it, so
  the result has the bits the values would give in a plain tensor.
- A write (any argument the operator's schema marks as written: in place, ``out=``,
  ``_foreach_*_``, c10d collectives) reaches the values only through ``Source.open_write``
  (which may refuse in one line before anything changed) and ``Source.close_write``, which
  hands the written values back.
- A view operation (``view``, ``detach``, ``.data``, indexing, ``split``) gives a tensor of
  the same class over a ``DerivedSource``, which replays the view on its parent's values,
  so writes through it are seen too.

What reads memory rather than calling an operator (``numpy()``, ``tolist()``, ``print``,
pickling, ``torch.save``, ``copy.deepcopy``) gets the values as a plain tensor; what needs
the storage itself (``data_ptr()``) raises, loudly, as for any storage-less tensor.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

# Operations that change a tensor's own shape or strides in place: a view cannot follow.
_METADATA_WRITES = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_",
                    "swapaxes_", "resize_", "resize_as_", "set_", "_resize_output_"}


class Source(abc.ABC):
    """Where a SourcedTensor's values are: how an operation reads them and writes them.

    (Sources and tensors have __slots__: a p.grad view is made per gradient per step, and
    each is one object for the cyclic GC to track, not two.)"""

    __slots__ = ("device",)
    # Whether snapshot() makes the values anew (read from a file, say) rather than copying
    # memory that already holds them: a view's snapshot then takes the parent's.
    fresh_snapshots = False

    @abc.abstractmethod
    def read(self) -> torch.Tensor:
        """The values, as a tensor on the view's device (a copy where they live elsewhere)."""

    @abc.abstractmethod
    def open_write(self) -> torch.Tensor:
        """A tensor on the view's device that an operation may write in place."""

    def close_write(self, written: torch.Tensor) -> None:
        """The operation has written ``written`` (what open_write returned)."""

    def snapshot(self) -> torch.Tensor:
        """The values in a plain tensor of their own, which nothing else changes."""
        return self.read().clone()

    def shadow(self) -> Optional[torch.Tensor]:
        """The values as another world holds them, where one is kept (pipeline/verify.py);
        None elsewhere."""
        return None

    def step_source(self) -> Any:
        """The asynchronous step's source these values come from, if any (grad_views.py)."""
        return None


class KeptSource(Source):
    """Values held in one plain tensor."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.device = tensor, tensor.device

    def read(self) -> torch.Tensor:
        return self.tensor

    def open_write(self) -> torch.Tensor:
        return self.tensor


class DerivedSource(Source):
    """A view (``view``, ``detach``, indexing, ...) of another SourcedTensor, replayed on its
    values."""

    __slots__ = ("parent", "_func", "_args", "_kwargs", "_index", "_open")

    @property
    def fresh_snapshots(self) -> bool:  # type: ignore[override]
        return self.parent.source.fresh_snapshots  # a view of a view of fresh values

    def __init__(self, parent: "SourcedTensor", func: Any, args: tuple, kwargs: dict,
                 index: Optional[int]) -> None:
        self.parent, self.device = parent, parent.device
        self._func, self._args, self._kwargs, self._index = func, args, kwargs, index
        self._open: Optional[torch.Tensor] = None

    def _replay(self, base: torch.Tensor) -> torch.Tensor:
        out = self._func(base, *self._args[1:], **self._kwargs)
        return out if self._index is None else out[self._index]

    def read(self) -> torch.Tensor:
        return self._replay(self.parent.source.read())

    def snapshot(self) -> torch.Tensor:
        if not self.parent.source.fresh_snapshots:
            return self.read().clone()
        whole = self.parent.source.snapshot()  # its own already: no second copy
        view = self._replay(whole)
        return view if view.numel() == whole.numel() and view.is_contiguous() else view.clone()

    def open_write(self) -> torch.Tensor:
        self._open = self.parent.source.open_write()
        return self._replay(self._open)

    def close_write(self, written: torch.Tensor) -> None:
        base, self._open = self._open, None
        self.parent.source.close_write(base)

    def shadow(self) -> Optional[torch.Tensor]:
        base = self.parent.source.shadow()
        return None if base is None else self._replay(base)

    def step_source(self) -> Any:
        return self.parent.source.step_source()


class SourcedTensor(torch.Tensor):
    """A tensor whose every operation reaches its ``source``; subclasses say why a shape
    change in place is refused (``SHAPE_CHANGE_REFUSAL``) and may take some operations
    first (``_dispatch``)."""

    __slots__ = ("source",)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: Any, source: Source, device: Any = None) -> "SourcedTensor":
        view = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype,
            device=like.device if device is None else device, requires_grad=False)
        view.source = source
        return view

    # The one line a shape change in place (t_, resize_, ...) is refused with: {name} is the
    # operation, {call} the same without its trailing underscore. Subclasses say their own.
    SHAPE_CHANGE_REFUSAL = ("adambridge: .{name}() changes a tensor's shape in place, which a "
                            "tensor whose values live elsewhere cannot follow; make a new "
                            "tensor instead (x = x.{call}(...))")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.source.read())

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save / pickle: the values, as a plain tensor
        return self.source.snapshot().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.source.snapshot()

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
        return cls._dispatch(func, args, kwargs or {})

    @classmethod
    def _dispatch(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        early = dispatch_views(func, args, kwargs)
        if early is not NotImplemented:
            return early
        return run(func, args, kwargs, written_views(func, args, kwargs))


def plain(value: Any) -> Any:
    """A real tensor with ``value``'s values (``value`` itself unless it is a SourcedTensor)."""
    return value.source.read() if isinstance(value, SourcedTensor) else value


# --------------------------------------------------------------------------- dispatch


def dispatch_views(func: Any, args: tuple, kwargs: dict) -> Any:
    """What every SourcedTensor does first: ``detach_`` is a no-op, a shape change in place
    is refused, a view operation gives a derived view; NotImplemented for anything else."""
    name = func.overloadpacket.__name__
    if func is aten.detach_.default:
        return args[0]
    if name in _METADATA_WRITES and isinstance(args[0], SourcedTensor):
        raise RuntimeError(args[0].SHAPE_CHANGE_REFUSAL.format(name=name, call=name[:-1]))
    if func.is_view and isinstance(args[0], SourcedTensor):
        return _derived(func, args, kwargs)
    return NotImplemented


def run(func: Any, args: tuple, kwargs: dict, written: list,
        after: Optional[Callable[..., None]] = None) -> Any:
    """``func`` on the values: written views opened, then closed; ``after(func, flat, spec,
    written, out)`` runs once the writes are closed (grad_views' verification)."""
    flat, spec = tree_flatten((args, kwargs))
    opened: dict = {}
    for view in written:
        if id(view) not in opened:
            opened[id(view)] = (view, view.source.open_write())
    values = [opened[id(x)][1] if id(x) in opened else x.source.read()
              if isinstance(x, SourcedTensor) else x for x in flat]
    call_args, call_kwargs = tree_unflatten(values, spec)
    out = func(*call_args, **call_kwargs)
    _wait_for_collective(func, out)
    for view, tensor in opened.values():
        view.source.close_write(tensor)
    if after is not None:
        after(func, flat, spec, [view for view, _ in opened.values()], out)
    by_tensor = {id(tensor): view for view, tensor in opened.values()}
    out_flat, out_spec = tree_flatten(out)
    return tree_unflatten([by_tensor.get(id(x), x) for x in out_flat], out_spec)


def written_views(func: Any, args: tuple, kwargs: dict) -> list:
    """The SourcedTensors in the arguments the operator's schema marks as written."""
    return [x for x in written_args(func, args, kwargs) if isinstance(x, SourcedTensor)]


def written_args(func: Any, args: tuple, kwargs: dict) -> list:
    """Every tensor (view or not) the schema marks as written."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [x for x in values if isinstance(x, torch.Tensor)]
    return found


def _derived(func: Any, args: tuple, kwargs: dict) -> Any:
    parent = args[0]
    kind = type(parent)
    sample = _view_metadata(func, parent, args, kwargs)  # (on the meta device)
    if isinstance(sample, torch.Tensor):
        return kind(sample, DerivedSource(parent, func, args, kwargs, None), parent.device)
    return type(sample)(kind(s, DerivedSource(parent, func, args, kwargs, i), parent.device)
                        for i, s in enumerate(sample))


def _view_metadata(func: Any, parent: SourcedTensor, args: tuple, kwargs: dict) -> Any:
    """The view's shape and strides, from a meta tensor laid out as ``parent`` (no read of
    its values: on a GPU or in a file that would copy them for nothing)."""
    meta = torch.empty_strided(parent.shape, parent.stride(), dtype=parent.dtype, device="meta")
    try:
        return func(meta, *args[1:], **kwargs)
    except (RuntimeError, NotImplementedError, TypeError):  # an argument on another device
        return func(parent.source.read(), *args[1:], **kwargs)


def _wait_for_collective(func: Any, out: Any) -> None:
    # A c10d collective on a view (dist.all_reduce(p.grad)) returns its Work: the values are
    # final only once it has run, and close_write hands them back now.
    if func.namespace != "c10d":
        return
    for x in tree_flatten(out)[0]:
        wait: Optional[Callable[[], Any]] = getattr(x, "wait", None)
        if wait is not None and not isinstance(x, torch.Tensor):
            wait()
