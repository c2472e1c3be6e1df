"""Host-resident optimizer state per parameter: fp32 master, m and v in the chosen precision.

The state of a parameter is a plain dict in ``optimizer.state[param]`` with torch's keys
(``step``, ``exp_avg``, ``exp_avg_sq``) plus ``master`` and, for fp8, the block scales. All
tensors are flat (1-D) and live in host memory; ranges of them (chunks, shards) are views.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Optional

import torch

from ..host.alloc import host_empty, host_zeros  # noqa: F401 (state's allocations)
from . import codecs
from .codecs import FP8_BLOCK
from .items import Hyper, UpdateItem

# NOTE: the version of the update's arithmetic (docs/numerics.md). Checkpoints record it and a
# checkpoint of another version is refused: its moments and rounding decisions would not be
# the ones this code makes, so a resume would silently stop being bit-exact. Bump it with any
# change that alters a single bit of an update (the number lives in update/codecs.py, beside the
# arithmetic it names).
NUMERICS_VERSION = codecs.NUMERICS_VERSION

# Storage dtype of (exp_avg, exp_avg_sq) per precision; the dtype identifies the precision
# of a saved state, which is how a checkpoint is converted on load.
MOMENT_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8": (torch.float8_e4m3fn, torch.float8_e5m2),
}
# Bytes per parameter of master + moments (fp8 adds two fp32 scales per 128 elements).
HOST_BYTES_PER_PARAM = {"fp32": 12.0, "bf16": 8.0, "fp8": 6.0 + 8.0 / FP8_BLOCK}

HOST_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


class HostState(dict):
    """``optimizer.state[p]``: a plain dict of p's state, whose tensors stay in host memory.

    NOTE: frameworks move "the optimizer state" to the training device after loading a
    checkpoint: Lightning's ``_optimizer_to_device`` assigns ``state[key] = value.to(device)``
    for every key but 'step' (DeepSpeed's and torchao's offload optimizers meet the same).
    Here that would put the host state on the GPU, or, on the meta device, drop its values.
    So a tensor on another device assigned to a key whose host tensor has its shape and
    dtype is written into that host tensor (a meta tensor holds no values: nothing is
    written), and the host tensor stays; anything else is stored as given.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        old = self.get(key)
        if (key in HOST_KEYS and isinstance(value, torch.Tensor) and not value.is_cpu
                and isinstance(old, torch.Tensor) and old.is_cpu
                and value.shape == old.shape and value.dtype == old.dtype):
            if value.device.type != "meta":
                old.copy_(value)
            return
        super().__setitem__(key, value)


class StateTable(defaultdict):
    """``optimizer.state``: parameter -> HostState, where a whole dict written from outside
    (``opt.state[p] = {...}``) goes through the optimizer that owns the table.

    NOTE: torch.distributed.optim.ZeroRedundancyOptimizer.load_state_dict writes each
    parameter's saved entry (torch's form, our master and ab_ entries, p's shape and dtype)
    straight into ``optim.state[p]``; stored as given, the next step would read a state the
    kernel's flat views do not fit. ``owner`` (a weak reference to the optimizer) turns
    such a write (a plain dict) into the state the entry describes, checked as
    load_state_dict checks it, or refuses it in one line. The optimizer's own states
    (HostState, the NVMe tier's) are stored as they are.
    """

    owner: Any = None

    def __setitem__(self, key: Any, value: Any) -> None:
        owner = self.owner() if self.owner is not None else None
        if type(value) is dict:  # the optimizer's own (HostState, the tier's) are not plain
            value = (owner.take_written_state(key, value)
                     if owner is not None and isinstance(key, torch.Tensor) else HostState(value))
        super().__setitem__(key, value)


def host_states(states: Any, owner: Any = None) -> "StateTable":
    """``optimizer.state`` with each parameter's plain dict a HostState; ``owner``: the
    optimizer that takes whole dicts written from outside (StateTable)."""
    out = StateTable(HostState)
    for key, value in states.items():
        out[key] = HostState(value) if type(value) is dict else value
    if owner is not None:
        out.owner = weakref.ref(owner)
    return out


def can_alias_master(p: torch.Tensor) -> bool:
    """An fp32, contiguous CPU parameter is its own master: no copy, no write-back."""
    return p.is_cpu and p.dtype == torch.float32 and p.is_contiguous()


def new_state(master_source: torch.Tensor, precision: str, *, alias: bool) -> dict:
    """Fresh state for a parameter about to receive its first update.

    The master is taken from the parameter's values *now* (so weights loaded after the
    optimizer was built are kept); with ``alias`` it is the parameter's own fp32 storage.
    """
    numel = master_source.numel()
    if alias:
        master = master_source.view(-1)
    else:
        master = host_empty(numel, torch.float32)
        master.copy_(master_source.reshape(-1))
    m_dtype, v_dtype = MOMENT_DTYPES[precision]
    state = {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "master": master,
        "exp_avg": host_zeros(numel, m_dtype),
        "exp_avg_sq": host_zeros(numel, v_dtype),
    }
    if precision == "fp8":
        blocks = codecs.fp8_num_blocks(numel)
        state["exp_avg_scale"] = torch.zeros(blocks, dtype=torch.float32)
        state["exp_avg_sq_scale"] = torch.zeros(blocks, dtype=torch.float32)
    return state


def precision_of(state: dict) -> str:
    """The precision a state was stored in, read from its moment dtypes."""
    for name, dtypes in MOMENT_DTYPES.items():
        if state["exp_avg"].dtype == dtypes[0]:
            return name
    raise ValueError(f"Invalid exp_avg dtype in optimizer state: {state['exp_avg'].dtype}")


def decode_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) as fp32, whatever the stored precision."""
    precision = precision_of(state)
    m, v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
    if precision == "fp8":
        return (codecs.fp8_decode(m, state["exp_avg_scale"]),
                codecs.fp8_decode_v(v, state["exp_avg_sq_scale"]))
    return m.float(), v.float()


def encode_moments(state: dict, m: torch.Tensor, v: torch.Tensor, precision: str) -> None:
    """Store fp32 (m, v) into ``state`` in ``precision``, rounding to nearest (no SR).

    Used to convert a state between precisions (checkpoint load, autotune step-down).
    """
    numel = m.numel()
    m_dtype, v_dtype = MOMENT_DTYPES[precision]
    state.pop("exp_avg_scale", None)
    state.pop("exp_avg_sq_scale", None)
    if precision == "fp8":
        codes_m, scale_m = codecs.fp8_encode_m(m, None)
        codes_s, scale_s = codecs.fp8_encode_sqrt_v(codecs.sqrt_f32(v), None)
        state["exp_avg"], state["exp_avg_scale"] = codes_m, scale_m
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = codes_s, scale_s
        return
    state["exp_avg"] = host_empty(numel, m_dtype)
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"] = host_empty(numel, v_dtype)
    state["exp_avg_sq"].copy_(v)


def convert_precision(state: dict, precision: str) -> None:
    """Re-encode a state's moments in another precision, in place."""
    if precision_of(state) == precision:
        return
    m, v = decode_moments(state)
    encode_moments(state, m, v, precision)


def state_bytes(state: dict) -> int:
    """Host bytes held by one parameter's state (master, moments, scales)."""
    keys = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
    return sum(state[k].numel() * state[k].element_size() for k in keys if k in state)


def adopt_written(state: dict, values: torch.Tensor) -> bool:
    """Take a parameter's values as the new master unless they are the master's rounding.

    ``values`` are the parameter's (any device, any layout). Returns whether the master
    changed. NOTE: written weights win (docs/architecture.md), but a parameter that holds
    exactly the rounding of the master (a model loaded from the same checkpoint, in either
    order) keeps the fp32 master, so a resume stays bit-exact.
    """
    master = state["master"]
    values = values.detach().reshape(-1).to("cpu")
    if is_rounding_of(master, values):
        return False
    master.copy_(values)
    return True


def is_rounding_of(master: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether flat host ``values`` are bit for bit the rounding of fp32 ``master``."""
    rounded = master if values.dtype == torch.float32 else master.to(values.dtype)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    as_bits = bits[values.dtype]  # compare bits: NaN payloads and -0.0 count as written too
    return torch.equal(rounded.view(as_bits), values.view(as_bits))


def range_views(state: dict, start: int, end: int) -> dict:
    """The master, moments and fp8 scales of elements [start, end) (start % 128 == 0)."""
    views = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
    if start == 0 and end == state["master"].numel():
        return {k: state.get(k) for k in views}  # the whole parameter: no slicing
    first_block, end_block = start // FP8_BLOCK, -(-end // FP8_BLOCK)
    ranged = {k: state[k][start:end] for k in views[:3]}
    ranged.update({k: state[k][first_block:end_block] if k in state else None
                   for k in views[3:]})
    return ranged


def range_item(state: dict, *, grad: torch.Tensor, out: Optional[torch.Tensor], start: int,
               key: int, hyper: Hyper, stochastic_rounding: bool) -> UpdateItem:
    """The UpdateItem of elements [start, start + grad.numel()) of one parameter's state.

    The one range builder: a whole parameter, a chunk, a shard or a page is a range, and the
    item's offset is ``start``, so every split draws the same rounding bits as the whole.
    """
    return UpdateItem(**range_views(state, start, start + grad.numel()), grad=grad, out=out,
                      offset=start, key=key, precision=precision_of(state),
                      stochastic_rounding=stochastic_rounding, hyper=hyper)
