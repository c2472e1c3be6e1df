"""LoRA (peft) on a tiny GPT-2 built from a config: a frozen base, small adapter matrices.

A plain loop: sync AdamBridge equals torch.optim.AdamW to fp32 rounding, and hooked
(async) training equals sync bit for bit, for every precision, with small_param_threshold
at its default (no adapter is hooked: all are small) and at 0 (every adapter is hooked),
with gradient checkpointing off, reentrant (with enable_input_require_grads) and not,
and gradient accumulation. Then the same through the Trainer, with a resume.
"""
import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
peft = pytest.importorskip("peft", reason="needs peft (test extra)")
transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (test extra)")

from adambridge import AdamBridge  # noqa: E402
from adambridge.integrations.transformers import (  # noqa: E402
    AdamBridgeCallback, optimizer_cls_and_kwargs)

FIRES, NEVER_FIRES = 0.05, 1e6  # max_grad_norm below / far above this model's gradient norm
STEPS = 4
# Against AdamW the gradients come from each run's own weights: a step's rounding feeds the
# next step's gradient, so the tolerance grows by one step's worth per step (measured: step
# 1 is within rtol 1e-6, atol 1e-7, step 4 about 2e-7 apart with clipping firing).
COMPOUNDED = dict(rtol=STEPS * 1e-6, atol=STEPS * 1e-7)
ROWS = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
# transformers 5 renamed gradient_checkpointing (the old name warns, and goes in v6).
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing"
                 in transformers.TrainingArguments.__dataclass_fields__ else "gradient_checkpointing")


def lora_gpt2(reentrant=None) -> torch.nn.Module:
    """reentrant: None (no checkpointing), else torch.utils.checkpoint's use_reentrant."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    # init_lora_weights=False: lora_B starts non-zero, so lora_A gets a gradient at step 1.
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                           lora_dropout=0.0, fan_in_fan_out=True, init_lora_weights=False)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    if reentrant is not None:
        # transformers 5 renamed it (the old name warns, and goes in v6).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()  # the frozen embeddings' output needs a grad
    return model.train()


def adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def loop(kind, reentrant=None, accumulation=1, max_grad_norm=FIRES, all_params=False,
         accumulate_by_context=False, backend="torch", **adambridge) -> dict:
    """STEPS steps of a plain loop; kind: 'adamw', 'sync' or 'async'. Returns the adapters."""
    model = lora_gpt2(reentrant)
    params = [p for p in model.parameters() if all_params or p.requires_grad]
    frozen = [(p, p.detach().clone()) for p in model.parameters() if not p.requires_grad]
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2)
    else:
        opt = AdamBridge(params, lr=1e-2, max_grad_norm=max_grad_norm, backend=backend,
                         **adambridge)
        if kind == "async":
            opt.attach_hooks(model, accumulation_steps=1 if accumulate_by_context
                             else accumulation)
    rows = iter(ROWS.repeat(accumulation, 1))
    for _ in range(STEPS):
        for micro in range(accumulation):
            x = next(rows)[None]
            closes = micro == accumulation - 1
            with (opt.accumulate() if accumulate_by_context and not closes
                  else contextlib.nullcontext()):
                (model(input_ids=x, labels=x).loss / accumulation).backward()
        if kind == "adamw":
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad()
    out = dict(adapters(model), _frozen_kept=all(torch.equal(p, q) for p, q in frozen))
    if kind == "async":
        out["_hooked"] = len(opt.pipeline.hooked)
        opt.detach_hooks()
    return out


def adapter_names(run: dict) -> list:
    return [n for n in run if not n.startswith("_")]


def assert_adapters(a: dict, b: dict, **tolerance) -> None:
    names = adapter_names(a)
    assert names and all("lora_" in n for n in names)
    for name in names:
        torch.testing.assert_close(a[name], b[name], **(tolerance or dict(rtol=0, atol=0)))


# (reentrant, accumulation): reentrant checkpointing with accumulation_steps is refused in
# async mode (test below); sync mode and the Trainer's closes_window run it.
SETTINGS = [(None, 1), (None, 2), (True, 1), (False, 1), (False, 2)]


@pytest.mark.parametrize("reentrant,accumulation,all_params",
                         [s + (False,) for s in SETTINGS + [(True, 2)]]
                         + [(None, 2, True), (True, 1, True)])
def test_sync_equals_adamw_to_compounded_fp32_rounding(reentrant, accumulation, all_params,
                                                       backend):
    # all_params: the frozen base is handed to the optimizer too; it gets no gradient and
    # must stay as it is, as with AdamW.
    start = adapters(lora_gpt2())
    ref = loop("adamw", reentrant, accumulation, all_params=all_params)
    ours = loop("sync", reentrant, accumulation, all_params=all_params, backend=backend)
    assert all(not torch.equal(ref[n], start[n]) for n in start)  # every adapter trained
    assert_adapters(ours, ref, **COMPOUNDED)
    assert ours["_frozen_kept"] and ref["_frozen_kept"]


@pytest.mark.parametrize("reentrant,accumulation", SETTINGS)
@pytest.mark.parametrize("threshold", [65536, 0])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_async_equals_sync_bit_for_bit(reentrant, accumulation, threshold, precision, backend):
    kwargs = dict(precision=precision, small_param_threshold=threshold,
                  max_grad_norm=NEVER_FIRES, backend=backend)
    sync = loop("sync", reentrant, accumulation, **kwargs)
    hooked = loop("async", reentrant, accumulation, **kwargs)
    # Every adapter is under the default 65536 elements: none is hooked unless it is lowered.
    assert hooked["_hooked"] == (0 if threshold else len(adapter_names(sync)))
    assert hooked["_frozen_kept"]
    assert_adapters(sync, hooked)


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_async_clipping_matches_sync_bit_for_bit(reentrant):
    sync = loop("sync", reentrant, small_param_threshold=0)
    hooked = loop("async", reentrant, small_param_threshold=0)
    assert_adapters(sync, hooked)
    unclipped = loop("sync", reentrant, max_grad_norm=NEVER_FIRES)
    assert any(not torch.equal(sync[n], unclipped[n]) for n in adapter_names(sync))  # fired


def test_reentrant_checkpointing_with_accumulation_steps_is_refused_before_any_update():
    # Every adapter sits inside a checkpointed block: the outer backward reaches no hook,
    # so the hooks cannot tell one micro-batch's inner passes from the next micro-batch.
    model = lora_gpt2(reentrant=True)
    before = adapters(model)
    opt = AdamBridge([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                     backend="torch", small_param_threshold=0)
    opt.attach_hooks(model, accumulation_steps=2)
    x = ROWS[:1]
    with pytest.raises(RuntimeError, match=r"accumulation_steps=2\).*use_reentrant=True"):
        model(input_ids=x, labels=x).loss.backward()
    opt.detach_hooks()
    assert_adapters(adapters(model), before)


def test_reentrant_checkpointing_accumulates_inside_opt_accumulate():
    # The way the refusal points to: the earlier passes of the step under opt.accumulate().
    sync = loop("sync", True, 2, max_grad_norm=NEVER_FIRES)
    hooked = loop("async", True, 2, max_grad_norm=NEVER_FIRES, small_param_threshold=0,
                  accumulate_by_context=True)
    assert_adapters(sync, hooked)


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 7  # with gradient_accumulation_steps=2 each epoch ends on a one-batch window

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": ROWS[i], "labels": ROWS[i]}


def trainer_run(out, mode, threshold, max_grad_norm, resume=None) -> dict:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
        max_grad_norm=max_grad_norm, save_strategy="steps", save_steps=2, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, **{CHECKPOINTING: True,
        f"{CHECKPOINTING}_kwargs": {"use_reentrant": True}})
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=threshold)
    trainer = transformers.Trainer(model=lora_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=mode == "async")])
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.optimizer
    assert opt.pipeline is None and trainer.state.global_step == STEPS
    assert all(int(s["step"]) == STEPS for s in opt.state.values())
    return adapters(trainer.model)


@pytest.mark.parametrize("threshold,max_grad_norm",
                         [(65536, NEVER_FIRES), (0, NEVER_FIRES), (0, FIRES)])
def test_trainer_with_reentrant_checkpointing_async_equals_sync_and_resumes(
        tmp_path, threshold, max_grad_norm):
    # gradient_accumulation_steps=2: the Trainer's closes_window counts the micro-batches.
    sync = trainer_run(str(tmp_path / "sync"), "sync", threshold, max_grad_norm)
    hooked = trainer_run(str(tmp_path / "async"), "async", threshold, max_grad_norm)
    # Bit for bit, with clipping that fires or not (README).
    assert_adapters(sync, hooked)
    start = adapters(lora_gpt2())
    assert all(not torch.equal(start[n], hooked[n]) for n in start)  # every adapter trained
    resumed = trainer_run(str(tmp_path / "async"), "async", threshold, max_grad_norm,
                          resume=str(tmp_path / "async" / "checkpoint-2"))
    assert_adapters(hooked, resumed)
