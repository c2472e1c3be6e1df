"""FSDP2 with shards that do not split evenly (torchao's test_uneven_shard, run on 2 real
gloo ranks): fully_shard(nn.Linear(512, 33)), whose 33 rows split 17 + 16.

- fp32 moments, sync and async: the full parameters equal torch.optim.AdamW replaying the
  same full gradients in one process (fp32 contract).
- bf16 moments: equal to an unsharded AdamBridge replaying them, bit for bit (the stochastic
  bits are keyed by the element's index in the full parameter, so N ranks change nothing).
- fp8 moments: the same for the weight, whose second shard starts at element 17 * 512, a
  multiple of the 128-element block; the bias's second shard starts at element 17, so its
  block scales are the shard's own and differ from one process's (README, "Multi-GPU").
- async equals sync on every rank bit for bit, every precision.
"""
from __future__ import annotations

import pytest
import torch

import _distributed_workers as workers
from adambridge import AdamBridge

from ._peer_ranks import LR, WD
from ._twins import RTOL, ATOL, assert_elements_close, assert_identical, own_copy

TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return workers.launch("peers._peer_ranks:fsdp2_uneven", 2,
                          tmp_path_factory.mktemp("fsdp2_uneven"), timeout_s=TIMEOUT_S)


def _replay(factory, init: list, grads: list) -> list:
    params = [own_copy(v) for v in init]
    opt = factory(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def test_fsdp2_uneven_shards_fp32_equal_adamw(ranks):
    rank0 = ranks[0]
    grads = rank0["fp32", "sync"]["grads"]
    for other in ranks[1:]:  # every rank saw the same full gradients
        for a, b in zip(other["fp32", "sync"]["grads"], grads):
            assert_identical(a, b, what="full gradients across ranks")
    ref = _replay(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD), rank0["init"], grads)
    for mode in ("sync", "async"):
        for rank, result in enumerate(ranks):
            for i, (p, r) in enumerate(zip(result["fp32", mode]["full"], ref)):
                assert_elements_close(p, r, rtol=RTOL, atol=ATOL, what=f"rank {rank} {mode} [{i}]")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fsdp2_uneven_shards_low_precision_equal_one_process(ranks, precision):
    rank0 = ranks[0]
    one = _replay(lambda ps: AdamBridge(ps, lr=LR, weight_decay=WD, precision=precision, seed=5),
                  rank0["init"], rank0[precision, "sync"]["grads"])
    compared = one if precision == "bf16" else one[:1]  # fp8: the weight (see the docstring)
    for mode in ("sync", "async"):
        for rank, result in enumerate(ranks):
            full = result[precision, mode]["full"][:len(compared)]
            assert_identical(full, compared, what=f"{precision} rank {rank} {mode}")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_fsdp2_uneven_shards_async_equals_sync(ranks, precision):
    for rank, result in enumerate(ranks):
        sync, hooked = result[precision, "sync"], result[precision, "async"]
        assert_identical(hooked["local"] + hooked["state"], sync["local"] + sync["state"],
                         what=f"{precision} rank {rank}")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return workers.launch("peers._peer_ranks:fsdp2_uneven_dcp_resume", 2,
                          tmp_path_factory.mktemp("fsdp2_resume"), timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_uneven_shards_dcp_resume_equals_uninterrupted(resumed, precision, mode):
    """torchao's FSDP2 checkpoint test on uneven shards: saved by DCP on 2 ranks, loaded into
    a fresh model and optimizer, trained on: equal to the run never stopped, bit for bit."""
    for rank, result in enumerate(resumed):
        run = result[precision, mode]
        assert_identical(run["resumed"], run["uninterrupted"], what=f"rank {rank}")
