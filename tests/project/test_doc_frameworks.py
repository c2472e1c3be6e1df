"""docs/frameworks.md's "Reaching the AdamBridge" table, line by line, through the real
frameworks (the tiny runs of tests/integrations/), and its example after a Trainer run."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from _readme import example

from adambridge import AdamBridge

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network


def test_trainer_hands_out_accelerates_wrapper_and_the_example_reads_the_adambridge(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (test extra)")
    from accelerate.optimizer import AcceleratedOptimizer
    from test_integrations_transformers import Rows, tiny_gpt2

    from adambridge.integrations.transformers import AdamBridgeCallback, optimizer_cls_and_kwargs
    seen = []

    class Look(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            seen.append(optimizer)

    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=1, max_steps=2,
                                          report_to=[], use_cpu=True, disable_tqdm=True,
                                          save_strategy="no")
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=args, train_dataset=Rows(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=0),
        callbacks=[AdamBridgeCallback(async_mode=True), Look()])
    trainer.train()
    assert type(trainer.optimizer) is AcceleratedOptimizer and seen == [trainer.optimizer] * 2
    assert type(trainer.optimizer.optimizer) is AdamBridge
    for name in ("last_step_stats", "host_memory_bytes", "pipeline"):
        with pytest.raises(AttributeError):
            getattr(trainer.optimizer, name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        names = dict(trainer=trainer)
        code = example("After `trainer.train()` in the Trainer example", "docs/frameworks.md")
        exec(compile(code, "docs/frameworks.md", "exec"), names)
    opt = trainer.optimizer.optimizer
    assert names["opt"] is opt and names["stats"] is opt.last_step_stats
    assert re.fullmatch(rf"last step: {opt.last_step_stats.num_params} parameters, \d+\.\d ms in the "
                        rf"host kernel; host memory \d+\.\d MiB\n", printed.getvalue())
    assert opt.last_step_stats.num_params > 0


def test_accelerate_prepare_hands_out_its_wrapper_and_attach_hooks_the_adambridge():
    pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
    from accelerate.optimizer import AcceleratedOptimizer
    from test_integrations_accelerate import epoch, make_run

    run = make_run("async")  # prepare(), then adambridge.integrations.accelerate.attach_hooks
    opt = run[2]
    assert type(opt) is AcceleratedOptimizer and type(opt.optimizer) is AdamBridge
    try:
        epoch(run, 1e6, [])
        assert opt.optimizer.pipeline is not None and opt.optimizer.last_step_stats.num_params > 0
        for name in ("last_step_stats", "host_memory_bytes", "pipeline"):
            with pytest.raises(AttributeError):
                getattr(opt, name)
    finally:
        opt.optimizer.detach_hooks()


def test_lightning_hands_out_the_adambridge_and_in_the_module_a_wrapper_that_reads_through():
    lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
    from test_integrations_lightning import Tiny

    from adambridge.integrations.lightning import AdamBridgeCallback
    seen: dict = {}

    class Look(lightning.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen["callback"] = optimizer

    class Probe(Tiny):
        def training_step(self, batch, batch_idx):
            wrapper = self.optimizers()
            if wrapper.optimizer.last_step_stats is not None:  # from the second step on
                seen["wrapper"] = wrapper
                seen["reads"] = (wrapper.last_step_stats is wrapper.optimizer.last_step_stats,
                                 wrapper.host_memory_bytes() == wrapper.optimizer.host_memory_bytes())
                wrapper.note = "set on the wrapper"
                seen["write stays"] = not hasattr(wrapper.optimizer, "note")
            return super().training_step(batch, batch_idx)

    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[AdamBridgeCallback(async_mode=True), Look()])
    trainer.fit(Probe())
    opt = trainer.optimizers[0]
    assert type(opt) is AdamBridge and seen["callback"] is opt
    assert type(seen["wrapper"]).__name__ == "LightningAdamBridge" and seen["wrapper"].optimizer is opt
    assert seen["reads"] == (True, True) and seen["write stays"]
    assert opt.last_step_stats.num_params > 0 and opt.host_memory_bytes()["total"] > 0

