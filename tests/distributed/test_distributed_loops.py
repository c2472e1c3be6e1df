"""The loops users write, on 2 gloo ranks and in one process: the asynchronous loop without
zero_grad() under DDP, shard_state and FSDP2; the DDP wrapper found from what attach_hooks is
given, never by scanning the heap; FSDP2 shards whose fp8 blocks start off a multiple of 128.

The scenarios are in tests/helpers/_loop_workers.py; each launch has a timeout, so a rank left
waiting in a collective fails the test instead of hanging it.
"""
from __future__ import annotations

import gc
import re
import time
import warnings
import weakref

import pytest
import torch

import _distributed_workers as workers
from adambridge import AdamBridge

TIMEOUT_S = 240.0  # the seed loop builds 16 models per rank; this machine is shared


def _identical(ours: list, theirs: list) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _launch(name: str, tmp_path_factory) -> list:
    return workers.launch(f"_loop_workers:{name}", 2, tmp_path_factory.mktemp(name),
                          timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def seed_loop(tmp_path_factory):
    return _launch("seed_loop", tmp_path_factory)


@pytest.mark.parametrize("view", [False, True], ids=["bucket_copy", "gradient_as_bucket_view"])
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "shard_state"])
def test_ddp_async_loop_without_zero_grad_equals_sync_with_it(seed_loop, view, sharded):
    targets = ("ddp",) if sharded else ("ddp", "module")
    for result in seed_loop:
        for target in targets:
            _identical(result["ddp", view, sharded, target], result["ddp", view, sharded, None])
    for target in targets:
        _identical(seed_loop[0]["ddp", view, sharded, target],
                   seed_loop[1]["ddp", view, sharded, target])
    if not sharded:  # the comm hook handed both hooked weights over in every backward
        for result in seed_loop:
            for target in targets:
                assert result["ddp", view, sharded, target, "taken"] == [2] * 5


def test_ddp_async_loop_with_kept_gradients_accumulates_as_sync(seed_loop):
    # release_grads=False keeps p.grad, as torch does: without zero_grad() the backward
    # passes add up, in both loops alike.
    for result in seed_loop:
        _identical(result["kept", "async"], result["kept", "sync"])


@pytest.mark.parametrize("setup", ["plain", "cpu_offload"])
def test_fsdp2_async_loop_without_zero_grad_equals_sync_with_it(seed_loop, setup):
    for result in seed_loop:
        _identical(result["fsdp2", setup, "async"], result["fsdp2", setup, "sync"])


# --------------------------------------------------------------------------- the DDP wrapper


@pytest.fixture(scope="module")
def wrapper_lookup(tmp_path_factory):
    return _launch("wrapper_lookup", tmp_path_factory)


def test_ddp_wrapping_after_attach_hooks_is_bound_at_its_forward(wrapper_lookup):
    for result in wrapper_lookup:
        _identical(result["wrapped after", "async"], result["wrapped after", "sync"])
        assert result["wrapped after", "async", "taken"] == [2] * 5


def test_a_model_no_ddp_wraps_is_updated_at_step_with_one_warning(wrapper_lookup):
    # No hook may see a gradient before something reduces it: with 2 ranks and no DDP, every
    # gradient goes at step(), exactly as the synchronous step takes it.
    for result in wrapper_lookup:
        _identical(result["alone", "async"], result["alone", "sync"])
        assert result["alone", "async", "taken"] == [0] * 5
        outside = [m for m in result["warnings"] if "this forward ran outside DDP" in m]
        assert len(outside) == 1, result["warnings"]
    assert not torch.equal(wrapper_lookup[0]["alone", "async"][0],
                           wrapper_lookup[1]["alone", "async"][0])  # each its own gradients


def test_attach_hooks_without_a_ddp_to_find_is_refused_in_one_line(wrapper_lookup):
    errors = wrapper_lookup[0]
    expected = {
        "no model": "ValueError: attach_hooks() with no model under torch.distributed (2 "
                    "ranks) cannot tell whether DDP reduces the gradients; pass the model",
        "no model, shard_state": "ValueError: attach_hooks() with shard_state=True needs the "
                                 "DDP model",
        ".module, shard_state": "ValueError: attach_hooks() with shard_state=True needs the "
                                "DDP model",
    }
    for name, start in expected.items():
        assert errors[name].startswith(start), (name, errors[name])
        assert "\n" not in errors[name]


class _Nothing:
    pass


def test_attach_hooks_after_torch_compile_with_a_dead_weakref_proxy():
    earlier = torch.compile(torch.nn.Linear(8, 8))
    earlier(torch.randn(2, 8)).sum().backward()  # compiles (dynamo keeps weak proxies)
    target = _Nothing()
    dead = weakref.proxy(target)
    del target  # a dead proxy raises ReferenceError on any attribute access
    model = torch.compile(torch.nn.Linear(8, 8))
    model(torch.randn(2, 8)).sum().backward()
    model.zero_grad()
    opt = AdamBridge(model.parameters(), lr=1e-2, small_param_threshold=0)
    opt.attach_hooks(model)
    try:
        model(torch.randn(2, 8)).sum().backward()
        opt.step_sync()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1, 1]
    finally:
        opt.detach_hooks()
    assert dead is not None


def test_attach_hooks_warns_nothing():
    model = torch.nn.Linear(8, 8)
    opt = AdamBridge(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's FutureWarning of reduce_op would raise here
        opt.attach_hooks(model)
        opt.detach_hooks()


def _attach_seconds(model: torch.nn.Module) -> float:
    best = float("inf")  # the fastest of 15: a call takes ~0.1 ms, a scheduler hiccup more
    for _ in range(15):
        opt = AdamBridge(model.parameters())
        began = time.perf_counter()
        opt.attach_hooks(model)
        best = min(best, time.perf_counter() - began)
        opt.detach_hooks()
    return best


def _walk_seconds() -> float:
    """One walk of the heap, looking at each object's type (what a search for DDP costs)."""
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        # (type(), not isinstance: a dead weakref.proxy raises ReferenceError at the latter)
        sum(1 for obj in gc.get_objects() if type(obj) is torch.nn.Linear)
        best = min(best, time.perf_counter() - began)
    return best


def test_attach_hooks_time_does_not_grow_with_the_heap():
    model = torch.nn.Linear(4, 4)
    _attach_seconds(model)  # warm: imports, the native build, the first thread
    enabled = gc.isenabled()
    gc.disable()  # a collection during a timed call would scan the extra objects too
    try:
        alone = _attach_seconds(model)
        extra = [[] for _ in range(300_000)]  # 300K more objects the collector tracks
        crowded, walk = _attach_seconds(model), _walk_seconds()
        del extra
    finally:
        if enabled:
            gc.enable()
    # The time the extra objects added, as a fraction of one walk over the heap holding
    # them: about half a walk for a call that walks the heap, nothing for one that never
    # does (its ~0.1 ms is thread starts, which the load on the machine may stretch).
    assert (crowded - alone) / walk < 0.1, (alone, crowded, walk)


# --------------------------------------------------------------------------- FSDP2, fp8


def test_fsdp2_fp8_shard_starting_off_a_block_steps_alike_on_both_backends(tmp_path_factory):
    ranks = _launch("fsdp2_fp8_uneven", tmp_path_factory)
    assert ranks[1]["offsets"] == [17 * 512, 17]  # the bias shard starts at element 17
    for result in ranks:
        for mode in ("sync", "async"):
            _identical(result["native", mode], result["torch", mode])
        _identical(result["native", "async"], result["native", "sync"])


# --------------------------------------------------------------------------- hyperparameters


@pytest.fixture(scope="module")
def hyper_after_backward(tmp_path_factory):
    return _launch("hyper_after_backward", tmp_path_factory)


@pytest.mark.parametrize("kind", ["fsdp2", "shard_state"])
def test_distributed_async_lr_written_before_backward_overlaps_and_equals_sync(
        hyper_after_backward, kind):
    for result in hyper_after_backward:
        _identical(result[kind, None, "async"], result[kind, None, "sync"])
        assert result[kind, None, "async", "warnings"] == []
        # the first step after attach_hooks is held; every later one updated in backward
        taken = result[kind, None, "async", "in backward"]
        assert taken[0] == 0 and all(n > 0 for n in taken[1:])


@pytest.mark.parametrize("kind", ["fsdp2", "shard_state"])
def test_distributed_async_lr_written_after_every_backward_equals_sync_bit_for_bit(
        hyper_after_backward, kind):
    # llm.c's loop: the write after the first (held) backward is seen, and every later step
    # is held too, so each step uses the values step() sees, as torch's does.
    for result in hyper_after_backward:
        _identical(result[kind, 0, "async"], result[kind, 0, "sync"])
        assert result[kind, 0, "async", "in backward"] == [0] * 5
        [warning] = result[kind, 0, "async", "warnings"]
        assert "written between backward and step()" in warning
        assert "from now on every step is held until step()" in warning


@pytest.mark.parametrize("kind", ["fsdp2", "shard_state"])
def test_distributed_async_first_late_write_warns_of_the_updates_it_made_then_holds(
        hyper_after_backward, kind):
    for result in hyper_after_backward:
        taken = result[kind, 2, "async", "in backward"]
        assert taken[0] == 0 and taken[1] > 0 and taken[2] > 0 and taken[3:] == [0, 0]
        [warning] = result[kind, 2, "async", "warnings"]
        # (shard_state's count is of the parameters this rank holds a range of)
        updated = re.search(r"(\d+) parameters of this step had been updated with the values "
                            r"read during backward", warning)
        assert updated and 0 < int(updated.group(1)) <= taken[2]
        # that one step used the old lr and weight_decay for what it had updated: close to
        # sync, not equal, and the warning said so
        for ours, theirs in zip(result[kind, 2, "async"], result[kind, 2, "sync"], strict=True):
            assert (ours - theirs).abs().max() < 1e-2


# -- gradients changed between backward and step (pipeline/grad_edits.py, landed_worker.py)


@pytest.fixture(scope="module")
def grad_edits(tmp_path_factory):
    return _launch("grad_edits", tmp_path_factory)


@pytest.mark.parametrize("kind", ["scale", "titan"])
@pytest.mark.parametrize("where", ["ddp", "shard_state", "fsdp2"])
def test_gradients_changed_from_the_first_step_equal_sync(grad_edits, where, kind):
    # The first step after attach_hooks is held: a loop that changes gradients from its
    # first step is seen before any update is made (DDP: kept copies, shard_state and FSDP2:
    # every later step held), so every step equals the synchronous loop's.
    for result in grad_edits:
        (ours, error), (sync, _) = result[where, kind, 0, "async"], result[where, kind, 0, "sync"]
        assert error == "no error"
        _identical(ours, sync)


@pytest.mark.parametrize("where", ["ddp", "shard_state", "fsdp2"])
def test_gradients_first_changed_after_speculative_updates_fail_the_step(grad_edits, where):
    # Nothing was kept to redo the updates made before the change: the step says so.
    for result in grad_edits:
        error = result[where, "scale", 2, "async"][1]
        assert error.startswith("step 2: ") and "edits_grads=True" in error, error



@pytest.fixture(scope="module")
def kept_zeros(tmp_path_factory):
    return _launch("kept_zeros", tmp_path_factory)


@pytest.mark.parametrize("where", ["ddp", "shard_state", "fsdp2"])
def test_idle_expert_steps_on_kept_zeros_as_in_sync(kept_zeros, where):
    # zero_grad(set_to_none=False) after a step that released the gradients gives them
    # their zeros back, so an expert that gets no token steps on zeros, as in sync mode.
    for result in kept_zeros:
        _identical(result[where, "async"], result[where, "sync"])
