"""Checkpoints that stream: each value saved once, loads that adopt what nothing else holds.

The saved form holds views of the state (no decoded copy beside it); a load keeps a loaded
tensor as the state where only the checkpoint holds it (a dict fresh from torch.load) and
copies it otherwise (a live optimizer's dict, a file mapping, two entries on one tensor);
fp8 checkpoints reach torch.optim.AdamW through ``to_torch_adamw``, and without it AdamW
refuses to step in one line; checkpoints of the earlier form (torch's decoded moments beside
ours) resume bit for bit; nothing of a load is made on a device.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adambridge import AdamBridge
from adambridge.checkpoint import to_torch_adamw
from adambridge.host.mapped import Mappings
from adambridge.update import state as host_state
from _tiny import tiny_mlp
from test_lossless_state import roundtrip as _roundtrip, train as _train

PRECISIONS = ("fp32", "bf16", "fp8")
DTYPES = (torch.float32, torch.bfloat16)
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _model(dtype):
    return tiny_mlp((9, 300, 3), between="relu", dtype=dtype, seed=5)  # fp8's short last block


def _trained(precision, dtype, steps=3):
    model = _model(dtype)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision, seed=7)
    _train(model, opt, steps, seed=1)
    return model, opt


def _memory(state):
    return {state[k].data_ptr() for k in STATE_KEYS if k in state}


# --------------------------------------------------------------------------- the saved form


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_saved_form_holds_each_stored_value_once_as_views_of_the_state(precision, dtype):
    model, opt = _trained(precision, dtype)
    saved = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        entry, state = saved["state"][i], opt.state[p]
        moments = ("exp_avg", "exp_avg_sq") if precision != "fp8" else \
            ("ab_exp_avg", "ab_exp_avg_sq", "ab_exp_avg_scale", "ab_exp_avg_sq_scale")
        assert set(entry) == {"step", "master", "ab_step", *moments}
        for key in ("master", *moments):
            assert entry[key].data_ptr() in _memory(state), key  # a view, not a copy
        if precision != "fp8":  # torch's keys, in p's shape, in the stored dtype
            assert entry["exp_avg"].shape == p.shape
            assert entry["exp_avg"].dtype == host_state.MOMENT_DTYPES[precision][0]
    file_bytes = len(_bytes(saved))
    assert file_bytes < opt.host_state_bytes() + 16 * 1024  # the state once, plus pickling


def _bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------- adopting


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_load_keeps_the_tensors_of_a_dict_fresh_from_torch_load(precision, dtype):
    model, opt = _trained(precision, dtype)
    loaded = _roundtrip(opt.state_dict())
    opt2 = AdamBridge(_model(dtype).parameters(), lr=1e-3, precision=precision)
    opt2.load_state_dict(loaded)
    for i, q in enumerate(opt2.param_groups[0]["params"]):
        entry = loaded["state"][i]
        held = {v.data_ptr() for k, v in entry.items() if k not in ("step", "ab_step")}
        assert _memory(opt2.state[q]) - {q.data_ptr()} <= held  # nothing allocated again


@pytest.mark.parametrize("precision", PRECISIONS)
def test_load_copies_what_another_optimizer_still_steps(precision):
    # torch.optim.AdamW keeps the tensors of a dict it loads: AdamBridge loading the same
    # dict must not share them, nor those of a live AdamBridge's state_dict().
    model, opt = _trained(precision, torch.float32)
    loaded = to_torch_adamw(_roundtrip(opt.state_dict()))
    adamw = torch.optim.AdamW(_model(torch.float32).parameters(), lr=1e-3)
    adamw.load_state_dict(loaded)
    theirs = {t.data_ptr() for s in adamw.state.values() for t in s.values()}
    ours_live = {t.data_ptr() for s in opt.state.values() for t in s.values()}
    for source in (loaded, opt.state_dict()):
        opt2 = AdamBridge(_model(torch.float32).parameters(), lr=1e-3, precision=precision)
        opt2.load_state_dict(source)
        for q in opt2.param_groups[0]["params"]:
            mine = _memory(opt2.state[q]) - {q.data_ptr()}
            assert not mine & (theirs | ours_live)


def test_two_entries_on_one_tensor_are_not_both_adopted():
    model, opt = _trained("fp32", torch.bfloat16)
    loaded = _roundtrip(opt.state_dict())
    loaded["state"][0]["exp_avg"] = loaded["state"][0]["exp_avg_sq"]  # m and v one tensor
    opt2 = AdamBridge(_model(torch.bfloat16).parameters(), lr=1e-3, precision="fp32")
    opt2.load_state_dict(loaded)
    state = opt2.state[opt2.param_groups[0]["params"][0]]
    assert state["exp_avg"].data_ptr() != state["exp_avg_sq"].data_ptr()
    assert torch.equal(state["exp_avg"], state["exp_avg_sq"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_load_of_a_mapped_file_copies_it_out_and_resumes_bit_for_bit(precision, tmp_path):
    model, opt = _trained(precision, torch.bfloat16)
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    saved_model = copy.deepcopy(model.state_dict())
    _train(model, opt, 2, seed=2)
    resumed = _model(torch.bfloat16)
    resumed.load_state_dict(saved_model)
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision=precision)
    opt2.load_state_dict(torch.load(tmp_path / "optim.pt", mmap=True, weights_only=True))
    maps = Mappings()
    for state in opt2.state.values():
        assert not any(maps.holds(state[k]) for k in STATE_KEYS if k in state)
    torch.save({}, tmp_path / "optim.pt")  # the file rewritten: the state is not in it
    _train(resumed, opt2, 2, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


def test_where_mappings_cannot_be_read_every_tensor_is_copied(monkeypatch):
    # Outside Linux (no /proc/self/maps) a load cannot tell a mapped file from memory of its
    # own: it copies everything, and resumes the same.
    from adambridge.host import mapped
    monkeypatch.setattr(mapped, "MAPS", "/nonexistent/maps")
    model, opt = _trained("bf16", torch.bfloat16)
    loaded = _roundtrip(opt.state_dict())
    opt2 = AdamBridge(_model(torch.bfloat16).parameters(), lr=1e-3, precision="bf16")
    opt2.load_state_dict(loaded)
    for p, q in zip(model.parameters(), opt2.param_groups[0]["params"]):
        held = {v.data_ptr() for v in loaded["state"][opt.param_index[p]].values()}
        assert not _memory(opt2.state[q]) & held
        assert all(torch.equal(opt2.state[q][k], opt.state[p][k]) for k in STATE_KEYS[:3])


# --------------------------------------------------------------------------- torch.optim.AdamW


@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw_refuses_to_step_from_an_unconverted_fp8_checkpoint_in_one_line(dtype):
    model, opt = _trained("fp8", dtype)
    other = _model(dtype)
    adamw = torch.optim.AdamW(other.parameters(), lr=1e-3)
    adamw.load_state_dict(_roundtrip(opt.state_dict()))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match=r"^AdamW holds an AdamBridge fp8 checkpoint's "
                                           r"stored moments .*adambridge\.checkpoint\."
                                           r"to_torch_adamw\(state_dict\)"):
        _train(other, adamw, 1, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_to_torch_adamw_gives_adamw_the_decoded_moments(precision, dtype):
    model, opt = _trained(precision, dtype)
    other = _model(dtype)
    adamw = torch.optim.AdamW(other.parameters(), lr=1e-3)
    adamw.load_state_dict(to_torch_adamw(_roundtrip(opt.state_dict()), dtype=dtype))
    for p, q in zip(model.parameters(), adamw.param_groups[0]["params"]):
        m, v = host_state.decode_moments(opt.state[p])
        state = adamw.state[q]
        assert not any(k.startswith("ab_exp_avg") for k in state)
        assert state["exp_avg"].shape == q.shape and state["exp_avg"].dtype == dtype
        assert torch.equal(state["exp_avg"], m.to(dtype).view(q.shape))
        assert torch.equal(state["exp_avg_sq"], v.to(dtype).view(q.shape))
    _train(other, adamw, 1, seed=2)  # and it steps


# --------------------------------------------------------------------------- the earlier form


def _earlier_entry(p, state):
    """An entry as adambridge saved it before the moments were saved once: torch's decoded
    form in p's dtype always, our stored moments beside it unless they were p's dtype."""
    m, v = host_state.decode_moments(state)
    entry = {"step": state["step"].clone(), "exp_avg": m.to(p.dtype).view(p.shape),
             "exp_avg_sq": v.to(p.dtype).view(p.shape),
             "master": state["master"].clone().view(p.shape),
             "ab_step": torch.tensor(int(state["step"].item()))}
    if host_state.MOMENT_DTYPES[host_state.precision_of(state)] != (p.dtype, p.dtype):
        entry.update({"ab_" + k: state[k].clone() for k in host_state.HOST_KEYS[1:]
                      if k in state})
    return entry


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_of_the_earlier_form_resumes_bit_for_bit(precision, dtype):
    model, opt = _trained(precision, dtype)
    saved = opt.state_dict()
    saved["state"] = {i: _earlier_entry(p, opt.state[p])
                      for i, p in enumerate(model.parameters())}
    saved = _roundtrip(saved)
    saved_model = copy.deepcopy(model.state_dict())
    _train(model, opt, 2, seed=2)
    resumed = _model(dtype)
    resumed.load_state_dict(saved_model)
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision=precision)
    opt2.load_state_dict(saved)
    _train(resumed, opt2, 2, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


# --------------------------------------------------------------------------- devices


class _Devices(TorchDispatchMode):
    """The device of every tensor an operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.seen.add(value.device.type)
        return out


@pytest.mark.parametrize("target", PRECISIONS)
@pytest.mark.parametrize("source", PRECISIONS)
def test_load_makes_every_tensor_on_the_host(source, target):
    model, opt = _trained(source, torch.bfloat16)
    loaded = _roundtrip(opt.state_dict())
    opt2 = AdamBridge(_model(torch.bfloat16).parameters(), lr=1e-3, precision=target)
    with _Devices() as devices:
        opt2.load_state_dict(loaded)
    assert devices.seen == {"cpu"}
