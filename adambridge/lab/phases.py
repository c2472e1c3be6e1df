"""The lab's phases that live in the package: the demo and the test suite, and what all phases share.

A phase takes a `Context` (its report folder, the run's options, a progress callback) and
returns a report `Section`; it raises `PhaseError` with a one-line reason when it cannot run.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from .report import Section

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding benchmarks/ and tests/


class PhaseError(RuntimeError):
    """A phase cannot run here (a missing checkout or package) or stopped: one line why."""


@dataclasses.dataclass
class Context:
    """What a phase gets: where to write plots, the run's options, how to report progress."""
    folder: Path
    options: Mapping
    progress: Callable[[float, str], None]  # (fraction of this phase done, what runs now)

    def step(self, fraction: float, message: str = "") -> None:
        self.progress(min(1.0, max(0.0, fraction)), message)


def source_file(relative: str) -> Path:
    """A file of the source checkout, or PhaseError saying the phase needs one."""
    path = SOURCE_ROOT / relative
    if not path.exists():
        raise PhaseError(f"needs a source checkout: {path} is not there (clone the adambridge "
                         "repository and run the lab from it)")
    return path


def stream(cmd: Sequence[str], on_line: Callable[[str], None], *, cwd: Optional[Path] = None,
           env: Optional[Mapping[str, str]] = None) -> int:
    """Run a command, echo its output line by line into our log and `on_line`; its exit status."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env or os.environ), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        on_line(line.rstrip("\n"))
    return proc.wait()


# ---------------------------------------------------------------------------- the demo

DEMO_PLOT = "demo-loss_curves.png"


def demo(ctx: Context) -> Section:
    """The demo's comparison at the chosen size, its table and loss curves."""
    import torch
    from . import demo as demo_mod, demo_report
    argv = ["--noise-runs", "1" if ctx.options.get("demo_preset") == "tiny" else "2"]
    for flag, key in (("--preset", "demo_preset"), ("--steps", "demo_steps")):
        if ctx.options.get(key) is not None:
            argv += [flag, str(ctx.options[key])]
    if ctx.options.get("demo_preset") == "tiny":
        argv += ["--pretrain-steps", str(ctx.options.get("demo_steps") or 6), "--device", "cpu"]
    threads = torch.get_num_threads()
    # NOTE: the tiny model gains nothing from intra-op threads, and on a busy 2-core machine
    # OpenMP barriers spin: one thread makes it several times faster there.
    torch.set_num_threads(1 if ctx.options.get("demo_preset") == "tiny" else threads)
    try:
        report = demo_mod.experiment(demo_mod.parse_args(argv),
                                     progress=lambda done, total, desc: ctx.step(done / total, desc))
    finally:
        torch.set_num_threads(threads)
    why_not = demo_report.write_plot(report, ctx.folder / DEMO_PLOT)
    section = demo_report.section(report, [] if why_not else [DEMO_PLOT])
    section.notes += [why_not] if why_not else []
    return section


# ---------------------------------------------------------------------------- the plan

def plan(ctx: Context) -> Section:
    """adambridge plan for the options' model on this host, with --check's measurement."""
    from ..plan import check, hardware, plan as make_plan, report as plan_report
    gpu, note = ctx.options.get("plan_gpu"), []
    if gpu is None and hardware.cuda_device() is None:
        gpu, note = "H100", ["no CUDA device here: planned for an H100 (option plan_gpu)"]
    ctx.step(0.1, "measuring the host")
    planned = make_plan(params=ctx.options.get("plan_params") or "7e9", gpu=gpu,
                        tokens_per_step=ctx.options.get("plan_tokens") or 4096)
    ctx.step(0.5, "running the host update")
    checked = (check.run_check(planned.host.bw_gbps, planned.host.bw_source)
               if ctx.options.get("plan_check", True) else None)
    section = Section(**plan_report.section(planned, checked))
    section.notes += note
    return section


# ---------------------------------------------------------------------------- the tests

_PERCENT = re.compile(r"\[\s*(\d+)%\]\s*$")


def tests(ctx: Context) -> Section:
    """pytest in a subprocess; a row per test file with its passes, failures and skips."""
    source_file("tests")
    targets = list(ctx.options.get("tests") or ["tests"])
    with tempfile.TemporaryDirectory(prefix="adambridge-lab-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o",
               "console_output_style=progress", f"--junitxml={xml}", *targets]

        def on_line(line: str) -> None:
            match = _PERCENT.search(line)
            if match:
                ctx.step(int(match.group(1)) / 100, line.split(" ")[0])
        rc = stream(cmd, on_line, cwd=SOURCE_ROOT)
        if not xml.exists():
            raise PhaseError(f"pytest exited with status {rc} before writing its results")
        counts, failures, seconds = junit_counts(xml)
    columns = ["test file", "passed", "failed", "skipped", "seconds"]
    rows = [[name, str(c["passed"]), str(c["failed"]), str(c["skipped"]), f"{c['seconds']:.1f}"]
            for name, c in sorted(counts.items())]
    total = {k: sum(c[k] for c in counts.values()) for k in ("passed", "failed", "skipped")}
    section = Section(name="tests", title="Test suite (pytest)",
                      setup=f"python -m pytest {' '.join(targets)}: {total['passed']} passed, "
                            f"{total['failed']} failed, {total['skipped']} skipped in {seconds:.0f} s",
                      columns=columns, rows=rows, notes=failures[:20],
                      figures=dict(files=counts, totals=total, exit_status=rc),
                      conclusion=tests_conclusion(counts, total))
    if rc != 0:
        section.status = "failed"
        section.error = ("pytest collected no tests" if rc == 5 else
                         f"pytest exited with status {rc}: {total['failed']} failed")
    return section


def tests_conclusion(counts: Mapping, total: Mapping) -> str:
    ran = total["passed"] + total["failed"]
    skipped = f" ({total['skipped']} skipped)" if total["skipped"] else ""
    if not ran:
        return "no test ran" + skipped
    if not total["failed"]:
        return f"all {ran} tests passed{skipped}"
    files = sorted(name for name, c in counts.items() if c["failed"])
    return f"{total['failed']} of {ran} tests failed{skipped}, in {', '.join(files)}"


def _test_file(classname: str) -> str:
    """tests.gpu.test_x.TestY -> tests/gpu/test_x.py (test classes are capitalised)."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def junit_counts(xml: Path) -> tuple[dict, list, float]:
    """Per test file: passed, failed, skipped and seconds; the failures' one-line reasons; the time."""
    counts: dict = defaultdict(lambda: dict(passed=0, failed=0, skipped=0, seconds=0.0))
    failures, root = [], ET.parse(xml).getroot()
    for case in root.iter("testcase"):
        file = _test_file(case.get("classname") or "?")
        entry = counts[file]
        entry["seconds"] += float(case.get("time") or 0)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            entry["failed"] += 1
            failures.append(f"{file}::{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:200]}"
                            if bad.get("message") else f"{file}::{case.get('name')}")
        elif case.find("skipped") is not None:
            entry["skipped"] += 1
        else:
            entry["passed"] += 1
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return dict(counts), failures, sum(float(s.get("time") or 0) for s in suites)
