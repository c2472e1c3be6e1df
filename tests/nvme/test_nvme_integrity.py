"""What the NVMe tier's files hold: space in proportion to each state, checksummed pages, and an earlier run's state never overwritten silently.

A page damaged on the drive (a flipped byte, a stale record) is refused in one line naming
the file and offset; a killed run's committed state (a real SIGKILL of a child) is refused
by a new optimizer's first step, or resumed bit for bit against the uninterrupted run.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.nvme.direct_io import TierError
from adambridge.nvme.layout import MANIFEST, fitted, read_committed
from adambridge.nvme.tier import OffloadConfig
from test_nvme import ENGINES
from test_nvme_faults import _drives, _grads, _optimizer, _params, _ram_run, _step

REPO = Path(__file__).resolve().parents[2]

# master + moments per element (fp8: two fp32 scales per 128 elements too)
STATE_BYTES = {"fp32": 12, "bf16": 8, "fp8": 6 + 8 / 128}

SMALL = [{"desc": "one element", "numel": 1}, {"desc": "a bias", "numel": 300},
         {"desc": "a norm of 4096", "numel": 4096},
         {"desc": "a whole page", "numel": 1 << 18}]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c["desc"])
def test_tier_files_take_space_in_proportion_to_the_state(case, precision, tmp_path):
    p = nn.Parameter(torch.randn(case["numel"]))
    opt = AdamBridge([p], precision=precision, offload_dir=tmp_path, host_budget=0)
    p.grad = torch.randn_like(p)
    opt.step()
    size = (tmp_path / "adambridge-p0.bin").stat().st_size
    # Two slots of the state (rounded up to a 128-element block), a trailer and the 4 KiB
    # alignment of each record: never a 256K-element page for a small parameter.
    blocks = -(-case["numel"] // 128) * 128
    assert size <= 2 * (STATE_BYTES[precision] * blocks + 2 * 4096) + 2 * 4096
    assert size == 2 * -(-case["numel"] // (1 << 18)) * \
        fitted(precision, 1 << 18, case["numel"]).record_bytes
    opt.nvme_tier.close()


def _committed_offset(opt: AdamBridge, index: int) -> int:
    """The byte offset, in its file, of page 0 of parameter ``index``'s committed slot."""
    files = next(f for f in opt.nvme_tier._files.values() if f.index == index)
    generation = opt.nvme_tier._committed[index][0]
    return files.locate(0, generation)[1]


DAMAGE = [
    {"desc": "a flipped byte in a moment", "at": 1000, "how": "flip",
     "match": r"the record at byte {offset} of .*adambridge-p1\.bin fails its checksum"},
    {"desc": "a flipped byte in the trailer", "at": -1, "how": "flip",
     "match": r"the record at byte {offset} of .*adambridge-p1\.bin (fails its checksum|holds "
              r"no trailer)"},
    {"desc": "the other slot's (stale) record", "at": 0, "how": "stale",
     "match": r"the record at byte {offset} of .*adambridge-p1\.bin holds no trailer of page "
              r"0, generation 3"},
]


def _damage(path: Path, offset: int, record: int, case: dict) -> None:
    with open(path, "r+b") as f:
        if case["how"] == "stale":  # the older generation's record copied over the committed
            other = offset + record if offset % (2 * record) == 0 else offset - record
            f.seek(other)
            old = f.read(record)
            f.seek(offset)
            f.write(old)
            return
        at = offset + (case["at"] if case["at"] >= 0 else record - 4096 + 16)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", DAMAGE, ids=lambda c: c["desc"])
def test_tier_damaged_page_is_refused_naming_file_and_offset(case, engine, tmp_path):
    params = _params()
    dirs = _drives(tmp_path, 1)
    opt = _optimizer(params, dirs, engine=engine)
    for step in (1, 2, 3):
        _step(opt, params, step)
    values = [p.detach().clone() for p in params]
    offset = _committed_offset(opt, 1)
    record = fitted("bf16", 256, 1000).record_bytes
    _damage(dirs[0] / "adambridge-p1.bin", offset, record, case)
    match = case["match"].format(offset=offset)
    with pytest.raises(TierError, match=match) as info:
        _step(opt, params, 4)
    assert "\n" not in str(info.value)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    with pytest.raises(TierError, match=match):
        read_committed(dirs[0])  # the reader without an optimizer checks them too
    opt.nvme_tier.close()


_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = {paths!r}
    from test_nvme_integrity import _train_then_kill
    _train_then_kill({dirs!r}, {steps})
""")


def _train_then_kill(dirs: list, steps: int) -> None:
    params = _params()
    opt = _optimizer(params, [Path(d) for d in dirs], budget=0)
    for step in range(1, steps + 1):
        _step(opt, params, step)
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_run(dirs: list, steps: int) -> None:
    paths = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "helpers"),
             str(Path(__file__).parent)]
    code = _KILLED.format(paths=paths, dirs=[str(d) for d in dirs], steps=steps)
    child = subprocess.run([sys.executable, "-c", code], timeout=300)
    assert child.returncode == -signal.SIGKILL


def test_tier_of_a_killed_run_is_refused_not_overwritten(tmp_path):
    dirs = _drives(tmp_path, 2)
    _killed_run(dirs, 5)
    manifest = (dirs[0] / MANIFEST).read_bytes()
    params = _params()
    opt = _optimizer(params, dirs, budget=0)
    with pytest.raises(TierError, match=r"holds the committed state of an earlier run \(step 5 "
                                        r"of 3 parameters\), which this step would overwrite; "
                                        r"resume it with opt.nvme_tier.resume\(\) before the "
                                        r"first step, load a checkpoint with "
                                        r"opt.load_state_dict\(\), or start fresh with "
                                        r"opt.nvme_tier.discard\(\)") as info:
        _step(opt, params, 1)
    assert "\n" not in str(info.value)
    assert (dirs[0] / MANIFEST).read_bytes() == manifest  # nothing overwritten
    assert {int(s["step"]) for s in read_committed(dirs[0]).values()} == {5}
    assert not any(opt.state.values())  # nothing was made either
    opt.nvme_tier.discard()  # start fresh, as said
    _step(opt, params, 1)
    assert {int(s["step"]) for s in read_committed(dirs[0]).values()} == {1}
    opt.nvme_tier.close()


def test_tier_of_a_killed_run_is_refused_in_async_mode_with_nothing_changed(tmp_path):
    dirs = _drives(tmp_path, 2)
    _killed_run(dirs, 3)
    params = _params()
    values = [p.detach().clone() for p in params]
    opt = _optimizer(params, dirs, budget=0)
    opt.attach_hooks()
    with pytest.raises(RuntimeError, match=r"\(TierError: NVMe tier: .* holds the committed "
                                           r"state of an earlier run \(step 3 of 3 parameters\)"
                                           r", which this step would overwrite; .*\); no "
                                           r"parameter or optimizer state was changed"):
        sum((p * g).sum() for p, g in zip(params, _grads(params, 1))).backward()
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert not any(opt.state.values())
    assert {int(s["step"]) for s in read_committed(dirs[0]).values()} == {3}
    opt.detach_hooks()
    opt.nvme_tier.close()


def test_tier_of_a_killed_run_resumes_bit_for_bit(tmp_path):
    dirs = _drives(tmp_path, 2)
    _killed_run(dirs, 5)
    params = _params()
    opt = _optimizer(params, dirs, budget=0)
    assert opt.nvme_tier.resume() == 5
    for step in (6, 7, 8):
        _step(opt, params, step)
    ram_params, ram_opt = _ram_run(8)
    for p, q in zip(params, ram_params):
        assert torch.equal(p, q)
    state, ram_state = opt.state_dict()["state"], ram_opt.state_dict()["state"]
    for i in ram_state:
        for key in ("step", "master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][key].float(), ram_state[i][key].float()), (i, key)
    opt.nvme_tier.close()


RESUME_REFUSALS = [
    {"desc": "a parameter placed in RAM", "budget": 200, "precision": "bf16", "seed": 0,
     "match": r"parameter 0 keeps its state in RAM \(host_budget\), which the earlier run lost"},
    {"desc": "another precision", "budget": 0, "precision": "fp32", "seed": 0,
     "match": r"parameter 0 has precision 'fp32', the earlier run's state in .* has 'bf16'"},
    {"desc": "another seed", "budget": 0, "precision": "bf16", "seed": 9,
     "match": r"parameter 0 has seed 9, the earlier run's state in .* has 0"},
]


@pytest.mark.parametrize("case", RESUME_REFUSALS, ids=lambda c: c["desc"])
def test_tier_resume_that_does_not_fit_is_refused(case, tmp_path):
    dirs = _drives(tmp_path, 2)
    _killed_run(dirs, 2)
    params = _params()
    opt = AdamBridge(params, lr=1e-2, precision=case["precision"], backend="torch",
                     host_budget=case["budget"], seed=case["seed"],
                     offload_dir=OffloadConfig(dirs, page_size=256, queue_depth=2))
    with pytest.raises(ValueError, match=case["match"]):
        opt.nvme_tier.resume()
    assert not any(opt.state.values())
    opt.nvme_tier.close()


def _hooked_run(tmp_path: Path, load_mid_step: bool) -> tuple:
    """4 steps with hooks on the tier; at the 4th, a load of step 2's state between
    backward() and step() when ``load_mid_step``. Returns (params, state_dict, refusal)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 300), nn.Linear(300, 5))
    opt = AdamBridge(model.parameters(), lr=1e-2, offload_dir=tmp_path, host_budget=0,
                     chunk_size=256, small_param_threshold=64)
    opt.attach_hooks(model)
    gen = torch.Generator().manual_seed(3)
    refusal, saved = None, None
    for step in range(1, 5):
        model(torch.randn(8, 24, generator=gen)).pow(2).mean().backward()
        if step == 4 and load_mid_step:
            committed = read_committed(tmp_path)
            with pytest.raises(RuntimeError) as info:
                opt.load_state_dict(saved)
            refusal = str(info.value)
            after = read_committed(tmp_path)  # the refused load wrote nothing
            assert all(torch.equal(committed[i][k], after[i][k]) for i in after
                       for k in after[i])
        opt.step()
        opt.zero_grad()
        if step == 2:
            saved = {**opt.state_dict()}
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    params = [p.detach().clone() for p in model.parameters()]
    opt.detach_hooks()
    opt.nvme_tier.close()
    return params, state, refusal


def test_tier_load_between_backward_and_step_with_hooks_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    params, state, refusal = _hooked_run(tmp_path / "a", load_mid_step=True)
    assert re.fullmatch(r"load_state_dict\(\) between backward\(\) and step\(\) with hooks on "
                        r"the NVMe tier \(offload_dir\): this step's updates have begun and "
                        r"would mix with the loaded state; call opt.step\(\) first and load "
                        r"after it, or load before backward\(\)", refusal)
    # The step then went on as if no load had been tried.
    plain_params, plain_state, _ = _hooked_run(tmp_path / "b", load_mid_step=False)
    assert all(torch.equal(p, q) for p, q in zip(params, plain_params))
    assert all(torch.equal(state[i][k], plain_state[i][k]) for i in state for k in state[i])
