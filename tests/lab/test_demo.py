"""python -m adambridge demo: the data split, the bf16-changed fraction, the table, and one tiny run."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adambridge.lab import demo, demo_model as dm, demo_report, report as lab_report

ROOT = Path(__file__).resolve().parents[2]


def test_split_tokens_disjoint_complete_and_spread():
    tokens = torch.arange(100_000)
    train, val = dm.split_tokens(tokens, val_fraction=0.1, block=1000)
    assert len(train) + len(val) == len(tokens)
    assert torch.equal(torch.cat([train, val]).sort().values, tokens)
    assert len(val) == 10_000
    # held out from all over the text, not only its tail
    assert val.min() < 10_000 and val.max() >= 90_000


def test_split_tokens_deterministic_and_short_text_still_splits():
    tokens = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    a, b = dm.split_tokens(tokens), dm.split_tokens(tokens)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert 0 < len(a[1]) < len(a[0])
    with pytest.raises(ValueError, match="too short"):
        dm.split_tokens(torch.zeros(3, dtype=torch.uint8))


def test_batch_starts_fixed_per_seed_and_in_range():
    a = dm.batch_starts(1000, ctx=32, batch=4, steps=6, seed=0)
    assert torch.equal(a, dm.batch_starts(1000, ctx=32, batch=4, steps=6, seed=0))
    assert not torch.equal(a, dm.batch_starts(1000, ctx=32, batch=4, steps=6, seed=1))
    assert a.shape == (6, 4) and a.min() >= 0 and a.max() + 33 <= 1000
    seqs = dm.gather(torch.arange(1000), a[0], 32)
    assert seqs.shape == (4, 33) and torch.equal(seqs[:, 1:] - seqs[:, :-1], torch.ones(4, 32).long())


def test_bf16_changed_fraction_counts_moves_at_bf16_resolution():
    before = {"a": torch.ones(100), "b": torch.full((100,), 0.02)}
    after = {k: v.clone() for k, v in before.items()}
    after["a"][:10] += 1e-3   # below half a bf16 ulp of 1.0 (2**-8): rounds back to 1.0
    after["a"][10:30] += 1e-2  # above it: changes
    after["b"][:50] -= 1e-3    # bf16 ulp of 0.02 is 2**-13: changes
    assert dm.bf16_changed_fraction(before, after) == pytest.approx(70 / 200)
    after["b"] = after["b"].bfloat16()  # a bf16 model compares the same way
    assert dm.bf16_changed_fraction(before, after) == pytest.approx(70 / 200)


def test_lr_lambda_warms_up_then_decays_to_zero():
    f = demo.lr_lambda(100, warmup=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.5)
    assert f(99) < 0.001


def _run(label, loss, noise=False):
    return dict(config="reference" if noise or label == "ref" else label, label=label, mode="sync",
                final_val_loss=loss, bf16_changed=0.5, ms_per_step=1.0, state_bytes_per_param=8.0,
                rss_growth_bytes=0, peak_device_bytes=None, noise_run=noise)


def test_verdict_calls_ties_within_the_noise_band():
    ref = _run("ref", 2.0)
    assert lab_report.verdict(_run("x", 2.0009), ref, band=0.001) == "tie"
    assert lab_report.verdict(_run("x", 2.0011), ref, band=0.001) == "worse"
    assert lab_report.verdict(_run("x", 1.9980), ref, band=0.001) == "better"
    assert lab_report.verdict(_run("x", 2.0001), ref, band=None) == "worse"



@pytest.mark.parametrize("desc,finals,band", [
    # sd of (2.0, 2.0004, 1.9993) is 5.568e-4; t(0.975, 2) = 4.303; x sqrt(2)
    ("three runs", [2.0, 2.0004, 1.9993], 0.0033882),
    # two runs: sd = |d| / sqrt(2), so the band is t(0.975, 1) = 12.706 times their difference
    ("two runs", [2.0, 2.0004], 0.0050824),
    ("one run: no band", [2.0], None),
])
def test_noise_band_is_the_t_bound_on_two_runs_difference(desc, finals, band):
    runs = [_run("ref", finals[0]), _run("x", 2.1)] + [_run(f"n{k}", f, True) for k, f in enumerate(finals[1:])]
    runs.append(dict(config="reference", label="failed", noise_run=True, error="boom"))  # ignored
    got = lab_report.noise_band(runs, "reference")
    assert got == (None if band is None else pytest.approx(band, rel=1e-4)), desc
    assert lab_report.band_runs(runs, "reference") == len(finals)
    note = lab_report.noise_note(runs, "reference", got)
    assert re.search(rf"noise band {band:.4f} from {len(finals)} runs of the reference" if band
                     else r"no noise band .*no ties called", note), note


@pytest.mark.parametrize("df,t", [(1, 12.706), (2, 4.303), (10, 2.228), (11, 2.201), (30, 2.042), (31, 2.040),
                                  (100, 1.984)])
def test_t975_matches_the_published_table(df, t):
    assert lab_report.t975(df) == pytest.approx(t, abs=0.002)


def test_verdict_by_reduction_judges_what_the_optimizer_did_not_where_it_began():
    ref = dict(_run("ref", 2.0), start_val_loss=2.5)
    cast = dict(_run("x", 2.0012), start_val_loss=2.5012)  # the same reduction, from a worse start
    assert lab_report.loss_delta(cast, ref) == pytest.approx(0.0012)
    assert lab_report.verdict(cast, ref, band=0.0005) == "worse"
    assert lab_report.loss_delta(cast, ref, by_reduction=True) == pytest.approx(0.0, abs=1e-12)
    assert lab_report.verdict(cast, ref, band=0.0005, by_reduction=True) == "tie"
    slower = dict(_run("y", 2.0012), start_val_loss=2.5)   # the same start, less reduced
    assert lab_report.verdict(slower, ref, band=0.0005, by_reduction=True) == "worse"
    report = dict(runs=[ref, cast, slower], noise_band=0.0005, start_val_loss=2.5,
                  setup=dict(device="cpu"))
    _, rows = demo_report.table_rows(report)
    assert rows[1][3:5] == ["+0.0000 tie", "100%"] and rows[2][3:5] == ["+0.0012 worse", "100%"]
    assert demo_report.start_line(report["runs"]).endswith("each is judged by its own reduction")


def test_demo_shared_start_is_exact_in_every_configurations_weights():
    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(0)), "i": torch.arange(3)}
    start = demo.shared_start(state, demo.stored_dtype(list(demo.CONFIGS.values())))
    assert start["w"].dtype == torch.float32 and torch.equal(start["i"], state["i"])
    assert torch.equal(start["w"].bfloat16().float(), start["w"])  # a bf16 copy is the same values
    assert not torch.equal(start["w"], state["w"])
    assert demo.stored_dtype([demo.CONFIGS["reference"]]) == torch.float32


def test_text_bar_draws_on_stderr(capsys):
    bar = demo_report.TextBar(4)
    bar.set_description("reference")
    for _ in range(4):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "reference" in err and "4/4" in err and "#" * 30 in err


def test_demo_unwritable_out_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert demo.main(["--preset", "tiny", "--out", str(blocker / "report")]) == 1
    assert "cannot write reports to" in capsys.readouterr().err


def test_demo_unknown_config_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--configs", "reference,adam8bit"])
    assert "adam8bit" in capsys.readouterr().err


@pytest.fixture
def one_thread():
    # NOTE: a model this small gains nothing from intra-op threads, and on a busy 2-core
    # machine OpenMP barriers spin: one thread makes this test 4x faster there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_tiny_run_writes_report_plot_and_table(tmp_path, capsys, one_thread):
    out = tmp_path / "report"
    assert demo.main(["--preset", "tiny", "--steps", "6", "--pretrain-steps", "6",
                      "--noise-runs", "1", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    names = [r["config"] for r in report["runs"]]
    assert names == list(demo.CONFIGS) + ["reference"]
    assert report["runs"][-1]["noise_run"] and report["noise_band"] >= 0
    for run in report["runs"]:
        assert run["final_val_loss"] > 0 and 0 <= run["bf16_changed"] <= 1
        assert len(run["train_curve"]) == 6 and run["val_curve"][-1][0] == 6
    # one start for all: bf16 and fp32 weights hold the same values, so the verdict measures
    # the optimizers and not the cast of the starting weights to bf16
    starts = {r["config"]: r["start_val_loss"] for r in report["runs"]}
    assert len(set(starts.values())) == 1, starts
    assert f"every configuration starts at validation loss {report['start_val_loss']:.4f}" in printed
    assert "rounded to bf16" in printed and "the verdict measures the optimizer" in printed
    # the mode column says what ran: the tensors at or over the preset's threshold, counted
    # here from the model itself, are the ones hooked
    p = demo.PRESETS["tiny"]
    model = dm.TinyGPT(p.width, p.layers, p.heads, p.ctx)
    big = sum(1 for t in model.parameters() if t.numel() >= p.small_param_threshold)
    assert 0 < big < len(list(model.parameters()))
    expected = f"async {big}/{len(list(model.parameters()))}"
    cells = {row[0]: row[1] for row in report["sections"][0]["rows"]}
    for run in report["runs"]:
        ours = run["config"].startswith("adambridge-")
        # and the share of the update that ran during backward, from StepStats
        assert (0 <= run["off_path"] <= 1) if ours else run["off_path"] is None, run["label"]
        assert cells[run["label"]] == (f"{expected}, {run['off_path']:.0%} off path" if ours
                                       else "sync"), run["label"]
        assert run["hooked"] == ([big, len(list(model.parameters()))] if ours else None)
    state = {r["config"]: r["state_bytes_per_param"] for r in report["runs"]}
    assert state["adambridge-fp32"] > state["adambridge-bf16"] > state["adambridge-fp8"] > 4
    for run in report["runs"]:
        assert run["label"] in printed
    assert "noise band" in printed and report["table"] in printed
    # without --peers: ours in this process, and one line on the peers it left out
    skipped, = [line for line in printed.splitlines() if "peers skipped (" in line]
    assert skipped.startswith("adambridge demo: peers skipped (") and "--peers" in skipped
    assert report["setup"]["processes"] == "one process for all"
    # the lab's report format: the same rows in its section, a report.md a README can quote
    assert report["format"] == lab_report.FORMAT and report["isa"]["backend"]
    section, = report["sections"]
    assert [row[0] for row in section["rows"]] == [r["label"] for r in report["runs"]]
    assert "| AdamBridge bf16 moments |" in (out / "report.md").read_text()
    png = out / "loss_curves.png"
    if png.exists():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and section["plots"] == [png.name]
    else:
        assert "matplotlib is not installed" in printed


@pytest.mark.parametrize("desc,threshold,mode,hooks", [
    ("every tensor under the threshold: sync, no hook left attached", 65536, "sync", None),
    ("the weight over it: async, that one hooked", 1024, "async", [1, 2]),
])
def test_demo_attach_mode_says_what_is_hooked(desc, threshold, mode, hooks):
    from adambridge import AdamBridge
    from adambridge.lab import demo_run
    model = torch.nn.Linear(64, 32)  # a 2048-element weight and a 32-element bias
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=threshold)
    got = demo_run.attach(opt, model, "test")
    assert (got, demo_run.hooked(opt, got)) == (mode, hooks), desc
    assert (opt.pipeline is None) == (mode == "sync"), desc
    model(torch.randn(4, 64)).sum().backward()
    opt.step_sync() if got == "async" else opt.step()  # the mode's own step runs
    demo_run._release(opt)


@pytest.mark.parametrize("device, message", [
    ("cuda", r"^adambridge demo: Invalid --device 'cuda': this torch (is a CPU-only build|\(CUDA .*\) sees no GPU); "
             r"use --device cpu"),
    ("cuda:3", r"^adambridge demo: Invalid --device 'cuda:3': "),
    ("gpu", r"^adambridge demo: Invalid --device 'gpu': choose cpu, cuda or cuda:N$"),
], ids=["cuda", "cuda:3", "gpu"])
def test_demo_device_without_a_gpu_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, device, message):
    from adambridge import cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine is tested as one without
    out = tmp_path / "report"
    assert cli.main(["demo", "--preset", "tiny", "--device", device, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.match(message, err.strip()), err
    assert not out.exists()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be read


class _CtrlC:
    """A progress bar that is interrupted at the child's first step."""

    def update(self, n: int = 1) -> None:
        raise KeyboardInterrupt


@pytest.mark.skipif(not hasattr(os, "killpg") or not Path("/proc/self/stat").exists(),
                    reason="process groups and /proc are POSIX/Linux")
def test_demo_fresh_interrupted_ends_the_child_and_what_it_started(tmp_path, monkeypatch):
    from adambridge.lab import demo_fresh
    pidfile = tmp_path / "worker.pid"
    child = tmp_path / "child.sh"  # stands in for python -m adambridge.lab.demo_fresh
    child.write_text("#!/bin/sh\n"
                     "trap '' INT\n"                   # a worker deaf to Ctrl-C, as compile workers are
                     f"sleep 300 & echo $! > {pidfile}\n"
                     f"echo {demo_fresh.STEP_LINE}\n"
                     "wait\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    with pytest.raises(KeyboardInterrupt):
        demo_fresh.run_fresh(tmp_path / "setup.pt", demo.CONFIGS["reference"], 0, 1, _CtrlC())
    worker = int(pidfile.read_text())
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"the child's worker {worker} outlived the interrupted run")


def test_demo_interrupted_leaves_no_empty_report_folder(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    # NOTE: a shell runs a background job with SIGINT ignored, and a child inherits that;
    # the demo gets Python's Ctrl-C handling only if SIGINT reaches it at its default.
    proc = subprocess.Popen([sys.executable, "-m", "adambridge", "demo", "--preset", "tiny", "--device", "cpu",
                             "--steps", "400", "--out", str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    try:
        seen = ""
        while "pretraining" not in seen:  # the experiment has begun; the folder exists by now
            line = proc.stderr.read(1)
            assert line, f"the demo ended early: {proc.stdout.read()}"
            seen += line
        assert out.is_dir()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted before any result; nothing was written" in err
    assert not out.exists()
