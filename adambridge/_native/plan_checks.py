"""The step plan's metadata pass (csrc_torch/plan_checks.cpp): loaded once per process, or None.

Every function answers a question a step plan asks each step (is each tensor still the one its
row describes, are the gradients fit to take, are the state dicts unchanged) in one native
pass. None of them raises for a mismatch: they say False, and the plan takes the full path,
which raises whatever is wrong. ``load()`` returns None (and ``unavailable_reason()`` says
why) when the library cannot be had: no C++ compiler, no torch headers, Windows, or
``ADAMBRIDGE_TORCH_FACTS=0``; the plan then makes the same checks in Python.

The first build takes about 10 s, so a step never waits for it: ``start_loading()`` runs
``load()`` on a daemon thread, and ``loaded()`` answers at once with the library or None.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Optional, Sequence

import torch

from . import build, loader, torch_build

log = logging.getLogger("adambridge.build")

ABI = 1              # AB_FACTS_ABI of plan_checks.cpp
ROW_WORDS = 12       # AB_ROW_WORDS: pointer, dtype code, dim, AB_MAX_DIM sizes, scratch
MAX_DIM = 8
_ALL_MATCH = -1

_I64, _PTR, _OBJ = ctypes.c_int64, ctypes.c_void_p, ctypes.py_object
# PYFUNCTYPE: the GIL stays held (the pass reads Python objects) and a Python error set inside
# would be raised on return.
_PROTOTYPES = {
    "ab_read_rows": (_I64, _OBJ, _PTR, ctypes.c_int),
    "ab_check_rows": (_I64, _OBJ, _PTR),
    "ab_take_grads": (_I64, _OBJ, _PTR, _PTR, _I64),
    "ab_check_states": (_I64, _OBJ, _OBJ, _PTR, _PTR, _I64),
    "ab_same_items": (_I64, _OBJ, _PTR, _I64),
    "ab_same_dict": (_I64, _OBJ, _PTR, _PTR, _I64),
    "ab_bump_versions": (_I64, _OBJ),
    "ab_read_versions": (_I64, _OBJ, _PTR),
}


class TorchFacts:
    """The loaded library's passes, over plain Python lists (never tuples) of tensors."""

    def __init__(self, lib: ctypes.CDLL, path):
        self.path = path
        abi = ctypes.CFUNCTYPE(ctypes.c_int)(("ab_facts_abi", lib))()
        if abi != ABI:
            raise build.NativeBuildError(f"{path} has facts ABI {abi}, this adambridge needs {ABI}")
        self._fn = {name: ctypes.PYFUNCTYPE(*types)((name, lib)) for name, types in _PROTOTYPES.items()}

    def read_rows(self, tensors: list, of_grads: bool = False) -> Optional[torch.Tensor]:
        """The (len, ROW_WORDS) int64 rows of the tensors (or of their gradients), or None
        when one is not a plain contiguous CPU tensor of at most MAX_DIM dimensions."""
        rows = torch.zeros((len(tensors), ROW_WORDS), dtype=torch.int64)
        found = self._fn["ab_read_rows"](tensors, rows.data_ptr(), int(of_grads))
        return rows if found == _ALL_MATCH else None

    def same_rows(self, tensors: list, rows: torch.Tensor) -> bool:
        """Each tensor still plain, with its row's pointer, dtype and sizes."""
        return self._fn["ab_check_rows"](tensors, rows.data_ptr()) == _ALL_MATCH

    def take_grads(self, params: list, rows: torch.Tensor, column: int, stride: int) -> bool:
        """Each parameter's gradient plain, with its row's dtype and sizes; if all are, each
        pointer is written into its row and at ``column + i * stride`` (bytes). Either way
        the last word of each row is scratch."""
        return self._fn["ab_take_grads"](params, rows.data_ptr(), column, stride) == _ALL_MATCH

    def same_states(self, dicts: list, keys: tuple, refs: torch.Tensor, ptrs: torch.Tensor,
                    ntensors: int) -> bool:
        """dicts[i][keys[j]] is the object at refs[i, j], and the last ntensors of them still
        have the storage at ptrs[i, t]."""
        return self._fn["ab_check_states"](dicts, keys, refs.data_ptr(), ptrs.data_ptr(),
                                           ntensors) == _ALL_MATCH

    def same_items(self, lists: list, addresses: torch.Tensor) -> bool:
        """The items of the lists, in order, are the objects at addresses (int64), no more."""
        return self._fn["ab_same_items"](lists, addresses.data_ptr(), addresses.numel()) == 1

    def same_dict(self, mapping: dict, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """mapping holds, in order, the key objects at keys to the value objects at values."""
        return self._fn["ab_same_dict"](mapping, keys.data_ptr(), values.data_ptr(),
                                        keys.numel()) == 1

    def bump_versions(self, tensors: list) -> None:
        """torch.autograd.graph.increment_version(tensors), which also raises what it raises."""
        failed = self._fn["ab_bump_versions"](tensors)
        if failed != _ALL_MATCH:
            torch.autograd.graph.increment_version(tensors[failed:])

    def versions(self, tensors: list) -> torch.Tensor:
        """The autograd version of each tensor (int64)."""
        out = torch.empty(len(tensors), dtype=torch.int64)
        if self._fn["ab_read_versions"](tensors, out.data_ptr()) != _ALL_MATCH:
            return torch.tensor([t._version for t in tensors], dtype=torch.int64)
        return out


def object_addresses(objects: Sequence) -> torch.Tensor:
    """id() of each object as int64 (CPython: its address), the refs of same_states."""
    return torch.tensor(list(map(id, objects)), dtype=torch.int64)


def disabled() -> bool:
    return os.environ.get("ADAMBRIDGE_TORCH_FACTS", "").strip().lower() in ("0", "false", "no", "off")


_reason: list = []
_lock = threading.Lock()
_start_lock = threading.Lock()
_loaded: list = []   # the TorchFacts, once load() has made it
_loading: list = []  # the thread start_loading() started


def load() -> Optional[TorchFacts]:
    """The library, built on first call (about 10 s, once per torch version), or None."""
    if disabled():
        return None
    with _lock:
        return _load()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[TorchFacts]:
    try:
        lib, built = loader._dlopen(planner=torch_build.plan)
        facts = TorchFacts(lib, built.path)
    except (build.NativeBuildError, OSError, AttributeError, ValueError) as exc:
        # Only speed is lost: the plan checks the same facts in Python. (ValueError: a bad
        # ADAMBRIDGE_BUILD_TIMEOUT, which the kernel's own build reports.)
        _reason.append(str(exc))
        log.info("adambridge: no torch metadata pass (%s); step plans check in Python", exc)
        return None
    _loaded.append(facts)
    return facts


def start_loading() -> None:
    """load() on a daemon thread, once per process (later calls do nothing)."""
    with _start_lock:  # (not load's lock, which the thread holds for the whole build)
        if _loading or _loaded or _reason or disabled():
            return
        thread = threading.Thread(target=load, name="adambridge-torch-facts", daemon=True)
        _loading.append(thread)
    thread.start()


def _after_fork_in_child() -> None:
    # The loading thread is not in the child, and it may have held the lock at the fork.
    global _lock, _start_lock
    _lock, _start_lock = threading.Lock(), threading.Lock()
    _loading.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def loaded() -> Optional[TorchFacts]:
    """The library if a load() has finished with it, else None; never waits."""
    return None if disabled() or not _loaded else _loaded[0]


def unavailable_reason() -> Optional[str]:
    """Why load() returned None, if it did (None before the first load and when loaded)."""
    if disabled():
        return "disabled by ADAMBRIDGE_TORCH_FACTS=0"
    return _reason[0] if _reason else None


def reset() -> None:
    """Forget the loaded library (tests)."""
    for thread in _loading:
        thread.join()
    _load.cache_clear()
    _reason.clear()
    _loaded.clear()
    _loading.clear()
