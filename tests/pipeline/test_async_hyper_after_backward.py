"""Hyperparameters written between backward and step() reach every update in async mode.

llm.c's and build-nanogpt's loops set the step's lr after backward and the clip:
``loss.backward(); clip_grad_norm_(...); for g in opt.param_groups: g["lr"] = lr;
opt.step()``. torch.optim.AdamW applies that lr to every parameter. With hooks attached the
worker updates each gradient as it lands, during backward, with the group as it was then;
the step must still equal sync ``step()`` bit for bit, whatever is written there (lr as a
float or a tensor, weight_decay, betas, eps), every precision, both backends, with
accumulation and with clipping.

``keep_up`` (tests/helpers/_worker_pace.py) makes the worker update each gradient before backward
goes on, so on this CPU every update of a step is made before the write, as behind a GPU.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from _worker_pace import keep_up
from adambridge import AdamBridge
from adambridge.pipeline import step_wide, worker

STEPS = 10
PRECISIONS = ["fp32", "bf16", "fp8"]


class Net(nn.Module):
    """Embedding, two residual MLP blocks and an output layer: ~13k parameters, 16 tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(48, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48),
                                                  nn.GELU(), nn.Linear(48, 24))
                                    for _ in range(2))
        self.head = nn.Linear(24, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(n: int) -> list:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 48, (4, 10), generator=gen) for _ in range(n)]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 48), ids[:, 1:].reshape(-1))


def groups(model: nn.Module, tensor_lr: bool = False) -> list:
    """nanoGPT's two groups: matrices decay, biases and norms do not (each group its own
    lr tensor with ``tensor_lr``)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    lr = (lambda: {"lr": torch.tensor(3e-3)}) if tensor_lr else dict  # noqa: E731
    return [{"params": decay, "weight_decay": 0.1, **lr()},
            {"params": rest, "weight_decay": 0.0, **lr()}]


# What the loop writes at step k (0-based), one entry per hyperparameter: each differs
# from the value the optimizer was made with from the first step on.
def _write_lr(group: dict, k: int) -> None:
    group["lr"] = 3e-3 * (1.0 - 0.08 * (k + 1))


def _write_lr_tensor(group: dict, k: int) -> None:
    group["lr"].fill_(3e-3 * (1.0 - 0.08 * (k + 1)))  # in place, as torch's schedulers do


def _write_weight_decay(group: dict, k: int) -> None:
    group["weight_decay"] = 0.1 + 0.05 * (k + 1)


def _write_betas(group: dict, k: int) -> None:
    group["betas"] = (0.9 - 0.01 * (k + 1), 0.999 - 0.002 * (k + 1))


def _write_eps(group: dict, k: int) -> None:
    group["eps"] = 1e-6 * (k + 1)


WRITES = {"lr": _write_lr, "lr tensor": _write_lr_tensor, "weight_decay": _write_weight_decay,
          "betas": _write_betas, "eps": _write_eps}
# "every step": llm.c's loop. "every other step": the steps between writes keep the state
# of their speculative updates and redo them (the first write comes at the first step).
PATTERNS = {"every step": lambda k: True, "every other step": lambda k: k % 2 == 0}


@pytest.fixture
def counts(monkeypatch) -> dict:
    """How often the pipeline redid, rebased and snapshotted, and its speculative batches."""
    seen = {"redo": 0, "rebase": 0, "snapshot": 0, "speculative": 0}
    for name in ("redo", "rebase", "snapshot_many"):
        real = getattr(step_wide, name, None)
        if real is None:  # (a pipeline without it: the results are compared all the same)
            continue

        def counting(*args, _real=real, _key=name.split("_")[0], **kwargs):
            seen[_key] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(step_wide, name, counting)
    real_run = worker.Lane.run

    def run(self, batch, speculative=False):
        seen["speculative"] += speculative
        return real_run(self, batch, speculative)
    monkeypatch.setattr(worker.Lane, "run", run)
    return seen


def loop(hooks: bool, precision: str, backend: str, write=None, when=lambda k: False, *,
         clip: float | None = None, accumulation: int = 2, tensor_lr: bool = False,
         schedule=None, resume: tuple | None = None, save_at: int | None = None) -> tuple:
    """The plain loop; ``write(group, k)`` after backward (and the clip) where ``when(k)``.
    ``resume``: (model state, optimizer state, first step) to start from; ``save_at``: keep
    those after step k in ``saved``. Returns (params after each step, optimizer, model, saved).
    """
    model = Net()
    opt = AdamBridge(groups(model, tensor_lr), lr=3e-3, precision=precision, backend=backend,
                     small_param_threshold=0)
    first, saved = 0, None
    if resume is not None:
        model.load_state_dict(resume[0])
        opt.load_state_dict(resume[1])
        first = resume[2]
    if hooks:
        opt.attach_hooks(model, accumulation_steps=accumulation)
        keep_up(opt, model)
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = batches(accumulation * STEPS)
    params = []
    for k in range(first, STEPS):
        for ids in data[accumulation * k:accumulation * (k + 1)]:
            loss_of(model, ids).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if when(k):
            for group in opt.param_groups:
                write(group, k)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        if k == save_at:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), k + 1)
    return params, opt, model, saved


def assert_same_run(ours: tuple, theirs: tuple) -> None:
    """Every step's parameters and the final state, bit for bit (separate storage)."""
    (params, opt, model, _), (sync_params, sync_opt, sync_model, _) = ours, theirs
    for k, (step, sync_step) in enumerate(zip(params, sync_params)):
        for i, (p, q) in enumerate(zip(step, sync_step)):
            assert p.data_ptr() != q.data_ptr()
            assert torch.equal(p, q), f"step {k + 1}, parameter {i}: {(p - q).abs().max():.3g}"
    for p, q in zip(model.parameters(), sync_model.parameters()):
        for key, value in sync_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("pattern", PATTERNS, ids=PATTERNS)
@pytest.mark.parametrize("hyper", WRITES, ids=WRITES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_async_hyper_written_after_backward_equals_sync_bit_for_bit(precision, hyper, pattern,
                                                                    backend, counts):
    args = (precision, backend, WRITES[hyper], PATTERNS[pattern])
    tensor_lr = hyper == "lr tensor"
    sync = loop(False, *args, tensor_lr=tensor_lr)
    hooked = loop(True, *args, tensor_lr=tensor_lr)
    assert_same_run(hooked, sync)
    assert counts["rebase"] == 0  # the first write came at the (held) first step
    if pattern == "every other step":
        # The steps that follow a write are held; the others update during backward,
        # keep the state first, and redo those updates at step() with the written values.
        assert counts["speculative"] > 0 and counts["snapshot"] > 0 and counts["redo"] > 0
    else:
        # Each step follows a write: its updates wait for step(), nothing is redone.
        assert counts["speculative"] == 0 and counts["redo"] == 0


# This loop's gradient norms are 1.31 to 1.48: 1.4 fires on about half of the steps. With
# clipping expected the state is kept anyway; where it fires, the redo of the clipped
# gradient must use the written values too, and where it does not, the written values
# alone call for the redo.
CLIPS = {"clip fires on some steps": 1.4, "clip never fires": 1e3}


@pytest.mark.parametrize("clip", CLIPS.values(), ids=CLIPS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_async_lr_written_after_the_clip_equals_sync_bit_for_bit(precision, clip, backend,
                                                                 counts):
    args = (precision, backend, _write_lr, PATTERNS["every other step"])
    hooked = loop(True, *args, clip=clip)
    sync = loop(False, *args, clip=clip)
    assert_same_run(hooked, sync)
    assert counts["redo"] > 0 and counts["rebase"] == 0


def _write_inside_backward(opt: AdamBridge, model: Net, steps: set) -> list:
    """Write lr from a gradient hook halfway through backward, on the given steps; returns
    the one-element list the loop sets the step number in."""
    k = [0]
    middle = model.blocks[0][1].weight

    def write(_: torch.Tensor) -> None:
        if k[0] in steps:
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (k[0] + 1)
    middle.register_post_accumulate_grad_hook(write)
    return k


@pytest.mark.parametrize("precision", PRECISIONS)
def test_async_lr_written_during_backward_equals_sync_bit_for_bit(precision, backend, counts):
    runs = []
    for hooks in (True, False):
        model = Net()
        opt = AdamBridge(groups(model), lr=3e-3, precision=precision, backend=backend,
                         small_param_threshold=0)
        if hooks:
            opt.attach_hooks(model)
            keep_up(opt, model)
        k = _write_inside_backward(opt, model, steps={0, 3, 6})
        params = []
        for k[0], ids in enumerate(batches(STEPS)):
            loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
            params.append([p.detach().clone() for p in model.parameters()])
        runs.append((params, opt, model, None))
    assert_same_run(*runs)
    assert counts["redo"] > 0 and counts["rebase"] == 0


# --------------------------------------------------------------------------- the first write


FIRST, SECOND = 5, 8  # 0-based: lr changes at steps 6 and 9 only


def _step_schedule(group: dict, k: int) -> None:
    group["lr"] = 3e-3 if k < FIRST else 1e-3 if k < SECOND else 5e-4


# What the correction made without a kept state may be off by, per precision: (rtol, and a
# fraction of the lr change; the uncorrected update is off by about the whole change).
# fp32 moments: an element whose master two fp32 values lead to keeps an ulp; bf16 and
# fp8 moments store a rounding of the m and sqrt(v) the kernel used, so about that rounding
# of the change (measured: 6e-6, 6e-3 and 0.25 of it).
REBASE_TOLERANCE = {"fp32": (1e-6, 1e-4), "bf16": (1e-6, 0.02), "fp8": (1e-6, 0.35)}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_first_lr_write_mid_training_corrects_approximately_then_exact(precision, backend,
                                                                       counts, caplog):
    """No state was kept when lr is first written after backward at step 6: the updates of
    that step are corrected from the updated state (approximately, one warning naming
    them); from then on the state is kept, and the next write (step 9) is redone exactly."""
    when = lambda k: k in (FIRST, SECOND)  # noqa: E731
    sync_params = loop(False, precision, backend, _step_schedule, when, accumulation=1)[0]
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        params, opt, model, saved = loop(True, precision, backend, _step_schedule, when,
                                         accumulation=1, save_at=FIRST)
    for k in range(FIRST):  # before the write: bit for bit
        for p, q in zip(params[k], sync_params[k]):
            assert torch.equal(p, q), f"step {k + 1}"
    n = len(list(model.parameters()))
    rebased = [r.getMessage() for r in caplog.records if "corrected approximately" in r.message]
    assert rebased == [f"adambridge: hyperparameters were written after parameters "
                       f"{list(range(n))} had been updated from this step's gradients, and no "
                       f"copy of their state was kept; those updates were corrected "
                       f"approximately. From now on that copy is kept, so later corrections "
                       f"are exact"]
    assert counts["rebase"] == n  # every parameter, once (one piece each)
    assert sum("written between backward and step()" in r.message for r in caplog.records) == 1
    rtol, frac = REBASE_TOLERANCE[precision]
    change, exact, total = 3e-3 - 1e-3, 0, 0
    for i, (p, q) in enumerate(zip(params[FIRST], sync_params[FIRST])):
        gap = (p - q).abs()
        assert bool((gap <= rtol * q.abs() + frac * change).all()), (i, gap.max().item())
        exact, total = exact + int((p == q).sum()), total + q.numel()
    if precision == "fp32":
        assert exact >= 0.95 * total, f"{exact} of {total} elements bit for bit"  # 98% here
    # From the state the corrected step left, the rest is sync's, step for step: a sync
    # run resumed from it equals the hooked run bit for bit, the redone write included.
    counts["redo"] = 0
    twin = loop(False, precision, backend, _step_schedule, when, accumulation=1, resume=saved)
    hooked_rest = params[FIRST + 1:]
    assert len(twin[0]) == len(hooked_rest) == STEPS - FIRST - 1
    for k, (step, sync_step) in enumerate(zip(hooked_rest, twin[0])):
        for i, (p, q) in enumerate(zip(step, sync_step)):
            assert torch.equal(p, q), f"step {FIRST + 2 + k}, parameter {i}"


def test_lambda_lr_stepped_after_step_costs_nothing_and_equals_sync(backend, counts, caplog):
    """A scheduler stepped after opt.step() (HF Trainer, Lightning, accelerate) writes lr
    before the next backward: no step is held after the first, no state is kept."""
    schedule = lambda k: 1.0 - 0.07 * k  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        hooked = loop(True, "bf16", backend, schedule=schedule)
    assert counts["snapshot"] == 0 and counts["redo"] == 0 and counts["rebase"] == 0
    assert counts["speculative"] >= (STEPS - 1) * len(list(hooked[2].parameters()))
    assert not [r for r in caplog.records if r.name == "adambridge"]
    sync = loop(False, "bf16", backend, schedule=schedule)
    assert_same_run(hooked, sync)


# --------------------------------------------------------------------------- the NVMe tier


def _nvme_loop(hooks: bool, folder, when, steps: int = 6) -> list:
    """lr written after backward where ``when(k)``; every state in files (budget 0)."""
    from adambridge.nvme.tier import OffloadConfig
    model = Net()
    folder.mkdir(parents=True)
    opt = AdamBridge(groups(model), lr=3e-3, backend="torch", small_param_threshold=0,
                     offload_dir=OffloadConfig([folder], page_size=256, queue_depth=2),
                     host_budget=0)
    if hooks:
        opt.attach_hooks(model)
        keep_up(opt, model)
    params = []
    for k, ids in enumerate(batches(steps)):
        loss_of(model, ids).backward()
        if when(k):
            for group in opt.param_groups:
                _write_lr(group, k)
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def test_nvme_tier_lr_written_after_backward_equals_sync_bit_for_bit(tmp_path):
    """Once a write after backward has been seen the tier holds its parameters to the
    step's end (their state is only in files, so nothing could redo them): exact."""
    every_other = PATTERNS["every other step"]
    hooked = _nvme_loop(True, tmp_path / "async", every_other)
    sync = _nvme_loop(False, tmp_path / "sync", every_other)
    for k, (step, sync_step) in enumerate(zip(hooked, sync)):
        for i, (p, q) in enumerate(zip(step, sync_step)):
            assert torch.equal(p, q), f"step {k + 1}, parameter {i}"


def test_nvme_tier_first_lr_write_after_commits_fails_the_step(tmp_path):
    """A first write after the tier has committed parameters with the old lr cannot be
    corrected (their state is in files): the step fails, naming them, in one line."""
    with pytest.raises(RuntimeError, match=r"^adambridge: correcting the speculative updates "
                       r"on cpu failed \(RuntimeError: a hyperparameter \(lr, betas, eps or "
                       r"weight_decay\) was written between backward and step\(\) after the "
                       r"NVMe tier had committed parameters \[0, 1, 2, .*\] with the old value"):
        _nvme_loop(True, tmp_path / "async", lambda k: k == 3)
