"""Benchmarks that say when their timings are not to be trusted: a machine with more runnable
threads than CPUs, or repeats that spread wider than their noise. The load readings and the
timings are injected, so each verdict is deterministic whatever this machine is doing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adambridge.lab import bench_phases, phases, report as lab_report, trust

from test_lab import MACHINE

TIGHT = [0.0100, 0.0101, 0.0102, 0.0100, 0.0101]


def _monitor(reading, threads=2, cpus=2, samples=5):
    monitor = trust.LoadMonitor(threads, reader=lambda t: reading, cpus=cpus)
    for _ in range(samples):
        monitor.sample()
    return monitor


def test_trust_quiet_machine_and_tight_repeats_are_trusted():
    verdict = trust.judge({"a": TIGHT, "b": [x * 2 for x in TIGHT]}, _monitor(0.0))
    assert verdict.trusted and verdict.figures["trusted"] and not verdict.reasons
    assert verdict.line == ("timings look trustworthy: repeats within 10% of their median, "
                            "0 other runnable threads beside its 2 on 2 CPUs")


def test_trust_more_runnable_threads_than_cpus_is_untrusted():
    verdict = trust.judge({"a": TIGHT}, _monitor(3.0, threads=1, cpus=2))
    assert not verdict.trusted
    assert verdict.line == ("WARNING: these timings are not to be trusted: 3 other runnable threads "
                            "(median of 5 readings) competed with its 1 on 2 CPUs")
    assert trust.judge({"a": TIGHT}, _monitor(1.0, threads=1, cpus=2)).trusted  # 1 + 1 fit on 2


def test_trust_repeats_spread_past_their_noise_are_untrusted():
    samples = {"native fp32": TIGHT, "torch backend": [0.010, 0.030, 0.012, 0.011, 0.040]}
    verdict = trust.judge(samples, _monitor(0.0))
    assert not verdict.trusted and verdict.figures["spread"]["native fp32"] < 0.10
    assert "the repeats of 1 of 2 variants spread wider than 10% of their median " \
           "(worst: torch backend, 158%)" in verdict.line
    assert trust.spread([1.0]) == 0.0 and trust.spread([1.0, 1.0]) == 0.0


def test_trust_reads_proc_loadavg_less_this_process_own_runnable_threads(tmp_path):
    (tmp_path / "loadavg").write_text("7.10 6.00 5.00 7/300 12345\n")
    for tid, state in [(1, "R"), (2, "S"), (3, "R")]:
        (tmp_path / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / "task" / str(tid) / "stat").write_text(f"{tid} (a (b) c) {state} 1 2 3\n")
    assert trust.read_others(2, loadavg=tmp_path / "loadavg", tasks=tmp_path / "task") == 5.0
    found = trust.read_others(2)  # the real machine: a count, never negative
    assert found is None or found >= 0


def test_trust_without_a_load_reading_still_judges_the_spread():
    verdict = trust.judge({"a": TIGHT}, trust.LoadMonitor(2, reader=lambda t: None, cpus=2))
    assert verdict.trusted and "the machine's load could not be read" in verdict.line


# ---------------------------------------------------------------------------- the benchmarks

def test_bench_kernels_prints_the_warning_under_load(monkeypatch, capsys):
    monkeypatch.setattr(trust, "read_others", lambda threads: 9.0)
    bk = bench_phases.load_script("bench_kernels")
    with bench_phases.thread_counts_kept():  # the script sets them, as a script may
        bk.main(["--numel", "64K", "--repeats", "3", "--threads", "1", "--no-torch-backend"])
    out = capsys.readouterr().out
    warning, = [line for line in out.splitlines() if line.startswith("WARNING: ")]
    assert warning.startswith("WARNING: these timings are not to be trusted: ")
    # every variant's 3 repeats read the load before each timed run (7 variants, 9 where
    # DeepSpeed's two CPU Adam rows run)
    table = out[out.index("\nvariant "):].split("\n\n")[0].splitlines()[2:]
    assert len(table) in (7, 9), table
    assert (f"9 other runnable threads (median of {3 * len(table)} readings) competed with its 1 on "
            f"{trust.allowed_cpus()} CPUs") in warning
    assert out.index("setup: ") < out.index(warning) < out.index("native fp32 moments")


def _kernels_section(tmp_path, monkeypatch, samples_for, reading):
    """The lab's kernels phase over bench_kernels with injected timings and load."""
    bk = bench_phases.load_script("bench_kernels")

    def fake_samples(variants, repeats, monitor=None):
        for _ in range(repeats):
            monitor.sample()
        return {name: list(samples_for(name)) for name in variants}
    monkeypatch.setattr(bk, "time_samples", fake_samples)
    monkeypatch.setattr(bench_phases, "load_script", lambda name: bk)
    monkeypatch.setattr(trust, "read_others", lambda threads: reading)
    ctx = phases.Context(tmp_path, dict(sizes=["64K"], repeats=5, threads=1, torch_backend=False),
                         lambda f, m: None)
    section = bench_phases.kernels(ctx)
    lab_report.write_report(tmp_path, preset="quick", title="T", sections=[section], status="complete",
                            machine=MACHINE)
    return section, json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


def _timings(name):
    fast = {"native": 1.0, "floor": 0.9}.get(name.split()[0], 3.0)
    return [fast * t for t in TIGHT]


def test_lab_kernels_section_trusted_when_quiet(tmp_path, monkeypatch):
    section, saved, md = _kernels_section(tmp_path, monkeypatch, _timings, 0.0)
    assert section.warnings == [] and saved["sections"][0]["warnings"] == []
    assert section.conclusion == ("at 64K, native fp32 / bf16 / fp8 moments: 3.00x / 3.00x / 3.00x "
                                  "the all-CPU torch alternative's speed")
    assert f"**{section.conclusion}**" in md and "WARNING" not in md


@pytest.mark.parametrize("reading, samples_for, reason", [
    (5.0, _timings, "5 other runnable threads (median of 5 readings) competed with its 1"),
    (0.0, lambda name: [0.01, 0.01, 0.03, 0.01, 0.05] if name == "native fp8 moments" else _timings(name),
     "worst: native fp8 moments, 200%"),
], ids=["load", "spread"])
def test_lab_kernels_section_warns_in_report_json_and_md(tmp_path, monkeypatch, reading, samples_for, reason):
    section, saved, md = _kernels_section(tmp_path, monkeypatch, samples_for, reading)
    warning, = section.warnings
    assert warning.startswith("64K: WARNING: these timings are not to be trusted: ") and reason in warning
    assert saved["sections"][0]["warnings"] == [warning]
    assert saved["sections"][0]["figures"][0]["trust"]["trusted"] is False
    assert section.conclusion.endswith("(not to be trusted: see the warning)")
    assert f"> {warning}" in md
