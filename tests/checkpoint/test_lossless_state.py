"""Every saved form of AdamBridge's state is lossless, and AdamW's state crosses both ways.

1. AdamBridge -> torch.save / DCP (opt.state_dict(), get/set_optimizer_state_dict nested and
   flattened) -> a fresh AdamBridge: the resumed run equals the uninterrupted one bit for bit
   (params, master, moments, fp8 scales), every precision, fp32 and bf16 parameters, and in
   async mode after the load.
2. torch.optim.AdamW -> torch.save / DCP -> AdamBridge (fp32 moments) continues as AdamW does
   within the tolerance the README promises (rtol 1e-6, atol 1e-7 per element), and back
   into AdamW; bf16 and fp8 moments take AdamW's moments rounded to nearest, as documented.
"""
from __future__ import annotations

import io
import warnings

import pytest
import torch

from adambridge import AdamBridge
from adambridge.update import state as host_state

dcp = pytest.importorskip("torch.distributed.checkpoint",
                          reason="torch.distributed is not built into this torch")
from torch.distributed.checkpoint import state_dict as dsd  # noqa: E402

from adambridge.dcp import LoadPlanner  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8")
DTYPES = (torch.float32, torch.bfloat16)
RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md: fp32 moments equal torch.optim.AdamW


@pytest.fixture(autouse=True)
def _local_dcp():
    with warnings.catch_warnings():
        # One process, no process group: DCP saves and loads locally, and says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(5)  # 300 outputs: fp8 blocks of 128 with a short last one
    return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 3)).to(dtype)


def train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 9, generator=gen).to(dtype)).float().pow(2).mean().backward()
        opt.step()


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_run(model, opt, resumed, opt2) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), resumed.parameters())):
        assert bits_equal(p.detach(), q.detach()), f"parameter {i}"
        assert opt.state[p].keys() == opt2.state[q].keys(), i
        for key, value in opt.state[p].items():
            assert bits_equal(value, opt2.state[q][key]), (i, key)


# --------------------------------------------------------------------------- the ways to save

def save_torch(model, opt, path):
    return roundtrip(opt.state_dict())


def load_torch(resumed, opt2, saved, path):
    opt2.load_state_dict(saved)


def save_dcp_plain(model, opt, path):
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(path))


def load_dcp_plain(resumed, opt2, saved, path):
    dsd.get_optimizer_state_dict(resumed, opt2)  # state to load into (a zero-lr step)
    target = {"optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(path))
    opt2.load_state_dict(target["optim"])


def helpers(flatten: bool):
    options = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)

    def save(model, opt, path):
        dcp.save({"optim": dsd.get_optimizer_state_dict(model, opt, options=options)},
                 checkpoint_id=str(path))

    def load(resumed, opt2, saved, path):
        target = {"optim": dsd.get_optimizer_state_dict(resumed, opt2, options=options)}
        dcp.load(target, checkpoint_id=str(path))
        dsd.set_optimizer_state_dict(resumed, opt2, target["optim"], options=options)
    return save, load


WAYS = {"torch.save": (save_torch, load_torch),
        "dcp opt.state_dict()": (save_dcp_plain, load_dcp_plain),
        "dcp get/set nested": helpers(False),
        "dcp get/set flattened": helpers(True)}


def resume_case(precision, dtype, way, mode, tmp_path):
    save, load = WAYS[way]
    kwargs = dict(lr=1e-3, precision=precision, seed=7, small_param_threshold=0)
    model = model_of(dtype)
    opt = AdamBridge(model.parameters(), **kwargs)
    train(model, opt, 3, seed=1)
    saved_model = roundtrip(model.state_dict())
    saved = save(model, opt, tmp_path)
    train(model, opt, 3, seed=2)

    resumed = model_of(dtype)
    # NOTE: the flattened form keeps only the keys the live groups have, so the seed is the
    # optimizer's own there (docs/checkpoints.md): every way is built with the same one.
    opt2 = AdamBridge(resumed.parameters(), **kwargs)
    load(resumed, opt2, saved, tmp_path)
    resumed.load_state_dict(saved_model)
    if mode == "async":
        opt2.attach_hooks(resumed)
    train(resumed, opt2, 3, seed=2)
    opt2.detach_hooks()
    return model, opt, resumed, opt2


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_is_bit_for_bit(precision, dtype, way, tmp_path):
    assert_same_run(*resume_case(precision, dtype, way, "sync", tmp_path))


@pytest.mark.parametrize("way", ["torch.save", "dcp get/set flattened"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_in_async_mode_is_bit_for_bit(precision, dtype, way, tmp_path):
    assert_same_run(*resume_case(precision, dtype, way, "async", tmp_path))


@pytest.mark.parametrize("flatten", [False, True])
def test_fp8_codes_into_another_precision_by_dcp_are_decoded_by_the_planner(flatten, tmp_path):
    # An fp8 checkpoint holds codes and scales only; a bf16 optimizer's dict wants exp_avg:
    # DCP's default planner names the missing key, adambridge.dcp.LoadPlanner decodes the
    # codes into it, rounded to nearest as load_state_dict() converts them.
    options = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = model_of(torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="fp8", seed=7)
    train(model, opt, 3, seed=1)
    dcp.save({"optim": dsd.get_optimizer_state_dict(model, opt, options=options)},
             checkpoint_id=str(tmp_path))
    resumed = model_of(torch.float32)
    opt2 = AdamBridge(resumed.parameters(), lr=1e-3, precision="bf16", seed=7)
    target = {"optim": dsd.get_optimizer_state_dict(resumed, opt2, options=options)}
    with pytest.raises(dcp.api.CheckpointException, match=r"Missing key .*exp_avg"):
        dcp.load(target, checkpoint_id=str(tmp_path))
    dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner())
    dsd.set_optimizer_state_dict(resumed, opt2, target["optim"], options=options)
    for p, q in zip(model.parameters(), resumed.parameters()):
        m, v = host_state.decode_moments(opt.state[p])
        assert bits_equal(opt2.state[q]["exp_avg"], m.bfloat16())
        assert bits_equal(opt2.state[q]["exp_avg_sq"], v.bfloat16())
        assert bits_equal(opt2.state[q]["master"], opt.state[p]["master"])


# --------------------------------------------------------------------------- torch.optim.AdamW

class Two(torch.nn.Module):
    """Two parameters whose gradients the test sets (fixed, independent of the weights)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(64, 33, generator=gen).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(300, generator=gen).to(dtype))


def fixed_grads(steps: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(64, 33, generator=gen) * 0.1, torch.randn(300, generator=gen)]
            for _ in range(steps)]


def run_grads(module, opt, grads) -> None:
    for step in grads:
        for p, g in zip(module.parameters(), step):
            p.grad = g.to(p.dtype)
        opt.step()


def adamw_save(way: str, module, adamw, path):
    if way == "torch.save":
        return roundtrip(adamw.state_dict())
    options = dsd.StateDictOptions(flatten_optimizer_state_dict=way.endswith("flattened"))
    dcp.save({"optim": dsd.get_optimizer_state_dict(module, adamw, options=options)},
             checkpoint_id=str(path))
    return None


def adamw_load_into(way: str, module, opt, saved, path) -> None:
    """An AdamW checkpoint into AdamBridge (DCP: with adambridge.dcp.LoadPlanner), or ours
    into AdamW (DCP's default planner)."""
    if way == "torch.save":
        opt.load_state_dict(saved)
        return
    options = dsd.StateDictOptions(flatten_optimizer_state_dict=way.endswith("flattened"))
    target = {"optim": dsd.get_optimizer_state_dict(module, opt, options=options)}
    planner = LoadPlanner() if isinstance(opt, AdamBridge) else None
    dcp.load(target, checkpoint_id=str(path), planner=planner)
    dsd.set_optimizer_state_dict(module, opt, target["optim"], options=options)


ADAMW_WAYS = ["torch.save", "dcp get/set nested", "dcp get/set flattened"]


@pytest.mark.parametrize("way", ADAMW_WAYS)
def test_adamw_state_continues_in_adambridge_and_back_as_adamw(way, tmp_path):
    kwargs = dict(lr=1e-2, weight_decay=0.05)
    first, second, third = fixed_grads(3, 1), fixed_grads(3, 2), fixed_grads(3, 3)
    straight = Two(torch.float32)
    adamw = torch.optim.AdamW(straight.parameters(), **kwargs)
    run_grads(straight, adamw, first)
    saved_model = roundtrip(straight.state_dict())
    saved = adamw_save(way, straight, adamw, tmp_path / "adamw")
    run_grads(straight, adamw, second)
    after_second = [p.detach().clone() for p in straight.parameters()]
    run_grads(straight, adamw, third)

    ours_model = Two(torch.float32)
    ours_model.load_state_dict(saved_model)
    opt = AdamBridge(ours_model.parameters(), precision="fp32", **kwargs)
    adamw_load_into(way, ours_model, opt, saved, tmp_path / "adamw")
    run_grads(ours_model, opt, second)
    for p, ref, q in zip(ours_model.parameters(), after_second, straight.parameters()):
        torch.testing.assert_close(p.detach(), ref, rtol=RTOL, atol=ATOL)
    # ... and back: our state into a fresh AdamW, which goes on as the uninterrupted AdamW.
    saved_ours = adamw_save(way, ours_model, opt, tmp_path / "ours")
    back_model = Two(torch.float32)
    back_model.load_state_dict(roundtrip(ours_model.state_dict()))
    back = torch.optim.AdamW(back_model.parameters(), **kwargs)
    adamw_load_into(way, back_model, back, saved_ours, tmp_path / "ours")
    run_grads(back_model, back, third)
    for p, q in zip(back_model.parameters(), straight.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(back.state[p][key], adamw.state[q][key],
                                       rtol=RTOL, atol=ATOL)
        assert back.state[p]["step"].item() == adamw.state[q]["step"].item() == 9


@pytest.mark.parametrize("way", ADAMW_WAYS)
def test_adamw_state_of_bf16_params_continues_as_fp32_adamw_then_nearest_cast(way, tmp_path):
    # AdamW on bf16 parameters keeps bf16 moments, which fp32 holds exactly: AdamBridge then
    # steps as an fp32 AdamW started from those values (the README's bf16-parameter promise).
    kwargs = dict(lr=1e-3, weight_decay=0.01)
    source = Two(torch.bfloat16)
    adamw = torch.optim.AdamW(source.parameters(), **kwargs)
    run_grads(source, adamw, fixed_grads(3, 1))
    saved = adamw_save(way, source, adamw, tmp_path)

    ref_model = Two(torch.float32)
    ref_model.load_state_dict({k: v.float() for k, v in source.state_dict().items()})
    ref = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    ref.load_state_dict(roundtrip(adamw.state_dict()))  # torch casts the moments to fp32
    ours_model = Two(torch.bfloat16)
    ours_model.load_state_dict(source.state_dict())
    opt = AdamBridge(ours_model.parameters(), precision="fp32", **kwargs)
    adamw_load_into(way, ours_model, opt, saved, tmp_path)
    grads = fixed_grads(3, 2)
    for step in grads:
        for p, q, g in zip(ours_model.parameters(), ref_model.parameters(), step):
            p.grad = g.bfloat16()
            q.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        master = opt.state[p]["master"].view(p.shape)
        torch.testing.assert_close(master, q.detach(), rtol=RTOL, atol=ATOL)
        assert bits_equal(p.detach(), master.bfloat16())


@pytest.mark.parametrize("way", ADAMW_WAYS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("precision", ("bf16", "fp8"))
def test_adamw_state_into_narrow_moments_is_rounded_to_nearest(precision, dtype, way, tmp_path):
    # docs/checkpoints.md: torch's moments are converted round to nearest; the master is the
    # parameter.
    source = Two(dtype)
    adamw = torch.optim.AdamW(source.parameters(), lr=1e-3)
    run_grads(source, adamw, fixed_grads(3, 1))
    saved = adamw_save(way, source, adamw, tmp_path)
    module = Two(dtype)
    module.load_state_dict(source.state_dict())
    opt = AdamBridge(module.parameters(), lr=1e-3, precision=precision)
    adamw_load_into(way, module, opt, saved, tmp_path)
    for p, q in zip(module.parameters(), source.parameters()):
        expected = {}
        host_state.encode_moments(expected, adamw.state[q]["exp_avg"].float().reshape(-1),
                                  adamw.state[q]["exp_avg_sq"].float().reshape(-1), precision)
        for key, value in expected.items():
            assert bits_equal(opt.state[p][key], value), key
        assert bits_equal(opt.state[p]["master"], p.detach().float().reshape(-1))
        assert opt.state[p]["step"].item() == 3
