"""The accelerate and HF Trainer adapters in asynchronous mode on 2 gloo ranks (DDP).

Each framework wraps the model in DistributedDataParallel; the optimizer updates from DDP's
all-reduced buckets, so async must equal sync bit for bit on every rank, with gradient
accumulation (the other micro-batches run under ``no_sync``) and clipping that fires, and
the ranks must stay identical (each saw its own share of the data).
"""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("accelerate", reason="needs accelerate (test extra)")

import _framework_ranks as ranks  # noqa: E402


def _assert_same(a: dict, b: dict) -> None:
    for i, (p, q) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(p, q), i
        for key, value in a["state"][i].items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


def _check(results: list) -> None:
    for result in results:
        _assert_same(result["async"], result["sync"])
        assert result["async"]["norms"] == result["sync"]["norms"]
        assert min(result["async"]["norms"]) > ranks.FIRES  # clipping fired
        assert result["async"]["wrapped"] == "DistributedDataParallel"
    _assert_same(results[0]["async"], results[1]["async"])  # the ranks agree


def test_accelerate_async_on_two_ranks_equals_sync_bit_for_bit(tmp_path):
    results = ranks.launch("accelerate", 2, tmp_path)
    _check(results)
    assert all(r["async"]["hooked"] and r["async"]["kind"] == "MULTI_CPU" for r in results)


def test_trainer_async_on_two_ranks_equals_sync_bit_for_bit(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    results = ranks.launch("trainer", 2, tmp_path)
    _check(results)
    assert all(r["async"]["world"] == 2 for r in results)


def test_trainer_with_shard_state_saves_streamed_and_resumes_bit_for_bit(tmp_path):
    # The Trainer calls state_dict() on its saving process only; shard_state's is a
    # collective, so without stream_saves (which calls it on every rank) the first save hung.
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    results = ranks.launch("trainer_shard_state", 2, tmp_path)
    for result in results:
        whole, resumed = result["whole"], result["resumed"]
        _assert_same(dict(params=resumed["params"], state=resumed["state"]),
                     dict(params=whole["params"], state=whole["state"]))
        assert result["gathered_saves"] == [result is results[0]] * 2  # steps 2 and 4
        assert result["unstreamed"]["refused"] == (
            "AdamBridgeCallback: the Trainer saves the optimizer on one process and "
            "shard_state's state_dict() gathers from every rank, so its first save would "
            "hang; call adambridge.integrations.transformers.stream_saves(trainer) before "
            "train()")


def test_accelerate_with_shard_state_saves_gathered_and_resumes_bit_for_bit(tmp_path):
    # save_state calls state_dict() on every process, which gathered the whole state on each;
    # the optimizer file is now written by save_gathered (the main process writing).
    results = ranks.launch("accelerate_shard_state", 2, tmp_path)
    for rank, result in enumerate(results):
        _assert_same(result["resumed"], result["whole"])
        assert result["gathered_saves"] == [rank == 0]


def test_lightning_with_shard_state_saves_gathered_and_resumes_bit_for_bit(tmp_path):
    pytest.importorskip("lightning", reason="needs lightning (test extra)")
    results = ranks.launch("lightning_shard_state", 2, tmp_path)
    for rank, result in enumerate(results):
        _assert_same(result["resumed"], result["whole"])
        assert result["gathered_saves"] == [rank == 0] * 2  # steps 2 and 4
        assert re.fullmatch(r"AdamBridgeCallback: shard_state on 2 ranks is saved with its "
                            r"gathered save, which OwnIO cannot run on every rank; "
                            r"use adambridge\.integrations\.lightning\.AdamBridgeCheckpointIO "
                            r"\(the callback's default\)", result["own_io"]["refused"])
