"""python -m adambridge plan: the table, --json, one-line errors, --check's measurement,
--bench-json, the lab's plan section, the examples of the README and docs/planning.md."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from adambridge import cli
from adambridge._native import loader
from adambridge.plan import arithmetic as ar, check, hardware, plan
from _readme import example

ROOT = Path(__file__).resolve().parents[2]
GIVEN = ["--host-bw", "200", "--host-ram", "1500", "--numa-nodes", "1"]
MACHINE = dict(machine=dict(cpu="cpu", cpus=2), versions=dict(adambridge="0", torch="t", python="3"),
               isa=dict(backend="native/x"), threads=dict(native=2, torch=2), facts={})


@pytest.fixture(autouse=True)
def _fresh_memos():
    loader.reset()
    yield
    loader.reset()


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def test_plan_cli_prints_the_setup_the_table_and_one_recommendation(capsys):
    assert cli.main(["plan", "--params", "7e9", "--gpu", "H100", "--tokens-per-step", "8192", *GIVEN]) == 0
    out = capsys.readouterr().out
    for row in ("all-GPU AdamW", "AdamBridge fp32 moments", "AdamBridge bf16 moments",
                "AdamBridge fp8 moments", "NVMe"):
        assert re.search(rf"^{re.escape(row)}", out, re.M), row
    for column in ("GPU GB", "w+g+s+a", "host GB", "link s", "update s", "bwd s", "exposed s",
                   "step s", "vs GPU", "hides at", "NVMe s", "DWPD", "life mo"):
        assert column in out
    legend = out.split("\n\n")[1].splitlines()   # the table, then its legend under it
    explained = " ".join(line for line in legend if line.startswith("  "))
    for column in ("GPU GB", "w+g+s+a", "fits", "host GB", "link GB", "link s", "update s", "bwd s",
                   "exposed s", "step s", "vs GPU", "hides at", "NVMe s", "DWPD", "life mo"):
        assert f"{column}:" in explained or f"{column}," in explained, column
    assert out.count("Recommendation: ") == 1 and "host: 200.0 GB/s [given: --host-bw]" in out


def test_plan_cli_gpu_memory_and_name_plan_any_card_and_say_how_deepspeed_counts(capsys, monkeypatch):
    from adambridge.plan import hardware
    monkeypatch.setattr(hardware, "cuda_device", lambda: None)  # a CPU-only machine planning a card
    assert cli.main(["plan", "--params", "1e9", "--gpu-memory", "12", "--gpu-name", "RTX 3060", *GIVEN]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^GPU: RTX 3060, 12\.0 GB \(10\.8 usable\), 50 TFLOP/s .*\[not in the table; "
                     r"defaults, not this card's: ", out, re.M), out
    assert re.search(r"DeepSpeed's estimate_zero2/3_model_states_mem_needs prints GiB \(2\^30 bytes\).*"
                     r"additional_buffer_factor=1\.5", out)


def test_plan_cli_json_is_the_function_plan(capsys):
    argv = ["plan", "--params", "13B", "--gpu", "L40S", "--gpus", "4", "--json", *GIVEN]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = plan(params="13B", gpu="L40S", gpus=4, host_bw=200, host_ram=1500, numa_nodes=1)
    assert printed == json.loads(json.dumps(expected.to_dict()))
    assert cli.main(argv) == 0 and json.loads(capsys.readouterr().out) == printed   # deterministic
    assert {r["name"] for r in printed["rows"]} >= {"all-GPU AdamW", "AdamBridge bf16 moments"}


@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], "adambridge plan: Invalid params (--params): '0' (expected a number > 0)"),
    (["--params", "7e9", "--gpu", "H300"], "adambridge plan: Unknown gpu (--gpu): 'H300' (known: H200,"),
    (["--params", "7e9", "--tokens-per-step", "-5"], "Invalid tokens_per_step (--tokens-per-step): '-5'"),
    (["--params", "7e9", "--host-bw", "0"], "Invalid host_bw (--host-bw): '0' (expected a number > 0)"),
    (["--params", "7e9", "--check", "--check-precisions", "fp16"], "Invalid check_precisions"),
    (["--params", "7e9", "--bogus"], "adambridge plan: unrecognized arguments: --bogus (see --help)"),
], ids=["zero params", "unknown gpu", "negative tokens", "zero bandwidth", "check precision", "flag"])
def test_plan_cli_bad_input_is_one_line_on_stderr(capsys, argv, message):
    base = [] if "--gpu" in argv else ["--gpu", "H100"]
    base += [] if "--host-bw" in argv else ["--host-bw", "200"]
    try:
        code = cli.main(["plan", *argv, *base, "--host-ram", "1500"])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_plan_cli_config_without_the_needed_field_names_it(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="mystery", vocab_size=10)))
    assert cli.main(["plan", "--model", str(tmp_path), "--gpu", "H100", *GIVEN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no 'hidden_size' or 'n_embd' or 'd_model'" in err


def test_plan_check_runs_the_native_update_for_each_precision(capsys):
    # NOTE: whether predicted and measured agree is a measurement of this machine (reported
    # by the command), not a property a test can assert on a shared, loaded host.
    assert cli.main(["plan", "--params", "1e9", "--gpu", "RTX4090", "--host-ram", "64",
                     "--check", "--check-size", "2M"]) == 0
    out = capsys.readouterr().out
    assert "measured: native probe" in out and "check: host update of 2M elements" in out
    for precision in ar.PRECISIONS:
        found = re.search(rf"^  {precision}: predicted ([\d.]+) ms, measured ([\d.]+) ms", out, re.M)
        assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0, out


def test_plan_check_predicts_from_what_it_measures_beside_each_update(monkeypatch):
    """--check re-measures the bandwidth and the arithmetic ceiling in each round and predicts
    each round's update from them (max of memory time and arithmetic time)."""
    from adambridge.plan import probes
    gbps = iter([40.0, 10.0, 40.0])  # warm-up round, then the two rounds that count
    monkeypatch.setattr(probes, "bandwidth_gbps", lambda items: next(gbps))
    monkeypatch.setattr(probes, "ceiling_ns", lambda batch, step: 1.5)
    n = 1 << 20
    result = check.run_check(40.0, "given", ["bf16"], numel=n, repeats=2)
    row, = result.rows
    memory = [n * 20 / 10e9, n * 20 / 40e9]           # 2.1 ms and 0.52 ms
    arithmetic = n * 1.5e-9                           # 1.57 ms
    expected = sorted(max(m, arithmetic) for m in memory)
    assert row.predicted_s == pytest.approx(sum(expected) / 2) and row.measured_s > 0
    assert result.bw_gbps == pytest.approx(25.0)  # the median of the rounds' 10 and 40
    assert json.dumps(result.to_dict()) and "bf16: predicted" in result.lines()[1]


def test_host_update_is_memory_or_arithmetic_bound_whichever_is_slower():
    assert ar.host_update_seconds(1e9, "fp8", 50) == pytest.approx(1e9 * 16.125 / 50e9)
    assert ar.host_update_seconds(1e9, "fp8", 50, update_ns=0.1) == pytest.approx(1e9 * 16.125 / 50e9)
    assert ar.host_update_seconds(1e9, "fp8", 50, update_ns=1.0) == pytest.approx(1.0)


def test_plan_takes_a_given_arithmetic_ceiling_and_refuses_a_bad_one(capsys):
    kwargs = dict(params=7e9, gpu="H100", host_bw=50, host_ram=1000, numa_nodes=1)
    memory_bound = plan(**kwargs)
    assert memory_bound.host.update_ns == () and "memory-bound" in memory_bound.host.update_source
    bound = plan(host_update_ns="fp8=1.0", **kwargs)
    assert bound.row("AdamBridge fp8 moments").host_update_s == pytest.approx(7.0)
    assert bound.row("AdamBridge bf16 moments").host_update_s == pytest.approx(
        memory_bound.row("AdamBridge bf16 moments").host_update_s)
    assert plan(host_update_ns={"fp8": 1.0}, **kwargs).to_dict() == bound.to_dict()
    assert cli.main(["plan", "--params", "7e9", "--gpu", "H100", "--host-bw", "50",
                     "--host-ram", "1000", "--host-update-ns", "fp9=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adambridge plan: Invalid host_update_ns (--host-update-ns): 'fp9=1'")
    assert "\n" not in err


def test_plan_without_the_native_library_says_the_bandwidth_is_a_default(monkeypatch, capsys):
    monkeypatch.setenv("ADAMBRIDGE_DISABLE_NATIVE", "1")
    p = plan(params=7e9, gpu="H100", host_ram=64)
    assert p.host.bw_gbps == hardware.DEFAULT_HOST_BW_GBPS and "NOT measured" in p.host.bw_source
    assert any("NOT measured" in note for note in p.notes)
    assert cli.main(["plan", "--params", "7e9", "--gpu", "H100", "--host-ram", "64", "--check"]) == 1
    assert "plan --check needs the native kernel" in capsys.readouterr().err


def test_plan_package_imports_neither_transformers_nor_the_native_library():
    code = ("import sys, adambridge.plan, adambridge.plan.cli\n"
            "from adambridge._native import loader\n"
            "assert 'transformers' not in sys.modules\n"
            "assert loader._load.cache_info().currsize == 0\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


BENCH = dict(preset="gpu", params=67_000_000, tokens_per_step=4096, backend="native/avx2",
             setup="a test double of bench_step.py --json", rows=[
                 dict(variant="torch AdamW", median_ms=40.0, steps=10, peak_gib=2.5),
                 dict(variant="adambridge sync bf16", median_ms=60.0, steps=10, peak_gib=1.2),
                 dict(variant="adambridge async bf16", median_ms=42.0, steps=10, peak_gib=1.1)],
             sweep=dict(precision="bf16", points=[dict(tokens=4096, ratio=1.05), dict(tokens=8192, ratio=1.01)]))


def test_plan_bench_json_prints_planned_and_measured_side_by_side(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    assert cli.main(["plan", "--bench-json", str(path), "--gpu", "H100", *GIVEN]) == 0
    out = capsys.readouterr().out
    expected = plan(params=67_000_000, tokens_per_step=4096, gpu="H100", host_bw=200, host_ram=1500,
                    numa_nodes=1)
    base, ours = expected.row("all-GPU"), expected.row("AdamBridge bf16 moments")
    assert f"torch AdamW | {base.step_s * 1e3:.1f} | 40.0 | " in out
    assert f"adambridge async bf16 | {ours.step_s * 1e3:.1f} | 42.0 | " in out
    assert f"| {2.5 * 2**30 / 1e9:.2f}" in out and "adambridge sync bf16 |" not in out
    assert re.search(r"^8192 \| [\d.]+x \| 1.010x$", out, re.M)
    path.write_text(json.dumps({"rows": []}))
    assert cli.main(["plan", "--bench-json", str(path), "--gpu", "H100", *GIVEN]) == 2
    assert "no params, tokens_per_step: not a bench_step.py --json file" in capsys.readouterr().err


def test_plan_lab_phase_is_the_plan_table_in_the_report(tmp_path):
    from adambridge.lab import phases, presets, report as lab_report
    _, options = presets.resolve("all", {"plan_gpu": "H100", "plan_params": "7B", "plan_check": "false"})
    assert presets.PRESETS["all"].phases[-1] == "plan"
    section = phases.plan(phases.Context(folder=tmp_path, options=options, progress=lambda f, m: None))
    assert section.name == "plan" and section.rows[0][0] == "all-GPU AdamW"
    assert any(n.startswith("Recommendation: ") for n in section.notes)
    lab_report.write_report(tmp_path, preset="all", title="t", sections=[section], status="complete",
                            machine=MACHINE, wall_seconds=1.0)
    assert "## Will offload pay here?" in (tmp_path / "report.md").read_text()
    assert lab_report.read_report(tmp_path)["sections"][0]["figures"]["plan"]["model"]["total"] == 7e9


@pytest.mark.parametrize("options, message", [
    ({"plan_gpu": "H300"}, r"Invalid option plan_gpu: 'H300' \(one of H200, "),
    ({"plan_params": "-1"}, r"Invalid option plan_params: '-1' \(a parameter count"),
], ids=["gpu", "params"])
def test_plan_lab_options_are_checked_in_one_line(options, message):
    from adambridge.lab import presets
    with pytest.raises(presets.PresetError, match=message):
        presets.resolve("all", options)


def _blocks_after(heading: str, count: int) -> list:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    at, blocks = text.index(heading), []
    for _ in range(count):
        start = text.index("```\n", at) + 4
        at = text.index("```", start)
        blocks.append(text[start:at])
        at += 3
    return blocks


def test_readme_plan_example_runs_and_prints_what_the_readme_shows():
    command, shown = _blocks_after("## When offload pays", 2)
    assert command.startswith("python -m adambridge plan ")
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    for line in shown.strip().splitlines():
        assert line in printed, line


def test_docs_planning_example_runs():
    code = example("## Example", ROOT / "docs" / "planning.md")
    namespace: dict = {}
    exec(compile(code, "docs/planning.md", "exec"), namespace)
