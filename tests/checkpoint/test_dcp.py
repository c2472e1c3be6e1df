"""torch.distributed.checkpoint (DCP) on one process: every way users load, and cross-loading.

Supported, each resuming bit for bit: get/set_optimizer_state_dict, get/set_state_dict, a
torchtitan-style ``Stateful``, and the in-place pattern of torchao's FSDP2 test
(``dcp.load({"optim": opt.state_dict()})`` with no load_state_dict) wherever the saved
tensors are the optimizer's own; elsewhere that pattern is refused at the next step, until
load_state_dict(). Cross-loading: torch.optim.AdamW's checkpoints into AdamBridge (with
adambridge.dcp.LoadPlanner) and ours into AdamW (DCP's default planner), each equal to the
same through torch.save. tests/distributed/test_dcp_ranks.py does the same on 2 gloo ranks with FSDP2.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from adambridge import AdamBridge

dcp = pytest.importorskip("torch.distributed.checkpoint",
                          reason="torch.distributed is not built into this torch")
from torch.distributed.checkpoint import state_dict as dsd  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from adambridge.checkpoint import to_torch_adamw  # noqa: E402
from adambridge.dcp import LoadPlanner  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8")
# Every saved tensor is the state's own (the moments saved once, as they are stored), so an
# in-place load is taken in every precision; only copies (the NVMe tier's) are refused.
IN_PLACE_TAKEN = [
    dict(desc="fp32 moments of fp32 params", precision="fp32", dtype=torch.float32),
    dict(desc="bf16 moments of bf16 params", precision="bf16", dtype=torch.bfloat16),
    dict(desc="fp8 moments of fp32 params: the ab_ codes and scales are live",
         precision="fp8", dtype=torch.float32),
    dict(desc="fp8 moments of bf16 params", precision="fp8", dtype=torch.bfloat16),
    dict(desc="bf16 moments of fp32 params", precision="bf16", dtype=torch.float32),
    dict(desc="fp32 moments of bf16 params", precision="fp32", dtype=torch.bfloat16),
]
ALL = IN_PLACE_TAKEN
_ids = [c["desc"] for c in ALL]
REFUSED = r"loaded in place into opt.state_dict\(\) .*load_state_dict\(\)"


@pytest.fixture(autouse=True)
def _local_dcp():
    with warnings.catch_warnings():
        # One process, no process group: DCP saves and loads locally, and says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(5)  # 300 outputs: fp8's blocks of 128 with a short last one
    return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 3)).to(dtype)


def train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 9, generator=gen).to(dtype)).float().pow(2).mean().backward()
        opt.step()


def ours(model, config: dict, **kwargs) -> AdamBridge:
    return AdamBridge(model.parameters(), lr=1e-3, precision=config["precision"],
                      **{"seed": 7, **kwargs})


def uninterrupted(config: dict, path) -> tuple:
    """3 steps, a DCP checkpoint at ``path`` as torchao's test saves one, 3 more: the run a
    resume must equal."""
    model = model_of(config["dtype"])
    opt = ours(model, config)
    train(model, opt, 3, seed=1)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(path))
    train(model, opt, 3, seed=2)
    return model, opt


def assert_same_run(model, opt, resumed, opt2) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), resumed.parameters())):
        assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key, value in opt.state[p].items():
            other = opt2.state[q][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (i, key)
    assert opt2.seed == opt.seed and opt2.precision == opt.precision


# --------------------------------------------------------------------------- the supported ways


class AppState(Stateful):
    """What torchtitan hands DCP: state_dict() and load_state_dict() over DCP's helpers."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        model_sd, optim_sd = dsd.get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        dsd.set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])


def load_by_helpers(resumed, opt2, path) -> None:
    target = {"model": dsd.get_model_state_dict(resumed),
              "optim": dsd.get_optimizer_state_dict(resumed, opt2)}
    dcp.load(target, checkpoint_id=str(path))
    dsd.set_model_state_dict(resumed, target["model"])
    dsd.set_optimizer_state_dict(resumed, opt2, target["optim"])


def load_by_state_dict(resumed, opt2, path) -> None:
    model_sd, optim_sd = dsd.get_state_dict(resumed, opt2)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(path))
    dsd.set_state_dict(resumed, opt2, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])


def load_stateful(resumed, opt2, path) -> None:
    dcp.load({"app": AppState(resumed, opt2)}, checkpoint_id=str(path))


LOADERS = {"get/set_optimizer_state_dict": load_by_helpers,
           "get/set_state_dict": load_by_state_dict, "Stateful": load_stateful}


@pytest.mark.parametrize("way", list(LOADERS))
@pytest.mark.parametrize("config", ALL, ids=_ids)
def test_dcp_supported_loads_resume_bit_for_bit(config, way, tmp_path):
    saver = {"Stateful": lambda m, o: {"app": AppState(m, o)}}.get(way)
    model = model_of(config["dtype"])
    opt = ours(model, config)
    train(model, opt, 3, seed=1)
    saved = saver(model, opt) if saver else {
        "model": model.state_dict(), "optim": dsd.get_optimizer_state_dict(model, opt)}
    dcp.save(saved, checkpoint_id=str(tmp_path))
    train(model, opt, 3, seed=2)

    resumed = model_of(config["dtype"])
    opt2 = ours(resumed, config, seed=0)  # the seed comes from the checkpoint
    LOADERS[way](resumed, opt2, tmp_path)
    train(resumed, opt2, 3, seed=2)
    assert_same_run(model, opt, resumed, opt2)


# --------------------------------------------------------------------------- in place


def in_place(config: dict, path, planner=None, **kwargs) -> tuple:
    """torchao's pattern: a resumed run with state of its own, loaded in place, no load call."""
    resumed = model_of(config["dtype"])
    opt2 = ours(resumed, config, **kwargs)
    train(resumed, opt2, 1, seed=9)  # state of its own, which the load must replace
    dcp.load({"model": resumed.state_dict(), "optim": opt2.state_dict()},
             checkpoint_id=str(path), planner=planner)
    return resumed, opt2


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("config", IN_PLACE_TAKEN, ids=[c["desc"] for c in IN_PLACE_TAKEN])
def test_dcp_load_in_place_reaches_the_optimizer(config, mode, tmp_path):
    model, opt = uninterrupted(config, tmp_path)
    resumed, opt2 = in_place(config, tmp_path, small_param_threshold=0)
    if mode == "async":
        opt2.attach_hooks(resumed)
    train(resumed, opt2, 3, seed=2)
    opt2.detach_hooks()
    assert_same_run(model, opt, resumed, opt2)


def test_dcp_load_in_place_of_a_torch_stepped_checkpoint_is_refused(tmp_path):
    # torch.optim.AdamW loaded our checkpoint (keeping our entries, unused) and stepped on.
    config = IN_PLACE_TAKEN[0]
    model = model_of(config["dtype"])
    opt = ours(model, config)
    train(model, opt, 3, seed=1)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-3)
    theirs.load_state_dict(opt.state_dict())
    train(model, theirs, 1, seed=2)
    dcp.save({"model": model.state_dict(), "optim": theirs.state_dict()},
             checkpoint_id=str(tmp_path))
    resumed, opt2 = in_place(config, tmp_path, LoadPlanner())  # it lacks ['adambridge']
    with pytest.raises(RuntimeError, match=r"'ab_step' 3 with 'step' 4"):
        train(resumed, opt2, 1, seed=2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dcp_load_in_place_into_the_nvme_tier_is_refused_until_load_state_dict(mode, tmp_path):
    # The tier's entries are copies read from its files: a load into them reaches nothing.
    config = IN_PLACE_TAKEN[4]
    model, _ = uninterrupted(config, tmp_path / "ckpt")
    (tmp_path / "drive").mkdir()
    resumed = model_of(config["dtype"])
    opt2 = ours(resumed, config, small_param_threshold=0, offload_dir=tmp_path / "drive",
                host_budget=0)
    train(resumed, opt2, 1, seed=9)
    target = {"model": resumed.state_dict(), "optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    if mode == "async":
        opt2.attach_hooks(resumed)
    for _ in range(2):  # refused at every step, with the parameters left as they were
        before = [p.detach().clone() for p in resumed.parameters()]
        with pytest.raises(RuntimeError, match=r"NVMe tier.s files"):
            train(resumed, opt2, 1, seed=2)
        assert all(torch.equal(a, b) for a, b in zip(before, resumed.parameters()))
        opt2.zero_grad()
    opt2.detach_hooks()
    opt2.load_state_dict(target["optim"])  # the fix the error names
    train(resumed, opt2, 3, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    opt2.nvme_tier.close()


def test_dcp_load_refused_by_load_state_dict_after_in_place_blocks_the_step(tmp_path):
    config = IN_PLACE_TAKEN[0]
    model, opt = uninterrupted(config, tmp_path)
    resumed = model_of(config["dtype"])
    opt2 = ours(resumed, config)
    train(resumed, opt2, 1, seed=9)
    target = {"optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path))  # our live tensors hold it now
    target["optim"]["param_groups"][0]["lr"] = float("inf")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt2.load_state_dict(target["optim"])
    with pytest.raises(RuntimeError, match=r"refused a checkpoint that had been loaded in place"):
        train(resumed, opt2, 1, seed=2)


# --------------------------------------------------------------------------- cross-loading


def adamw_run(dtype: torch.dtype, path=None) -> tuple:
    model = model_of(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 3, seed=1)
    if path is not None:
        dcp.save({"optim": dsd.get_optimizer_state_dict(model, opt)}, checkpoint_id=str(path))
    return model, opt


def assert_same_states(a, b, model_a, model_b) -> None:
    for i, (p, q) in enumerate(zip(model_a.parameters(), model_b.parameters())):
        assert torch.equal(p, q), f"parameter {i}"
        assert a.state[p].keys() == b.state[q].keys(), i
        for key, value in a.state[p].items():
            other = b.state[q][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (i, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dcp_adamw_checkpoint_loads_into_adambridge_as_through_torch_save(
        precision, dtype, tmp_path):
    trained, adamw = adamw_run(dtype, tmp_path)
    config = dict(precision=precision, dtype=dtype)
    by_dcp, by_save = model_of(dtype), model_of(dtype)
    by_dcp.load_state_dict(trained.state_dict())
    by_save.load_state_dict(trained.state_dict())
    opt_dcp, opt_save = ours(by_dcp, config), ours(by_save, config)
    target = {"optim": dsd.get_optimizer_state_dict(by_dcp, opt_dcp)}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner())
    dsd.set_optimizer_state_dict(by_dcp, opt_dcp, target["optim"])
    opt_save.load_state_dict(adamw.state_dict())
    assert_same_states(opt_dcp, opt_save, by_dcp, by_save)
    train(by_dcp, opt_dcp, 3, seed=2)
    train(by_save, opt_save, 3, seed=2)
    assert_same_states(opt_dcp, opt_save, by_dcp, by_save)


def test_dcp_adamw_checkpoint_needs_the_planner(tmp_path):
    # DCP's default planner needs every key of the loading state_dict in the checkpoint; the
    # error is DCP's own (raised before any AdamBridge code runs), naming our 'master' key.
    adamw_run(torch.float32, tmp_path)
    model = model_of(torch.float32)
    opt = ours(model, dict(precision="fp32"))
    missing = r"Missing key in checkpoint state_dict: optim\.state\..*\.(master|ab_step)"
    with pytest.raises(CheckpointException, match=missing):
        dcp.load({"optim": dsd.get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(tmp_path))


def test_dcp_adamw_checkpoint_loaded_in_place_with_the_planner_is_refused(tmp_path):
    _, adamw = adamw_run(torch.float32)
    dcp.save({"optim": adamw.state_dict()}, checkpoint_id=str(tmp_path))
    model = model_of(torch.float32)
    opt = ours(model, dict(precision="fp32"))
    train(model, opt, 1, seed=9)
    dcp.load({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path), planner=LoadPlanner())
    with pytest.raises(RuntimeError, match=r"without AdamBridge's entries"):
        train(model, opt, 1, seed=2)


def test_dcp_planner_still_needs_torch_keys(tmp_path):
    adamw_run(torch.float32, tmp_path)
    model = model_of(torch.float32)
    opt = ours(model, dict(precision="fp32"))
    target = {"optim": dsd.get_optimizer_state_dict(model, opt)}
    target["optim"]["state"]["0.weight"]["extra_torch_key"] = torch.zeros(())
    with pytest.raises(CheckpointException, match=r"Missing key .*extra_torch_key"):
        dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dcp_adambridge_checkpoint_loads_into_adamw_as_through_torch_save(
        precision, dtype, tmp_path):
    config = dict(precision=precision, dtype=dtype)
    trained = model_of(dtype)
    opt = ours(trained, config)
    train(trained, opt, 3, seed=1)
    dcp.save({"optim": dsd.get_optimizer_state_dict(trained, opt)}, checkpoint_id=str(tmp_path))
    by_dcp, by_save = model_of(dtype), model_of(dtype)
    by_dcp.load_state_dict(trained.state_dict())
    by_save.load_state_dict(trained.state_dict())
    adamw_dcp = torch.optim.AdamW(by_dcp.parameters(), lr=1e-3)
    adamw_save = torch.optim.AdamW(by_save.parameters(), lr=1e-3)
    target = {"optim": dsd.get_optimizer_state_dict(by_dcp, adamw_dcp)}
    # DCP's default planner, but for fp8: its codes are decoded by ours (torch.save's way:
    # to_torch_adamw), and the default planner names the missing exp_avg.
    if precision == "fp8":
        with pytest.raises(CheckpointException, match=r"Missing key .*\.exp_avg"):
            dcp.load(target, checkpoint_id=str(tmp_path))
    dcp.load(target, checkpoint_id=str(tmp_path),
             planner=LoadPlanner() if precision == "fp8" else None)
    dsd.set_optimizer_state_dict(by_dcp, adamw_dcp, target["optim"])
    # torch.save's way carries our extra entries along; DCP loads torch's keys only.
    adamw_save.load_state_dict(to_torch_adamw(copy.deepcopy(opt.state_dict())))
    for p, q in zip(by_dcp.parameters(), by_save.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = adamw_dcp.state[p][key], adamw_save.state[q][key]
            assert a.dtype == b.dtype and torch.equal(a, b), key
    train(by_dcp, adamw_dcp, 3, seed=2)
    train(by_save, adamw_save, 3, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(by_dcp.parameters(), by_save.parameters()))


@pytest.mark.parametrize("saved", PRECISIONS)
@pytest.mark.parametrize("loaded", PRECISIONS)
def test_dcp_adambridge_across_precisions_with_the_planner_as_through_torch_save(
        saved, loaded, tmp_path):
    dtype = torch.float32
    trained = model_of(dtype)
    opt = ours(trained, dict(precision=saved))
    train(trained, opt, 3, seed=1)
    dcp.save({"optim": dsd.get_optimizer_state_dict(trained, opt)}, checkpoint_id=str(tmp_path))
    by_dcp, by_save = model_of(dtype), model_of(dtype)
    by_dcp.load_state_dict(trained.state_dict())
    by_save.load_state_dict(trained.state_dict())
    opt_dcp = ours(by_dcp, dict(precision=loaded))
    opt_save = ours(by_save, dict(precision=loaded))
    target = {"optim": dsd.get_optimizer_state_dict(by_dcp, opt_dcp)}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner())
    dsd.set_optimizer_state_dict(by_dcp, opt_dcp, target["optim"])
    opt_save.load_state_dict(opt.state_dict())
    train(by_dcp, opt_dcp, 2, seed=2)
    train(by_save, opt_save, 2, seed=2)
    assert_same_states(opt_dcp, opt_save, by_dcp, by_save)
