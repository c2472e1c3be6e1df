"""GradScaler in asynchronous mode: unscaled on the host, inf/NaN skips the whole step, bit for bit
equal to sync scaler.step(opt), and sync equal to torch.optim.AdamW under the same scaler."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from _tiny import tiny_mlp

RTOL, ATOL = 1e-6, 1e-7


def _model(dtype=torch.float32) -> nn.Module:
    return tiny_mlp((32, 64, 64, 8), dtype=dtype)


def _data(n: int) -> list:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen))
            for _ in range(n)]


def _run(opt_factory, hooks: bool, *, dtype=torch.float32, unscale_first=False,
         clip=None, inf_steps=(2,), steps=6):
    model = _model(dtype)
    opt = opt_factory(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=2)
    if hooks:
        opt.attach_hooks(model)
    scales, skipped = [], []
    for i, (x, y) in enumerate(_data(steps)):
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        if i in inf_steps:
            loss = loss * float("inf")  # every gradient becomes inf/NaN
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if isinstance(opt, AdamBridge):
            skipped.append(opt.last_step_stats.skipped)
    return model, opt, scales, skipped


def _ours(model):
    return AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend="torch",
                      small_param_threshold=100, chunk_size=1024)


CASES = [
    dict(desc="fp32 params, scaler.step alone"),
    dict(desc="fp32 params, unscale_ first", unscale_first=True),
    dict(desc="fp32 params, unscale_ then clip_grad_norm_", unscale_first=True, clip=0.5),
    dict(desc="fp16 params, scaler.step alone", dtype=torch.float16),
    dict(desc="inf on the first (held) step", inf_steps=(0, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["desc"])
def test_amp_async_equals_sync_bit_for_bit(case):
    kw = {k: v for k, v in case.items() if k != "desc"}
    sync = _run(_ours, False, **kw)
    hooked = _run(_ours, True, **kw)
    for p, q in zip(sync[0].parameters(), hooked[0].parameters()):
        assert torch.equal(p, q)
        for key, value in sync[1].state[p].items():
            assert torch.equal(value.float(), hooked[1].state[q][key].float()), key
    assert sync[2] == hooked[2]  # the scale backed off at the same steps
    inf_steps = kw.get("inf_steps", (2,))
    assert [i for i, s in enumerate(hooked[3]) if s] == list(inf_steps)
    steps = len(sync[2]) - len(inf_steps)
    assert all(int(hooked[1].state[p]["step"]) == steps for p in hooked[0].parameters())


def test_amp_sync_equals_torch_adamw_under_the_same_scaler():
    ours = _run(_ours, False, unscale_first=True, clip=0.5)
    ref = _run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), False,
               unscale_first=True, clip=0.5)
    assert ours[2] == ref[2]
    for p, q in zip(ours[0].parameters(), ref[0].parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_amp_unscale_of_fp16_gradients_is_refused_like_torch():
    model = _model(torch.float16)
    opt = _ours(model)
    opt.attach_hooks(model)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _data(1)[0]
    scaler.scale(((model(x.half()).float() - y) ** 2).mean()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_amp_scaler_first_used_after_speculative_steps_is_an_error():
    model = _model()
    opt = _ours(model)
    opt.attach_hooks(model)
    data = _data(3)
    for x, y in data[:2]:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    x, y = data[2]
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    for lane in opt.pipeline.lanes.values():  # let the worker update before the scaler asks
        lane.wait(lane.call(lambda: None))
    with pytest.raises(RuntimeError, match=r"GradScaler was first used at a step whose updates "
                                           r"had already started.*this step had already "
                                           r"updated parameters"):
        scaler.step(opt)
