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
    monkeypatch.setattr(autotune, "_process_threads", [None])  # no earlier test's choice
    opt = AdamBridge([nn.Parameter(torch.randn(4))], backend="torch",
                     autotune=AutoTuneConfig(thread_candidates=(1, 2, 3)))
    monkeypatch.setattr(opt, "resolve_backend", lambda: "native")
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
                           log, origin=case["start"])
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


def test_autotune_threads_are_tuned_once_per_process_across_optimizers(monkeypatch):
    # The native pool is process-wide: before the fix a second optimizer measured again and
    # re-sized the pool under the first (whose log still named its own choice).
    from adambridge._native import loader
    configured, fastest = [], {}
    monkeypatch.setattr(loader, "set_num_threads", lambda n, cpus=(): configured.append(n))
    monkeypatch.setattr(autotune, "_kernel_timer",
                        lambda precision: lambda: fastest[configured[-1]])
    monkeypatch.setattr(autotune, "_process_threads", [None])
    opts = []
    for timings in ({1: 3.0, 2: 1.0, 3: 2.0}, {1: 3.0, 2: 2.0, 3: 1.0}):
        fastest.clear()
        fastest.update(timings)
        opt = AdamBridge([nn.Parameter(torch.randn(4))], backend="torch",
                         autotune=AutoTuneConfig(thread_candidates=(1, 2, 3)))
        monkeypatch.setattr(opt, "resolve_backend", lambda: "native")
        autotune.tune_threads_once(opt)
        opts.append(opt)
    assert configured == [1, 2, 3, 2, 2]  # three trials, the choice, then the choice kept
    second = opts[1].autotune_log
    assert [(d.action, d.value) for d in second] == [("skipped", 2)]
    assert "process-wide" in second[0].reason


def _step_down_once(monkeypatch, bf16_host_s: float = 0.002) -> None:
    """Injected timings: 30 ms of host update per fp32 step, bf16_host_s per bf16 one, fp8
    1 ms, 10 ms of backward."""
    real_after = autotune.Tuner.after_step
    host_s = {"fp32": 0.03, "bf16": bf16_host_s, "fp8": 0.001}

    def after_step(self, pipeline, stats, backward_s):
        stats.host_update_s = host_s[pipeline.opt.precision]
        real_after(self, pipeline, stats, backward_s=0.01)

    monkeypatch.setattr(autotune.Tuner, "after_step", after_step)


def _tuned(model, **config):
    return AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=0,
                      autotune=AutoTuneConfig(warmup_steps=1, min_precision="fp8", **config))


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen))
            for _ in range(n)]


def _fit(model, opt, batches):
    for x, y in batches:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved_at", [2, 3], ids=["mid-trial", "after the decision"])
def test_autotune_resume_across_a_step_down_equals_the_uninterrupted_run(monkeypatch, saved_at):
    # Before the fix the resumed optimizer (built with precision fp32, as the first was)
    # converted the bf16 checkpoint back to fp32 and tuned again from scratch.
    _step_down_once(monkeypatch)
    batches = _batches(6)
    model = _tiny()
    opt = _tuned(model)
    opt.attach_hooks(model)
    _fit(model, opt, batches)
    assert opt.precision == "bf16"
    first = _tiny()
    first_opt = _tuned(first)
    first_opt.attach_hooks(first)
    _fit(first, first_opt, batches[:saved_at])
    saved, weights = first_opt.state_dict(), first.state_dict()
    resumed = _tiny()
    resumed.load_state_dict(weights)
    resumed_opt = _tuned(resumed)
    resumed_opt.load_state_dict(saved)
    assert resumed_opt.precision == "bf16"
    resumed_opt.attach_hooks(resumed)
    _fit(resumed, resumed_opt, batches[saved_at:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed_opt.state[q][key]), key
    decisions = [(d.action, d.value) for d in opt.autotune_log if d.kind == "precision"]
    resumed_decisions = [(d.action, d.value) for d in first_opt.autotune_log + resumed_opt.autotune_log
                         if d.kind == "precision"]
    assert resumed_decisions == decisions


def test_autotune_reattach_and_add_param_group_do_not_tune_precision_again(monkeypatch):
    # bf16 is 20 ms against 10 ms of backward: kept (it fell from 30), and a fresh tuner
    # would step down again to fp8. Before the fix every attach_hooks made a fresh tuner.
    _step_down_once(monkeypatch, bf16_host_s=0.02)
    model = _tiny()
    opt = _tuned(model)
    model.add_module("extra", nn.Linear(8, 8))  # in no optimizer yet
    opt.attach_hooks(model)
    _fit(model, opt, _batches(4))
    assert opt.precision == "bf16"
    opt.detach_hooks()
    opt.add_param_group({"params": list(model.extra.parameters())})
    opt.attach_hooks(model)
    for x, y in _batches(4):
        ((model.extra(model(x)) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.precision == "bf16"
    assert {opt.state[p]["exp_avg"].dtype for p in model.parameters()} == {torch.bfloat16}
    assert [d.action for d in opt.autotune_log if d.kind == "precision"] == ["stepped_down",
                                                                             "kept"]


def test_autotune_checkpoint_with_a_bad_tuner_entry_is_refused_unchanged(monkeypatch):
    _step_down_once(monkeypatch)
    model = _tiny()
    opt = _tuned(model)
    opt.attach_hooks(model)
    _fit(model, opt, _batches(2))
    saved = opt.state_dict()
    saved["adambridge"]["autotune"] = dict(saved["adambridge"]["autotune"], phase="later")
    other = _tuned(_tiny())
    with pytest.raises(ValueError, match=r"^Invalid checkpoint \['adambridge'\]\['autotune'\]"):
        other.load_state_dict(saved)
    assert other.precision == "fp32" and not other.state


def test_autotune_checkpoint_of_another_starting_precision_loads_in_the_optimizers(monkeypatch):
    # A run built with precision="fp8" loading a tuned fp32 -> bf16 checkpoint: the
    # user's choice wins, as for any checkpoint (loading converts between precisions).
    _step_down_once(monkeypatch)
    model = _tiny()
    opt = _tuned(model)
    opt.attach_hooks(model)
    _fit(model, opt, _batches(3))
    other = AdamBridge(_tiny().parameters(), backend="torch", precision="fp8",
                       autotune=AutoTuneConfig(min_precision="fp8"))
    other.load_state_dict(opt.state_dict())
    assert other.precision == "fp8" and other._tuner.phase == "observe"


def test_autotune_step_down_equals_sync_steps_then_loading_into_the_lower_precision(monkeypatch):
    # The reference for a tuned async run: the same steps in sync mode, fp32 (equal to
    # torch.optim.AdamW) until the step-down, then the checkpoint loaded into a bf16 one.
    _step_down_once(monkeypatch)
    batches = _batches(5)
    model = _tiny()
    opt = _tuned(model)
    opt.attach_hooks(model)
    _fit(model, opt, batches)
    assert [(d.action, d.value) for d in opt.autotune_log if d.kind == "precision"] == [
        ("stepped_down", "bf16"), ("kept", "bf16")]  # after the held step and one observed
    reference, adamw = _tiny(), _tiny()
    before = AdamBridge(reference.parameters(), lr=1e-2, backend="torch")
    _fit(reference, before, batches[:2])
    _fit(adamw, torch.optim.AdamW(adamw.parameters(), lr=1e-2), batches[:2])
    for p, q in zip(reference.parameters(), adamw.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    after = AdamBridge(reference.parameters(), lr=1e-2, backend="torch", precision="bf16")
    after.load_state_dict(before.state_dict())
    _fit(reference, after, batches[2:])
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_autotune_two_optimizers_tune_precision_each_for_its_own_state(monkeypatch):
    # The first one's host update outlasts backward, the second one's hides behind it.
    real_after = autotune.Tuner.after_step
    model = _tiny()
    first = AdamBridge(model[0].parameters(), lr=1e-2, backend="torch", small_param_threshold=0,
                       autotune=AutoTuneConfig(warmup_steps=1))
    second = AdamBridge(model[2].parameters(), lr=3e-3, backend="torch",
                        small_param_threshold=0, autotune=AutoTuneConfig(warmup_steps=1))

    def after_step(self, pipeline, stats, backward_s):
        slow = pipeline.opt is first and pipeline.opt.precision == "fp32"
        stats.host_update_s = 0.03 if slow else 0.002
        real_after(self, pipeline, stats, backward_s=0.01)

    monkeypatch.setattr(autotune.Tuner, "after_step", after_step)
    for opt in (first, second):
        opt.attach_hooks(model)
    for x, y in _batches(4):
        ((model(x) - y) ** 2).mean().backward()
        for opt in (first, second):
            opt.step()
        for opt in (first, second):
            opt.zero_grad()
    assert (first.precision, second.precision) == ("bf16", "fp32")
    assert {first.state[p]["exp_avg"].dtype for p in model[0].parameters()} == {torch.bfloat16}
    assert {second.state[p]["exp_avg"].dtype for p in model[2].parameters()} == {torch.float32}
