"""The page's runs: at most one run process at a time, its state read from its folder, cancel as a kill.

A run is ``python -m adambridge.lab.runner`` in a session of its own, writing into
reports/<timestamp>-<preset>/ (log.txt, progress.json, report.json). Nothing here waits on
it: status() reads those files, so the server answers while a benchmark runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from . import presets, report as lab_report
from .runner import LOG, PROGRESS, write_progress
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # so the run imports this very adambridge


class RunConflict(RuntimeError):
    """A run was started while another runs, or cancelled when none does (HTTP 409)."""


@dataclasses.dataclass
class Run:
    name: str
    preset: str
    folder: Path
    proc: subprocess.Popen
    started: float
    cancelled: bool = False
    finished: bool = False  # its report has been given its final status by us
    ended: Optional[float] = None  # when status() first saw the process gone


def tail(path: Path, lines: int = 40, max_bytes: int = 32768) -> str:
    """The last lines of a log; carriage-return redraws (progress bars) count as lines."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


class RunManager:
    """Starts, watches and cancels the one run the page may have going."""

    def __init__(self, reports: Path) -> None:
        # resolved: the run process gets this path on its command line
        self.reports = lab_report.check_writable(Path(reports).resolve())
        self._lock = threading.Lock()
        self._run: Optional[Run] = None

    def start(self, preset: str, options: Optional[Mapping[str, Any]] = None) -> dict:
        """Start a run; PresetError for bad input, RunConflict while one runs, ReportDirError."""
        with self._lock:
            if self._run is not None and self._run.proc.poll() is None:
                raise RunConflict(f"a run is in progress ({self._run.name}): wait for it or cancel it")
            spec, resolved = presets.resolve(preset, options)
            folder = lab_report.new_report_dir(self.reports, spec.name)
            env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
                filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")])))
            cmd = [sys.executable, "-m", "adambridge.lab.runner", "--preset", spec.name,
                   "--dir", str(folder), "--options", json.dumps(resolved)]
            with open(folder / LOG, "wb") as log:
                # NOTE: a session of its own, so cancel kills pytest and the benchmark workers too.
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            self._run = Run(folder.name, spec.name, folder, proc, time.monotonic())
        return self.status()

    def cancel(self) -> dict:
        """Kill the run's process group, and mark its progress and report cancelled."""
        with self._lock:
            run = self._run
            if run is None or run.proc.poll() is not None:
                raise RunConflict("no run is in progress")
            run.cancelled = True
            try:
                if hasattr(os, "killpg"):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                else:  # Windows: no process groups here; the run process itself is killed
                    run.proc.kill()
            except ProcessLookupError:
                pass  # it ended between poll() and the kill
            run.proc.wait()
            self._mark_cancelled(run)
        return self.status()

    def _mark_cancelled(self, run: Run) -> None:
        progress = self._progress(run)
        write_progress(run.folder / PROGRESS, dict(progress, state="cancelled",
                                                   message="cancelled from the page"))
        self._finish_report(run, "cancelled")

    def _finish_report(self, run: Run, status: str) -> None:
        """Rewrite the run's report with `status`, keeping the phases it finished."""
        try:
            done = lab_report.read_report(run.folder)
        except ValueError:  # it ended before its first report: write one that says so
            done = dict(title=f"adambridge-lab: {run.preset}", sections=[], options={})
        sections = [lab_report.Section(**s) for s in done.get("sections", [])]
        keep = {k: done[k] for k in ("machine", "versions", "isa", "threads", "facts") if k in done}
        lab_report.write_report(run.folder, preset=run.preset, title=done["title"],
                                sections=sections, status=status, machine=keep,
                                options=done.get("options"),
                                wall_seconds=round(time.monotonic() - run.started, 1))
        run.finished = True

    def _progress(self, run: Run) -> dict:
        try:
            return json.loads((run.folder / PROGRESS).read_text())
        except (OSError, ValueError):
            return dict(state="starting", phases=list(presets.PRESETS[run.preset].phases),
                        phase_index=0, phase=None, fraction=0.0, message="starting")

    def status(self) -> dict:
        """The current (or last) run: state, phase, fraction, log tail; {"run": None} before any."""
        run = self._run
        if run is None:
            return dict(run=None)
        progress, code = self._progress(run), run.proc.poll()
        if code is not None and run.ended is None:
            run.ended = time.monotonic()
        state = progress.get("state", "running")
        if run.cancelled:
            state = "cancelled"
        elif code is not None and state in ("running", "starting"):
            state = "failed"  # it died without saying so: the log tells why
            progress["message"] = f"the run process exited with status {code}; see the log"
            with self._lock:
                if not run.finished:
                    self._finish_report(run, "failed")
        elif code is None and state not in ("running", "starting"):
            state = "running"  # written its last progress, still writing the report
        return dict(run=dict(progress, name=run.name, preset=run.preset, state=state,
                             exit_code=code, running=code is None,
                             seconds=round((run.ended or time.monotonic()) - run.started, 1),
                             log_tail=tail(run.folder / LOG)))

    def close(self) -> None:
        """Kill a run still going (the server is shutting down)."""
        try:
            self.cancel()
        except RunConflict:
            pass
