"""The torch.optim.Optimizer contract, checked the way PyTorch's test_optim.py checks AdamW.

Each property is data with a ``desc`` and the item it guards; ``check`` runs it
on one backend. The checkpoint properties (both ways, checked values, DCP) are in
test_checkpoint.py.
"""
from __future__ import annotations

import copy
import io
import pickle
import re
import sys

import pytest
import torch

from adambridge import AdamBridge
from adambridge.update import state as host_state
from adambridge.optimizer import UNSUPPORTED_TORCH_FLAGS
from conftest import native_available

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md


def _stepped(dtype=torch.float32, shape=(5, 3), backend="torch", steps=1, **kwargs):
    p = torch.nn.Parameter(torch.randn(shape).to(dtype))
    opt = AdamBridge([p], lr=1e-3, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return p, opt


def _same_optimizer(a, b):
    assert [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups]
    assert len(a.state) == len(b.state)
    for (pa, sa), (pb, sb) in zip(a.state.items(), b.state.items()):
        assert torch.equal(pa, pb) and sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


# --------------------------------------------------------------------------- 1: versions


def _backward_after_step_raises(dtype, layout):
    def check(backend):
        base = torch.randn(6, 4).to(dtype)
        p = torch.nn.Parameter(base.t() if layout == "transposed" else base)
        opt = AdamBridge([p], lr=1e-2, backend=backend)
        loss = (p * p).sum()  # mul saves p
        p.grad = torch.ones_like(p)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    return check


def _async_backward_after_step_sync_raises(backend):
    model = torch.nn.Linear(8, 8)
    opt = AdamBridge(model.parameters(), lr=1e-2, backend=backend, small_param_threshold=0)
    opt.attach_hooks(model)
    try:
        model(torch.ones(2, 8)).sum().backward()
        opt.step_sync()
        kept = (model.weight * model.weight).sum()  # saved before the next update
        model(torch.ones(2, 8)).sum().backward()
        opt.step_sync()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            kept.backward()
    finally:
        opt.detach_hooks()


# --------------------------------------------------------------------------- 2: flags


def _flag_in_group_refused(flag):
    def check(backend):
        p = torch.nn.Parameter(torch.randn(3))
        with pytest.raises(ValueError, match=rf"^Unsupported torch.optim flag in a param group: "
                                             rf"{flag}=True \(AdamBridge does not implement"):
            AdamBridge([{"params": [p], flag: True}], backend=backend)
        opt = AdamBridge([p], backend=backend)
        with pytest.raises(ValueError, match=rf"{flag}=True"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], flag: True})
    return check


def _flag_set_later_refused_at_step(backend):
    p, opt = _stepped(backend=backend)
    before = p.detach().clone()
    opt.param_groups[0]["maximize"] = True
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: maximize=True"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"].item() == 1


def _flag_in_torch_checkpoint_refused(backend):
    q = torch.nn.Parameter(torch.randn(5, 3))
    ref = torch.optim.AdamW([q], maximize=True)
    q.grad = torch.ones_like(q)
    ref.step()
    p, opt = _stepped(backend=backend)
    kept = copy.deepcopy(opt)
    with pytest.raises(ValueError, match=r"checkpoint param_groups\[0\]: maximize=True"):
        opt.load_state_dict(ref.state_dict())
    _same_optimizer(opt, kept)


# --------------------------------------------------------------------------- 4: copies


def _public(opt):
    return {k: v for k, v in vars(opt).items() if not k.startswith("_")}


def _equal_values(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_values(x, y) for x, y in zip(a, b))
    return a == b


def _copy_keeps_public_attributes_and_steps_alike(make_copy):
    def check(backend):
        p, opt = _stepped(torch.bfloat16, backend=backend, precision="bf16", seed=5, steps=2)
        twin = make_copy(opt)
        assert _public(twin).keys() == _public(opt).keys()
        for key, value in _public(opt).items():
            if key not in ("state", "param_groups"):
                assert _equal_values(getattr(twin, key), value), key
        q = twin.param_groups[0]["params"][0]
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        twin.step()
        assert torch.equal(p.detach(), q.detach())
        for key, value in opt.state[p].items():
            assert torch.equal(twin.state[q][key], value), key
    return check


def _pickled(opt):
    buffer = io.BytesIO()
    torch.save(opt, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --------------------------------------------------------------------------- 5-8: groups


def _names_kept_by_an_unnamed_checkpoint(backend):
    model = torch.nn.Linear(3, 2)
    named = AdamBridge(model.named_parameters(), backend=backend)
    unnamed = AdamBridge(model.parameters(), backend=backend)
    named.load_state_dict(unnamed.state_dict())
    assert named.param_groups[0]["param_names"] == ["weight", "bias"]
    assert named.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


def _non_parameter_state_kept(backend):
    p, opt = _stepped(backend=backend)
    saved = opt.state_dict()
    saved["state"]["extra"] = {"note": torch.tensor(3.0)}
    opt.load_state_dict(saved)
    assert torch.equal(opt.state["extra"]["note"], torch.tensor(3.0))
    assert opt.host_state_bytes() == host_state.state_bytes(opt.state[p])
    assert "extra" in opt.state_dict()["state"]
    p.grad = torch.ones_like(p)
    opt.step()


def _set_of_params_refused(backend):
    with pytest.raises(TypeError, match=r"Invalid params of a param group: a set"):
        AdamBridge([{"params": {torch.nn.Parameter(torch.randn(2))}}], backend=backend)


def _state_dict_post_hook_sees_everything(backend):
    p, opt = _stepped(backend=backend, seed=9)
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(
        (sd["adambridge"]["seed"], sd["param_groups"][0]["seed"])))
    opt.state_dict()
    assert seen == [(9, 9)]


def _load_pre_hook_gets_a_shallow_copy(backend):
    p, opt = _stepped(backend=backend)
    saved = opt.state_dict()
    got = []

    def hook(o, sd):
        got.append(sd)
        sd["added_by_hook"] = 1
    opt.register_load_state_dict_pre_hook(hook)
    opt.load_state_dict(saved)
    assert got[0] is not saved and "added_by_hook" not in saved
    assert got[0]["state"] is saved["state"]  # shallow, as torch's


# --------------------------------------------------------------------------- 12: writes


def _written(write):
    def check(backend):
        model = torch.nn.Linear(130, 4).bfloat16()
        opt = AdamBridge(model.parameters(), lr=1e-3, backend=backend)
        model(torch.ones(2, 130, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        write(model)
        opt.zero_grad()
        model(torch.ones(2, 130, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        # One step of lr=1e-3 from 5.0, not from the master of before the write.
        assert (model.weight.float() - 5.0).abs().max() < 2e-2
        torch.testing.assert_close(opt.state[model.weight]["master"].view(4, 130),
                                   model.weight.float(), rtol=0, atol=2e-2)
    return check


def _fill(model):
    with torch.no_grad():
        model.weight.fill_(5.0)


def _assign_data(model):
    model.weight.data = torch.full_like(model.weight, 5.0)


def _load_model(model):
    model.load_state_dict(dict(model.state_dict(), weight=torch.full_like(model.weight, 5.0)))


def _async_write_wins(backend):
    model = torch.nn.Linear(130, 4).bfloat16()
    opt = AdamBridge(model.parameters(), lr=1e-3, backend=backend, small_param_threshold=0)
    opt.attach_hooks(model)
    try:
        for step in range(2):
            if step == 1:
                _fill(model)
            model(torch.ones(2, 130, dtype=torch.bfloat16)).sum().backward()
            opt.step_sync()
    finally:
        opt.detach_hooks()
    assert (model.weight.float() - 5.0).abs().max() < 2e-2


def _unwritten_parameters_are_not_compared(backend):
    calls = []
    real = host_state.adopt_written

    def counting(state, values):
        calls.append(values.shape)
        return real(state, values)
    p, opt = _stepped(torch.bfloat16, backend=backend)
    host_state.adopt_written = counting
    try:
        for write in (False, False, True, False):
            if write:
                with torch.no_grad():
                    p.add_(1.0)
            p.grad = torch.ones_like(p)
            opt.step()
    finally:
        host_state.adopt_written = real
    assert len(calls) == 1  # the version counter says when to look


def _rounding_rewritten_keeps_master(backend):
    p, opt = _stepped(torch.bfloat16, backend=backend, steps=2)
    master = opt.state[p]["master"].clone()
    assert not torch.equal(master, master.bfloat16().float())  # the master has more bits
    with torch.no_grad():
        p.copy_(master.view(p.shape).bfloat16())  # written, but the master's own rounding
    opt.ensure_state(p)
    assert torch.equal(opt.state[p]["master"], master)
    with torch.no_grad():
        p.add_(1.0)
    opt.ensure_state(p)
    assert torch.equal(opt.state[p]["master"], p.detach().float().reshape(-1))


PROPERTIES = [
    dict(item=1, desc="backward through a graph that saved an fp32 CPU parameter raises",
         check=_backward_after_step_raises(torch.float32, "contiguous")),
    dict(item=1, desc="backward through a graph that saved a bf16 CPU parameter raises",
         check=_backward_after_step_raises(torch.bfloat16, "contiguous")),
    dict(item=1, desc="backward through a graph that saved a non-contiguous parameter raises",
         check=_backward_after_step_raises(torch.float32, "transposed")),
    dict(item=1, desc="async mode: backward through a graph saved before step_sync raises",
         check=_async_backward_after_step_sync_raises),
    *[dict(item=2, desc=f"{flag}=True in a param group is refused",
           check=_flag_in_group_refused(flag)) for flag in UNSUPPORTED_TORCH_FLAGS],
    dict(item=2, desc="maximize=True set in a group after construction is refused at step",
         check=_flag_set_later_refused_at_step),
    dict(item=2, desc="a torch checkpoint with maximize=True is refused, nothing changed",
         check=_flag_in_torch_checkpoint_refused),
    dict(item=4, desc="deepcopy keeps every public attribute and steps alike",
         check=_copy_keeps_public_attributes_and_steps_alike(copy.deepcopy)),
    dict(item=4, desc="pickling keeps every public attribute and steps alike",
         check=_copy_keeps_public_attributes_and_steps_alike(_pickled)),
    dict(item=5, desc="param_names survive loading an unnamed checkpoint",
         check=_names_kept_by_an_unnamed_checkpoint),
    dict(item=6, desc="non-parameter state entries are kept, host_state_bytes still works",
         check=_non_parameter_state_kept),
    dict(item=7, desc="a set as a group's params is refused", check=_set_of_params_refused),
    dict(item=8, desc="state_dict post hooks see the adambridge entry and group seeds",
         check=_state_dict_post_hook_sees_everything),
    dict(item=8, desc="load_state_dict pre hooks get a shallow copy",
         check=_load_pre_hook_gets_a_shallow_copy),
    dict(item=12, desc="p.fill_ after a bf16 step is the next step's start",
         check=_written(_fill)),
    dict(item=12, desc="p.data = ... after a bf16 step is the next step's start",
         check=_written(_assign_data)),
    dict(item=12, desc="model.load_state_dict after a bf16 step is the next step's start",
         check=_written(_load_model)),
    dict(item=12, desc="async mode: a write between steps is the next step's start",
         check=_async_write_wins),
    dict(item=12, desc="a write of the master's own rounding keeps the fp32 master",
         check=_rounding_rewritten_keeps_master),
    dict(item=12, desc="only a written parameter is compared with its master",
         check=_unwritten_parameters_are_not_compared),
]


@pytest.mark.parametrize("case", PROPERTIES, ids=lambda c: f"{c['item']}: {c['desc']}")
def test_contract_property_holds(case, backend):
    case["check"](backend)


# --------------------------------------------------------------------------- 9: memory


def _rss_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="reads the peak resident size from Linux's /proc/self/status")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_torch_backend_step_peaks_under_twice_the_parameter(precision):
    numel = 1 << 22  # 16 MiB of fp32: far above allocator noise
    p, opt = _stepped(shape=(numel,), precision=precision)
    p.grad = torch.randn(numel)
    before = _rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak (VmHWM) to the current size
    opt.step()
    extra = _rss_bytes("VmHWM") - before
    assert extra <= 2 * numel * 4, f"{extra / (numel * 4):.2f}x the parameter"  # torch: 2x


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_torch_backend_in_blocks_equals_native_bit_for_bit(precision):
    if not native_available():
        pytest.skip("needs the native kernel, which did not build here (python -m adambridge info)")
    numel = (1 << 17) + 300  # three blocks of the torch backend, the last short
    runs = []
    for backend in ("torch", "native"):
        torch.manual_seed(2)
        p, opt = _stepped(torch.bfloat16, shape=(numel,), backend=backend, steps=3,
                          precision=precision)
        runs.append((p, opt.state[p]))
    (p, a), (q, b) = runs
    assert torch.equal(p.detach(), q.detach())
    for key in a:
        assert torch.equal(a[key], b[key]), key
