"""DCP under FSDP2 on 2 gloo ranks: every supported way of resuming is bit for bit.

The ranks (tests/helpers/_dcp_workers.py) save one run three ways (DCP's helpers, a torchtitan
``Stateful``, and the modules' and optimizer's own state_dict() as torchao's FSDP2 test
does), go on, and resume each way on fresh FSDP2 models; the resumed shards and the host
state of each rank must equal the uninterrupted run's, in place too: every saved tensor is
the state's own (DTensors over views of each rank's shard), whatever the precision.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint",
                    reason="torch.distributed is not built into this torch")
import _dcp_workers as workers  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return workers.launch(2, tmp_path_factory.mktemp("fsdp2_dcp") / "out")


def _identical(a: dict, b: dict) -> None:
    for i, (p, q) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
    for i, (s, t) in enumerate(zip(a["state"], b["state"], strict=True)):
        assert s.keys() == t.keys()
        for key in s:
            assert s[key].dtype == t[key].dtype and torch.equal(s[key], t[key]), (i, key)


@pytest.mark.parametrize("way", workers.WAYS)
@pytest.mark.parametrize("config", workers.CONFIGS, ids=[f"{p}-{d}" for p, d in workers.CONFIGS])
def test_fsdp2_dcp_resume_is_bit_for_bit(ranks, config, way):
    precision, dtype = config
    for result in ranks:
        resumed = result[precision, dtype, way]
        assert "error" not in resumed, resumed.get("error")
        _identical(resumed, result[precision, dtype, "uninterrupted"])
