"""The tuner (autotune.py): thread choice, precision step-down with keep/revert, the log."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from adambridge import AdamBridge, AutoTuneConfig
from adambridge import autotune


def test_autotune_thread_candidates_are_powers_of_two_then_the_max():
    assert autotune.default_thread_candidates(1) == (1,)
    assert autotune.default_thread_candidates(6) == (1, 2, 4, 6)
    assert autotune.default_thread_candidates(8) == (1, 2, 4, 8)


def test_autotune_choose_threads_keeps_the_fastest_and_logs_each_trial():
    log: list = []
    best = autotune.choose_threads({1: 0.009, 2: 0.004, 4: 0.005}.get, (1, 2, 4), log)
    assert best == 2
    assert [(d.action, d.value) for d in log] == [("measured", 1), ("measured", 2),
                                                  ("measured", 4), ("chose", 2)]
    assert all(d.kind == "threads" and d.reason for d in log)


def test_autotune_threads_are_tuned_once_and_pinned(monkeypatch):
    from adambridge._native import loader
    configured = []
    monkeypatch.setattr(loader, "set_num_threads", lambda n, cpus=(): configured.append((n, cpus)))
    monkeypatch.setattr(autotune, "_kernel_timer",
                        lambda precision: lambda: {1: 3.0, 2: 1.0, 3: 2.0}[configured[-1][0]])
    opt = AdamBridge([nn.Parameter(torch.randn(4))], backend="torch",
                     autotune=AutoTuneConfig(thread_candidates=(1, 2, 3)))
    monkeypatch.setattr(opt, "_resolve_backend", lambda: "native")
    autotune.tune_threads_once(opt, cpus=(0, 1, 2))
    autotune.tune_threads_once(opt, cpus=(0, 1, 2))
    assert configured == [(1, (0, 1, 2)), (2, (0, 1, 2)), (3, (0, 1, 2)), (2, (0, 1, 2))]
    assert opt.autotune_log[-1].action == "chose" and opt.autotune_log[-1].value == 2


def test_autotune_torch_backend_logs_that_there_is_nothing_to_tune():
    p = nn.Parameter(torch.randn(4))
    opt = AdamBridge([p], backend="torch", autotune=True)
    for _ in range(2):
        p.grad = torch.ones(4)
        opt.step()
    assert len(opt.autotune_log) == 1
    assert opt.autotune_log[0].action == "skipped"
    assert "nothing to tune" in opt.autotune_log[0].reason


TUNER_CASES = [
    dict(desc="update hides behind backward: keep", start="fp32", min_precision="bf16",
         samples=[(1.0, 2.0)], expect=[None], actions=["kept"]),
    dict(desc="slower than backward, faster after: step down and keep", start="fp32",
         min_precision="bf16", samples=[(3.0, 1.0), (2.0, 1.0)], expect=["bf16", None],
         actions=["stepped_down", "kept"]),
    dict(desc="slower than backward, not faster after: revert", start="fp32",
         min_precision="fp8", samples=[(3.0, 1.0), (3.5, 1.0)], expect=["bf16", "fp32"],
         actions=["stepped_down", "reverted"]),
    dict(desc="already at the floor: keep", start="bf16", min_precision="bf16",
         samples=[(3.0, 1.0)], expect=[None], actions=["kept"]),
    dict(desc="bf16 may go to fp8 when allowed", start="bf16", min_precision="fp8",
         samples=[(3.0, 1.0), (1.0, 1.0), (9.0, 9.0)], expect=["fp8", None, None],
         actions=["stepped_down", "kept"]),
]


@pytest.mark.parametrize("case", TUNER_CASES, ids=lambda c: c["desc"])
def test_autotune_precision_decisions(case):
    log: list = []
    tuner = autotune.Tuner(AutoTuneConfig(min_precision=case["min_precision"], warmup_steps=2),
                           log)
    precision, got = case["start"], []
    for host, backward in case["samples"]:
        assert tuner.observe(precision, host * 0.9, backward) is None  # warm-up sample
        target = tuner.observe(precision, host * 1.1, backward)
        got.append(target)
        precision = target or precision
    assert got == case["expect"]
    assert [d.action for d in log] == case["actions"]
    assert all(d.kind == "precision" and d.reason for d in log)


@pytest.mark.parametrize("bf16_host_s,kept", [(0.002, True), (0.06, False)],
                         ids=["kept", "reverted"])
def test_autotune_steps_down_state_on_the_workers(monkeypatch, bf16_host_s, kept):
    # Injected timings, not sleeps: the tuner sees 30 ms of host update per fp32 step,
    # bf16_host_s per bf16 step, and 10 ms of backward, whatever the machine is doing.
    real_after = autotune.Tuner.after_step

    def after_step(self, pipeline, stats, backward_s):
        stats.host_update_s = 0.03 if pipeline.opt.precision == "fp32" else bf16_host_s
        real_after(self, pipeline, stats, backward_s=0.01)

    monkeypatch.setattr(autotune.Tuner, "after_step", after_step)
    model = nn.Linear(16, 16)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0,
                     autotune=AutoTuneConfig(warmup_steps=1))
    opt.attach_hooks(model)
    for _ in range(4):
        model(torch.randn(4, 16)).sum().backward()
        opt.step_sync()
    actions = [d.action for d in opt.autotune_log if d.kind == "precision"]
    assert actions == ["stepped_down", "kept" if kept else "reverted"]
    expected = "bf16" if kept else "fp32"
    assert opt.precision == expected
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[expected]
    assert all(opt.state[p]["exp_avg"].dtype == dtype for p in model.parameters())
