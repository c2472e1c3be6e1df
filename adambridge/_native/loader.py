"""Loading the native library with ctypes: prototypes, the ABI check, the ISA and thread pool knobs.

``load()`` builds on first use (build.py compiles, cache.py publishes), loads only the file that
trusted.py verified and hashed, and returns a ``Native`` whose ctypes functions all have
argtypes and restype set. ``native_or_none()`` is what backends call: it returns None,
after one warning per process, when no compiler works, so the caller falls back to torch.

Environment:
  ADAMBRIDGE_DISABLE_NATIVE=1   never load the library (the torch backend is used)
  ADAMBRIDGE_ISA=scalar|avx2|avx512|neon   force one instruction set (ab_set_isa)
  ADAMBRIDGE_BUILD_TIMEOUT=120  seconds that all compiler calls of one build may take together
"""
from __future__ import annotations

import array
import ctypes
import functools
import operator
import os
import struct
import threading
import warnings
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Optional, Sequence

from . import build, cache, trusted
from .build import INFO_HINT, NativeBuildError

ISA_NAMES = ("scalar", "avx2", "avx512", "neon")  # index = enum ab_isa
AB_ETHREAD = -4


class AbHyper(ctypes.Structure):
    """struct ab_hyper (adambridge.h)."""
    _fields_ = [("beta1", c_float), ("beta2", c_float), ("one_minus_beta1", c_float),
                ("one_minus_beta2", c_float), ("decay", c_float), ("step_size", c_float),
                ("eps", c_float), ("reserved", c_float)]


class AbTensor(ctypes.Structure):
    """struct ab_tensor (adambridge.h): one contiguous range of one parameter."""
    _fields_ = [("param", c_void_p), ("grad", c_void_p), ("exp_avg", c_void_p),
                ("exp_avg_sq", c_void_p), ("exp_avg_scale", c_void_p),
                ("exp_avg_sq_scale", c_void_p), ("out", c_void_p), ("n", c_int64),
                ("offset", c_int64), ("key", c_uint32), ("grad_dtype", c_int32),
                ("out_dtype", c_int32), ("precision", c_int32),
                ("stochastic_rounding", c_int32), ("reserved", c_int32), ("hparams", AbHyper)]


AB_TASK_FN = ctypes.CFUNCTYPE(None, c_void_p, c_int)

# Every AB_API function of adambridge.h: name -> (restype, argtypes).
PROTOTYPES = {
    "ab_abi_version": (c_int, ()),
    "ab_adamw_update": (c_int, (POINTER(AbTensor), c_int64)),
    "ab_mix32": (c_uint32, (c_uint32,)),
    "ab_hash": (c_uint32, (c_uint32, c_uint64)),
    "ab_isa_detected": (c_int, ()),
    "ab_isa_compiled": (c_int, (c_int,)),
    "ab_isa_supported": (c_int, (c_int,)),
    "ab_isa_active": (c_int, ()),
    "ab_set_isa": (c_int, (c_int,)),
    "ab_isa_name": (c_char_p, (c_int,)),
    "ab_pool_configure": (c_int, (c_int, POINTER(c_int), c_int)),
    "ab_pool_threads": (c_int, ()),
    "ab_pool_run": (c_int, (AB_TASK_FN, c_void_p)),
    "ab_first_touch": (c_int, (c_void_p, c_int64)),
    "ab_memory_pass": (c_int, (POINTER(AbTensor), c_int64)),
    "ab_l2_cache_bytes": (c_int64, ()),
    "ab_strerror": (c_char_p, (c_int,)),
}


class Native:
    """The loaded library: ``lib`` is the ctypes.CDLL with every prototype set."""

    def __init__(self, lib: ctypes.CDLL, built: build.Built):
        for name, (restype, argtypes) in PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise NativeBuildError(f"{built.path} does not export {name}: the csrc/ sources are "
                                       f"incomplete or do not match adambridge.h; reinstall adambridge; "
                                       f"{INFO_HINT}.") from None
            fn.restype, fn.argtypes = restype, argtypes
        self.lib, self.built, self.path = lib, built, built.path

    def check(self, status: int, what: str) -> None:
        """Raise RuntimeError for a negative AB_E* status."""
        if status != 0:
            reason = self.lib.ab_strerror(status).decode(errors="replace")
            raise RuntimeError(f"adambridge native {what} failed: {reason} (status {status}); {INFO_HINT}.")

    def isa_name(self, isa: int) -> str:
        return self.lib.ab_isa_name(isa).decode()

    def isas(self, test) -> tuple[str, ...]:
        return tuple(name for i, name in enumerate(ISA_NAMES) if test(i))


def _load_verified(built: build.Built) -> ctypes.CDLL:
    """CDLL of built.path after trusted.py checked and hashed that very file."""
    return trusted.dlopen(trusted.verify_library(built.path.parent, built.path.name, build.MANIFEST))


def _dlopen(src_dir: Optional[Path] = None, cache_dir: Optional[Path] = None,
            planner=None) -> tuple[ctypes.CDLL, build.Built]:
    """CDLL of the verified library; planner: see cache.build (_native/plan_checks.py).

    A cached library that is damaged (its hash does not match) or does not load is deleted and
    rebuilt, with one warning; one that another user could have changed is never loaded: a
    private build is made instead. A library compiled by this call that fails is an error.
    """
    built = cache.build(src_dir, cache_dir, planner=planner)
    for _ in range(3):  # cache -> repaired cache -> private, at most
        try:
            return _load_verified(built), built
        except trusted.Untrusted as exc:
            if built.private:
                raise _untrusted_private(built, exc) from None
            built = cache.build_private(src_dir, str(exc), planner)
        except trusted.Damaged as exc:
            if built.fresh:
                raise _unloadable(built, exc) from None
            build._warn_once("corrupt-cache", f"adambridge could not load its cached library: {exc}; "
                             f"it deletes it and builds it again.")
            built = cache.build(src_dir, cache_dir, broken=exc, planner=planner)
    raise _unloadable(built, "it kept changing while it was being loaded")


def _unloadable(built: build.Built, exc) -> NativeBuildError:
    return NativeBuildError(f"adambridge built {built.path} but cannot load it ({exc}). Check that the "
                            f"compiler targets this Python's architecture, or set ADAMBRIDGE_CC; {INFO_HINT}.")


def _untrusted_private(built: build.Built, exc: Exception) -> NativeBuildError:
    return NativeBuildError(f"adambridge will not load {built.path}: {exc}. Set TMPDIR (or "
                            f"ADAMBRIDGE_CACHE_DIR) to a directory that only you can write; {INFO_HINT}.")


def forced_isa() -> Optional[str]:
    """The ISA that ADAMBRIDGE_ISA names, None when unset; ValueError for an unknown name."""
    value = os.environ.get("ADAMBRIDGE_ISA", "").strip()
    if not value:
        return None
    if value.lower() not in ISA_NAMES:
        raise ValueError(f"ADAMBRIDGE_ISA={value!r} is not an instruction set; valid: {', '.join(ISA_NAMES)}")
    return value.lower()


def native_disabled() -> bool:
    return os.environ.get("ADAMBRIDGE_DISABLE_NATIVE", "").strip().lower() not in ("", "0", "false", "no")


_load_lock = threading.Lock()


def load() -> Native:
    """The native library, built on first call. Raises NativeBuildError or ValueError (ISA)."""
    with _load_lock:  # one build and one ab_set_isa when several threads start at once
        return _load()


@functools.lru_cache(maxsize=None)
def _load() -> Native:
    if native_disabled():
        raise NativeBuildError("the adambridge native kernel is disabled by ADAMBRIDGE_DISABLE_NATIVE; "
                               f"unset it to use the native backend; {INFO_HINT}.")
    forced = forced_isa()  # a bad name fails before any build
    lib, built = _dlopen()
    native = Native(lib, built)
    expected = build.abi_version()
    if lib.ab_abi_version() != expected:
        raise NativeBuildError(f"{built.path} has ABI version {lib.ab_abi_version()}, this adambridge "
                               f"needs {expected}; delete {build.cache_root()} and retry; {INFO_HINT}.")
    isa = ISA_NAMES.index(forced) if forced else lib.ab_isa_detected()
    if lib.ab_set_isa(isa) != 0:
        supported = ", ".join(native.isas(lib.ab_isa_supported))
        raise ValueError(f"ADAMBRIDGE_ISA={forced!r} is not supported here (the CPU lacks it or it is "
                         f"not compiled in); supported: {supported}")
    return native


_unavailable: list = []  # the NativeBuildError that made native_or_none() return None


def native_or_none() -> Optional[Native]:
    """load(), or None (one warning per process) when the native backend cannot be had.

    ADAMBRIDGE_DISABLE_NATIVE gives None without a warning. A bad ADAMBRIDGE_ISA still raises:
    that is the user's setting to fix, not a reason to run slower.
    """
    if native_disabled() or _unavailable:
        return None
    try:
        return load()
    except NativeBuildError as exc:
        _unavailable.append(exc)
        warnings.warn(f"{exc} Falling back to the torch backend.", RuntimeWarning, stacklevel=2)
        return None


def unavailable_reason() -> Optional[str]:
    """Why native_or_none() returned None, if it did."""
    if native_disabled():
        return "disabled by ADAMBRIDGE_DISABLE_NATIVE"
    return str(_unavailable[0]) if _unavailable else None


def reset() -> None:
    """Forget every per-process memo (for tests that change the environment)."""
    _load.cache_clear()
    _unavailable.clear()
    build._warned.clear()
    build._compilers.clear()
    cache._private.clear()


# -- the multi-tensor update (functional.adamw_update(backend="native") lands here) ------------
#
# NOTE: the descriptors of a batch are rows of one uint8 torch tensor laid out as struct
# ab_tensor, filled column by column from Python lists (one torch.tensor per column) instead
# of one ctypes.Structure per item: the per-item Python is then a few attribute reads and the
# pointer checks, and a batch built once (functional.NativeBatch) refreshes only the columns
# that change per step (10,000 small tensors as cheap as one).

_DTYPE_NAMES = {"float32": 0, "bfloat16": 1, "float16": 2}           # enum ab_dtype
_PRECISIONS = {"fp32": (0, 4, 4), "bf16": (1, 2, 2), "fp8": (2, 1, 1)}  # enum, m and v bytes
AB_NONE = 3
DESC_BYTES = ctypes.sizeof(AbTensor)
# Column offsets within a row, in units of the view's element size.
_I64_POINTERS = slice(0, 7)    # param, grad, exp_avg, exp_avg_sq, the two scales, out
_I64_GRAD = 1
_I64_SIZES = slice(7, 9)       # n, offset
_I32_KEY = AbTensor.key.offset // 4
_I32_CODES = slice(_I32_KEY, _I32_KEY + 5)   # key, grad_dtype, out_dtype, precision, sr
_F32_HYPER = slice(AbTensor.hparams.offset // 4, AbTensor.hparams.offset // 4 + 7)
# The functional.Hyper attribute behind each float of struct ab_hyper, in order (its step_size
# and eps are step_hat and eps_hat, numerics.md section 1).
HYPER_FIELDS = ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "decay", "step_hat",
                "eps_hat")


@functools.lru_cache(maxsize=None)
def _dtypes() -> dict:
    import torch
    return {getattr(torch, name): (code, 4 if name == "float32" else 2)
            for name, code in _DTYPE_NAMES.items()}


@functools.lru_cache(maxsize=None)
def _itemsizes() -> dict:
    import torch
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    return {dt: torch.empty(0, dtype=dt).element_size() for dt in dtypes}


def _pointer(t, name: str, n: int, itemsize: int) -> int:
    """t's data address after checking that the kernel may read n elements of itemsize there."""
    # (a dict lookup by dtype: Tensor.element_size() costs four times as much)
    if t.numel() != n or not t.is_contiguous() or not t.is_cpu or _itemsizes().get(t.dtype) != itemsize:
        raise ValueError(f"Invalid {name}: the native kernel needs a contiguous CPU tensor of {n} "
                         f"elements of {itemsize} bytes, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.data_ptr()


def _dtype_code(t, name: str) -> tuple[int, int]:
    found = _dtypes().get(t.dtype)
    if found is None:
        raise ValueError(f"Invalid {name} dtype: {t.dtype} (valid: float32, bfloat16, float16)")
    return found


def checked_column(t, name: str, n: int) -> tuple[int, int]:
    """(data pointer, dtype code) of a row's gradient or ``out`` tensor (float32, bfloat16 or
    float16), after the checks every packed row makes: n elements, contiguous, on the CPU."""
    code, size = _dtype_code(t, name)
    return _pointer(t, name, n, size), code


def _grad_pointer(grad, n: int) -> tuple[int, int]:
    return checked_column(grad, "grad", n)


def _append_row(item, words: list, codes: list) -> None:
    """Append one functional.UpdateItem's 9 int64 words (pointers, n, offset) and 5 int32 codes
    (key, dtypes, precision, rounding) to the flat lists, every pointer checked.

    NOTE: flat lists of ints on purpose: a list or tuple per item is a container the cyclic
    GC tracks, and 10,000 of them trigger collections that walk every live tensor (measured:
    the pack of 10,000 items took 114 ms with a row list per item, 35 ms without).
    """
    n = item.master.numel()
    precision, m_size, v_size = _PRECISIONS[item.precision]
    grad, grad_code = _grad_pointer(item.grad, n)
    scale_m = scale_v = out = 0
    if precision == 2:
        blocks = (n + 127) // 128
        scale_m = _pointer(item.exp_avg_scale, "exp_avg_scale", blocks, 4)
        scale_v = _pointer(item.exp_avg_sq_scale, "exp_avg_sq_scale", blocks, 4)
    out_code = AB_NONE
    if item.out is not None:
        out, out_code = checked_column(item.out, "out", n)
    words += (_pointer(item.master, "master", n, 4), grad,
              _pointer(item.exp_avg, "exp_avg", n, m_size),
              _pointer(item.exp_avg_sq, "exp_avg_sq", n, v_size), scale_m, scale_v, out, n,
              item.offset)
    codes += (item.key & 0xFFFFFFFF, grad_code, out_code, precision,
              int(bool(item.stochastic_rounding)))


# NOTE: the async pipeline on CPU often updates one landed gradient per wake-up;
# a few rows pack faster one struct at a time (about 5 us a row) than column by column with
# torch ops (about 28 us for one row), which win from a few dozen rows on.
_SMALL_BATCH = 16
# struct ab_tensor: 7 pointers, n, offset, key, 4 codes, reserved, then struct ab_hyper.
_ROW = struct.Struct("=7Q2qI5i8f")
assert _ROW.size <= DESC_BYTES and AbTensor.hparams.offset == _ROW.size - ctypes.sizeof(AbHyper)


def _packed_rows(items, words: list, codes: list):
    import torch
    buffer = bytearray(len(items) * DESC_BYTES)
    for i, item in enumerate(items):
        _ROW.pack_into(buffer, i * DESC_BYTES, *words[9 * i:9 * i + 9], *codes[5 * i:5 * i + 5],
                       0, *_hyper_row(item.hyper), 0.0)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(len(items), DESC_BYTES)


def descriptors(items):
    """The ab_tensor array of items as a (len(items), DESC_BYTES) uint8 tensor, every pointer
    checked against its length. The caller keeps the items' tensors alive while it is used."""
    import torch
    words, codes = [], []
    for item in items:
        _append_row(item, words, codes)
    count = len(codes) // 5
    if 0 < count <= _SMALL_BATCH:
        return _packed_rows(items, words, codes)
    desc = torch.zeros((count, DESC_BYTES), dtype=torch.uint8)
    if count:
        desc.view(torch.int64)[:, :9] = torch.tensor(words, dtype=torch.int64).view(count, 9)
        codes = torch.tensor(codes, dtype=torch.int64).view(count, 5)
        desc.view(torch.int32)[:, _I32_CODES] = codes.to(torch.int32)  # keys wrap to int32 bits
        set_hyper(desc, [item.hyper for item in items])
    return desc


# NOTE: rows of hyperparameter columns written per call, so each write stays under
# torch's parallel grain (32768 elements) and runs inline: an OpenMP region over 10,000 rows
# took 6-13 ms on the shared 2-vCPU VM (its second thread waits for a busy CPU), 20 us inline.
_ROWS_INLINE = 4096


def set_hyper(desc, hypers, index=None) -> None:
    """The hyperparameter columns: one functional.Hyper for every row, or one per row; with
    ``index`` (an int64 tensor, one entry per row), row r gets ``hypers[index[r]]``."""
    import torch
    columns = desc.view(torch.float32)[:, _F32_HYPER]
    if not isinstance(hypers, (list, tuple)):
        row = torch.tensor(_hyper_row(hypers), dtype=torch.float32)
        for start in range(0, columns.shape[0], _ROWS_INLINE):
            columns[start:start + _ROWS_INLINE] = row
        return
    if index is None:
        # A step's parameters share a few Hyper objects (one per group): one row per object,
        # gathered by index.
        slot, unique, rows = {}, [], []
        for h in hypers:
            k = slot.get(id(h))
            if k is None:
                k = slot[id(h)] = len(unique)
                unique.append(h)
            rows.append(k)
        hypers, index = unique, (None if len(unique) == 1 else torch.tensor(rows))
    table = torch.tensor([_hyper_row(h) for h in hypers], dtype=torch.float32)
    for start in range(0, columns.shape[0], _ROWS_INLINE):
        end = start + _ROWS_INLINE
        # (index_select: torch's advanced indexing starts a parallel region far sooner)
        columns[start:end] = table[0] if index is None else table.index_select(0, index[start:end])


def _hyper_row(hyper) -> tuple:
    return tuple(getattr(hyper, f) for f in HYPER_FIELDS)


def set_keys(desc, keys) -> None:
    """The stream-key column from an int64 tensor (or list) of values in [0, 2**32)."""
    import torch
    keys = torch.as_tensor(keys, dtype=torch.int64)
    desc.view(torch.int32)[:, _I32_KEY] = keys.to(torch.int32)


_DTYPE_OF, _IS_CPU = operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


def _grad_columns(grads: list, numels: Optional[list]) -> tuple[list, list]:
    """(pointers, dtypes) of the gradients, each checked as _grad_pointer checks it; with
    ``numels`` None the caller has checked every element count (equal shapes, say).

    NOTE: one pass per property over all gradients (C-level map) instead of one
    Python call per gradient; any failure is reported by the per-gradient check.
    """
    import torch
    codes = _dtypes()
    dtypes = list(map(_DTYPE_OF, grads))
    if (all(map(codes.__contains__, dtypes))
            and (numels is None or list(map(torch.Tensor.numel, grads)) == numels)
            and all(map(_IS_CPU, grads)) and all(map(torch.Tensor.is_contiguous, grads))):
        return list(map(torch.Tensor.data_ptr, grads)), dtypes
    numels = numels if numels is not None else list(map(torch.Tensor.numel, grads))
    pointers = [_grad_pointer(g, n)[0] for g, n in zip(grads, numels)]  # raises for the bad one
    return pointers, dtypes


def set_grads(desc, grads, numels, written_dtypes=None) -> tuple[list, list]:
    """The gradient column (pointer and dtype), each gradient checked against its row's n
    (``numels`` None: the caller checked the counts). Returns (pointers, dtypes); the dtype
    column is rewritten only if the dtypes differ from ``written_dtypes`` (what the last call
    returned for this desc)."""
    import torch
    grads = list(grads)
    pointers, dtypes = _grad_columns(grads, None if numels is None else list(numels))
    if len(pointers) != desc.shape[0]:
        raise ValueError(f"Invalid grads: {len(pointers)} for a batch of {desc.shape[0]} ranges")
    set_grad_pointers(desc, pointers)
    # (a list of dtypes compares by identity: torch.dtype objects are singletons)
    if written_dtypes is None or dtypes != written_dtypes:
        codes = _dtypes()
        desc.view(torch.int32)[:, _I32_KEY + 1] = torch.tensor([codes[d][0] for d in dtypes],
                                                               dtype=torch.int32)
    return pointers, dtypes


def set_grad_pointers(desc, pointers) -> None:
    """The gradient pointer column from checked data pointers (one int per row)."""
    import torch
    if len(pointers) != desc.shape[0]:
        raise ValueError(f"Invalid grads: {len(pointers)} for a batch of {desc.shape[0]} ranges")
    # (an int64 array read in place: half the time of torch.tensor over a list of ints)
    column = torch.frombuffer(array.array("q", pointers), dtype=torch.int64) if pointers \
        else torch.zeros(0, dtype=torch.int64)
    desc.view(torch.int64)[:, _I64_GRAD] = column


def run(desc) -> None:
    """One native call over every row of a descriptor tensor (GIL released)."""
    native = load()
    array = ctypes.cast(desc.data_ptr(), POINTER(AbTensor))
    native.check(native.lib.ab_adamw_update(array, desc.shape[0]), "ab_adamw_update")


def _ab_tensor(item) -> AbTensor:
    """The struct for one functional.UpdateItem, every pointer checked (one row of descriptors)."""
    return AbTensor.from_buffer_copy(bytes(descriptors([item])[0].tolist()))


def update(items) -> None:
    """AdamW on every functional.UpdateItem in one native call (raises if native is unavailable)."""
    load()
    run(descriptors(items))


def memory_pass(items) -> None:
    """The bandwidth floor: stream over the items' buffers as an update would (scrambles them)."""
    native = load()
    desc = descriptors(items)
    array = ctypes.cast(desc.data_ptr(), POINTER(AbTensor))
    native.check(native.lib.ab_memory_pass(array, desc.shape[0]), "ab_memory_pass")


# -- the public knobs (each is None / empty / a no-op on the torch backend) -----------------------

def backend_name() -> str:
    native = native_or_none()
    return f"native/{isa_name()}" if native is not None else "torch"


def isa_name() -> Optional[str]:
    native = native_or_none()
    return native.isa_name(native.lib.ab_isa_active()) if native else None


def detected_isa() -> Optional[str]:
    native = native_or_none()
    return native.isa_name(native.lib.ab_isa_detected()) if native else None


def compiled_isas() -> tuple[str, ...]:
    native = native_or_none()
    return native.isas(native.lib.ab_isa_compiled) if native else ()


def supported_isas() -> tuple[str, ...]:
    native = native_or_none()
    return native.isas(native.lib.ab_isa_supported) if native else ()


def set_num_threads(n: int, cpus: Optional[Sequence[int]] = None) -> bool:
    """Size the native pool to n threads (n <= 0: one per CPU), pinned round-robin to cpus.

    Returns False, changing nothing, on the torch backend (torch.set_num_threads governs it).
    """
    native = native_or_none()
    if native is None:
        return False
    cpus = list(cpus or ())
    array = (c_int * len(cpus))(*cpus) if cpus else None
    native.check(native.lib.ab_pool_configure(int(n), array, len(cpus)), f"ab_pool_configure({n}, {cpus})")
    return True


def num_threads() -> int:
    native = native_or_none()
    if native is None:
        import torch
        return torch.get_num_threads()
    return native.lib.ab_pool_threads()


def l2_cache_bytes() -> int:
    """L2 size from cpuid (native), else from sysfs; 0 when unknown."""
    native = native_or_none()
    found = native.lib.ab_l2_cache_bytes() if native else 0
    if found <= 0:
        from ..host import topology
        found = topology.l2_cache_bytes()
    return int(found)


def library_path() -> Optional[Path]:
    native = native_or_none()
    return native.path if native else None


def compiler_description() -> str:
    try:
        return build.find_compiler().describe()
    except build.NoCompilerError:
        return "none found"


def dropped_isas() -> dict:
    """{isa: why} for the ISAs this build left out (other architecture, compiler too old)."""
    native = native_or_none()
    return dict(native.built.dropped) if native else {}
