"""adambridge-lab without its server: presets and options, the report format, the runner's
phase loop, the phases' tables, and `python -m adambridge lab run` headless."""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adambridge import cli
from adambridge.lab import bench_phases, phases, presets, report as lab_report, runner, trust

ROOT = Path(__file__).resolve().parents[2]
MACHINE = dict(machine=dict(cpu="cpu", cpus=2), versions=dict(adambridge="0", torch="t", python="3"),
               isa=dict(backend="native/x"), threads=dict(native=2, torch=2), facts={})


# ---------------------------------------------------------------------------- presets

def test_presets_fill_defaults_and_resolve_their_own_output_again():
    preset, opts = presets.resolve("quick", {"threads": "2"})
    assert preset.phases == ("kernels", "demo") and opts["threads"] == 2
    assert opts["sizes"] == ["256K", "1M"] and opts["demo_preset"] == "tiny"
    # the page's run process gets the resolved options as JSON and resolves them again
    assert presets.resolve("quick", json.loads(json.dumps(opts)))[1] == opts
    assert presets.resolve("tests", {"tests": "tests/project/test_cli.py tests/lab/test_lab.py"})[1]["tests"] == \
        ["tests/project/test_cli.py", "tests/lab/test_lab.py"]
    assert set(presets.PRESETS) == {"quick", "kernels", "step", "finetune", "tests", "all"}
    assert set(presets.PRESETS["all"].phases) == set(runner.PHASES) == set(presets.PHASE_TITLES)


@pytest.mark.parametrize("name, options, message", [
    ("fast", {}, r"Unknown preset 'fast'"),
    ("quick", {"sizes": "1M,big"}, r"Invalid option sizes"),
    ("quick", {"repeats": "x"}, r"Invalid option repeats: 'x' \(a whole number\)"),
    ("quick", {"demo_preset": "huge"}, r"Invalid option demo_preset: 'huge' \(one of tiny, small, gpu\)"),
    ("quick", {"torch_backend": "maybe"}, r"Invalid option torch_backend"),
    ("tests", {"tests": "tests -x"}, r"Invalid option tests"),
], ids=["preset", "sizes", "repeats", "demo_preset", "torch_backend", "tests"])
def test_presets_refuse_bad_input_in_one_line(name, options, message):
    with pytest.raises(presets.PresetError, match=message):
        presets.resolve(name, options)


# ---------------------------------------------------------------------------- the report format

def test_report_written_read_listed_and_rendered(tmp_path):
    folder = lab_report.new_report_dir(tmp_path, "quick", now=datetime.datetime(2026, 1, 2, 3, 4, 5))
    again = lab_report.new_report_dir(tmp_path, "quick", now=datetime.datetime(2026, 1, 2, 3, 4, 5))
    assert (folder.name, again.name) == ("20260102-030405-quick", "20260102-030405-quick-2")
    sections = [lab_report.Section("kernels", "Kernels", setup="2 threads", columns=["a", "b"],
                                   rows=[["x|y", "1.0"]], notes=["n"], plots=["p.png"], figures=[1]),
                lab_report.Section("demo", "Demo", status="failed", error="ValueError: boom")]
    lab_report.write_report(folder, preset="quick", title="T", sections=sections, status="failed",
                            machine=MACHINE, wall_seconds=3.0)
    back = lab_report.read_report(folder)
    assert back["format"] == lab_report.FORMAT and back["sections"][0]["figures"] == [1]
    md = (folder / "report.md").read_text()
    assert "| x\\|y | 1.0 |" in md and "**failed**: ValueError: boom" in md and "![kernels](p.png)" in md
    (tmp_path / "not-a-report").mkdir()
    (tmp_path / "not-a-report" / "report.json").write_text('{"runs": []}')
    listed = lab_report.list_reports(tmp_path)
    assert [r["name"] for r in listed] == [folder.name]  # the empty folder and the non-report skipped
    assert listed[0]["sections"] == ["kernels", "demo"] and listed[0]["status"] == "failed"
    with pytest.raises(ValueError, match="not an adambridge-lab report"):
        lab_report.read_report(tmp_path / "not-a-report")
    with pytest.raises(ValueError, match="Invalid report status"):
        lab_report.write_report(folder, preset="q", title="T", sections=[], status="done", machine=MACHINE)


def test_report_verdicts_line_judges_each_run_by_its_own_reduction():
    def run(config, label, start, final, **extra):
        return dict(config=config, label=label, start_val_loss=start, final_val_loss=final, **extra)
    runs = [run("adamw", "AdamW", 3.0, 2.0), run("ab", "AdamBridge bf16", 3.001, 2.0012),
            run("b16", "BF16-only", 3.001, 2.5), run("adamw", "AdamW, order 1", 3.0, 2.0004, noise_run=True),
            dict(config="bnb", label="bitsandbytes", not_installed="bitsandbytes")]
    band = lab_report.noise_band(runs, "adamw")
    assert lab_report.verdicts_line(runs, "adamw", band) == (
        "against AdamW: AdamBridge bf16 tie (+0.0002), BF16-only worse (+0.4990); "
        "noise band 0.0051 from 2 runs of the reference")
    assert lab_report.verdicts_line(runs[1:3], "adamw", None) == "no reference run finished: nothing to compare"


def test_report_dir_that_cannot_be_written_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(lab_report.ReportDirError, match=r"cannot write reports to .*file.*--reports DIR"):
        lab_report.new_report_dir(tmp_path / "file" / "reports", "quick")


# ---------------------------------------------------------------------------- the runner

def test_runner_one_failing_phase_keeps_the_others_and_marks_the_run_failed(tmp_path, monkeypatch):
    seen = []

    def good(ctx):
        ctx.step(0.5, "half way")
        seen.append(json.loads((tmp_path / runner.PROGRESS).read_text()))
        return lab_report.Section("kernels", "K", columns=["a"], rows=[["1"]])

    def bad(ctx):
        raise phases.PhaseError("needs a source checkout: benchmarks/x.py is not there")
    monkeypatch.setattr(runner, "PHASES", dict(kernels=good, demo=bad))
    monkeypatch.setattr(runner, "machine_facts", lambda: MACHINE)
    report = runner.run_preset("quick", folder=tmp_path)
    assert report["status"] == "failed" and [s["status"] for s in report["sections"]] == ["ok", "failed"]
    assert report["sections"][1]["error"] == "needs a source checkout: benchmarks/x.py is not there"
    assert seen[0]["state"] == "running" and seen[0]["phase"] == "kernels"
    progress = json.loads((tmp_path / runner.PROGRESS).read_text())
    assert progress["state"] == "failed" and lab_report.read_report(tmp_path)["status"] == "failed"
    # finished: past every phase, and a message of its own rather than the last phase's
    assert progress["phase"] is None and progress["phase_index"] == 2
    assert re.fullmatch(r"2 of 2 phases ran in \d+ s; failed: demo", progress["message"])
    assert report["sections"][1]["conclusion"].startswith("failed: needs a source checkout")


# ---------------------------------------------------------------------------- phases

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="2.5">
<testcase classname="tests.test_a" name="test_one" time="0.5"/>
<testcase classname="tests.test_a.TestGroup" name="test_two" time="1.0"><failure message="assert 1 == 2&#10;more"/></testcase>
<testcase classname="tests.gpu.test_b" name="test_three" time="0.1"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def test_phases_junit_counts_per_file(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    counts, failures, seconds = phases.junit_counts(tmp_path / "j.xml")
    assert counts["tests/test_a.py"] == dict(passed=1, failed=1, skipped=0, seconds=1.5)
    assert counts["tests/gpu/test_b.py"]["skipped"] == 1
    assert failures == ["tests/test_a.py::test_two: assert 1 == 2"] and seconds == 2.5


def test_phases_tests_runs_pytest_and_tables_each_file(tmp_path):
    target = tmp_path / "test_lab_target.py"
    target.write_text("import pytest\n\ndef test_ok():\n    pass\n\n"
                      "@pytest.mark.skip(reason='named')\ndef test_skipped():\n    pass\n\n"
                      "def test_bad():\n    assert 1 == 2\n")
    seen = []
    ctx = phases.Context(tmp_path, dict(tests=[str(target)]), lambda f, m: seen.append(f))
    section = phases.tests(ctx)
    assert section.status == "failed" and "exited with status 1: 1 failed" in section.error
    (name, passed, failed, skipped, _), = section.rows
    assert name.endswith("test_lab_target.py") and (passed, failed, skipped) == ("1", "1", "1")
    assert section.conclusion == f"1 of 2 tests failed (1 skipped), in {name}"
    assert "test_bad" in section.notes[0] and seen and seen[-1] == 1.0


def test_phases_step_table_is_the_one_bench_step_prints(tmp_path, monkeypatch):
    bench_step = bench_phases.load_script("bench_step")
    rows = [dict(variant=v, median_ms=ms, steps=8, peak_gib=None, state_mib=1.0,
                 host_update_ms=h, sync_wait_ms=h) for v, ms, h in
            [("torch AdamW", 10.0, None), ("adambridge sync bf16", 12.0, 2.0), ("adambridge async bf16", 9.0, 1.0)]]
    # a machine with 4 other runnable threads beside the step's 2 on 2 CPUs (an injected reading)
    monitor = trust.LoadMonitor(2, reader=lambda threads: 4.0, cpus=2)
    monitor.sample()
    verdict = trust.judge({r["variant"]: [r["median_ms"]] * 3 for r in rows}, monitor)
    monkeypatch.setattr(bench_step, "run", lambda preset, names, seconds: dict(
        preset=preset, params=1000, tokens_per_step=256, backend="native/x", rows=rows, setup="cpu",
        trust=verdict.figures, trust_line=verdict.line))
    monkeypatch.setattr(bench_phases, "load_script", lambda name: bench_step)
    section = bench_phases.step(phases.Context(tmp_path, dict(step_seconds=5, threads=None), lambda f, m: None))
    assert section.columns[:3] == ["variant", "step ms", "vs torch AdamW"]
    assert [r[0] for r in section.rows] == [r["variant"] for r in rows]
    assert section.rows[2][1:4] == ["9.0", "0.90x", "0.75x"]  # async vs torch, async vs sync
    assert all(len(r) == len(section.columns) for r in section.rows)
    assert section.warnings == [verdict.line] and verdict.line in bench_step.table(bench_step.run("cpu", [], 0))
    assert "4 other runnable threads (median of 1 readings) competed with its 2 on 2 CPUs" in verdict.line
    assert section.conclusion == ("step time against torch AdamW: async bf16 0.90x "
                                  "(not to be trusted: see the warning)")


def test_phases_finetune_without_transformers_says_not_installed(tmp_path, monkeypatch):
    real = bench_phases.importlib.util.find_spec
    monkeypatch.setattr(bench_phases.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    section = bench_phases.finetune(phases.Context(tmp_path, {}, lambda f, m: None))
    assert section.status == "skipped" and "not installed: transformers" in section.error


def test_phases_missing_checkout_is_a_phase_error(monkeypatch, tmp_path):
    monkeypatch.setattr(phases, "SOURCE_ROOT", tmp_path)
    with pytest.raises(phases.PhaseError, match="needs a source checkout"):
        bench_phases.load_script("bench_kernels")


# ---------------------------------------------------------------------------- headless

def _lab(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "adambridge", "lab", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_lab_run_quick_headless_writes_the_report_folder(tmp_path):
    done = _lab("run", "--preset", "quick", "--reports", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder, = (tmp_path / "out").iterdir()
    assert folder.name.endswith("-quick")
    report = lab_report.read_report(folder)
    assert report["status"] == "complete" and [s["name"] for s in report["sections"]] == ["kernels", "demo"]
    for name in ("report.json", "report.md", *[p for s in report["sections"] for p in s["plots"]]):
        assert (folder / name).stat().st_size > 0
    assert "## Host AdamW kernels" in done.stdout and str(folder.name) in done.stdout
    # the same log.txt a run from the page has: everything the run printed
    log = (folder / "log.txt").read_text()
    assert "adambridge lab: phase 1/2: kernels" in log and "adambridge lab: phase 2/2: demo" in log
    assert "validated: native == torch backend" in log and "pretraining" in log  # stdout and stderr
    kernels, demo = report["sections"]
    assert kernels["conclusion"].startswith("at 1M, native fp32 / bf16 / fp8 moments: ")
    assert demo["conclusion"].startswith("against AdamW, fp32 weights: AdamBridge fp32 moments ")
    for section in report["sections"]:
        assert f"**{section['conclusion']}**" in done.stdout  # report.md, printed at the end
    # each size says whether its timings can be trusted; the untrusted ones are the warnings
    lines = [m["trust_line"] for m in kernels["figures"]]
    assert len(lines) == 2 and all(line.startswith(("WARNING: these timings are not to be trusted: ",
                                                    "timings look trustworthy: ")) for line in lines)
    assert kernels["warnings"] == [f"{size}: {m['trust_line']}" for size, m in
                                   zip(report["options"]["sizes"], kernels["figures"]) if not m["trust"]["trusted"]]
    assert all(f"> {w}" in done.stdout for w in kernels["warnings"])


@pytest.mark.parametrize("argv, message", [
    (["run", "--preset", "nope"], "invalid choice: 'nope'"),
    (["run", "--preset", "quick", "-o", "threads=0"], "Invalid option threads: 0"),
    (["run", "--preset", "quick", "--reports", "blocker/reports"], "cannot write reports to"),
    (["--reports", "blocker/reports"], "cannot write reports to"),
], ids=["unknown preset", "bad option", "unwritable run", "unwritable serve"])
def test_lab_command_line_bad_input(tmp_path, monkeypatch, capsys, argv, message):
    (tmp_path / "blocker").write_text("")
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(["lab", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    assert code in (1, 2) and message in capsys.readouterr().err
    assert not (tmp_path / "reports").exists()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout of adambridge")
def test_lab_default_reports_folder_is_ignored_by_git():
    # `python -m adambridge lab` in a checkout writes ./reports/ (app.DEFAULT_REPORTS)
    from adambridge.lab import app
    path = f"{app.DEFAULT_REPORTS}/20260102-030405-quick/report.json"
    assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_lab_wheel_carries_the_page_and_the_console_script(tmp_path):
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = zipfile.ZipFile(next(tmp_path.glob("adambridge-*.whl")))
    names = set(wheel.namelist())
    static = {f"adambridge/lab/static/{p.name}" for p in (ROOT / "adambridge/lab/static").iterdir()}
    assert {"adambridge/lab/static/index.html", "adambridge/lab/static/app.js"} <= static <= names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "adambridge-lab = adambridge.lab.app:main" in wheel.read(entry).decode()
