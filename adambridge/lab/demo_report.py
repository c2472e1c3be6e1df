"""What the demo shows a person: the progress bar, the results table, the JSON report and the plot."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

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


def progress_bar(total: int) -> Any:
    """tqdm on stderr when it is installed, else a TextBar."""
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total)
    return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)


# ---------------------------------------------------------------------------- table

def verdict(run: dict, ref: Optional[dict], band: Optional[float]) -> str:
    """How a run's final loss compares with the reference's: within the noise band is a tie."""
    if ref is None or run is ref:
        return "reference" if run is ref else ""
    if run.get("noise_run"):
        return "noise run"
    delta = run["final_val_loss"] - ref["final_val_loss"]
    if band is not None and abs(delta) <= band:
        return "tie"
    return "worse" if delta > 0 else "better"


def _mem(run: dict) -> str:
    if run.get("peak_device_bytes") is not None:
        return f"{run['peak_device_bytes'] / MIB:.0f} MiB"
    if run.get("rss_growth_bytes") is not None:
        return f"+{run['rss_growth_bytes'] / MIB:.0f} MiB"
    return "-"


def _row(run: dict, ref: Optional[dict], band: Optional[float], start: float) -> list[str]:
    loss = run["final_val_loss"]
    delta = gain = "-"
    if ref is not None and run is not ref:
        delta = f"{loss - ref['final_val_loss']:+.4f} {verdict(run, ref, band)}"
        if start - ref["final_val_loss"] > 0:
            gain = f"{(start - loss) / (start - ref['final_val_loss']):.0%}"
    return [run["label"], run["mode"], f"{loss:.4f}", delta, gain,
            f"{run['bf16_changed']:.1%}", f"{run['ms_per_step']:.1f}", _mem(run),
            f"{run['state_bytes_per_param']:.2f}"]


def format_table(report: dict) -> str:
    """The results as an aligned text table with a setup line above and the key below."""
    runs, band = report["runs"], report["noise_band"]
    ref = next((r for r in runs if r["config"] == "reference" and not r.get("noise_run")), None)
    start = report["start_val_loss"]
    mem_head = "peak GPU mem" if report["setup"]["device"].startswith("cuda") else "RSS growth"
    head = ["configuration", "mode", "val loss", "vs reference", "gain kept",
            "bf16 changed", "ms/step", mem_head, "state B/param"]
    rows = [head] + [_row(r, ref, band, start) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    band_text = (f"noise band {band:.4f} (reference re-run with {report['setup']['noise_runs']} "
                 f"other data orders): differences within it are ties" if band is not None
                 else "no noise runs: differences are not classified as ties")
    s = report["setup"]
    return "\n".join([
        f"{s['model']} on {s['device']}; fine-tuned {s['steps']} steps of "
        f"{s['batch']} x {s['ctx']} bytes after {s['pretrain_steps']} shared pretraining steps; "
        f"validation loss at start {start:.4f}",
        f"peak lr {s['lr']:g}: an update that size is below half a bf16 ulp for "
        f"{s['lr_below_half_bf16_ulp']:.0%} of the weights (rounded away without an fp32 master)",
        *lines,
        band_text,
        "gain kept: the share of the reference's validation-loss reduction; bf16 changed: weights "
        "whose bf16 value moved; state B/param: optimizer-held bytes per parameter "
        "(AdamBridge: fp32 master + moments, in host RAM)",
    ])


# ---------------------------------------------------------------------------- files

def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_plot(report: dict, path: Path) -> Optional[str]:
    """Validation loss, and its difference from the reference against the noise band.

    Returns why no plot was written (matplotlib missing), else None.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib), so no plot was written"
    runs, band = report["runs"], report["noise_band"]
    ref = next((r for r in runs if r["config"] == "reference" and not r.get("noise_run")), None)
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
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
