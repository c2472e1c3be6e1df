"""The NVMe tier (offload_dir) as users reach it: through HF transformers' Trainer, Lightning,
accelerate, torch.save'd state_dicts and several processes.

Every run is compared with the same run with the state in RAM, bit for bit (parameters and
every state tensor of state_dict()): the tier promises the same bits. Budgets put the small
parameters in RAM and the rest in files, with pages of 128 or 256 elements so every file
holds several pages. The refusals (one directory for two optimizers, FSDP2, shard_state) are
one-line errors that name the fix, raised before anything changes.
"""
import copy
import errno
import gc
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import _distributed_workers as workers
from _test_paths import folders
from adambridge import AdamBridge
from adambridge.nvme.tier import OffloadConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network


def tier_args(folder, budget: int, page_size: int = 256) -> dict:
    os.makedirs(folder, exist_ok=True)
    return dict(offload_dir=OffloadConfig([folder], page_size=page_size, queue_depth=2),
                host_budget=budget)


def assert_same(ours: tuple, theirs: tuple) -> None:
    """(parameters, state_dict()['state']) of two runs: equal bit for bit."""
    for i, (p, q) in enumerate(zip(ours[0], theirs[0], strict=True)):
        assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
    assert ours[1].keys() == theirs[1].keys()
    for i in ours[1]:
        assert ours[1][i].keys() == theirs[1][i].keys(), i
        for key in ours[1][i]:
            a, b = ours[1][i][key], theirs[1][i][key]
            assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), (i, key)


def in_files(opt: AdamBridge) -> set:
    return {placed.where for placed in opt.placement()}


# --------------------------------------------------------------------------- transformers

HF_STEPS, HF_SAVE_EVERY = 6, 3


def hf_train(out: str, mode: str, max_grad_norm: float, tier: bool, resume: str = None,
             precision: str = "fp32", streamed: bool = True):
    """The tiny GPT-2 of test_integrations_transformers: accumulation 2, a checkpoint every
    3 steps, saved streamed (stream_saves) unless ``streamed`` is False; returns the
    Trainer and (parameters, state)."""
    import transformers

    from adambridge.integrations.transformers import (AdamBridgeCallback,
                                                      optimizer_cls_and_kwargs, stream_saves)
    from test_integrations_transformers import Rows, tiny_gpt2
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=HF_STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
        max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="steps",
        save_steps=HF_SAVE_EVERY, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    # 20000 bytes: the biases, norms and position embeddings in RAM, the matrices in files.
    extra = tier_args(os.path.join(out, "tier"), 20000) if tier else {}
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=1024,
                                      precision=precision, **extra)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=mode == "async")])
    if streamed:
        stream_saves(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, hf_result(trainer)


def hf_result(trainer) -> tuple:
    opt = trainer.optimizer.optimizer
    return ([p.detach().clone() for p in trainer.model.parameters()],
            opt.state_dict()["state"])


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    out = {}
    for mode in ("sync", "async"):
        out[mode, "ram"] = hf_train(str(tmp_path_factory.mktemp(f"hf-{mode}-ram")), mode,
                                    0.05, tier=False)[1]
        folder = str(tmp_path_factory.mktemp(f"hf-{mode}-tier"))
        trainer, out[mode, "files"] = hf_train(folder, mode, 0.05, tier=True)
        out[mode, "placement"] = in_files(trainer.optimizer.optimizer)
        checkpoint = os.path.join(folder, f"checkpoint-{HF_SAVE_EVERY}")
        with pytest.raises(ValueError) as alive:  # the first Trainer still holds the directory
            hf_train(folder, mode, 0.05, tier=True, resume=checkpoint)
        out[mode, "alive"] = str(alive.value)
        trainer.optimizer.optimizer.nvme_tier.close()  # what the error says to do
        out[mode, "resumed"] = hf_train(folder, mode, 0.05, tier=True, resume=checkpoint)[1]
        del trainer, alive
    for tier in (False, True):  # max_grad_norm=0: no clipping at all
        out["off", tier] = hf_train(str(tmp_path_factory.mktemp(f"hf-off-{tier}")), "async",
                                    0.0, tier=tier)[1]
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_with_offload_dir_equals_state_in_ram(hf_runs, mode):
    assert hf_runs[mode, "placement"] == {"ram", "file"}
    assert_same(hf_runs[mode, "files"], hf_runs[mode, "ram"])


def test_trainer_with_offload_dir_and_no_clipping_equals_state_in_ram(hf_runs):
    assert_same(hf_runs["off", True], hf_runs["off", False])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_resume_in_the_same_process_equals_uninterrupted(hf_runs, mode):
    assert_same(hf_runs[mode, "resumed"], hf_runs[mode, "ram"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_resume_while_the_old_trainer_lives_names_the_fix(hf_runs, mode):
    message = hf_runs[mode, "alive"]
    assert "\n" not in message and "is in use by another optimizer" in message
    assert "opt.nvme_tier.close() on the old optimizer" in message


@pytest.mark.parametrize("streamed", [True, False], ids=["stream_saves", "torch.save"])
def test_trainer_warns_when_the_tier_is_saved_without_stream_saves(tmp_path, streamed):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = hf_train(str(tmp_path), "sync", 0.05, tier=True, streamed=streamed)
    trainer.optimizer.optimizer.nvme_tier.close()
    told = [str(w.message) for w in caught if "stream_saves(trainer)" in str(w.message)]
    assert told == ([] if streamed else [
        "the Trainer's checkpoints hold the NVMe tier's whole state in RAM while saving "
        "(torch.save); call adambridge.integrations.transformers.stream_saves(trainer) once "
        "to save it streamed"])


_RESUME_IN_A_NEW_PROCESS = """
import sys, torch
sys.path[:0] = {paths!r}
from test_nvme_frameworks import hf_train
_, result = hf_train({folder!r}, "async", 0.05, tier=True, precision="bf16",
                     resume={checkpoint!r})
torch.save(result, {saved!r})
"""


def test_trainer_resume_in_a_new_process_equals_uninterrupted(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    ram = hf_train(str(tmp_path / "ram"), "async", 0.05, tier=False, precision="bf16")[1]
    folder = str(tmp_path / "tier")
    trainer, _ = hf_train(folder, "async", 0.05, tier=True, precision="bf16")
    del trainer
    gc.collect()
    saved = str(tmp_path / "resumed.pt")
    script = _RESUME_IN_A_NEW_PROCESS.format(
        paths=folders(), folder=folder, saved=saved,
        checkpoint=os.path.join(folder, f"checkpoint-{HF_SAVE_EVERY}"))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                   timeout=120)
    assert_same(torch.load(saved, weights_only=True), ram)


# --------------------------------------------------------------------------- Lightning


def lightning_fit(folder: str, mode: str, precision: str, tier_dir=None, resume=None) -> tuple:
    """The Tiny module of test_integrations_lightning (accumulation 2, clipping that fires,
    a ModelCheckpoint every 4 steps, 8 steps); its optimizer optionally with offload_dir."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from adambridge.integrations.lightning import AdamBridgeCallback
    from test_integrations_lightning import Tiny

    class TierTiny(Tiny):
        def configure_optimizers(self):
            extra = {} if tier_dir is None else tier_args(tier_dir, 20000, page_size=128)
            opt = AdamBridge(self.parameters(), lr=1e-2, backend="torch", precision=precision,
                             small_param_threshold=512, **extra)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    model = TierTiny()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=8, accumulate_grad_batches=2,
        gradient_clip_val=0.05, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AdamBridgeCallback(async_mode=mode == "async"),
                   ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1,
                                   every_n_train_steps=4)])
    trainer.fit(model, ckpt_path=resume)
    opt = trainer.optimizers[0]
    placement = in_files(opt)
    result = ([p.detach().clone() for p in model.parameters()], opt.state_dict()["state"])
    del model, trainer, opt  # the module refers to its Trainer, which holds the optimizer
    gc.collect()  # the tier's directory is free for the resume
    return result, placement


@pytest.mark.parametrize("mode, precision", [("sync", "fp32"), ("async", "fp32"),
                                             ("async", "bf16")])
def test_lightning_fit_checkpoint_and_resume_with_offload_dir_equal_state_in_ram(tmp_path,
                                                                                mode, precision):
    pytest.importorskip("lightning", reason="needs lightning (test extra)")
    ram, _ = lightning_fit(str(tmp_path / "ram"), mode, precision)
    tier_dir = str(tmp_path / "tier")
    files, placement = lightning_fit(str(tmp_path / "files"), mode, precision, tier_dir)
    assert placement == {"ram", "file"}
    assert_same(files, ram)
    # step=4 is saved by ModelCheckpoint after the step, mid-fit, from the tier's files.
    resumed, _ = lightning_fit(str(tmp_path / "resumed"), mode, precision, tier_dir,
                               resume=str(tmp_path / "files" / "step=4.ckpt"))
    assert_same(resumed, ram)


# --------------------------------------------------------------------------- accelerate


def accelerate_run(folder: str, mode: str, precision: str, tier_dir=None,
                   resume: bool = False) -> tuple:
    """test_integrations_accelerate's run (accumulation 2, clip_grad_norm_, save_state
    after the first epoch, load_state into a fresh Accelerator with the hooks attached)."""
    import test_integrations_accelerate as reference
    real_init = AdamBridge.__init__

    def with_tier(self, params, **kwargs):
        extra = {} if tier_dir is None else tier_args(tier_dir, 20000, page_size=128)
        real_init(self, params, **kwargs, precision=precision, **extra)

    patch = pytest.MonkeyPatch()
    patch.setattr(reference.AdamBridge, "__init__", with_tier)
    try:
        run = reference.make_run(mode)
    finally:
        patch.undo()
    accelerator, model, opt = run[:3]
    if resume:
        accelerator.load_state(folder)
        reference.epoch(run, 0.05, [])
    else:
        reference.epoch(run, 0.05, [])
        accelerator.save_state(folder)
        reference.epoch(run, 0.05, [])
    inner = opt.optimizer
    inner.detach_hooks()
    result = ([p.detach().clone() for p in model.parameters()], inner.state_dict()["state"])
    placement = in_files(inner)
    del run, accelerator, model, opt, inner
    gc.collect()
    return result, placement


@pytest.mark.parametrize("mode, precision", [("sync", "fp32"), ("async", "fp32"),
                                             ("async", "fp8")])
def test_accelerate_save_state_load_state_with_offload_dir_equal_state_in_ram(tmp_path, mode,
                                                                              precision):
    pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
    ram, _ = accelerate_run(str(tmp_path / "ram"), mode, precision)
    tier_dir = str(tmp_path / "tier")
    files, placement = accelerate_run(str(tmp_path / "files"), mode, precision, tier_dir)
    assert placement == {"ram", "file"}
    assert_same(files, ram)
    resumed, _ = accelerate_run(str(tmp_path / "files"), mode, precision, tier_dir,
                                resume=True)
    assert_same(resumed, ram)


# --------------------------------------------------------------------------- torch.save

SIZES = [5, 3, 700, 1300, 256, 129]
PRECISIONS = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8", torch.float16)]


def plain_params(dtype: torch.dtype) -> list:
    gen = torch.Generator().manual_seed(5)
    return [nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def plain_grads(params: list, steps: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
            for _ in range(steps)]


def two_groups(params: list) -> list:
    return [dict(params=params[:3], lr=1e-2, weight_decay=0.1),
            dict(params=params[3:], lr=3e-3, weight_decay=0.0)]


def run_steps(params: list, opt: AdamBridge, grads: list) -> None:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()


# (where the checkpoint was taken, where it is loaded): 'ram', or a host_budget in bytes
# (300: the two smallest in RAM, the rest in files; 0: all in files; 10**6: all in RAM).
MOVES = [(300, 0), (0, 10**6), (300, "ram"), ("ram", 300), (0, 300)]


@pytest.mark.parametrize("source, target", MOVES, ids=lambda where: f"{where}")
@pytest.mark.parametrize("precision, dtype", PRECISIONS, ids=[p for p, _ in PRECISIONS])
def test_torch_save_load_across_placements_equals_uninterrupted(tmp_path, precision, dtype,
                                                                source, target):
    def make(params, where, name):
        tier = {} if where == "ram" else tier_args(tmp_path / name, where)
        return AdamBridge(two_groups(params), precision=precision, backend="torch", **tier)

    full = plain_params(dtype)
    full_opt = make(full, "ram", "full")
    run_steps(full, full_opt, plain_grads(full, 4))
    first = plain_params(dtype)
    first_opt = make(first, source, "first")
    run_steps(first, first_opt, plain_grads(first, 4)[:2])
    buffer = io.BytesIO()
    torch.save(first_opt.state_dict(), buffer)
    buffer.seek(0)
    second = [nn.Parameter(p.detach().clone()) for p in first]
    second_opt = make(second, target, "second")
    second_opt.load_state_dict(torch.load(buffer, weights_only=True))
    run_steps(second, second_opt, plain_grads(second, 4)[2:])
    assert_same((second, second_opt.state_dict()["state"]),
                (full, full_opt.state_dict()["state"]))


@pytest.mark.parametrize("precision, dtype", PRECISIONS[:2], ids=[p for p, _ in PRECISIONS[:2]])
def test_add_param_group_after_placement_equals_state_in_ram(tmp_path, precision, dtype):
    results = []
    for tier in ({}, tier_args(tmp_path, 300)):
        params, grads = plain_params(dtype), plain_grads(plain_params(dtype), 4)
        opt = AdamBridge(two_groups(params)[:1], precision=precision, backend="torch", **tier)
        run_steps(params[:3], opt, [g[:3] for g in grads[:2]])
        opt.add_param_group(two_groups(params)[1])  # placed with what the budget has left
        run_steps(params, opt, grads[2:])
        results.append(((params, opt.state_dict()["state"]), in_files(opt)))
    assert results[1][1] == {"ram", "file"}
    assert_same(results[1][0], results[0][0])


def test_reading_a_moment_of_a_file_backed_parameter_says_where_it_is(tmp_path):
    params = plain_params(torch.float32)
    opt = AdamBridge(params, backend="torch", **tier_args(tmp_path, 300))
    run_steps(params, opt, plain_grads(params, 1))
    assert opt.state[params[0]]["exp_avg"].numel() == 5  # in RAM: the tensors themselves
    filed = opt.state[params[3]]
    assert set(filed) == {"step"} and "exp_avg" not in filed
    with pytest.raises(KeyError, match=r"'exp_avg': this parameter's state lives in the NVMe "
                                       r"tier's files .*read opt.state_dict\(\)\['state'\]"):
        filed["exp_avg"]
    assert opt.state_dict()["state"][3]["exp_avg"].numel() == 1300
    opt.load_state_dict(opt.state_dict())  # a loaded file-backed state says it too
    with pytest.raises(KeyError, match=r"lives in the NVMe tier's files"):
        opt.state[params[3]]["master"]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copying_or_pickling_a_tier_optimizer_is_refused_in_one_line(tmp_path, how):
    params = plain_params(torch.float32)
    opt = AdamBridge(params, backend="torch", **tier_args(tmp_path, 300))
    run_steps(params, opt, plain_grads(params, 1))
    copy_it = {"deepcopy": lambda: copy.deepcopy(opt),
               "torch.save": lambda: torch.save(opt, io.BytesIO())}[how]
    with pytest.raises(TypeError, match=r"^an AdamBridge with offload_dir cannot be copied or "
                                        r"pickled .*save opt.state_dict\(\) and load it"):
        copy_it()
    run_steps(params, opt, plain_grads(params, 2)[1:])  # the original goes on untouched


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP], ids=["ENOLCK", "EOPNOTSUPP"])
def test_a_directory_that_cannot_be_locked_is_refused_not_called_in_use(tmp_path, monkeypatch,
                                                                        err):
    # Network mounts without flock: nothing would keep two nodes' ranks out of one directory.
    fcntl = pytest.importorskip("fcntl", reason="flock is POSIX (Windows locks with msvcrt)")

    def no_flock(fd, operation):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(ValueError, match=rf"^offload_dir '{tmp_path}' cannot be locked \(flock: "
                                         rf"{os.strerror(err)}\); use a directory on a local "
                                         rf"drive, one per optimizer$"):
        AdamBridge(plain_params(torch.float32), offload_dir=tmp_path)


def test_a_lock_that_does_not_reach_the_other_optimizer_fails_its_step_before_writing(
        tmp_path, monkeypatch):
    # Two nodes on a network filesystem that locks per machine both get the lock: the one
    # whose claim was overwritten must fail before it writes into the other's files.
    from adambridge.nvme import direct_io
    fcntl = pytest.importorskip("fcntl", reason="flock is POSIX (Windows locks with msvcrt)")
    monkeypatch.setattr(fcntl, "flock", lambda fd, operation: None)
    first, second = plain_params(torch.float32), plain_params(torch.float32)
    first_opt = AdamBridge(first, backend="torch", **tier_args(tmp_path, 300))
    second_opt = AdamBridge(second, backend="torch", **tier_args(tmp_path, 300))
    ram = plain_params(torch.float32)
    ram_opt = AdamBridge(ram, backend="torch")
    before = [p.detach().clone() for p in first]
    other = rf"\(.* pid {os.getpid()} [0-9a-f]+\)"  # the one that claimed the directory last
    with pytest.raises(direct_io.TierError, match=rf"^NVMe tier: offload_dir '{tmp_path}' was "
                                                rf"taken by another optimizer {other} whose "
                                                rf"lock did not see this one"):
        run_steps(first, first_opt, plain_grads(first, 1))
    assert all(torch.equal(p, q) for p, q in zip(first, before))
    with pytest.raises(direct_io.TierError, match=r"was taken by another optimizer"):
        first_opt.load_state_dict(ram_opt.state_dict())
    run_steps(second, second_opt, plain_grads(second, 2))
    run_steps(ram, ram_opt, plain_grads(ram, 2))
    assert_same((second, second_opt.state_dict()["state"]), (ram, ram_opt.state_dict()["state"]))


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def nvme_ranks(tmp_path_factory):
    return workers.launch("nvme_ranks", 2, tmp_path_factory.mktemp("nvme_ranks"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ddp_with_a_directory_per_rank_equals_state_in_ram(nvme_ranks, mode):
    for result in nvme_ranks:
        params, state, placement = result[mode, "files"]
        assert placement == {"ram", "file"}
        assert_same((params, state), result[mode, "ram"][:2])
    assert_same(nvme_ranks[0][mode, "files"][:2], nvme_ranks[1][mode, "files"][:2])


def test_ddp_ranks_given_one_directory_fail_naming_a_directory_per_rank(nvme_ranks):
    errors = sorted(result["one directory"] for result in nvme_ranks)
    assert errors[0].startswith("ValueError: ") and errors[1] == "no error"
    assert "\n" not in errors[0] and "is in use by another optimizer" in errors[0]
    assert "one per rank under torch.distributed, e.g. " in errors[0]
    assert "shared/rank" in errors[0]


def test_offload_dir_refused_with_fsdp2_and_shard_state_in_one_line(nvme_ranks):
    for result in nvme_ranks:
        assert result["shard_state"] == ("ValueError: shard_state=True with offload_dir is "
                                         "not supported; remove one of them")
        fsdp2 = ("ValueError: offload_dir with FSDP2 (DTensor) parameters is not supported, "
                 "in either mode; remove offload_dir (each rank's shard then stays in host "
                 "RAM)")
        assert result["fsdp2"] == fsdp2  # at construction, before any step
        assert result["fsdp2 add_param_group"] == fsdp2
        assert result["groups after the refusal"] == 1
