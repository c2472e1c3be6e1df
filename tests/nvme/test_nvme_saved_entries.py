"""The NVMe tier's state_dict() entries are read from its files when read (nvme/filed.py).

state_dict() reads nothing; each way of saving gets the committed values bit for bit;
adambridge.checkpoint.save and torch.distributed.checkpoint read one tensor at a time; a
dict kept across steps, past close() or past the optimizer keeps its values; a write into
an entry changes that entry only.
"""
from __future__ import annotations

import copy
import gc
import importlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from adambridge import AdamBridge
from adambridge.checkpoint import save
from adambridge.nvme.filed import FiledTensor
from adambridge.nvme.tier import OffloadConfig

layout = importlib.import_module("adambridge.nvme.layout")
tier_module = importlib.import_module("adambridge.nvme.tier")
PRECISIONS = ("fp32", "bf16", "fp8")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 70), nn.Linear(70, 9, bias=False)).to(torch.bfloat16)


def _step(model: nn.Module, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    for p in model.parameters():
        p.grad = None  # (DCP's get_optimizer_state_dict initialises a state only without)


def _tiered(model: nn.Module, folder, precision: str, steps: int = 2) -> AdamBridge:
    folder.mkdir()
    config = OffloadConfig([folder], page_size=256)
    opt = AdamBridge(model.parameters(), precision=precision, offload_dir=config,
                     host_budget=0, backend="torch", seed=5)
    for seed in range(steps):
        _step(model, opt, seed)
    return opt


def _plain(state_dict: dict) -> dict:
    """Every entry's tensors as plain tensors (read once), for comparing."""
    return {i: {k: copy.deepcopy(v) for k, v in entry.items()}
            for i, entry in state_dict["state"].items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for key in a[i]:
            x, y = a[i][key], b[i][key]
            assert type(x) is torch.Tensor and type(y) is torch.Tensor, (i, key)
            assert x.dtype == y.dtype and x.shape == y.shape, (i, key)
            assert torch.equal(x.view(torch.uint8) if x.dim() else x,
                               y.view(torch.uint8) if y.dim() else y), (i, key)


def _committed(folder) -> dict:
    """The committed state read straight from the tier's files, in the saved form's keys."""
    return layout.read_committed(folder)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_state_dict_reads_nothing_and_every_save_gets_the_committed_values(
        tmp_path, monkeypatch, precision):
    model = _model()
    opt = _tiered(model, tmp_path / "tier", precision)
    reads = []
    original = tier_module.read_state
    monkeypatch.setattr(tier_module, "read_state",
                        lambda *a, **k: reads.append(1) or original(*a, **k))
    saved = opt.state_dict()
    assert not reads  # the entries read when read
    assert all(isinstance(v, FiledTensor) for entry in saved["state"].values()
               for k, v in entry.items() if k not in ("step", "ab_step"))
    expected = _plain(saved)
    # One read per parameter: the entries of a parameter read together wait to be taken.
    assert len(reads) == len(saved["state"])
    for index, state in _committed(tmp_path / "tier").items():
        assert torch.equal(expected[index]["master"].reshape(-1), state["master"])
    save(saved, tmp_path / "streamed.pt")
    torch.save(saved, tmp_path / "plain.pt")
    for loaded in (torch.load(tmp_path / "streamed.pt"), torch.load(tmp_path / "plain.pt"),
                   torch.load(tmp_path / "streamed.pt", mmap=True, weights_only=True)):
        _same(_plain(loaded), expected)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path / "dcp")
    in_ram = AdamBridge(model.parameters(), precision=precision, backend="torch", seed=5)
    osd = get_optimizer_state_dict(model, in_ram)
    dcp.load({"optim": osd}, checkpoint_id=tmp_path / "dcp")
    set_optimizer_state_dict(model, in_ram, osd)
    _same(_plain(in_ram.state_dict()), expected)
    opt.nvme_tier.close()


def test_streamed_save_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    model = _model()
    opt = _tiered(model, tmp_path / "tier", "fp32")
    saved = opt.state_dict()
    alive, most = [], [0]
    original = tier_module.Tier.read_pinned

    def reading(self, pinned, key):
        value = original(self, pinned, key)
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive) + 1)
        import weakref
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(tier_module.Tier, "read_pinned", reading)
    save(saved, tmp_path / "streamed.pt")
    assert most[0] == 1  # each read tensor was written and let go before the next read
    alive.clear()
    monkeypatch.setattr(dcp.FileSystemWriter, "__init__", _one_thread(dcp.FileSystemWriter))
    dcp.save({"optim": saved}, checkpoint_id=tmp_path / "dcp")
    assert most[0] == 1
    opt.nvme_tier.close()


def _one_thread(cls):
    original = cls.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("thread_count", 1)
        original(self, *args, **kwargs)
    return init


@pytest.mark.parametrize("ending", ["steps", "close", "collected"])
def test_a_dict_kept_past_its_generation_keeps_its_values(tmp_path, ending):
    model = _model()
    opt = _tiered(model, tmp_path / "tier", "fp8")
    kept = opt.state_dict()
    view = kept["state"][0]["master"][3:5]  # a view made before: it follows its entry
    expected = _plain(kept)
    if ending == "steps":
        for seed in range(10, 13):  # rewrites both slots
            _step(model, opt, seed)
        assert not torch.equal(_plain(opt.state_dict())[0]["master"], expected[0]["master"])
    elif ending == "close":
        opt.nvme_tier.close()
    else:
        del opt
        gc.collect()
    _same(_plain(kept), expected)
    assert torch.equal(view, expected[0]["master"][3:5])
    assert torch.equal(copy.deepcopy(kept)["state"][1]["ab_exp_avg"],
                       expected[1]["ab_exp_avg"])


def test_a_write_into_an_entry_changes_that_entry_only(tmp_path):
    model = _model()
    opt = _tiered(model, tmp_path / "tier", "bf16")
    first = opt.state_dict()
    before = _plain(first)
    first["state"][0]["exp_avg"].detach()[0].add_(1.0)  # through a view: the entry's copy
    first["state"][0]["master"].fill_(7.0)
    assert torch.equal(first["state"][0]["master"], torch.full_like(before[0]["master"], 7.0))
    assert first["state"][0]["exp_avg"][0].equal(before[0]["exp_avg"][0].add(1.0))
    _same(_plain(opt.state_dict()), before)  # the files are as they were
    with pytest.raises(RuntimeError, match=r"NVMe-tier state_dict\(\) entry in place") as info:
        first["state"][1]["master"].t_()
    assert "\n" not in str(info.value)
    opt.load_state_dict(first)  # what was written is what loads
    assert torch.equal(_plain(opt.state_dict())[0]["master"], before[0]["master"].fill_(7.0))
    opt.nvme_tier.close()


def test_dcp_load_into_the_state_dict_then_load_state_dict_resumes(tmp_path):
    model = _model()
    opt = _tiered(model, tmp_path / "tier", "fp32")
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "dcp")
    expected = _plain(opt.state_dict())
    _step(model, opt, 20)  # the files move on; the checkpoint brings them back
    target = opt.state_dict()
    dcp.load({"optim": target}, checkpoint_id=tmp_path / "dcp")
    opt.load_state_dict(target)
    _same(_plain(opt.state_dict()), expected)
    opt.nvme_tier.close()
