"""The cached plan of the synchronous step (sync/step_plan.py): bit for bit the full path, and no
per-parameter allocation per step."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from adambridge import AdamBridge
from adambridge.sync import step_plan
from adambridge._native import plan_checks

from conftest import native_available


@pytest.fixture(autouse=True)
def _native_required():
    if not native_available():
        pytest.fail("the native kernel did not build on this machine; the step plan is a "
                    "native-only path (see `python -m adambridge info`)")


@pytest.fixture(autouse=True, params=["python checks", "native checks"])
def checks(request, monkeypatch):
    """Every test runs with the plan's Python passes and with its native ones (plan_checks),
    which a plan otherwise takes from FACTS_MIN_PARAMS parameters on."""
    if request.param == "native checks":
        if plan_checks.load() is None:
            pytest.fail("the torch metadata pass did not build on this machine: "
                        f"{plan_checks.unavailable_reason()}")
        monkeypatch.setattr(step_plan, "FACTS_MIN_PARAMS", 1)
    else:
        monkeypatch.setattr(step_plan, "FACTS_MIN_PARAMS", 10 ** 9)
    monkeypatch.setitem(_MODE, "checks", request.param)
    return request.param


_MODE = {"checks": None}  # the running test's checks (see the fixture)


def _assert_planned(opt) -> None:
    """opt holds a plan, with the checks the test runs under."""
    assert opt._plan is not None
    assert (opt._plan.native is not None) == (_MODE["checks"] == "native checks")


SHAPES = [(1,), (15,), (17,), (300,), (9, 13), (129,)]
DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float16,
          torch.bfloat16]
STEPS = 14


def _fresh_grads(params, gen):
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-1).to(p.dtype)


def _event(step: int, opt, params, extra, saved: dict, gen) -> None:
    """What happens before step ``step`` of the long run (the same in every variant)."""
    active = params + ([extra] if step >= 6 else [])
    if step in (2, 3):  # the same gradient tensors, changed in place
        for p in active:
            p.grad.mul_(0.5)
    else:
        _fresh_grads(active, gen)
    if step == 4:
        params[1].grad = None  # loses its gradient: takes no step
    if step == 6:
        opt.add_param_group({"params": [extra], "lr": 5e-3, "weight_decay": 0.0})
        saved["sched"] = _scheduler(opt)  # torch's schedulers keep their groups' count
    if step == 8:
        saved["state"] = copy.deepcopy(opt.state_dict())
    if step == 10:
        opt.load_state_dict(saved["state"])
    if step == 12:
        with torch.no_grad():
            params[2].add_(1.0)  # a write to a bf16 parameter: the next step starts from it


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))


def _snapshot(opt, params) -> list:
    out = []
    for p in params:
        out.append(p.detach().clone())
        state = opt.state.get(p) or {}
        for key in sorted(state):
            value = state[key]
            out.append(value.item() if key == "step" else value.detach().clone())
    return out


def _long_run(backend: str, precision: str) -> tuple[list, int]:
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt))
              for s, dt in zip(SHAPES, DTYPES)]
    extra = torch.nn.Parameter(torch.randn(40, generator=gen))
    opt = AdamBridge([{"params": params[:4]},
                      {"params": params[4:], "lr": 3e-3, "weight_decay": 0.1}],
                     lr=1e-2, precision=precision, backend=backend, seed=7)
    saved, trace, planned = {"sched": _scheduler(opt)}, [], 0
    for step in range(STEPS):
        _event(step, opt, params, extra, saved, gen)
        opt.step()
        # (a plan counts only with the checks the test runs under)
        planned += opt._plan is not None and \
            (opt._plan.native is not None) == (_MODE["checks"] == "native checks")
        saved["sched"].step()  # a new lr every step
        trace.append(_snapshot(opt, params + [extra]))
    return trace, planned


def _bits(value):
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).view(torch.uint8)
    return value


def _assert_same(a: list, b: list, what: str) -> None:
    for step, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"{what}: step {step} has different state entries"
        for i, (u, v) in enumerate(zip(x, y)):
            if isinstance(u, torch.Tensor):
                assert torch.equal(_bits(u), _bits(v)), f"{what}: step {step}, entry {i}"
            else:
                assert u == v, f"{what}: step {step}, entry {i}: {u} != {v}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_step_plan_long_run_equals_full_path_and_torch(precision):
    planned_trace, planned = _long_run("native", precision)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_plan, "eligible", lambda *args: False)
        full_trace, never = _long_run("native", precision)
    torch_trace, _ = _long_run("torch", precision)
    assert never == 0
    # Every step but those that changed the plan's facts ran on a plan.
    assert planned >= STEPS - 1
    _assert_same(planned_trace, full_trace, "plan vs full native path")
    _assert_same(planned_trace, torch_trace, "plan vs torch backend")


# --------------------------------------------------------------- changes between steps

def _change_exp_avg(opt, p):
    opt.state[p]["exp_avg"] = torch.full_like(opt.state[p]["exp_avg"], 0.25)


def _replace_data(opt, p):
    p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(5))


def _replace_state(opt, p):
    opt.state[p] = copy.deepcopy(opt.state[p])


def _same_grad_new_storage(opt, p):
    p.grad.data = torch.ones_like(p.grad)


def _fill_step(opt, p):
    opt.state[p]["step"].fill_(40.0)


_OLD_STORAGE = []  # kept alive: a row still holding an old address writes there, not into freed memory


def _moment_storage_replaced(opt, p):
    # The same tensor objects with new storage behind them (t.data = ...): neither their
    # identity nor their autograd version tells; only the data pointer does.
    for key in ("exp_avg", "exp_avg_sq"):
        moment = opt.state[p][key]
        _OLD_STORAGE.append(moment.data)
        moment.data = torch.full_like(moment, 0.25 if key == "exp_avg" else 0.5)


def _leave_group(opt, p):
    # The group's list itself edited: the group dicts and opt.state stay the same objects.
    listed = opt.param_groups[0]["params"]
    del listed[next(i for i, q in enumerate(listed) if q is p)]  # (list.remove calls ==)


CHANGES = [
    dict(desc="a parameter taken out of its group's list", change=_leave_group),
    dict(desc="a state tensor replaced", change=_change_exp_avg),
    dict(desc="a parameter's storage replaced (p.data = ...)", change=_replace_data),
    dict(desc="a state dict replaced by a copy", change=_replace_state),
    dict(desc="the same gradient object given new storage", change=_same_grad_new_storage),
    dict(desc="a step counter written in place", change=_fill_step),
    dict(desc="moments given new storage behind the same tensors", change=_moment_storage_replaced),
]


def _changed_run(backend: str, change, shapes=((7,), (130,), (33,)), seed: int = 11) -> list:
    """Five steps, ``change`` applied to the second parameter before the fourth."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    opt = AdamBridge(params, lr=1e-2, backend=backend)
    trace = []
    for step in range(5):
        if step != 3:
            _fresh_grads(params, gen)
        else:
            change(opt, params[1])
        opt.step()
        trace.append(_snapshot(opt, params))
    return trace


@pytest.mark.parametrize("config", CHANGES, ids=lambda c: c["desc"])
def test_step_plan_sees_changes_between_steps(config):
    _assert_same(_changed_run("native", config["change"]),
                 _changed_run("torch", config["change"]), config["desc"])


def _wrong_shape_new_grad(params):
    params[0].grad = torch.randn(5)
    params[1].grad = torch.randn(9)
    params[1].grad.data = torch.randn(3)  # torch refuses such a p.grad, not such a .data


def _same_grad_resized(params):
    params[1].grad.resize_(3)  # fewer elements keep the data pointer: only the shape tells


@pytest.mark.parametrize("spoil", [_wrong_shape_new_grad, _same_grad_resized],
                         ids=["new gradient of the wrong shape", "same gradient resized"])
def test_step_plan_bad_gradient_raises_before_any_update(spoil):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9)]
    opt = AdamBridge(params, backend="native")
    for _ in range(2):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    _assert_planned(opt)
    before = _snapshot(opt, params)
    spoil(params)
    with pytest.raises(ValueError, match=r"Invalid gradient of parameter 1: shape \(3,\)"):
        opt.step()
    _assert_same([_snapshot(opt, params)], [before], "after the refused step")


def test_step_plan_step_counters_read_as_torch_keeps_them():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4, 6)]
    opt = AdamBridge(params, backend="native")
    for _ in range(3):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    params[1].grad = None
    _fresh_grads(params[:1], torch.Generator().manual_seed(1))
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [4.0, 3.0]
    saved = opt.state_dict()["state"]
    assert [saved[i]["step"].item() for i in (0, 1)] == [4.0, 3.0]
    assert all(opt.state[p]["step"].shape == () for p in params)


# --------------------------------------------------------------- no allocation per parameter

def _collections_during_steps(count: int, fresh_grads: bool) -> int:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, generator=gen)) for _ in range(count)]
    opt = AdamBridge(params, backend="native")
    grad_sets = [[torch.randn(64, generator=gen) for _ in params] for _ in range(2)]
    for p, g in zip(params, grad_sets[0]):
        p.grad = g
    opt.step()  # builds the plan
    starts = []

    def count_start(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    threshold = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(count_start)
    gc.set_threshold(50, 10, 10)  # sensitive: 50 live new containers start a collection
    try:
        for k in range(3):
            if fresh_grads:
                for p, g in zip(params, grad_sets[(k + 1) % 2]):
                    p.grad = g
            opt.step()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count_start)
    _assert_planned(opt)
    return len(starts)


@pytest.mark.parametrize("fresh_grads", [False, True], ids=["same grads", "new grads"])
def test_step_plan_allocates_no_container_per_parameter(fresh_grads):
    # NOTE: the full path keeps several containers per parameter alive during a step
    # (work tuples, UpdateItems, views); 2,000 parameters then start hundreds of collections.
    few = _collections_during_steps(20, fresh_grads)
    many = _collections_during_steps(2000, fresh_grads)
    assert many <= few + 3, f"{many} collections with 2,000 parameters, {few} with 20"


def _batch_of(sizes):
    from adambridge.update import state as host_state
    from adambridge.update.functional import Hyper, NativeBatch, UpdateItem
    hyper = Hyper.for_step(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    states = [host_state.new_state(torch.randn(n), "fp32", alias=True) for n in sizes]
    items = [UpdateItem(master=st["master"], grad=torch.zeros(n), exp_avg=st["exp_avg"],
                        exp_avg_sq=st["exp_avg_sq"], exp_avg_scale=None, exp_avg_sq_scale=None,
                        out=None, offset=0, key=i, precision="fp32", stochastic_rounding=False,
                        hyper=hyper) for i, (st, n) in enumerate(zip(states, sizes))]
    return NativeBatch(items), states


@pytest.mark.parametrize("bad", ["int64 dtype", "non-contiguous", "wrong count"])
def test_set_grads_with_numels_checked_still_refuses_a_bad_gradient(bad):
    # numels_checked skips only the element-count read (the plan passes it after comparing
    # shapes); dtype, contiguity and, without it, the count are still checked before any write.
    batch, states = _batch_of([4, 6])
    before = [st["master"].clone() for st in states]
    grad = {"int64 dtype": torch.zeros(6, dtype=torch.int64),
            "non-contiguous": torch.zeros(12)[::2],
            "wrong count": torch.zeros(6)}[bad]
    if bad == "wrong count":
        with pytest.raises(ValueError, match="Invalid grad"):
            batch.set_grads([torch.zeros(4), torch.zeros(5)])
        return
    with pytest.raises(ValueError, match="Invalid grad"):
        batch.set_grads([torch.zeros(4), grad], numels_checked=True)
    batch.run()  # the old (zero) gradients are still in place: an update of zeros
    assert all(torch.equal(a, st["master"]) for a, st in zip(before, states))


def test_set_grads_rewrites_the_dtype_column_only_when_dtypes_change():
    # The column is kept while the dtypes are the same and rewritten when one changes: each
    # step equals an adamw_update over freshly packed items, bit for bit.
    from adambridge.update.functional import adamw_update
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    cached, cached_states = _batch_of([5, 7])
    plain, plain_states = _batch_of([5, 7])
    for st, ref in zip(cached_states, plain_states):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            st[key].copy_(ref[key])
    gen = torch.Generator().manual_seed(3)
    for dtype in dtypes:
        grads = [torch.randn(n, generator=gen).to(dtype) for n in (5, 7)]
        pointers = cached.set_grads(grads, numels_checked=True)
        assert pointers == [g.data_ptr() for g in grads]
        cached.run()
        for item, grad in zip(plain.items, grads):
            item.grad = grad
        adamw_update(plain.items, "native")
        for st, ref in zip(cached_states, plain_states):
            assert all(torch.equal(st[k].view(torch.int32), ref[k].view(torch.int32))
                       for k in ("master", "exp_avg", "exp_avg_sq")), dtype


# --------------------------------------------------------------- what the checks must still see

def _transpose_grad_data(opt, p):
    p.grad.data = p.grad.data.t()  # same object, same pointer and shape: not contiguous


def _square_run(backend: str, change) -> list:
    return _changed_run(backend, change, shapes=((3, 3), (6, 6), (5, 5)), seed=13)


def test_step_plan_sees_the_same_gradient_transposed_behind_its_pointer():
    _assert_same(_square_run("native", _transpose_grad_data),
                 _square_run("torch", _transpose_grad_data), "the same gradient transposed")


def test_step_plan_does_not_fit_a_parameter_transposed_behind_its_pointer():
    # p.data = p.data.t() keeps the pointer, the shape and the version: only contiguity tells.
    params = [torch.nn.Parameter(torch.randn(n, n)) for n in (3, 6)]
    opt = AdamBridge(params, backend="native")
    for _ in range(2):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    _assert_planned(opt)
    assert opt._plan.fits(opt)
    params[1].data = params[1].data.t()
    assert not opt._plan.fits(opt)


def _planned_pair(shape=(5,), dtype=torch.float32):
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for _ in range(2)]
    opt = AdamBridge(params, backend="native")
    for _ in range(2):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    _assert_planned(opt)
    return opt, params


def _same_grad_as_int32(params):
    params[1].grad.data = params[1].grad.data.view(torch.int32)  # same pointer and shape


def _param_reshaped(params):
    params[1].data = params[1].data.view(2, 3)  # same pointer, same count, no version bump
    params[1].grad = params[1].grad.view(2, 3)


def _new_sparse_grad(params):
    params[1].grad = torch.randn(6).to_sparse()


@pytest.mark.parametrize("spoil, error, match", [
    (_same_grad_as_int32, ValueError, r"Invalid gradient of parameter 1: dtype torch.int32"),
    (_param_reshaped, ValueError, r"Parameter 1 changed from \(6,\)"),
    (_new_sparse_grad, RuntimeError, r"Invalid gradient of parameter 1: sparse"),
], ids=["same gradient viewed as int32", "parameter reshaped in place", "new sparse gradient"])
def test_step_plan_refuses_what_the_full_path_refuses(spoil, error, match):
    opt, params = _planned_pair(shape=(6,))
    before = _snapshot(opt, params)
    spoil(params)
    with pytest.raises(error, match=match):
        opt.step()
    _assert_same([_snapshot(opt, params)], [before], "after the refused step")


def test_step_plan_is_not_built_over_an_empty_parameter():
    # An empty tensor's data pointer is 0 wherever it lives, so a plan could not tell it moved.
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(0))]
    opt = AdamBridge(params, backend="native")
    for _ in range(2):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    assert opt._plan is None
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0]


@pytest.mark.parametrize("key", ["exp_avg_sq", "exp_avg_sq_scale"])
def test_step_plan_does_not_fit_a_state_missing_an_entry(key):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 130)]
    opt = AdamBridge(params, backend="native", precision="fp8")
    for _ in range(2):
        _fresh_grads(params, torch.Generator().manual_seed(0))
        opt.step()
    _assert_planned(opt)
    assert opt._plan.fits(opt)
    del opt.state[params[1]][key]
    assert not opt._plan.fits(opt)


def _versions_run(planned: bool) -> list:
    params = [torch.nn.Parameter(torch.randn(n).to(dt))
              for n, dt in ((4, torch.float32), (9, torch.bfloat16))]
    opt = AdamBridge(params, backend="native")
    versions = []
    with pytest.MonkeyPatch.context() as mp:
        if not planned:
            mp.setattr(step_plan, "eligible", lambda *args: False)
        for _ in range(4):
            _fresh_grads(params, torch.Generator().manual_seed(0))
            opt.step()
            versions.append([p._version for p in params])
    if planned:
        _assert_planned(opt)
    return versions


def test_step_plan_bumps_autograd_versions_as_the_full_path_does():
    # A graph that saved a parameter must see the update (backward then refuses it).
    assert _versions_run(planned=True) == _versions_run(planned=False)
