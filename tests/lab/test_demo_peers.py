"""The demo's peers: the bytes each holds (counted), the line a run without them prints, the
fresh-process protocol, the trust rule on the demo's timings, and the peers' rows on the tiny
preset (CI installs the [peers] extra, so a peer release that changes its API shows here)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adambridge.lab import demo, demo_fresh, demo_peers, demo_report, demo_run, trust
from test_demo import one_thread  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
# NOTE: torchao's CPUOffloadOptimizer refuses a model without a CUDA or XPU device; every
# other peer steps CPU tensors.
CUDA_ONLY = {"torchao-offload", "torchao-offload-bf16"}


class _Quantized:
    """A stand-in for a quantized state: a float face over codes and per-block scales."""

    def __init__(self, numel: int, block: int) -> None:
        self.codes = torch.zeros(numel, dtype=torch.uint8)
        self.scale = torch.ones(numel // block)

    def __tensor_flatten__(self):
        return ["codes", "scale"], None


def test_held_bytes_counts_each_storage_once_and_looks_behind_subclasses():
    base = torch.zeros(1000)
    shared = torch.zeros(256)
    assert demo_peers.held_bytes([base, base[10:20], base.view(10, 100)]) == 4000
    assert demo_peers.held_bytes([shared, shared, torch.zeros(4)]) == 256 * 4 + 16
    assert demo_peers.held_bytes([_Quantized(4096, 256)]) == 4096 + 16 * 4


def test_state_bytes_count_the_host_masters_and_the_state():
    model = torch.nn.Linear(64, 64, bias=False).bfloat16()
    opt = demo_peers.HostMasterOptimizer(model.parameters(), lambda m: torch.optim.AdamW(m, **HYPER),
                                         master_dtype=torch.bfloat16)
    model(torch.randn(2, 64).bfloat16()).sum().backward()
    opt.step()
    opt.zero_grad()
    # bf16 master (2 B) + AdamW's m and v in the master's dtype (2 + 2 B) + its step tensor
    assert demo_peers.state_bytes_per_param(opt, 64 * 64) == pytest.approx(6 + 4 / 4096)
    assert opt.masters[0].grad is None and model.weight.grad is None


# What each peer holds per parameter of a 256 x 256 weight (quantized: >= 4096 values),
# stepped once in one child process (see _child_env for why a child).
_COUNT = """
import json, sys, warnings, torch
from adambridge.lab import demo_peers
held = {}
for name in sys.argv[1:]:
    peer = demo_peers.PEERS[name]
    peer.prepared()
    weight = torch.nn.Parameter(torch.randn(256, 256).to(peer.weights))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PagedAdamW8bit says it runs unpaged on a CPU
        opt = peer.build([weight], dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), weight.device)
        weight.grad = torch.randn_like(weight)
        opt.step()
    held[name] = demo_peers.state_bytes_per_param(opt, weight.numel())
print(json.dumps(held))
"""
HELD = {"bnb-adamw8bit": (2.0, 2.1),            # 1 + 1 B codes, fp32 absmax per block, shared maps
        "bnb-paged-adamw8bit": (2.0, 2.1),
        "deepspeed-cpu-adam": (12.0, 12.0),     # fp32 master + fp32 m and v
        "deepspeed-cpu-adam-bf16": (6.0, 6.0),  # bf16 master + bf16 m and v
        "torchao-adamw8bit": (2.0, 2.1),
        "torchao-adamw4bit": (1.0, 1.1),
        "torchao-adamwfp8": (2.0, 2.1)}


def _child_env() -> dict:
    # NOTE: torchao compiles each step with torch.compile, about 40 s per optimizer on a CPU
    # the first time; eager steps (TORCHDYNAMO_DISABLE, read when torch is imported) run the
    # same API in seconds.
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def test_peer_state_bytes_are_counted_from_what_it_holds():
    names = [n for n in HELD if demo_peers.installed(demo_peers.PEERS[n].package)]
    if not names:
        pytest.skip(f"no peer is installed ({demo_peers.INSTALL})")
    done = subprocess.run([sys.executable, "-c", _COUNT, *names], env=_child_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    held = json.loads(done.stdout.strip().splitlines()[-1])
    for name in names:
        low, high = HELD[name]
        assert low <= held[name] <= high + 1e-3, (name, held[name])


def test_skipped_line_says_which_peers_and_how_to_add_them(monkeypatch):
    monkeypatch.setattr(demo_peers, "installed", lambda package: False)
    assert demo_peers.skipped_line() == ("peers skipped (bitsandbytes, deepspeed, torchao not installed: "
                                         'pip install "adambridge[peers]", then add --peers)')
    monkeypatch.setattr(demo_peers, "installed", lambda package: package == "torchao")
    monkeypatch.setattr(demo_peers, "version", lambda package: "0.18.0")
    assert demo_peers.skipped_line() == ("peers skipped (torchao 0.18.0 installed: add --peers to run "
                                         "them; bitsandbytes, deepspeed not installed: "
                                         'pip install "adambridge[peers]", then add --peers)')


def test_peers_argument_picks_by_name_and_refuses_an_unknown_one(capsys):
    assert [p.name for p in demo_peers.pick("all")] == list(demo_peers.PEERS)
    assert [p.name for p in demo_peers.pick("torchao-adamw4bit,bnb-adamw8bit")] == [
        "torchao-adamw4bit", "bnb-adamw8bit"]
    assert demo.parse_args([]).peers is None and demo.parse_args(["--peers"]).peers == "all"
    with pytest.raises(SystemExit):
        demo.parse_args(["--peers", "bnb-adamw8bit,lion"])
    assert "unknown peer(s): lion; choose all or from bnb-adamw8bit," in capsys.readouterr().err


def test_one_line_keeps_the_type_and_the_first_line():
    assert demo_fresh.one_line(AssertionError("only CUDA\n  more")) == "AssertionError: only CUDA"
    assert demo_fresh.one_line(RuntimeError()) == "RuntimeError"


# ---------------------------------------------------------------------------- the trust rule

def _run(label, ms, trusted, config="x"):
    return dict(config=config, label=label, mode="sync", start_val_loss=2.5, final_val_loss=2.0,
                bf16_changed=0.5, ms_per_step=ms, timing_trusted=trusted, step_spread=0.3,
                timing_reasons=[] if trusted else ["its steps spread 30% of their median"],
                rss_growth_bytes=0, peak_device_bytes=None, state_bytes_per_param=8.0)


def _report(runs):
    return dict(runs=runs, noise_band=0.001, start_val_loss=2.5, setup=dict(
        device="cpu", model="m", steps=1, batch=1, ctx=8, pretrain_steps=0, start_weights="w",
        lr=1e-4, lr_below_half_bf16_ulp=0.5, noise_runs=0, torch="t", threads=1))


def test_demo_timings_carry_the_trust_rule_and_untrusted_ones_enter_no_ratio():
    ref = _run("ref", 10.0, True, "reference")
    runs = [ref, _run("fast", 5.0, True), _run("noisy", 2.0, False),
            dict(config="p", label="peer", error="AssertionError: only CUDA"),
            dict(config="q", label="absent", not_installed="torchao")]
    head, rows = demo_report.table_rows(_report(runs))
    cells = {row[0]: dict(zip(head, row)) for row in rows}
    assert cells["ref"]["ms/step"] == "10.0" and cells["ref"]["time vs AdamW"] == "1.00x"
    assert cells["fast"]["time vs AdamW"] == "0.50x"
    assert cells["noisy"]["ms/step"] == "(2.0)" and cells["noisy"]["time vs AdamW"] == "-"
    assert rows[3] == ["peer", "cannot run here: AssertionError: only CUDA"]
    assert rows[4] == ["absent", 'not installed (pip install "adambridge[peers]")']
    untrusted_ref = [dict(ref, timing_trusted=False), _run("fast", 5.0, True)]
    assert demo_report.table_rows(_report(untrusted_ref))[1][1][7] == "-"
    text = demo_report.format_table(_report(runs))
    assert "timings: 1 of 3 rejected by the trust rule (the worst, noisy: its steps spread 30%" in text
    assert any(line.split() == ["peer", "cannot", "run", "here:", "AssertionError:", "only", "CUDA"]
               for line in text.splitlines())  # its label, then why, in one line


def test_demo_legend_explains_every_column():
    head, _ = demo_report.table_rows(_report([_run("ref", 10.0, True, "reference")]))
    legend = " ".join(demo_report.LEGEND)
    for column in head[1:]:
        assert f"{column}:" in legend, column
    assert "RSS growth" in head and "peak GPU mem:" in legend


def _monitor(others: float) -> trust.LoadMonitor:
    monitor = trust.LoadMonitor(1, reader=lambda threads: others, cpus=2)
    monitor.sample()
    monitor.sample()
    return monitor


def test_step_timing_leaves_out_the_warm_up_and_judges_the_rest():
    steady = demo_run.step_timing([5.0, 1.0, 1.0, 0.010, 0.010, 0.0101, 0.010, 0.010,
                                   0.010, 0.010, 0.010, 0.010, 0.010, 0.010], _monitor(0.0))
    assert steady["timing_trusted"] and steady["ms_per_step"] == pytest.approx(10.0)
    assert len(steady["step_ms"]) == 11  # three warm-up steps left out
    noisy = demo_run.step_timing([0.010, 0.030] * 6, _monitor(0.0))
    assert not noisy["timing_trusted"] and noisy["step_spread"] > trust.SPREAD_LIMIT
    assert noisy["timing_reasons"] == [f"its steps spread {noisy['step_spread']:.0%} of their median"]
    busy = demo_run.step_timing([0.010] * 12, _monitor(3.0))
    assert not busy["timing_trusted"]
    assert busy["timing_reasons"] == ["3 other runnable threads beside its 1 on 2 CPUs"]


# ---------------------------------------------------------------------------- fresh processes

def _tiny_setup():
    args = demo.parse_args(["--preset", "tiny", "--steps", "4", "--pretrain-steps", "0"])
    setup, _ = demo.prepare(args, demo.pick_preset(args, torch.device("cpu")), torch.device("cpu"))
    setup.start_dtype = torch.bfloat16
    setup.init_state = demo.shared_start(setup.init_state, torch.bfloat16)
    return setup


class _Bar:
    def update(self, n=1):
        pass


def test_a_fresh_process_run_equals_the_same_run_in_this_process(tmp_path, one_thread):
    setup = _tiny_setup()
    demo_fresh.save_setup(setup, tmp_path / "setup.pt")
    loaded = demo_fresh.load_setup(tmp_path / "setup.pt")
    assert loaded.preset == setup.preset and torch.equal(loaded.train, setup.train)
    config = demo.CONFIGS["adambridge-fp8"]
    here = demo.run_config(setup, config, 0, _Bar())
    fresh = demo_fresh.run_fresh(tmp_path / "setup.pt", config, 0, setup.steps, _Bar())
    assert fresh["train_curve"] == here["train_curve"]  # the same start and batches, bit for bit
    assert fresh["val_curve"] == [list(point) for point in here["val_curve"]]
    assert fresh["state_bytes_per_param"] == here["state_bytes_per_param"]


def test_the_peers_rows_on_the_tiny_preset(tmp_path):
    """Every peer runs under the demo's protocol (or says in one line why it cannot)."""
    if not any(demo_peers.installed(p) for p in demo_peers.PACKAGES):
        pytest.skip(f"no peer is installed ({demo_peers.INSTALL})")
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "adambridge", "demo", "--preset", "tiny", "--steps", "4",
           "--pretrain-steps", "2", "--noise-runs", "0", "--configs", "reference", "--peers",
           "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["config"]: r for r in report["runs"]}
    assert list(runs) == ["reference"] + list(demo_peers.PEERS)
    assert report["setup"]["processes"] == "a fresh process each"
    for name, peer in demo_peers.PEERS.items():
        run = runs[name]
        assert run["label"] in done.stdout
        if not demo_peers.installed(peer.package):
            assert run["not_installed"] == peer.package
        elif name in CUDA_ONLY:
            assert run["error"] == "AssertionError: CPU Offload currently only supports CUDA & XPU"
        else:
            assert "error" not in run, run
            assert run["final_val_loss"] > 0 and run["state_bytes_per_param"] > 0
    if demo_peers.installed("deepspeed"):
        assert runs["deepspeed-cpu-adam"]["state_bytes_per_param"] == pytest.approx(12.0)
        assert runs["deepspeed-cpu-adam-bf16"]["state_bytes_per_param"] == pytest.approx(6.0)
    if demo_peers.installed("bitsandbytes"):
        # it runs unpaged here, and its row says so
        assert any("not supported on CPU" in w for w in runs["bnb-paged-adamw8bit"]["warnings"])


def test_kernel_benchmark_sets_deepspeeds_rows_beside_ours(capsys):
    if not demo_peers.installed("deepspeed"):
        pytest.skip(f"needs deepspeed ({demo_peers.INSTALL})")
    from adambridge.lab import bench_phases
    bk = bench_phases.load_script("bench_kernels")
    with bench_phases.thread_counts_kept():  # the script sets them, as a script may
        bk.main(["--numel", "64K", "--repeats", "3", "--threads", "1", "--no-torch-backend"])
    out = capsys.readouterr().out
    assert "DeepSpeed CPU Adam (fp32 update) " in out and "DeepSpeed CPU Adam (bf16 states) " in out
    beside = out[out.index("beside DeepSpeed"):].splitlines()[1:]
    # the bytes moved and held per parameter, counted the same way for both
    assert beside[0].endswith("moved 28 vs 28; held 12.00 vs 12.00")
    assert beside[1].endswith("moved 14 vs 20; held 6.00 vs 8.00")
    assert beside[2].endswith("moved 14 vs 16; held 6.00 vs 6.06")
    assert all(": no ratio (" in line or ("x; moved" in line) for line in beside)
