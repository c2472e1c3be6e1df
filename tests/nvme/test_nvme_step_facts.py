"""The NVMe tier with main's step facts and checkpoints: max_grad_norm and GradScaler in async
mode, torch-form checkpoints (torch.optim.AdamW loads them; resume is bit-exact), written
weights. Each is compared with the in-RAM optimizer doing the same.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.nvme.tier import OffloadConfig
from adambridge.nvme.layout import read_committed, read_manifest
from _tiny import tiny_mlp

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md
FILED = ("0.weight", "2.weight")  # 768 and 2304 elements: in files under the budget below


def _model(dtype=torch.float32) -> nn.Module:
    return tiny_mlp((16, 48, 48, 6), dtype=dtype)


def _data(n: int) -> list:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 6, generator=gen))
            for _ in range(n)]


def _tier(tmp_path, precision: str = "fp32") -> dict:
    # The biases and the last weight (390 elements) fit; the two big weights go to files.
    per_param = {"fp32": 12, "bf16": 8}[precision]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return dict(offload_dir=OffloadConfig([tmp_path], page_size=256, queue_depth=2),
                host_budget=per_param * 390)


def _optimizer(model: nn.Module, precision: str = "fp32", **kw) -> AdamBridge:
    return AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                      precision=precision, small_param_threshold=100, chunk_size=512, **kw)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean() * 20


def _filed(model: nn.Module, opt: AdamBridge) -> list:
    names = [name for name, _ in model.named_parameters()]
    where = {names[placed.index]: placed.where for placed in opt.placement()}
    return sorted(name for name, w in where.items() if w == "file")


def _entries(opt: AdamBridge) -> dict:
    return opt.state_dict()["state"]


def _assert_close(model_a, opt_a, model_b, opt_b, exact_names=()) -> None:
    """Params and checkpoint entries close (fp32 tolerance), bit for bit for ``exact_names``."""
    state_a, state_b = _entries(opt_a), _entries(opt_b)
    named_b = dict(model_b.named_parameters())
    for i, (name, p) in enumerate(model_a.named_parameters()):
        q = named_b[name]
        tensors = [(p, q)] + [(state_a[i][k], state_b[i][k])
                              for k in ("exp_avg", "exp_avg_sq", "master")]
        for a, b in tensors:
            if name in exact_names:
                assert torch.equal(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- max_grad_norm


def _clipped_run(hooks: bool, max_norm: float, steps: int = 5, **tier):
    model = _model()
    opt = _optimizer(model, max_grad_norm=max_norm, **tier)
    if hooks:
        opt.attach_hooks(model)
    norms = []
    for x, y in _data(steps):
        _loss(model, x, y).backward()
        opt.step()
        norms.append(opt.last_step_stats.grad_norm)
        if tier:
            assert opt.last_step_stats.io_write_bytes > 0
        opt.zero_grad()
    return model, opt, norms


@pytest.mark.parametrize("max_norm", [1e6, 9.0, 0.5],
                         ids=["never fires", "fires after speculative updates", "fires early"])
def test_tier_max_grad_norm_async_equals_sync(max_norm, tmp_path):
    sync = _clipped_run(False, max_norm)
    ram_async = _clipped_run(True, max_norm)
    tier_async = _clipped_run(True, max_norm, **_tier(tmp_path / "a"))
    assert _filed(tier_async[0], tier_async[1]) == sorted(FILED)
    # Bit for bit, firing or not: in-RAM parameters updated before the norm passed the
    # limit are redone from their kept state, file-backed ones wait for the norm.
    exact = [n for n, _ in sync[0].named_parameters()]
    _assert_close(sync[0], sync[1], tier_async[0], tier_async[1], exact_names=exact)
    _assert_close(ram_async[0], ram_async[1], tier_async[0], tier_async[1], exact_names=exact)
    torch.testing.assert_close(torch.tensor(tier_async[2]), torch.tensor(sync[2]),
                               rtol=1e-6, atol=0)


def test_tier_max_grad_norm_async_holds_file_backed_params_for_the_exact_update(tmp_path):
    # Step 1 is held for every parameter; at step 2 clipping fires after some in-RAM pieces
    # were updated (and are redone); file-backed ones waited for the norm: sync's bits.
    sync = _clipped_run(False, 9.0, steps=2)
    tier_async = _clipped_run(True, 9.0, steps=2, **_tier(tmp_path))
    _assert_close(sync[0], sync[1], tier_async[0], tier_async[1], exact_names=FILED)


LIMIT = 7.0  # above the norm of the gradients landing first at some steps, below the total


def _paced_clip_run(hooks: bool, steps: int = 6, **tier):
    """max_grad_norm=LIMIT with the worker keeping up: 4.weight, then the file-backed
    2.weight, then 0.weight are handed to it one by one (the biases go at the step); returns
    the model, the optimizer and, per step, (the norm of the first two gradients, the total)."""
    from _worker_pace import keep_up
    model = _model()
    opt = _optimizer(model, max_grad_norm=LIMIT, **tier)
    if hooks:
        opt.attach_hooks(model)
        keep_up(opt, model)
    named, norms = dict(model.named_parameters()), []
    for x, y in _data(steps):
        _loss(model, x, y).backward()
        if not hooks:  # sync keeps p.grad until the step: where the running norm stands
            first = torch.stack([named[n].grad.norm() for n in ("4.weight", "2.weight")])
            norms.append((float(first.norm()), None))
        opt.step()
        if not hooks:
            norms[-1] = (norms[-1][0], opt.last_step_stats.grad_norm)
        opt.zero_grad()
    return model, opt, norms


def test_tier_clipping_that_fires_after_file_backed_gradients_landed_equals_sync(tmp_path):
    # A file-backed parameter whose gradient lands while the running norm is under the
    # limit must wait for the step's norm: the tier commits what it streams, and a redo
    # needs the state from before the update, which only the files held.
    sync = _paced_clip_run(False)
    assert all(total > LIMIT for _, total in sync[2])  # clipping fires every step
    # ... and at step 5 (not held: only the first step after attach_hooks is), after
    # 2.weight's gradient was handed over under the limit.
    assert sync[2][4][0] < LIMIT, sync[2]
    tier_async = _paced_clip_run(True, **_tier(tmp_path))
    assert _filed(tier_async[0], tier_async[1]) == sorted(FILED)
    _assert_close(sync[0], sync[1], tier_async[0], tier_async[1],
                  exact_names=[n for n, _ in sync[0].named_parameters()])


def test_tier_clip_first_used_after_a_commit_fails_in_one_line(tmp_path):
    model = _model()
    opt = _optimizer(model, **_tier(tmp_path))
    opt.attach_hooks(model)
    data = _data(3)
    for x, y in data[:2]:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    before = read_manifest(tmp_path)["params"]
    _loss(model, *data[2]).backward()
    for lane in opt.pipeline.lanes.values():  # the worker has streamed what landed
        lane.wait(lane.call(lambda: None))
    # Refused before it clips a gradient: the tier's commits cannot be redone.
    with pytest.raises(RuntimeError, match=r"^adambridge: clipping changed the gradient of "
                                           r"parameter \d after backward, after the NVMe tier "
                                           r"had committed its update.*edits_grads=True") as info:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert "\n" not in str(info.value)
    with pytest.raises(RuntimeError, match=r"this step had already updated parameters \[0, 2"):
        opt.step()
    committed = read_manifest(tmp_path)["params"]
    assert all(committed[i]["step"] == before[i]["step"] + 1 for i in ("0", "2"))


# --------------------------------------------------------------------------- GradScaler


def _scaled_run(hooks: bool, **tier):
    model = _model()
    opt = _optimizer(model, **tier)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=2)
    if hooks:
        opt.attach_hooks(model)
    committed, writes = [], []
    for i, (x, y) in enumerate(_data(5)):
        loss = _loss(model, x, y)
        scaler.scale(loss * float("inf") if i == 2 else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert opt.last_step_stats.skipped == (i == 2)
        writes.append(opt.last_step_stats.io_write_bytes)
        if tier:
            committed.append(read_committed(tier["offload_dir"].paths[0]))
    return model, opt, committed, writes


@pytest.mark.parametrize("hooks", [False, True], ids=["sync", "async"])
def test_tier_grad_scaler_skip_writes_nothing(hooks, tmp_path):
    ram = _scaled_run(hooks)
    model, opt, committed, writes = _scaled_run(hooks, **_tier(tmp_path))
    assert _filed(model, opt) == sorted(FILED)
    assert writes[2] == 0 and all(w > 0 for i, w in enumerate(writes) if i != 2)
    # The skipped step left the committed generation as the step before wrote it.
    assert committed[2].keys() == committed[1].keys() == {0, 2}
    for i in committed[1]:
        for key, tensor in committed[1][i].items():
            assert torch.equal(tensor, committed[2][i][key]), (i, key)
        assert int(committed[2][i]["step"]) == 2 and int(committed[4][i]["step"]) == 4
    _assert_close(ram[0], ram[1], model, opt, exact_names=[n for n, _ in model.named_parameters()])


# --------------------------------------------------------------------------- checkpoints


def _train(model: nn.Module, opt, data: list) -> None:
    for x, y in data:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def test_tier_checkpoint_loads_into_torch_adamw(tmp_path):
    data = _data(4)
    ram_model, tier_model = _model(), _model()
    ram_opt, tier_opt = _optimizer(ram_model), _optimizer(tier_model, **_tier(tmp_path / "a"))
    _train(ram_model, ram_opt, data[:2])
    _train(tier_model, tier_opt, data[:2])
    saved = tier_opt.state_dict()
    _assert_close(ram_model, ram_opt, tier_model, tier_opt,
                  exact_names=[n for n, _ in ram_model.named_parameters()])
    torch_model = _model()
    torch_model.load_state_dict(tier_model.state_dict())
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(saved)
    _train(torch_model, torch_opt, data[2:3])
    _train(ram_model, ram_opt, data[2:3])
    for p, q in zip(torch_model.parameters(), ram_model.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    # And back: torch's stepped checkpoint into a tier (its moments go into the files).
    back_model = _model()
    back_model.load_state_dict(torch_model.state_dict())
    back_opt = _optimizer(back_model, **_tier(tmp_path / "b"))
    back_opt.load_state_dict(torch_opt.state_dict())
    _train(torch_model, torch_opt, data[3:])
    _train(back_model, back_opt, data[3:])
    for p, q in zip(torch_model.parameters(), back_model.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("into", ["ram", "files"])
def test_tier_torch_form_checkpoint_resumes_bit_exact(precision, dtype, into, tmp_path):
    data = _data(5)
    full_model = _model(dtype)
    full_opt = _optimizer(full_model, precision)
    _train(full_model, full_opt, data)
    model = _model(dtype)
    opt = _optimizer(model, precision, **_tier(tmp_path / "a", precision))
    _train(model, opt, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = _model(dtype)
    tier = _tier(tmp_path / "b", precision) if into == "files" else {}
    resumed_opt = _optimizer(resumed, precision, **tier)
    resumed_opt.load_state_dict(saved["opt"])  # the optimizer first, then the weights
    resumed.load_state_dict(saved["model"])
    _train(resumed, resumed_opt, data[3:])
    _assert_close(full_model, full_opt, resumed, resumed_opt,
                  exact_names=[n for n, _ in full_model.named_parameters()])


# --------------------------------------------------------------------------- written weights


@pytest.mark.parametrize("hooks", [False, True], ids=["sync", "async"])
def test_tier_written_weights_win_as_in_ram(hooks, tmp_path):
    runs = []
    for tier in ({}, _tier(tmp_path, "bf16")):
        model = _model(torch.bfloat16)
        opt = _optimizer(model, "bf16", **tier)
        if hooks:
            opt.attach_hooks(model)
        data = _data(4)
        _train(model, opt, data[:2])
        with torch.no_grad():
            model[0].weight.copy_(model[0].weight.clone())  # its own rounding: master kept
            model[2].weight.mul_(0.5)                       # a real write: it wins
        _train(model, opt, data[2:])
        runs.append((model, opt))
    assert _filed(*runs[1]) == sorted(FILED)
    _assert_close(*runs[0], *runs[1], exact_names=[n for n, _ in runs[0][0].named_parameters()])
