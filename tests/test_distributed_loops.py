"""The loops users write, on 2 gloo ranks: FSDP2 shards whose fp8 blocks start off a
multiple of 128.

The scenarios are in tests/_loop_workers.py; each launch has a timeout, so a rank left
waiting in a collective fails the test instead of hanging it.
"""
from __future__ import annotations

import torch

import _distributed_workers as workers

TIMEOUT_S = 240.0  # this machine is shared


def _identical(ours: list, theirs: list) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _launch(name: str, tmp_path_factory) -> list:
    return workers.launch(f"_loop_workers:{name}", 2, tmp_path_factory.mktemp(name),
                          timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- FSDP2, fp8


def test_fsdp2_fp8_shard_starting_off_a_block_steps_alike_on_both_backends(tmp_path_factory):
    ranks = _launch("fsdp2_fp8_uneven", tmp_path_factory)
    assert ranks[1]["offsets"] == [17 * 512, 17]  # the bias shard starts at element 17
    for result in ranks:
        for mode in ("sync", "async"):
            _identical(result["native", mode], result["torch", mode])
        _identical(result["native", "async"], result["native", "sync"])
