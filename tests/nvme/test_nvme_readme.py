"""The README's NVMe tier example, run as written (its drive folders moved under tmp_path): it
makes its folders, keeps the small parameters in RAM and streams the rest from files in both."""
from __future__ import annotations

import re

import torch
from torch import nn

import adambridge
from _readme import example


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.LayerNorm(512), nn.Linear(512, 128))


def _step(model, opt, seed):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_readme_nvme_example_runs_and_places_state_in_files(tmp_path, capsys):
    code = example("State beyond host RAM lives in files", "docs/nvme.md")
    code = code.replace('Path("/mnt/', f'Path("{tmp_path}/mnt/')
    assert code.count(f'Path("{tmp_path}/mnt/') == 2
    model = _model()
    names = dict(model=model)
    exec(compile(code, "README.md", "exec"), names)
    opt, drives = names["opt"], names["drives"]
    try:
        printed = capsys.readouterr().out.splitlines()
        placed = opt.placement()
        assert printed[:-1] == [str(p) for p in placed] and printed[-1] == str(opt.nvme_tier.io_engine)
        # the line the README shows as its comment is what this model prints first
        assert re.fullmatch(r"Placed\(index=0, numel=65536, where='file', state_bytes=524288, "
                            r"io='(io_uring|threads)'\)", printed[0]), printed[0]
        where = {p.index: p.where for p in placed}
        assert where == {0: "file", 1: "ram", 2: "ram", 3: "ram", 4: "file", 5: "ram"}
        assert sum(p.state_bytes for p in placed if p.where == "ram") <= names["state_bytes"] // 4
        # trained as usual: the same bits as the state in RAM, and the state in both drives' files
        twin = _model()
        in_ram = adambridge.AdamBridge(twin.parameters(), precision="bf16")
        for seed in range(2):
            _step(model, opt, seed)
            _step(twin, in_ram, seed)
        for ours, ref in zip(model.parameters(), twin.parameters()):
            assert torch.equal(ours.detach(), ref.detach())
        for folder in drives:
            assert folder.is_dir() and any(f.stat().st_size > 0 for f in folder.rglob("*") if f.is_file())
    finally:
        opt.nvme_tier.close()
