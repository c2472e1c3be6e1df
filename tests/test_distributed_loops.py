"""The loops users write, on 2 gloo ranks: the asynchronous loop without zero_grad() under
DDP, shard_state and FSDP2; FSDP2 shards whose fp8 blocks start off a multiple of 128.

The scenarios are in tests/_loop_workers.py; each launch has a timeout, so a rank left
waiting in a collective fails the test instead of hanging it.
"""
from __future__ import annotations

import pytest
import torch

import _distributed_workers as workers

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


# --------------------------------------------------------------------------- FSDP2, fp8


def test_fsdp2_fp8_shard_starting_off_a_block_steps_alike_on_both_backends(tmp_path_factory):
    ranks = _launch("fsdp2_fp8_uneven", tmp_path_factory)
    assert ranks[1]["offsets"] == [17 * 512, 17]  # the bias shard starts at element 17
    for result in ranks:
        for mode in ("sync", "async"):
            _identical(result["native", mode], result["torch", mode])
        _identical(result["native", "async"], result["native", "sync"])
