"""One lab run: a preset's phases in order, progress.json as it goes, the report after each phase.

The page starts this module in its own process (``python -m adambridge.lab.runner``) so that
cancelling is a kill and the server never waits on a benchmark; ``python -m adambridge lab
run`` calls `run_preset` directly.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from . import bench_phases, phases, presets
from .report import Section, machine_facts, write_report

PHASES: Mapping[str, Callable[[phases.Context], Section]] = {
    "tests": phases.tests, "kernels": bench_phases.kernels, "step": bench_phases.step,
    "demo": phases.demo, "finetune": bench_phases.finetune, "plan": phases.plan,
}
PROGRESS = "progress.json"
LOG = "log.txt"  # everything the run printed: the page's run process writes it, so does `lab run`


class Progress:
    """progress.json in the run's folder: state, phase, fraction done, what runs now."""

    def __init__(self, folder: Path, phase_names: Sequence[str]) -> None:
        self.path, self.names = Path(folder) / PROGRESS, list(phase_names)
        self.index, self.fraction, self.message, self._written = 0, 0.0, "", 0.0
        self.write("running", force=True)

    def phase(self, index: int) -> None:
        self.index, self.fraction, self.message = index, 0.0, "starting"
        self.write("running", force=True)

    def step(self, fraction: float, message: str) -> None:
        self.fraction, self.message = fraction, message or self.message
        self.write("running")

    def finish(self, state: str, message: str) -> None:
        """The last write: past every phase when complete, else at the phase that stopped."""
        if state != "cancelled":
            self.index, self.fraction = len(self.names), 0.0
        self.message = message
        self.write(state, force=True)

    def write(self, state: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written < 0.2:  # a step loop may report thousands of times
            return
        self._written = now
        overall = (self.index + self.fraction) / max(1, len(self.names))
        write_progress(self.path, dict(
            state=state, phases=self.names, phase_index=self.index,
            phase=self.names[self.index] if self.index < len(self.names) else None,
            fraction=1.0 if state == "complete" else round(overall, 4), message=self.message,
            updated=datetime.datetime.now().astimezone().isoformat(timespec="seconds")))


def write_progress(path: Path, progress: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, path)  # readers never see half a file


def _failed(name: str, exc: BaseException) -> Section:
    reason = str(exc) if isinstance(exc, phases.PhaseError) else f"{type(exc).__name__}: {exc}"
    return Section(name=name, title=presets.PHASE_TITLES[name], status="failed", error=reason,
                   conclusion=f"failed: {reason}")


def run_preset(name: str, options: Optional[Mapping] = None, *, folder: Path) -> dict:
    """Run every phase of a preset into `folder` (which must exist); returns the final report."""
    preset, opts = presets.resolve(name, options)
    progress = Progress(folder, preset.phases)
    started, machine, sections = time.perf_counter(), machine_facts(), []
    title = f"adambridge-lab: {preset.name} ({', '.join(preset.phases)})"

    def save(status: str) -> dict:
        return write_report(folder, preset=preset.name, title=title, sections=sections,
                            status=status, machine=machine, options=opts,
                            wall_seconds=round(time.perf_counter() - started, 1))
    save("running")
    try:
        for index, phase in enumerate(preset.phases):
            progress.phase(index)
            print(f"adambridge lab: phase {index + 1}/{len(preset.phases)}: {phase}", flush=True)
            ctx = phases.Context(folder=Path(folder), options=opts, progress=progress.step)
            try:
                sections.append(PHASES[phase](ctx))
            except Exception as exc:  # noqa: BLE001 - one phase failing must not lose the others
                traceback.print_exc()
                sections.append(_failed(phase, exc))
            save("running")
    except KeyboardInterrupt:
        progress.finish("cancelled", f"cancelled during {preset.phases[progress.index]}")
        return save("cancelled")
    failed = [s.name for s in sections if s.status == "failed"]
    status = "failed" if failed else "complete"
    seconds = time.perf_counter() - started
    progress.finish(status, f"{len(sections)} of {len(preset.phases)} phases ran in {seconds:.0f} s"
                            + (f"; failed: {', '.join(failed)}" if failed else ""))
    return save(status)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The page's run process: --preset NAME --dir FOLDER [--options JSON]."""
    ap = argparse.ArgumentParser(prog="python -m adambridge.lab.runner", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dir", required=True, type=Path, help="the run's report folder (exists)")
    ap.add_argument("--options", default="{}", help="the run's options as a JSON object")
    args = ap.parse_args(argv)
    report = run_preset(args.preset, json.loads(args.options), folder=args.dir)
    return 0 if report["status"] == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
