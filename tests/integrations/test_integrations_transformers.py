"""adambridge.integrations.transformers through the real Trainer, on CPU, on a tiny GPT-2.

Every run: 7 one-row batches per epoch with gradient_accumulation_steps=2 (so each epoch
ends on a one-batch window), a linear schedule with warmup, max_grad_norm, 6 optimizer
steps crossing an epoch, a checkpoint every 3 steps. Async runs are compared with sync runs
(bit for bit, with clipping that fires or not), and a resume
from the step-3 checkpoint with the uninterrupted run, bit for bit.
"""
import os
import subprocess
import sys
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (test extra)")

from adambridge import AdamBridge  # noqa: E402
from adambridge.integrations.transformers import (  # noqa: E402
    AdamBridgeCallback, optimizer_cls_and_kwargs, stream_saves)
from _streamed_saves import record_streamed_saves  # noqa: E402

FIRES, NEVER_FIRES = 0.05, 1e6  # max_grad_norm below / far above this model's gradient norm
STEPS, SAVE_EVERY = 6, 3
TOLERANCE = dict(rtol=1e-6, atol=1e-7)
# transformers 5 renamed gradient_checkpointing (the old name warns, and goes in v6).
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing"
                 in transformers.TrainingArguments.__dataclass_fields__ else "gradient_checkpointing")


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (7, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Probe(transformers.TrainerCallback):
    """Records, after each optimizer step, how many parameters had hooks and how many updated."""

    def __init__(self) -> None:
        self.seen = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt = optimizer.optimizer
        hooked = 0 if opt.pipeline is None else len(opt.pipeline.hooked)
        self.seen.append((hooked, opt.last_step_stats.num_params, opt.last_step_stats.skipped))


def train(out: str, mode: str, max_grad_norm: float, resume: str = None, threshold: int = 1024,
          **extra) -> dict:
    args = transformers.TrainingArguments(**extra,
        output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
        max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_EVERY, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    # small_param_threshold=1024: the matrices get hooks, biases and norms go at the step.
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=threshold)
    probe = Probe()
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=mode == "async"),
                                              probe])
    stream_saves(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return dict(snapshot(trainer), probe=probe.seen)


def test_stream_saves_writes_each_optimizer_checkpoint_streamed(tmp_path, monkeypatch):
    # The resumes of this file load these files with the Trainer's own torch.load.
    written = record_streamed_saves(monkeypatch)
    train(str(tmp_path), "sync", NEVER_FIRES)
    assert written == [os.path.join(str(tmp_path), f"checkpoint-{step}", "optimizer.pt")
                       for step in (SAVE_EVERY, STEPS)]
    assert all(os.path.isfile(os.path.join(os.path.dirname(path), "scheduler.pt"))
               for path in written)


@pytest.mark.parametrize("given", [object(), "trainer"], ids=["object", "str"])
def test_stream_saves_refuses_what_is_not_a_trainer_in_one_line(given):
    with pytest.raises(TypeError, match=r"^stream_saves\(trainer\): trainer is \w+, not a "
                                        r"transformers\.Trainer; pass the Trainer"):
        stream_saves(given)


def snapshot(trainer) -> dict:
    opt = trainer.optimizer.optimizer  # under accelerate's AcceleratedOptimizer
    assert isinstance(opt, AdamBridge) and opt.pipeline is None  # detached at train end
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = {n: {k: opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
             for n, p in trainer.model.named_parameters()}
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return dict(params=params, state=state, norms=norms, global_step=trainer.state.global_step,
                lrs=[log["learning_rate"] for log in trainer.state.log_history
                     if "learning_rate" in log])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("sync", "async"):
        for name, norm in (("fires", FIRES), ("never", NEVER_FIRES)):
            folder = str(tmp_path_factory.mktemp(f"{mode}-{name}"))
            out[mode, name] = train(folder, mode, norm)
            if name == "fires":
                checkpoint = os.path.join(folder, f"checkpoint-{SAVE_EVERY}")
                out[mode, "resumed"] = train(folder, mode, norm, resume=checkpoint)
    # max_grad_norm=0: the Trainer only measures the norm (clip_grad_norm_ with max_norm=inf).
    out["async", "off"] = train(str(tmp_path_factory.mktemp("async-off")), "async", 0.0)
    for mode in ("sync", "async"):  # reentrant checkpointing runs backward inside backward
        # threshold=32: ln_f gets a hook too, so the outer pass has one before the inner ones
        out[mode, "checkpointing"] = train(
            str(tmp_path_factory.mktemp(f"{mode}-gc")), mode, NEVER_FIRES, threshold=32,
            **{CHECKPOINTING: True, f"{CHECKPOINTING}_kwargs": {"use_reentrant": True}})
    return out


def assert_same(a: dict, b: dict, **tolerance) -> None:
    for name in a["params"]:
        compare = (torch.testing.assert_close if tolerance else
                   lambda x, y, **_: torch.testing.assert_close(x, y, rtol=0, atol=0))
        compare(a["params"][name], b["params"][name], **tolerance)
        for key in ("exp_avg", "exp_avg_sq"):
            compare(a["state"][name][key], b["state"][name][key], **tolerance)
        assert int(a["state"][name]["step"]) == int(b["state"][name]["step"]) == STEPS, name


def test_async_equals_sync_bit_for_bit_when_clipping_does_not_fire(runs):
    sync, hooked = runs["sync", "never"], runs["async", "never"]
    assert_same(sync, hooked)
    assert hooked["global_step"] == STEPS and len(hooked["norms"]) == STEPS
    # Every step went through the hooks and updated every parameter: nothing skipped.
    total = len(sync["params"])
    assert all(h >= 8 and n == total and not skipped for h, n, skipped in hooked["probe"])
    assert all(h == 0 for h, _, _ in sync["probe"])
    assert hooked["lrs"] == sync["lrs"]  # the scheduler stepped after every real step
    torch.testing.assert_close(torch.tensor(hooked["norms"]), torch.tensor(sync["norms"]),
                               **TOLERANCE)


def test_async_norm_logging_without_clipping_changes_nothing(runs):
    assert_same(runs["sync", "never"], runs["async", "off"])
    torch.testing.assert_close(torch.tensor(runs["async", "off"]["norms"]),
                               torch.tensor(runs["sync", "never"]["norms"]), **TOLERANCE)


def test_async_with_reentrant_gradient_checkpointing_equals_sync_bit_for_bit(runs):
    assert_same(runs["sync", "checkpointing"], runs["async", "checkpointing"])
    # The forward is run twice: the loss trajectory is the same as without checkpointing.
    assert_same(runs["sync", "never"], runs["async", "checkpointing"])


def test_async_clipping_fires_and_matches_sync_bit_for_bit(runs):
    sync, hooked = runs["sync", "fires"], runs["async", "fires"]
    assert min(hooked["norms"]) > FIRES  # the logged norm is the real one, so clipping fired
    assert hooked["norms"] == sync["norms"]
    assert_same(sync, hooked)
    unclipped = runs["async", "never"]["params"]
    assert any(not torch.equal(unclipped[n], hooked["params"][n]) for n in unclipped)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_from_checkpoint_equals_uninterrupted_run(runs, mode):
    resumed, whole = runs[mode, "resumed"], runs[mode, "fires"]
    assert resumed["global_step"] == STEPS
    assert_same(whole, resumed)


def test_optimizer_cls_and_kwargs_takes_adamw_settings_and_refuses_other_optimizers(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4,
                                          adam_beta2=0.95, report_to=[], use_cpu=True)
    cls, kwargs = optimizer_cls_and_kwargs(args, precision="bf16")
    assert cls is AdamBridge
    assert kwargs == dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, precision="bf16")
    args.optim = "sgd"
    with pytest.raises(ValueError, match="TrainingArguments.optim='sgd'"):
        optimizer_cls_and_kwargs(args)


def test_callback_refuses_what_async_mode_cannot_honour():
    model = torch.nn.Linear(4, 4)
    plain = types.SimpleNamespace(deepspeed=None, fsdp="", world_size=1)
    with pytest.raises(TypeError, match="AdamW, not AdamBridge"):
        AdamBridgeCallback().on_train_begin(plain, None, None, model=model,
                                            optimizer=torch.optim.AdamW(model.parameters()))
    opt = AdamBridge(model.parameters(), backend="torch")
    # (world_size > 1 under DDP works: tests/distributed/test_integrations_ranks.py.)
    for setting, value in (("deepspeed", "ds.json"), ("fsdp", "full_shard")):
        args = types.SimpleNamespace(**dict(vars(plain), **{setting: value}))
        with pytest.raises(ValueError, match=setting):
            AdamBridgeCallback().on_train_begin(args, None, None, model=model, optimizer=opt)
    assert opt.pipeline is None
    AdamBridgeCallback(async_mode=False).on_train_begin(
        types.SimpleNamespace(deepspeed="ds.json", fsdp="", world_size=1), None, None,
        model=model, optimizer=opt)  # sync mode: the Trainer's own handling applies


def test_importing_adambridge_and_its_integrations_package_imports_no_framework():
    code = ("import sys, adambridge, adambridge.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') "
            "if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("hooked", [False, True])
def test_a_step_the_grad_scaler_skips_is_reported_to_accelerate(hooked):
    # accelerate makes no GradScaler on CPU, so the wrapper the Trainer uses is built by hand.
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    scaler = torch.amp.GradScaler("cpu")
    wrapper = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    callback = AdamBridgeCallback(async_mode=hooked)
    args = types.SimpleNamespace(deepspeed=None, fsdp="", world_size=1)
    callback.on_train_begin(args, None, None, model=model, optimizer=wrapper)
    assert (opt.pipeline is not None) == hooked
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(1, 4)).sum() * float("inf")).backward()
    wrapper.step()
    assert opt.last_step_stats.skipped and torch.equal(before, model.weight)
    assert wrapper.step_was_skipped  # so the Trainer does not step the LR schedule
    callback.on_train_end(args, None, None)
    assert opt.pipeline is None


def test_readme_trainer_example_runs(tmp_path, monkeypatch):
    from _readme import example
    monkeypatch.chdir(tmp_path)  # the example writes to ./out
    code = example("Hugging Face `Trainer` (`max_grad_norm`", "docs/frameworks.md")
    # The torch backend: the test does not wait for the kernel to build (results are equal).
    code = code.replace('precision="bf16")', 'precision="bf16", backend="torch")')
    assert 'backend="torch"' in code
    names = dict(model=tiny_gpt2(), train_dataset=Rows())
    exec(compile(code, "README.md", "exec"), names)
    trainer = names["trainer"]
    assert trainer.state.global_step == 3  # 3 epochs of one 7-row batch (the default 8 rows)
    assert all(int(s["step"]) == 3 for s in trainer.optimizer.optimizer.state.values())
