"""Which key a parameter's entry sits under: a checkpoint whose entries the groups do not
name must not load as a fresh optimizer without a word.

torch.distributed.checkpoint's dcp_to_torch_save writes the ids as strings ('0'): taken as
those ids. An entry that is a parameter's state under a key no group lists (a name, as DCP's
get_optimizer_state_dict keys them) is refused in one line; torch keeps such entries aside
and starts the parameter fresh.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from adambridge import AdamBridge


def _trained(precision: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).to(torch.bfloat16)
    opt = AdamBridge(model.parameters(), precision=precision, seed=2)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        for key, value in a[i].items():
            other = b[i][key]
            assert torch.equal(value.view(torch.uint8) if value.dim() else value,
                               other.view(torch.uint8) if other.dim() else other), (i, key)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_a_dcp_checkpoint_converted_by_dcp_to_torch_save_loads(tmp_path, precision):
    model, opt = _trained(precision)
    expected = copy.deepcopy(opt.state_dict())
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)["optim"]
    assert set(converted["state"]) == {"0", "1", "2", "3"}  # what the conversion writes
    fresh = AdamBridge(model.parameters(), precision=precision, seed=2)
    fresh.load_state_dict(converted)
    _equal(fresh.state_dict()["state"], expected["state"])


def test_entries_under_keys_the_groups_do_not_list_are_refused_in_one_line():
    model, opt = _trained("bf16")
    by_name = get_optimizer_state_dict(model, opt)  # names in the groups too: it loads
    fresh = AdamBridge(model.parameters(), precision="bf16", seed=2)
    fresh.load_state_dict(copy.deepcopy(by_name))
    _equal(fresh.state_dict()["state"], opt.state_dict()["state"])
    names = list(by_name["state"])
    mixed = opt.state_dict()  # ids in the groups, names in the state
    mixed["state"] = {names[i]: entry for i, entry in mixed["state"].items()}
    other = AdamBridge(model.parameters(), precision="bf16")
    with pytest.raises(ValueError, match=r"a parameter's entry under '0\.weight', which no "
                                         r"param group lists \(they list \[0, 1, 2, 3\]\)") as info:
        other.load_state_dict(mixed)
    assert "\n" not in str(info.value)
    assert not other.state  # nothing changed


def test_entry_for_no_parameter_re_saves_as_a_plain_dict_torch_loads():
    model = torch.nn.Linear(3, 2)
    opt = AdamBridge(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    saved["state"][7] = {"note": torch.tensor([1.0, 2.0]), "count": 3}  # torch keeps these
    opt.load_state_dict(saved)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=True)["state"][7]
    assert type(again) is dict and again["count"] == 3
    assert torch.equal(again["note"], torch.tensor([1.0, 2.0]))
