"""The lab's command line: ``adambridge-lab`` / ``python -m adambridge lab`` serves the page,
``... lab run --preset NAME`` runs a preset headless and prints where its report is."""
from __future__ import annotations

import argparse
import contextlib
import io
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, TextIO

from . import presets, report as lab_report

DEFAULT_REPORTS = "reports"


def _option(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    return name.strip(), value


PROG = "python -m adambridge lab"   # how `adambridge` (cli.py) starts it, by default
SCRIPT = "adambridge-lab"          # the console script (pyproject.toml)


def invoked_as() -> str:
    """The lab's command as this process was started: the adambridge-lab script, or PROG."""
    # NOTE: pip's console scripts run with sys.argv[0] the script's path (.exe on Windows).
    return SCRIPT if Path(sys.argv[0]).stem == SCRIPT else PROG


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Serve the adambridge-lab page on 127.0.0.1, or run "
                                             "a preset headless with `lab run`.")
    ap.add_argument("--reports", default=DEFAULT_REPORTS, type=Path,
                    help="folder of the reports (default: ./reports)")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--open", action="store_true", help="open the page in a browser")
    return ap


def _run_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"{prog} run",
                                 description="Run a preset without the page; writes "
                                             "REPORTS/<timestamp>-<preset>/.")
    ap.add_argument("--preset", required=True, choices=list(presets.PRESETS),
                    help="; ".join(f"{p.name}: {p.description}" for p in presets.PRESETS.values()))
    ap.add_argument("--reports", default=DEFAULT_REPORTS, type=Path,
                    help="folder of the reports (default: ./reports)")
    ap.add_argument("--option", "-o", action="append", type=_option, default=[],
                    metavar="NAME=VALUE", help="options: " + ", ".join(presets.OPTIONS))
    return ap


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to the run's log file."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # tqdm and warnings ask
        return getattr(self.stream, "encoding", None) or "utf-8"


@contextlib.contextmanager
def _logged(path: Path) -> Iterator[None]:
    """stdout and stderr also into `path`, as the page's runs have them in their log.txt."""
    with open(path, "w", encoding="utf-8", errors="replace") as log:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def run_headless(argv: Sequence[str], prog: str = PROG) -> int:
    """`lab run`: the preset's phases in this process; 0 when every phase passed."""
    from .runner import LOG, run_preset
    ap = _run_parser(prog)
    args = ap.parse_args(list(argv))
    try:
        presets.resolve(args.preset, dict(args.option))
        folder = lab_report.new_report_dir(args.reports, args.preset)
    except (presets.PresetError, lab_report.ReportDirError) as exc:
        ap.error(str(exc))
    with _logged(folder / LOG):
        report = run_preset(args.preset, dict(args.option), folder=folder)
    print((folder / "report.md").read_text())
    print(f"adambridge lab: {report['status']} in {report['wall_seconds']} s; report: {folder}")
    return 0 if report["status"] == "complete" else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(argv: Sequence[str], prog: str = PROG) -> int:
    """Serve the page until Ctrl-C; a run still going is killed on the way out."""
    from .server import LabServer
    args = _parser(prog).parse_args(list(argv))
    try:
        server = LabServer(args.reports, port=args.port)
    except (lab_report.ReportDirError, OSError) as exc:
        print(f"adambridge lab: {exc}", file=sys.stderr)
        return 1
    print(f"adambridge lab: serving {Path(args.reports).resolve()} on\n  {server.url}\n"
          "(127.0.0.1 only; the token in the URL is the key. Ctrl-C stops.)", flush=True)
    if args.open:
        import webbrowser
        webbrowser.open(server.url)
    server.serve_in_thread()
    signal.signal(signal.SIGTERM, _interrupt)  # a plain kill also stops the run it started
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("adambridge lab: stopping", file=sys.stderr)
    finally:
        server.shutdown_all()
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The lab's command line. ``prog`` names the command in help and errors as the user typed
    it (cli.py passes ``adambridge lab`` or ``python -m adambridge lab``); None: invoked_as()."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or invoked_as()
    if argv[:1] == ["run"]:
        return run_headless(argv[1:], prog)
    return serve(argv, prog)
