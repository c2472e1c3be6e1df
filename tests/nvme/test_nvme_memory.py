"""The NVMe tier's host memory: what host_memory_bytes() counts, and checkpoint loads that stream into the files.

``opt.host_memory_bytes()["nvme_buffers"]`` is the tier's ring of aligned page buffers
(queue_depth + 1 page records, whole huge pages once a record spans 256 KiB) plus each
file-placed parameter's staging of its new weights. ``load_state_dict()`` builds each
file-placed state, writes it into the files and lets it go before building the next.
"""
from __future__ import annotations

import importlib
import importlib.util
import io
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.host.alloc import HUGE_PAGE
from adambridge.nvme.layout import fitted
from adambridge.nvme.tier import OffloadConfig

SIZES = (300, 1000, 4097)
restore = importlib.import_module("adambridge.checkpoint.restore")


def _params(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3)
    return [nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def _step(params, opt, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


@pytest.mark.parametrize("page_size,precision", [(256, "fp8"), (1 << 18, "fp32")])
def test_host_memory_bytes_counts_the_page_ring_and_the_staging(tmp_path, page_size,
                                                               precision):
    params = _params()
    config = OffloadConfig([tmp_path], page_size=page_size, queue_depth=3)
    opt = AdamBridge(params, precision=precision, offload_dir=config, host_budget=0)
    assert opt.host_memory_bytes()["nvme_buffers"] == 0  # nothing streamed yet
    _step(params, opt)
    # (the ring holds records of the largest parameter's pages: smaller ones are fitted)
    record = max(fitted(precision, page_size, p.numel()).record_bytes for p in params)
    resident = record if record < (256 << 10) else -(-record // HUGE_PAGE) * HUGE_PAGE
    staging = sum(p.numel() * p.element_size() for p in params)
    memory = opt.host_memory_bytes()
    assert memory["nvme_buffers"] == (config.queue_depth + 1) * resident + staging
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert memory["state"] == 0  # every state is in the files
    opt.nvme_tier.close()


def test_host_memory_bytes_has_no_nvme_buffers_without_the_tier():
    params = _params()
    opt = AdamBridge(params)
    _step(params, opt)
    assert opt.host_memory_bytes()["nvme_buffers"] == 0


def test_load_lets_each_file_placed_state_go_before_building_the_next(tmp_path, monkeypatch):
    # fp32 moments loaded into bf16 ones: every built state is new (a conversion), so a
    # state still alive when the next one is built is one held beside it.
    params = _params()
    source = AdamBridge(params, precision="fp32")
    _step(params, source)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    opt = AdamBridge(_params(), precision="bf16", offload_dir=OffloadConfig([tmp_path],
                     page_size=256), host_budget=0)
    built, alive_at_each_build = [], []
    original = restore.build_state

    def recording(*args, **kwargs):
        alive_at_each_build.append(sum(ref() is not None for ref in built))
        state = original(*args, **kwargs)
        built.append(weakref.ref(state["exp_avg"]))
        return state

    monkeypatch.setattr(restore, "build_state", recording)
    opt.load_state_dict(loaded)
    assert alive_at_each_build == [0] * len(SIZES)
    for i, p in enumerate(opt.param_groups[0]["params"]):
        state = opt.state_dict()["state"][i]
        assert torch.equal(state["exp_avg"], loaded["state"][i]["exp_avg"].bfloat16())
        assert torch.equal(state["master"], loaded["state"][i]["master"])
    opt.nvme_tier.close()


# --------------------------------------------------------------------------- saves that stream

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint.py"
WIDTH, LAYERS = 2048, 4  # 16.8M bf16 parameters, each layer a quarter of the state
SLACK = 12 << 20  # as tests/checkpoint/test_checkpoint_memory.py: what does not grow


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="needs Linux: VmHWM and /proc/self/clear_refs")
@pytest.mark.parametrize("precision", ("fp32", "fp8"))
@pytest.mark.parametrize("path", ("nvme_stream", "nvme_dcp", "nvme_trainer", "nvme_accelerate",
                                  "nvme_lightning"))
def test_a_streamed_save_of_the_tier_adds_at_most_one_parameters_state(tmp_path, path,
                                                                      precision):
    # adambridge.checkpoint.save and DCP read the file-placed entries one tensor at a time;
    # torch.save of the same dict holds all of them (12 / 6 B/param, the bench's nvme row).
    # DCP went to 10 B/param of fp32 while a copy of a copy (DCP's .cpu() then .detach())
    # snapshotted by reading and cloning. The frameworks' own saves (HF Trainer, accelerate's
    # save_state: torch.save; Lightning: torch.save into a BytesIO) held all of it too, until
    # adambridge.integrations wrote them with the streaming save.
    framework = {"nvme_trainer": "transformers", "nvme_accelerate": "accelerate",
                 "nvme_lightning": "lightning"}.get(path)
    if framework is not None:
        pytest.importorskip(framework, reason=f"needs {framework} (test extra)")
    from adambridge.update.state import HOST_BYTES_PER_PARAM
    spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ours = bench.measure(dict(width=WIDTH, layers=LAYERS, dir=str(tmp_path), threads=1,
                              path=path, optimizer=precision, phase="save"))
    assert "error" not in ours, ours
    largest = HOST_BYTES_PER_PARAM[precision] * WIDTH * WIDTH
    assert ours["extra"] <= largest + SLACK, (
        f"{path} {precision}: {ours['extra'] / 2**20:.1f} MiB beyond the steady state, one "
        f"parameter's state {largest / 2**20:.1f} MiB")
