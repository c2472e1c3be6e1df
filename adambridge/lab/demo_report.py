"""What the demo shows a person: the progress bar, the results table, its report section and the plot."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .demo_peers import INSTALL
from .trust import SPREAD_LIMIT
from .report import NO_MATPLOTLIB, Section, loss_delta, noise_note, pyplot, verdict, verdicts_line

MIB = 1 << 20


# ---------------------------------------------------------------------------- progress

class TextBar:
    """A minimal stand-in for tqdm: one self-overwriting line on stderr, redrawn at most 4x/s."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.n = max(total, 1), width, 0
        self.desc, self._drawn = "", 0.0

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._draw(force=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw(force=self.n >= self.total)

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < 0.25:
            return
        self._drawn = now
        done = int(self.width * min(self.n, self.total) / self.total)
        bar = "#" * done + "." * (self.width - done)
        sys.stderr.write(f"\r{self.desc:<28.28} [{bar}] {self.n}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


class ProgressTee:
    """A progress bar that also tells `report(done, total, desc)` (the lab's progress file)."""

    def __init__(self, bar: Any, total: int, report: Callable[[int, int, str], None]) -> None:
        self.bar, self.total, self.report, self.n, self.desc = bar, total, report, 0, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self.bar.set_description(desc)
        self.report(self.n, self.total, desc)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)
        self.report(self.n, self.total, self.desc)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, report: Optional[Callable[[int, int, str], None]] = None) -> Any:
    """tqdm on stderr when it is installed, else a TextBar; teed to `report` when given."""
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)
    except ImportError:
        bar = TextBar(total)
    return bar if report is None else ProgressTee(bar, total, report)


# ---------------------------------------------------------------------------- table

def _mem(run: dict) -> str:
    if run.get("peak_device_bytes") is not None:
        return f"{run['peak_device_bytes'] / MIB:.0f} MiB"
    if run.get("rss_growth_bytes") is not None:
        return f"+{run['rss_growth_bytes'] / MIB:.0f} MiB"
    return "-"


def step_ms_cell(run: dict) -> str:
    """The median step time; in brackets when the trust rule rejects it (see the legend)."""
    ms = f"{run['ms_per_step']:.1f}"
    return ms if run.get("timing_trusted", True) else f"({ms})"


def _time_ratio(run: dict, ref: Optional[dict]) -> str:
    """Step time against the reference's, only where both timings pass the trust rule."""
    if ref is None or run is ref:
        return "1.00x" if run is ref and run.get("timing_trusted", True) else "-"
    if not (run.get("timing_trusted", True) and ref.get("timing_trusted", True)):
        return "-"
    return f"{run['ms_per_step'] / ref['ms_per_step']:.2f}x"


def why_no_result(run: dict) -> Optional[str]:
    """Why a run has no figures, in one line (not installed, or the error it raised), or None."""
    if run.get("not_installed"):
        return f"not installed ({INSTALL})"
    if "error" in run:
        return f"cannot run here: {run['error']}"
    return None


def _row(run: dict, ref: Optional[dict], band: Optional[float]) -> list[str]:
    why = why_no_result(run)
    if why is not None:
        return [run["label"], why]
    loss = run["final_val_loss"]
    delta = gain = "-"
    if ref is not None and run is not ref:
        # NOTE: judged by each run's reduction from its own start, so that a start that differs
        # (weights cast to another dtype) can never pass for the optimizer's doing.
        delta = f"{loss_delta(run, ref, by_reduction=True):+.4f} {verdict(run, ref, band, by_reduction=True)}"
        ref_gain = ref["start_val_loss"] - ref["final_val_loss"]
        if ref_gain > 0:
            gain = f"{(run['start_val_loss'] - loss) / ref_gain:.0%}"
    return [run["label"], mode_cell(run), f"{loss:.4f}", delta, gain,
            f"{run['bf16_changed']:.1%}", step_ms_cell(run), _time_ratio(run, ref), _mem(run),
            f"{run['state_bytes_per_param']:.2f}"]


def mode_cell(run: dict) -> str:
    """ "sync", or "async N/M, S%": N of the optimizer's M tensors hooked (the rest update at
    step_sync()), S% of the updated elements updated during backward (off the critical path)."""
    if run["mode"] == "async" and run.get("hooked"):
        cell = "async {}/{}".format(*run["hooked"])
        share = run.get("off_path")
        return cell if share is None else f"{cell}, {share:.0%} off path"
    return run["mode"]


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The header and one row per run, as the table prints them (a run without figures: its
    label and why, two cells)."""
    runs, band = report["runs"], report["noise_band"]
    ref = next((r for r in runs if r["config"] == "reference" and not r.get("noise_run")
                and why_no_result(r) is None), None)
    head = ["configuration", "mode", "val loss", "vs reference", "gain kept",
            "bf16 changed", "ms/step", "time vs AdamW", _mem_head(report), "state B/param"]
    return head, [_row(r, ref, band) for r in runs]


def _mem_head(report: dict) -> str:
    return "peak GPU mem" if report["setup"]["device"].startswith("cuda") else "RSS growth"


def start_line(runs: list) -> str:
    """Where the runs started: one loss for all, or the range (each is then judged by its reduction)."""
    starts = [r["start_val_loss"] for r in runs if "start_val_loss" in r]
    if not starts:
        return "no run finished"
    if max(starts) == min(starts):
        return f"every configuration starts at validation loss {starts[0]:.4f}"
    return (f"the configurations start at validation losses {min(starts):.4f} to {max(starts):.4f}; "
            "each is judged by its own reduction")


def _setup_lines(report: dict) -> list[str]:
    s = report["setup"]
    return [f"{s['model']} on {s['device']}; fine-tuned {s['steps']} steps of "
            f"{s['batch']} x {s['ctx']} bytes after {s['pretrain_steps']} shared pretraining steps; "
            f"{start_line(report['runs'])} ({s['start_weights']})",
            f"peak lr {s['lr']:g}: an update that size is below half a bf16 ulp for "
            f"{s['lr_below_half_bf16_ulp']:.0%} of the weights (rounded away without an fp32 master)",
            _host_line(s)]


def _host_line(s: dict) -> str:
    """Where and when it ran, how loaded the machine was, and which peer versions."""
    load = s.get("load_average") or [None, None]
    loads = " -> ".join("?" if x is None else f"{x:g}" for x in load)
    peers = ", ".join(f"{k} {v}" for k, v in s.get("peers", {}).items()) or "none installed"
    return (f"host: {s.get('host', '?')}; {s.get('date', '?')}; load average {loads}; torch "
            f"{s['torch']}, {s['threads']} threads; {s.get('processes', 'one process for all')}; "
            f"peers: {peers}")


def _notes(report: dict) -> list[str]:
    band_line = noise_note(report["runs"], "reference", report["noise_band"])
    return [band_line] + LEGEND + _timing_notes(report["runs"]) + _peer_notes(report["runs"])


LEGEND = [
    "mode: sync is step() after backward; async N/M is attach_hooks with N of the M parameter "
    "tensors hooked (their update overlaps backward; the others, under small_param_threshold "
    "elements, update at step_sync()); S% off path: the share of the updated elements updated "
    "during backward, off the training step's critical path (StepStats)",
    "val loss: mean next-byte cross-entropy (nats) over the validation sequences after the last step",
    "vs reference: how much less the configuration reduced the validation loss from its start "
    "than the reference did (with one start for all, its final loss minus the reference's), "
    "so the verdict measures the optimizer, not the weights' dtype",
    "gain kept: the share of the reference's validation-loss reduction; bf16 changed: weights "
    "whose bf16 value moved",
    "ms/step: median time of a training step (forward, backward, optimizer step) after up to three "
    "warm-up steps; (in brackets): rejected by the benchmarks' trust rule (its steps spread more "
    f"than {SPREAD_LIMIT:.0%} of their median, or other work competed for the CPUs), not a speed "
    "figure and left out of every ratio",
    "time vs AdamW: ms/step over the reference's, only where both pass the trust rule",
    "RSS growth: the process's peak resident memory during the run over what it held before the "
    "model was built (weights, gradients, activations, optimizer state, and whatever the "
    "optimizer's package allocates to run); peak GPU mem: peak CUDA memory over the start",
    "state B/param: bytes the optimizer holds per parameter, counted from its state tensors "
    "(each storage once) and its host master copies (AdamBridge, DeepSpeed)",
]


def _timing_notes(runs: list) -> list[str]:
    timed = [r for r in runs if "ms_per_step" in r]
    rejected = [r for r in timed if not r.get("timing_trusted", True)]
    if not rejected:
        return [f"timings: all {len(timed)} pass the trust rule"] if timed else []
    worst = max(rejected, key=lambda r: r.get("step_spread") or 0)
    why = "; ".join(worst.get("timing_reasons", [])) or "rejected"
    return [f"timings: {len(rejected)} of {len(timed)} rejected by the trust rule (the worst, "
            f"{worst['label']}: {why})"]


def _peer_notes(runs: list) -> list[str]:
    return [f"{r['label']} warned: {w}" for r in runs for w in r.get("warnings", [])]


def format_table(report: dict) -> str:
    """The results as an aligned text table with a setup line above and the key below."""
    head, body = table_rows(report)
    rows = [head] + body
    full = [row for row in rows if len(row) == len(head)]
    widths = [max(len(row[i]) for row in full) for i in range(len(head))]
    # NOTE: a run without figures prints its label and why in one line, beside the columns.
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) if len(row) == len(head)
             else f"{row[0].ljust(widths[0])}  {row[1]}" for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(_setup_lines(report) + lines + _notes(report) + ["verdict: " + conclusion(report)])


def conclusion(report: dict) -> str:
    """The comparison in one line: each configuration's verdict against the reference."""
    return verdicts_line(report["runs"], "reference", report["noise_band"])


def section(report: dict, plots: list[str]) -> Section:
    """The demo's results as a lab report section (the same rows as the printed table)."""
    head, rows = table_rows(report)
    rows = [row + [""] * (len(head) - len(row)) for row in rows]
    return Section(name="demo", title="Fine-tuning comparison (demo)", setup="; ".join(_setup_lines(report)),
                   columns=head, rows=rows, notes=_notes(report), plots=plots,
                   conclusion=conclusion(report),
                   figures=dict(setup=report["setup"], runs=report["runs"],
                                noise_band=report["noise_band"],
                                start_val_loss=report["start_val_loss"]))


# ---------------------------------------------------------------------------- files

def write_plot(report: dict, path: Path) -> Optional[str]:
    """Validation loss, and its difference from the reference against the noise band.

    Returns why no plot was written (matplotlib missing), else None.
    """
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    runs, band = report["runs"], report["noise_band"]
    ref = next((r for r in runs if r["config"] == "reference" and not r.get("noise_run")), None)
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        if "val_curve" not in run:
            continue  # not installed, or it could not run here
        style = dict(lw=0.8, alpha=0.6, ls="--") if run.get("noise_run") else dict(lw=1.5)
        style["color"] = f"C{i % 10}"  # the same colour in both panels
        steps, losses = zip(*run["val_curve"])
        ax_loss.plot(steps, losses, marker="o", ms=3, label=run["label"], **style)
        if ref is not None and run is not ref:
            diffs = [a - b for (_, a), (_, b) in zip(run["val_curve"], ref["val_curve"])]
            ax_diff.plot(steps, diffs, marker="o", ms=3, label=run["label"], **style)
    if band is not None:
        ax_diff.axhspan(-band, band, color="grey", alpha=0.2, label="noise band (final)")
    ax_loss.set(title="validation loss", xlabel="fine-tuning step", ylabel="loss (nats/byte)")
    ax_diff.set(title="validation loss minus the reference's", xlabel="fine-tuning step")
    ax_loss.legend(fontsize=8)
    ax_diff.legend(fontsize=8)
    fig.suptitle(report["setup"]["model"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
