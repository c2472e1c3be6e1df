"""torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamBridge) on 2 gloo
ranks (tests/helpers/_zero_workers.py): it steps as ZeRO with torch.optim.AdamW does (fp32 moments,
the tolerance of docs/numerics.md), and its consolidated state_dict() resumes a fresh ZeRO
bit for bit in every precision (ZeRO writes each saved entry into optim.state[p] itself)."""
from __future__ import annotations

import pytest
import torch

import _distributed_workers as workers

RTOL, ATOL = 1e-6, 1e-7


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = {}
    for scenario in ("against_adamw", "resume", "async_mode"):
        out[scenario] = workers.launch(f"_zero_workers:{scenario}", 2,
                                       tmp_path_factory.mktemp(scenario), timeout_s=120.0)
    return out


def test_zero_with_adambridge_steps_as_zero_with_adamw(ranks):
    results = ranks["against_adamw"]
    for result in results:
        for ours, theirs in zip(result["ours"], result["adamw"], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for a, b in zip(results[0]["ours"][-1], results[1]["ours"][-1], strict=True):
        assert torch.equal(a, b)  # ZeRO broadcast every shard: the ranks agree


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_zero_consolidated_state_dict_resumes_a_fresh_zero_bit_for_bit(ranks, precision):
    for result in ranks["resume"]:
        run = result[precision]
        for straight, again in zip(run["straight"], run["again"], strict=True):
            for a, b in zip(straight, again, strict=True):
                assert torch.equal(a, b)
        assert len(run["state"]) == len(run["state_again"]) > 0
        for mine, resumed in zip(run["state"], run["state_again"], strict=True):
            assert mine.keys() == resumed.keys()
            for key, value in mine.items():
                assert value.dtype == resumed[key].dtype and torch.equal(value, resumed[key]), key


def test_zero_in_async_mode_equals_sync_bit_for_bit(ranks):
    # zero.optim.attach_hooks(ddp_model): the local AdamBridge updates its own parameters
    # from DDP's reduced buckets; ZeRO's step() finishes the step and broadcasts the shards.
    for result in ranks["async_mode"]:
        assert not isinstance(result["sync"], str), result["sync"]
        assert not isinstance(result["async"], str), result["async"]
        for a_step, s_step in zip(result["async"], result["sync"], strict=True):
            for a, b in zip(a_step, s_step, strict=True):
                assert torch.equal(a, b)
