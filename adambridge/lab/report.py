"""The lab report format: one folder per run holding report.json, report.md and PNG plots.

Every producer (the demo, the kernel and step benchmarks, the fine-tuning comparison, the
test run) describes its results as `Section`s; `write_report` turns them into the files the
page and a README read. The noise band and the tie/worse/better verdict live here so that
the demo and benchmarks/finetune_llm.py classify results the same way.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

FORMAT = "adambridge-lab-report/1"
STATUSES = ("running", "complete", "failed", "cancelled")


class ReportDirError(RuntimeError):
    """The report folder cannot be created or written."""


@dataclasses.dataclass
class Section:
    """One producer's results: a table (strings, as quoted), its notes and plots, the raw numbers."""
    name: str
    title: str
    status: str = "ok"                      # ok | failed | cancelled
    setup: str = ""
    columns: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    plots: list = dataclasses.field(default_factory=list)   # file names in the report folder
    figures: Any = None                     # every measured number, JSON-serialisable
    error: Optional[str] = None
    conclusion: str = ""                    # what the section shows, in one line
    warnings: list = dataclasses.field(default_factory=list)  # why its figures may not hold

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- verdicts

# Student's t, 97.5th percentile (two-sided 95%), for 1 to 30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
BAND_RULE = ("95% bound on the difference of two runs under data order alone: "
             "t(0.975, n-1) x sqrt(2) x the standard deviation of the reference's n final losses")


def t975(df: int) -> float:
    """Student's t 97.5th percentile: the table to 30 degrees of freedom, then Cornish-Fisher."""
    if df < 1:
        raise ValueError(f"Invalid degrees of freedom: {df} (at least 1)")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def band_runs(runs: Sequence[Mapping], reference: str) -> int:
    """How many finished runs of the reference (its own and its noise runs) the band rests on."""
    return sum(1 for r in runs if r.get("config") == reference and r.get("final_val_loss") is not None)


def noise_band(runs: Sequence[Mapping], reference: str) -> Optional[float]:
    """The tie band (BAND_RULE) from the reference's final losses under different data orders;
    None with fewer than two of them.

    `reference` names the reference configuration; runs that failed or were not installed
    (no final_val_loss) are ignored.
    """
    # NOTE: a configuration's run and the reference's are two draws, so their difference has
    # sqrt(2) times one run's spread; with few runs that spread is itself uncertain, which
    # Student's t carries (with 3 runs the band is about 6 standard deviations wide).
    measured = [r for r in runs if r.get("config") == reference and r.get("final_val_loss") is not None]
    if len(measured) < 2 or all(r.get("noise_run") for r in measured):
        return None
    spread = statistics.stdev(r["final_val_loss"] for r in measured)
    return t975(len(measured) - 1) * math.sqrt(2) * spread


def band_text(band: Optional[float], runs: int) -> str:
    """The band as every report prints it: its width and how many runs it rests on."""
    if band is None:
        return "no noise band (the reference needs a re-run with another data order): no ties called"
    return f"noise band {band:.4f} from {runs} runs of the reference"


def noise_note(runs: Sequence[Mapping], reference: str, band: Optional[float]) -> str:
    """The report's note on the band: its width, its runs and the rule that made it."""
    if band is None:
        return band_text(band, 0)
    return (f"{band_text(band, band_runs(runs, reference))}, each with its own data order "
            f"({BAND_RULE}): differences within it are ties")


def loss_delta(run: Mapping, ref: Mapping, *, by_reduction: bool = False) -> float:
    """How much worse a run ends than the reference (positive: worse).

    by_reduction: the reference's reduction of the loss from its own start minus the run's, so
    that a run starting from other weights (a cast, another initialisation) is judged by what
    its optimizer did, not by where it began. Equal to the final-loss difference when both
    runs start from the same loss.
    """
    delta = run["final_val_loss"] - ref["final_val_loss"]
    if by_reduction:
        delta -= run["start_val_loss"] - ref["start_val_loss"]
    return delta


def verdict(run: Mapping, ref: Optional[Mapping], band: Optional[float], *,
            by_reduction: bool = False) -> str:
    """How a run compares with the reference (see loss_delta): within the noise band is a tie."""
    if ref is None or run is ref:
        return "reference" if run is ref else ""
    if run.get("noise_run"):
        return "noise run"
    delta = loss_delta(run, ref, by_reduction=by_reduction)
    if band is not None and abs(delta) <= band:
        return "tie"
    return "worse" if delta > 0 else "better"


def verdicts_line(runs: Sequence[Mapping], reference: str, band: Optional[float]) -> str:
    """One line: each measured run's verdict against the reference, judged by its reduction
    where both start losses were measured, else (said so) by the final losses."""
    measured = [r for r in runs if r.get("final_val_loss") is not None]
    ref = next((r for r in measured if r.get("config") == reference and not r.get("noise_run")), None)
    if ref is None:
        return "no reference run finished: nothing to compare"
    parts = [_verdict_part(r, ref, band) for r in measured if r is not ref and not r.get("noise_run")]
    where = band_text(band, band_runs(runs, reference))
    return f"against {ref['label']}: {', '.join(parts) or 'no other run'}; {where}"


def _verdict_part(run: Mapping, ref: Mapping, band: Optional[float]) -> str:
    by_reduction = all(r.get("start_val_loss") is not None for r in (run, ref))
    text = (f"{run['label']} {verdict(run, ref, band, by_reduction=by_reduction)} "
            f"({loss_delta(run, ref, by_reduction=by_reduction):+.4f}")
    return text + (")" if by_reduction else ", final losses: a start loss was not measured)")


# ---------------------------------------------------------------------------- the machine

def machine_facts() -> dict:
    """Machine, versions, ISA and threads, from the facts `python -m adambridge info` prints."""
    import torch
    from .. import diagnostics
    native, native_ok = diagnostics.native_facts()
    facts = dict(diagnostics.environment_facts() + native + diagnostics.topology_facts())
    pick = lambda *names: {n: str(facts[n]) for n in names if n in facts}  # noqa: E731
    return dict(
        machine=dict(cpu=cpu_name(), cpus=os.cpu_count(), **pick("platform", "allowed cpus",
                                                                    "numa nodes", "cuda devices")),
        versions=pick("adambridge", "torch", "python"),
        isa=dict(native_ok=native_ok, **pick("backend", "isa detected", "isa active",
                                             "isa compiled", "isa supported", "isa forced",
                                             "compiler", "native")),
        threads=dict(native=facts.get("threads"), torch=torch.get_num_threads()),
        facts={k: str(v) for k, v in facts.items()})


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo (lscpu) gives it, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------- folders

def check_writable(root: Path) -> Path:
    """Create `root` if needed and prove a file can be written there; ReportDirError if not."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ReportDirError(f"cannot write reports to {root}: {exc.strerror or exc}. "
                             "Choose a writable folder with --reports DIR.") from exc
    return root


def new_report_dir(root: Path, preset: str, now: Optional[datetime.datetime] = None) -> Path:
    """A fresh reports/<timestamp>-<preset>/ folder (suffixed -2, -3... within one second)."""
    root = check_writable(root)
    stamp = f"{(now or datetime.datetime.now()):%Y%m%d-%H%M%S}-{preset}"
    for n in range(1, 1000):
        folder = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
        except OSError as exc:
            raise ReportDirError(f"cannot create {folder}: {exc.strerror or exc}") from exc
    raise ReportDirError(f"too many reports named {stamp} in {root}")


def _atomic_write(path: Path, text: str) -> None:
    # NOTE: the page may read a report while a run rewrites it after each phase.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- writing, reading

def write_report(folder: Path, *, preset: str, title: str, sections: Iterable[Section],
                 status: str, machine: Optional[dict] = None, wall_seconds: Optional[float] = None,
                 options: Optional[dict] = None, extra: Optional[dict] = None) -> dict:
    """Write report.json and report.md into `folder`; returns the report."""
    if status not in STATUSES:
        raise ValueError(f"Invalid report status: {status!r}")
    report = dict(extra or {})
    report.update(format=FORMAT, title=title, preset=preset, status=status,
                  created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  wall_seconds=wall_seconds, options=options or {},
                  **(machine if machine is not None else machine_facts()),
                  sections=[s.to_dict() for s in sections])
    _atomic_write(Path(folder) / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    _atomic_write(Path(folder) / "report.md", render_markdown(report))
    return report


def read_report(folder: Path) -> dict:
    """A report folder's report.json; ValueError when it is not a lab report."""
    path = Path(folder) / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable as a report: {exc}") from exc
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ValueError(f"{path} is not an adambridge-lab report (format {FORMAT})")
    return report


def list_reports(root: Path) -> list:
    """Summaries of every report under `root`, newest first; folders that are not reports are skipped."""
    found = []
    for folder in sorted(Path(root).iterdir() if Path(root).is_dir() else [], reverse=True):
        try:
            r = read_report(folder)
        except ValueError:
            continue
        found.append(dict(name=folder.name, title=r.get("title"), preset=r.get("preset"),
                          status=r.get("status"), created=r.get("created"),
                          wall_seconds=r.get("wall_seconds"),
                          sections=[s.get("name") for s in r.get("sections", [])]))
    return found


# ---------------------------------------------------------------------------- markdown, plots

def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; the first column left-aligned, the others right-aligned."""
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: Mapping) -> str:
    """report.md: the setup line, then each section's table, notes and plots."""
    m, v, isa = report.get("machine", {}), report.get("versions", {}), report.get("isa", {})
    threads = report.get("threads", {})
    lines = [f"# {report['title']}", "",
             f"Setup: {m.get('cpu')} ({m.get('cpus')} CPUs), {isa.get('backend', '?')}, "
             f"{threads.get('native')} native / {threads.get('torch')} torch threads; "
             f"adambridge {v.get('adambridge', '?').split(' ')[0]}, torch {v.get('torch')}, "
             f"Python {v.get('python', '?').split(' ')[0]}. Status: {report['status']}"
             + (f", {report['wall_seconds']:.0f} s." if report.get("wall_seconds") else "."), ""]
    for s in report.get("sections", []):
        lines += [f"## {s['title']}", ""]
        if s.get("conclusion"):
            lines += [f"**{s['conclusion']}**", ""]
        lines += [f"> {w}" for w in s.get("warnings", [])] + ([""] if s.get("warnings") else [])
        if s.get("error"):
            lines += [f"**{s['status']}**: {s['error']}", ""]
        if s.get("setup"):
            lines += [s["setup"], ""]
        if s.get("columns"):
            lines += [md_table(s["columns"], s["rows"]), ""]
        lines += [f"- {n}" for n in s.get("notes", [])] + ([""] if s.get("notes") else [])
        lines += [f"![{s['name']}]({p})" for p in s.get("plots", [])] + ([""] if s.get("plots") else [])
    return "\n".join(lines).rstrip() + "\n"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib), so no plot was written"


def bar_plot(path: Path, title: str, ylabel: str, groups: Mapping[str, Mapping[str, float]]) -> Optional[str]:
    """Grouped bars: one group per key of `groups`, one bar per inner key. Returns why not, or None."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    names = list(dict.fromkeys(k for bars in groups.values() for k in bars))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(4 + 1.2 * len(groups) * max(1, len(names)) ** 0.5, 4))
    for i, name in enumerate(names):
        xs = [g + i * width for g, bars in enumerate(groups.values()) if name in bars]
        ys = [bars[name] for bars in groups.values() if name in bars]
        ax.bar(xs, ys, width, label=name, color=f"C{i % 10}")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups))
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside, never over, the bars
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
