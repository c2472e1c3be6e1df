"""The checkpointing of torchtitan's train loop, written out: the model, the optimizer, the
lr scheduler and the train state are each a ``torch.distributed.checkpoint.stateful.Stateful``
(model and optimizer through ``get_state_dict``/``set_state_dict``, the optimizer's state
flattened as torchtitan asks), saved with ``dcp.save`` mid-run and loaded with ``dcp.load``
into a fresh model, optimizer and scheduler (DCP loads in place, then calls
``load_state_dict`` on each Stateful). The optimizer is built, and in async mode its hooks
attached, before the checkpoint is loaded, as torchtitan builds everything first.

- sync AdamBridge (fp32 moments) through the loop equals torch.optim.AdamW through it;
- async equals sync bit for bit, every precision;
- the resumed run equals the uninterrupted one bit for bit, both modes, every precision.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from adambridge import AdamBridge

from ._twins import (ATOL, MODES, PRECISIONS, RTOL, assert_elements_close, assert_identical)

STEPS, SAVE_AT, WARMUP = 6, 3, 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")  # DCP in one process says so


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    def __init__(self, model: torch.nn.Module, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.opt, options=FLAT)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.opt, optim_state_dict=state, options=FLAT)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def _warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _build(kind: str, mode: str, precision: str, seed: int,
           dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(seed)  # a resumed run starts from other weights: the load must win
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 32)).to(dtype)
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        opt = AdamBridge(model.parameters(), lr=3e-3, weight_decay=0.1, precision=precision,
                         small_param_threshold=0)
        if mode == "async":
            opt.attach_hooks(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    train = TrainState()
    return dict(model=model, opt=opt, schedule=schedule, train=train,
                states={"model": ModelState(model), "optimizer": OptimizerState(model, opt),
                        "lr_scheduler": schedule, "train_state": train})


def _train_until(run: dict, last: int) -> None:
    model, opt = run["model"], run["opt"]
    while run["train"].step < last:
        gen = torch.Generator().manual_seed(1000 + run["train"].step)
        tokens = torch.randint(0, 32, (8, 5), generator=gen)
        logits = model(tokens[:, :4])
        torch.nn.functional.cross_entropy(logits, tokens[:, 4]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        run["schedule"].step()
        run["train"].step += 1


def _result(run: dict) -> list:
    model, opt = run["model"], run["opt"]
    if isinstance(opt, AdamBridge):
        opt.detach_hooks()
    params = list(model.parameters())
    return [p.detach().clone() for p in params] + [
        opt.state[p][key].detach().clone() for p in params for key in ("exp_avg", "exp_avg_sq")]


def _uninterrupted(kind: str, mode: str, precision: str = "fp32",
                   dtype: torch.dtype = torch.float32) -> list:
    run = _build(kind, mode, precision, seed=0, dtype=dtype)
    _train_until(run, STEPS)
    return _result(run)


def _resumed(mode: str, precision: str, folder, dtype: torch.dtype) -> list:
    first = _build("bridge", mode, precision, seed=0, dtype=dtype)
    _train_until(first, SAVE_AT)
    dcp.save(first["states"], checkpoint_id=str(folder))
    _result(first)  # the first job ends here
    run = _build("bridge", mode, precision, seed=1, dtype=dtype)
    dcp.load(run["states"], checkpoint_id=str(folder))
    assert run["train"].step == SAVE_AT
    _train_until(run, STEPS)
    return _result(run)


def test_titan_loop_sync_equals_adamw():
    ref, ours = _uninterrupted("adamw", "sync"), _uninterrupted("bridge", "sync")
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_elements_close(a, b, rtol=RTOL, atol=ATOL, what=f"tensor {i}")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_titan_loop_async_equals_sync(precision):
    assert_identical(_uninterrupted("bridge", "async", precision),
                     _uninterrupted("bridge", "sync", precision), what=f"{precision} async")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_titan_loop_dcp_resume_equals_uninterrupted(precision, mode, dtype, tmp_path):
    """Parameters in fp32 or bf16 (the bf16 ones rebuilt from the checkpoint's masters)."""
    assert_identical(_resumed(mode, precision, tmp_path, dtype),
                     _uninterrupted("bridge", mode, precision, dtype),
                     what=f"{precision} {mode} {dtype}")
