"""The step plan's native metadata pass (csrc_torch/plan_checks.cpp, _native/plan_checks.py):
what each pass reads equals what Python reads, anything unusual is a mismatch (never a crash),
it lives in the verified cache, and without a C++ compiler plans check in Python."""
from __future__ import annotations

import json
import time

import pytest
import torch

from adambridge import AdamBridge
from adambridge.sync import step_plan
from adambridge._native import build, torch_build, plan_checks, trusted


@pytest.fixture(scope="module")
def lib():
    found = plan_checks.load()
    if found is None:
        pytest.fail(f"the torch metadata pass did not build here: {plan_checks.unavailable_reason()}")
    return found


def _params(*shapes):
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    return params


def test_rows_hold_what_python_reads(lib):
    params = _params((3,), (4, 5), (2, 1, 3, 1, 2, 1, 1, 2))
    rows = lib.read_rows(params)
    for p, row in zip(params, rows.tolist()):
        assert row[0] == p.data_ptr() and row[2] == p.dim() and row[3:3 + p.dim()] == list(p.shape)
    grads = lib.read_rows(params, of_grads=True)
    assert grads[:, 0].tolist() == [p.grad.data_ptr() for p in params]
    assert lib.same_rows(params, rows)
    assert lib.read_rows(_params((1,) * 9)) is None  # more dimensions than a row holds


class _Wrapped(torch.Tensor):
    """A subclass whose ops dispatch to Python (like DTensor): it has no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} is not for this test double")


SPOILED = {
    "storage replaced": lambda p: setattr(p, "data", torch.randn(p.shape)),
    "transposed behind its pointer": lambda p: setattr(p, "data", p.data.t()),
    "another dtype": lambda p: setattr(p, "data", p.data.double()),
    "reshaped": lambda p: setattr(p, "data", p.data.view(-1)),
    "swapped with another tensor": lambda p: torch.utils.swap_tensors(p, torch.nn.Parameter(torch.randn(p.shape))),
    "a prefix of its storage": lambda p: setattr(p, "data", p.data.view(-1)[:8].view(2, 4)),
}


@pytest.mark.parametrize("spoil", SPOILED.values(), ids=SPOILED.keys())
def test_a_changed_parameter_is_a_mismatch(lib, spoil):
    params = _params((3, 4), (4, 4), (5,))
    rows = lib.read_rows(params)
    spoil(params[1])
    assert not lib.same_rows(params, rows)


def _set_grad(p, grad):
    p.grad = grad


def _set_grad_data(p, data):
    p.grad = torch.randn(p.shape)
    p.grad.data = data  # bypasses the p.grad setter's checks, as the tests of step_plan do


BAD_GRADS = {
    "missing": lambda p: _set_grad(p, None),
    "another dtype": lambda p: _set_grad_data(p, torch.randn(p.shape, dtype=torch.float64)),
    "another shape": lambda p: _set_grad_data(p, torch.randn(p.numel())),
    "non-contiguous": lambda p: _set_grad_data(p, torch.randn(p.shape[::-1]).t()),
    "a lazily negated view": lambda p: _set_grad(p, torch._neg_view(torch.randn(p.shape))),
    "a Python-dispatch subclass without storage": lambda p: _set_grad(p, _Wrapped(torch.randn(p.shape))),
    "sparse": lambda p: _set_grad(p, torch.randn(p.shape).to_sparse()),
}


@pytest.mark.parametrize("spoil", BAD_GRADS.values(), ids=BAD_GRADS.keys())
def test_an_unfit_gradient_is_refused_and_nothing_written(lib, spoil):
    params = _params((3, 4), (4, 4))
    rows = lib.read_rows(params, of_grads=True)
    before = rows.clone()
    column = torch.zeros((2, 3), dtype=torch.int64)
    params[0].grad = torch.randn(params[0].shape)  # a new, fit one: would be taken
    spoil(params[1])
    assert not lib.take_grads(params, rows, column.data_ptr() + 8, 24)
    # (the last word of a row is scratch)
    assert torch.equal(rows[:, :-1], before[:, :-1]) and not column.any()


def test_fit_gradients_are_written_into_rows_and_column(lib):
    params = _params((3, 4), (7,))
    rows = lib.read_rows(params, of_grads=True)
    for p in params:
        p.grad = torch.randn(p.shape)
    column = torch.zeros((2, 3), dtype=torch.int64)
    assert lib.take_grads(params, rows, column.data_ptr() + 8, 24)
    pointers = [p.grad.data_ptr() for p in params]
    assert column[:, 1].tolist() == pointers and rows[:, 0].tolist() == pointers


def test_states_dicts_and_lists_compare_objects_and_storage(lib):
    states = [{"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)} for _ in range(40)]
    keys = ("exp_avg", "step")  # the last ntensors of them: storage compared too
    refs = plan_checks.object_addresses([s[k] for s in states for k in keys])

    def ptrs(*compared):
        return torch.tensor([s[k].data_ptr() for s in states for k in compared], dtype=torch.int64)

    both, step_only = ptrs(*keys), ptrs("step")
    assert lib.same_states(states, keys, refs, both, 2)
    kept = states[33]["exp_avg"].data
    states[33]["exp_avg"].data = torch.zeros(3)  # same object, new storage
    assert lib.same_states(states, keys, refs, step_only, 1)  # only "step"'s storage compared
    assert not lib.same_states(states, keys, refs, both, 2)
    states[33]["exp_avg"].data = kept
    del states[39]["step"]
    assert not lib.same_states(states, keys, refs, both, 2)

    items = [object() for _ in range(5)]
    addresses = plan_checks.object_addresses(items)
    assert lib.same_items([items[:2], items[2:]], addresses)
    assert not lib.same_items([items[:2], items[3:]], addresses)
    assert not lib.same_items([items, [object()]], addresses)
    assert not lib.same_items([tuple(items)], addresses)  # only lists are read
    mapping = dict(zip("abcde", items))
    keys_at = plan_checks.object_addresses(list(mapping))
    assert lib.same_dict(mapping, keys_at, addresses)
    mapping["c"] = object()
    assert not lib.same_dict(mapping, keys_at, addresses)


def test_versions_bump_as_torch_does_and_an_inference_tensor_is_passed_over(lib):
    params = _params((3,), (4,))
    before = lib.versions(params).tolist()
    lib.bump_versions(params)
    assert lib.versions(params).tolist() == [v + 1 for v in before] == [p._version for p in params]
    with torch.inference_mode():
        frozen = torch.zeros(3)  # has no version counter: torch does not bump it either
    plain = [torch.zeros(2), frozen, torch.zeros(2)]
    lib.bump_versions(plain)
    assert plain[0]._version == plain[2]._version == 1


def test_the_library_is_published_with_its_hash_and_refused_when_changed(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_CACHE_DIR", str(tmp_path))
    from adambridge._native import cache
    built = cache.build(planner=torch_build.plan)
    assert built.path.parent.parent == tmp_path and built.path.name == torch_build.LIB_NAME
    manifest = json.loads((built.path.parent / build.MANIFEST).read_text())
    assert manifest["sha256"] == trusted.sha256(built.path.read_bytes())
    with open(built.path, "ab") as f:
        f.write(b"\0")  # planted or damaged: its hash no longer matches
    with pytest.raises(trusted.Damaged):
        trusted.verify_library(built.path.parent, built.path.name, build.MANIFEST)


def test_without_a_cxx_compiler_plans_check_in_python(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(torch_build, "CXX_CANDIDATES", ())  # and nothing else to try
    monkeypatch.setattr(step_plan, "FACTS_MIN_PARAMS", 1)
    plan_checks.reset()
    try:
        assert plan_checks.load() is None
        assert "no C++ compiler" in plan_checks.unavailable_reason()
        params = _params((5,), (6,))
        opt = AdamBridge(params, backend="native")
        for _ in range(3):
            opt.step()
        assert opt._plan is not None and opt._plan.native is None
    finally:
        plan_checks.reset()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_TORCH_FACTS", "0")
    assert plan_checks.load() is None
    assert "ADAMBRIDGE_TORCH_FACTS" in plan_checks.unavailable_reason()


def test_a_plan_checks_in_python_until_the_library_is_ready_then_natively(lib, monkeypatch):
    monkeypatch.setattr(step_plan, "FACTS_MIN_PARAMS", 1)
    ready, started = [], []
    monkeypatch.setattr(plan_checks, "loaded", lambda: ready[0] if ready else None)
    monkeypatch.setattr(plan_checks, "start_loading", lambda: started.append(True))
    params = _params((5,), (6, 2))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = AdamBridge(params, backend="native"), AdamBridge(twins, backend="torch")
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:
            ready.append(lib)  # the build finished between two steps
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        assert (opt._plan.native is not None) == (step >= 2), step
        assert all(torch.equal(p, q) for p, q in zip(params, twins)), step
    assert started  # the first plan asked for the build instead of waiting for it


def test_start_loading_builds_on_a_thread_and_returns_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_CACHE_DIR", str(tmp_path))  # nothing built here yet
    plan_checks.reset()
    try:
        began = time.perf_counter()
        plan_checks.start_loading()
        plan_checks.start_loading()  # once per process
        assert time.perf_counter() - began < 1.0 and len(plan_checks._loading) == 1
        assert plan_checks.loaded() is None  # a build takes seconds
        plan_checks._loading[0].join(timeout=300)
        found = plan_checks.loaded()
        assert found is not None and tmp_path in found.path.parents
    finally:
        plan_checks.reset()
