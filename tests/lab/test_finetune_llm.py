"""benchmarks/finetune_llm.py: run planning, batches, the host-master wrapper, the report, and
one offline end-to-end run on a tiny random model (needs transformers)."""
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adambridge.lab import report as lab_report

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "finetune_llm.py"


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_llm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_llm"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("finetune_llm", None)


def test_parse_args_presets_fill_unset_options(ft):
    full = ft.parse_args([])
    assert (full.model, full.steps, full.batch, full.seq_len) == ("Qwen/Qwen2.5-0.5B", 200, 8, 512)
    quick = ft.parse_args(["--preset", "quick", "--steps", "5"])
    assert (quick.model, quick.steps, quick.seq_len) == ("HuggingFaceTB/SmolLM2-135M", 5, 256)
    with pytest.raises(SystemExit):
        ft.parse_args(["--configs", "adamw,lion"])


def test_plan_runs_skips_missing_peers_and_adds_noise_runs(ft, monkeypatch):
    monkeypatch.setattr(ft, "available", lambda c: c.needs is None)
    plan = ft.plan_runs(ft.parse_args(["--noise-runs", "2", "--seed", "5"]))
    names = [(c.name, seed, noise) for c, seed, noise in plan]
    assert names[0] == ("adamw", 5, False)
    assert names[-2:] == [("adamw", 6, True), ("adamw", 7, True)]
    assert not any(c.needs for c, _, _ in plan)
    assert {"adambridge-fp32", "adambridge-bf16", "adambridge-fp8", "bf16-only"} <= {n for n, _, _ in names}
    explicit = ft.plan_runs(ft.parse_args(["--configs", "bnb-adamw8bit", "--noise-runs", "1"]))
    assert [c.name for c, _, _ in explicit] == ["bnb-adamw8bit"]  # asked for: kept, may fail


def test_train_batches_same_order_per_seed(ft):
    args = ft.parse_args(["--steps", "4", "--batch", "3", "--seq-len", "8"])
    train = torch.arange(1000, dtype=torch.int32)
    a, b = ft.train_batches(train, args, 0), ft.train_batches(train, args, 0)
    assert a.shape == (4, 3, 8) and torch.equal(a, b)
    assert not torch.equal(a, ft.train_batches(train, args, 1))
    assert torch.equal(a[:, :, 0] % 8, torch.zeros(4, 3, dtype=torch.long))  # whole blocks
    assert len(a.view(-1, 8)[:, 0].unique()) == 12  # no block twice while unused ones remain


def test_host_master_optimizer_matches_adamw_on_an_fp32_copy(ft):
    torch.manual_seed(0)
    ref = torch.randn(257, requires_grad=True)
    low = torch.nn.Parameter(ref.detach().bfloat16())
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    opt_ref = torch.optim.AdamW([ref], **hyper)
    opt = ft.HostMasterOptimizer([low], lambda masters: torch.optim.AdamW(masters, **hyper))
    ref.data.copy_(low.detach().float())  # both start from the bf16 values
    for _ in range(3):
        g = torch.randn(257).bfloat16()
        ref.grad, low.grad = g.float(), g.clone()
        opt_ref.step()
        opt.step()
        opt.zero_grad()
    assert torch.equal(opt.masters[0].detach(), ref.detach())
    assert torch.equal(low.detach(), ref.detach().bfloat16())
    assert low.grad is None


def test_section_reports_ties_failures_and_rss_beyond_reference(ft):
    base = dict(weights="bfloat16", mode="sync", bf16_changed=0.5, ms_per_step=10.0,
                peak_device_bytes=None, state_bytes_per_param=4.0, start_val_loss=2.5)
    runs = [dict(base, config="adamw", label="ref", final_val_loss=2.0, rss_growth_bytes=1 << 30),
            dict(base, config="adambridge-bf16", label="ab", final_val_loss=2.0005,
                 rss_growth_bytes=3 << 30, state_bytes_per_param=8.0, timing_trusted=False),
            dict(base, config="bf16-only", label="b16", final_val_loss=2.1, rss_growth_bytes=1 << 30),
            dict(base, config="adamw", label="ref2", final_val_loss=1.999, rss_growth_bytes=1 << 30,
                 noise_run=True),
            dict(config="bnb-adamw8bit", label="bnb", error="ImportError: no bitsandbytes"),
            dict(config="torchao-offload", label="tao", not_installed="torchao")]
    band = lab_report.noise_band(runs, "adamw")
    assert band == pytest.approx(12.706 * 0.001)  # two runs: t(0.975, 1) x their difference
    setup = dict(model="m", device="cpu", torch="t", adambridge="a", steps=1, batch=1, seq_len=8,
                 data="d", lr=2e-5, warmup=0.1)
    section = ft.section(dict(setup=setup, runs=runs, noise_band=band, start_val_loss=2.5))
    rows = {row[0]: row for row in section.rows}
    assert all(len(row) == len(section.columns) for row in section.rows)
    assert rows["ab"][4] == "+0.0005 (tie)" and rows["ab"][8] == "+2.00" and rows["ab"][9] == "8.00"
    assert rows["ab"][6] == "(10.0)" and rows["ref"][6] == "10.0"  # the trust rule's brackets
    assert rows["b16"][4] == "+0.1000 (worse)" and rows["ref2"][4] == "-0.0010 (noise run)"
    assert rows["bnb"][1] == "cannot run here: ImportError: no bitsandbytes"
    assert rows["tao"][1] == 'not installed (pip install "adambridge[peers]")'
    md = lab_report.md_table(section.columns, section.rows)
    assert "| ab | bfloat16 | sync | 2.0005 | +0.0005 (tie) |" in md
    assert any(re.match(r"noise band 0\.0127 from 2 runs of the reference, .*t\(0\.975, n-1\)", n)
               for n in section.notes), section.notes


def test_section_judges_a_run_by_its_own_reduction_when_it_starts_elsewhere(ft):
    """A bf16 run starts from a cast of the weights, at another loss: the table must show what
    its optimizer did (its reduction against the reference's), not where the cast put it."""
    base = dict(weights="bfloat16", mode="sync", bf16_changed=0.5, ms_per_step=10.0,
                peak_device_bytes=None, state_bytes_per_param=8.0, rss_growth_bytes=0)
    runs = [dict(base, config="adamw", label="ref", start_val_loss=5.1151, final_val_loss=5.0),
            dict(base, config="adambridge-bf16", label="ab", start_val_loss=5.1164,
                 final_val_loss=5.0013)]
    setup = dict(model="m", device="cpu", torch="t", adambridge="a", steps=1, batch=1, seq_len=8,
                 data="d", lr=2e-5, warmup=0.1)
    section = ft.section(dict(setup=setup, runs=runs, noise_band=0.001, start_val_loss=5.1151))
    rows = {row[0]: row for row in section.rows}
    assert rows["ab"][4] == "+0.0000 (tie)"  # the final-loss difference would say +0.0013 worse


def test_not_installed_rows_only_for_the_default_plan(ft, monkeypatch):
    monkeypatch.setattr(ft, "available", lambda c: c.needs is None)
    rows = ft.not_installed(ft.parse_args([]))
    assert {r["config"] for r in rows} == {c.name for c in ft.CONFIGS.values() if c.needs}
    assert all(r["not_installed"] for r in rows)
    assert ft.not_installed(ft.parse_args(["--configs", "bnb-adamw8bit"])) == []


def test_configs_include_every_peer_of_the_demo(ft):
    from adambridge.lab import demo_peers
    peers = {n: c for n, c in ft.CONFIGS.items() if c.needs}
    assert list(peers) == list(demo_peers.PEERS)
    assert all(c.needs == demo_peers.PEERS[n].package for n, c in peers.items())


def _offline(tmp_path) -> tuple:
    text = tmp_path / "text.txt"
    text.write_text(Path(json.__file__).read_text() * 3)  # ~40 KB of real text
    # one intra-op thread: the model is tiny, and on a busy 2-core machine OpenMP barriers spin
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    return text, env


def test_finetune_tiny_model_offline_end_to_end(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed "
                                               "(pip install 'adambridge[test]')")
    text, env = _offline(tmp_path)
    out = tmp_path / "report"
    cmd = [sys.executable, str(SCRIPT), "--model-config", "tiny", "--text-file", str(text),
           "--device", "cpu", "--steps", "3", "--batch", "2", "--seq-len", "32",
           "--configs", "adamw,adambridge-bf16", "--noise-runs", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    ref, ab, noise = report["runs"]
    assert (ref["config"], ab["config"], noise["config"]) == ("adamw", "adambridge-bf16", "adamw")
    assert ref["weights"] == "float32" and ab["weights"] == "bfloat16" and noise["noise_run"]
    assert report["start_val_loss"] > ref["final_val_loss"] > 0
    # every run measures its own start: the bf16 run starts from the weights cast to bf16
    assert all(r["start_val_loss"] > 0 for r in report["runs"])
    assert ab["start_val_loss"] != ref["start_val_loss"]
    assert ab["state_bytes_per_param"] >= 8 and ref["state_bytes_per_param"] >= 8
    assert ab["mode"] in ("sync", "async") and isinstance(ab["timing_trusted"], bool)
    assert 0 < ab["bf16_changed"] <= 1 and ref["ms_per_step"] > 0
    assert "| AdamBridge bf16 moments | bfloat16 |" in (out / "report.md").read_text()
    assert report["format"] == lab_report.FORMAT and report["status"] == "complete"
    assert [row[0] for row in report["sections"][0]["rows"]] == [r["label"] for r in report["runs"]]
    assert not (out / "data.pt").exists()
    # what the lab's finetune phase concludes from these very runs (it crashed on a start
    # loss of null when only the reference measured its start)
    line = lab_report.verdicts_line(report["runs"], "adamw", report["noise_band"])
    assert line.startswith(f"against {ref['label']}: AdamBridge bf16 moments ") and "final losses" not in line
    # a report of the earlier script (start measured by the reference only) is still judged, and says how
    old = [dict(r, start_val_loss=None) if r is not ref else r for r in report["runs"]]
    line = lab_report.verdicts_line(old, "adamw", report["noise_band"])
    assert "AdamBridge bf16 moments" in line and "final losses: a start loss was not measured" in line


def test_lab_finetune_phase_on_a_cpu_concludes_from_the_real_runs(tmp_path, monkeypatch):
    """The lab's finetune preset on a CPU machine: the phase runs the real script (its offline
    tiny model) and judges what the runs really report."""
    pytest.importorskip("transformers", reason="transformers is not installed "
                                               "(pip install 'adambridge[test]')")
    from adambridge.lab import bench_phases, phases
    real_stream = bench_phases.stream

    def three_configs(cmd, on_line, **kwargs):  # the phase's own command, fewer configurations
        return real_stream(list(cmd) + ["--configs", "adamw,adambridge-fp8,bf16-only"], on_line, **kwargs)
    monkeypatch.setattr(bench_phases, "stream", three_configs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    section = bench_phases.finetune(phases.Context(tmp_path, {"finetune_steps": 3}, lambda f, m: None))
    assert section.status == "ok", section.error
    runs = section.figures["runs"]
    # two re-runs of the reference: the band rests on three runs, and says so
    assert [r["config"] for r in runs] == ["adamw", "adambridge-fp8", "bf16-only", "adamw", "adamw"]
    assert "from 3 runs of the reference" in section.conclusion
    assert all(r["start_val_loss"] is not None for r in runs)
    assert section.conclusion.startswith("by each run's reduction from its own start, against AdamW")
    assert "AdamBridge fp8 moments" in section.conclusion and "BF16-only AdamW" in section.conclusion


class _TensorLrAdamW(torch.optim.AdamW):
    """Holds lr as a tensor and refuses a float over it, as torchao's optimizers do."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=torch.tensor(lr), foreach=False)
        self.seen = []

    def step(self, closure=None):
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                raise RuntimeError("lr was changed to a non-Tensor object")
        self.seen.append(float(self.param_groups[0]["lr"]))
        return super().step(closure)


class _FloatLrAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        assert isinstance(self.param_groups[0]["lr"], float)
        self.seen = getattr(self, "seen", []) + [self.param_groups[0]["lr"]]
        return super().step(closure)


class _TinyLM(torch.nn.Module):
    """Takes input_ids and labels and returns an object with .loss, as a causal LM does."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids, labels):
        return type("Out", (), {"loss": self.emb(input_ids).pow(2).mean()})()


@pytest.mark.parametrize("make", [_TensorLrAdamW, _FloatLrAdamW], ids=["tensor-lr", "float-lr"])
def test_train_schedule_drives_tensor_and_float_lr(ft, make):
    from adambridge.lab import trust
    args = ft.parse_args(["--steps", "5", "--lr", "0.01", "--warmup", "0.4"])
    model = _TinyLM()
    opt = make(model.parameters(), lr=args.lr)
    held = opt.param_groups[0]["lr"]
    batches = torch.randint(0, 16, (5, 2, 3))
    ft.train(model, opt, "sync", contextlib.nullcontext, batches, args, torch.device("cpu"),
             trust.LoadMonitor(1))
    factor = ft.lr_lambda(5, 0.4)
    assert opt.seen == pytest.approx([0.01 * factor(s) for s in range(5)], rel=1e-6)
    assert type(opt.param_groups[0]["lr"]) is type(held)
    if isinstance(held, torch.Tensor):
        assert opt.param_groups[0]["lr"] is held  # written in place, the optimizer's own tensor
