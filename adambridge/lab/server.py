"""The lab's HTTP server: the page, its JSON API and the report files, for 127.0.0.1 and one token.

Standard library only (ThreadingHTTPServer). Every request must carry the token printed with
the URL (``?token=...``, or the X-Lab-Token header) and a Host naming this server; anything
else gets 403, so neither another local user's browser tab nor a rebound DNS name gets in.
"""
from __future__ import annotations

import hmac
import json
import re
import secrets
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

from . import compare, presets, report as lab_report
from .runs import RunConflict, RunManager

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
REPORT_FILES = {".png": "image/png", ".md": "text/markdown; charset=utf-8",
                ".json": "application/json", ".txt": "text/plain; charset=utf-8"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a report folder or file name, no paths
MAX_BODY = 65536


class LabServer(ThreadingHTTPServer):
    """Serves one RunManager's page to whoever holds the token."""
    daemon_threads = True  # a browser's open connection never holds up shutdown

    def __init__(self, reports: Path, port: int = 0, token: Optional[str] = None) -> None:
        self.manager = RunManager(reports)  # ReportDirError here, before anything listens
        self.token = token or secrets.token_urlsafe(24)
        super().__init__(("127.0.0.1", port), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/?token={self.token}"

    def serve_in_thread(self) -> threading.Thread:
        # NOTE: a short poll interval so shutdown() returns in 0.1 s, not serve_forever's 0.5 s.
        thread = threading.Thread(target=self.serve_forever, kwargs=dict(poll_interval=0.1),
                                  name="adambridge-lab", daemon=True)
        thread.start()
        return thread

    def shutdown_all(self) -> None:
        self.manager.close()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: LabServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the page polls twice a second; a line per request would bury the URL

    # ------------------------------------------------------------------ replies

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload, default=str).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, dict(error=message))

    # ------------------------------------------------------------------ the gate

    def _allowed(self) -> bool:
        query = parse_qs(urlsplit(self.path).query)
        given = self.headers.get("X-Lab-Token") or (query.get("token") or [""])[0]
        port = self.server.server_address[1]
        host_ok = self.headers.get("Host") in (f"127.0.0.1:{port}", f"localhost:{port}")
        return host_ok and hmac.compare_digest(given.encode(), self.server.token.encode())

    def _route(self, method: str) -> None:
        if not self._allowed():
            self._error(HTTPStatus.FORBIDDEN, "forbidden: open the URL that python -m adambridge "
                                              "lab printed (it carries the token)")
            return
        path = urlsplit(self.path).path
        try:
            if method == "GET":
                self._get(path)
            else:
                self._post(path)
        except BrokenPipeError:
            pass  # the browser went away mid-reply

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    # ------------------------------------------------------------------ GET

    def _get(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        if not parts:
            html = (STATIC / "index.html").read_text().replace("__TOKEN__", self.server.token)
            return self._send(HTTPStatus.OK, html.encode(), "text/html; charset=utf-8")
        if len(parts) == 1 and parts[0] in STATIC_FILES:
            return self._send(HTTPStatus.OK, (STATIC / parts[0]).read_bytes(), STATIC_FILES[parts[0]])
        if parts == ["api", "presets"]:
            return self._json(HTTPStatus.OK, dict(presets=presets.describe(), options={
                k: o.help for k, o in presets.OPTIONS.items()}))
        if parts == ["api", "status"]:
            return self._json(HTTPStatus.OK, self.server.manager.status())
        if parts == ["api", "reports"]:
            return self._json(HTTPStatus.OK, dict(reports=lab_report.list_reports(self.server.manager.reports)))
        if len(parts) == 3 and parts[:2] == ["api", "reports"]:
            return self._report(parts[2])
        if len(parts) == 4 and parts[:2] == ["api", "compare"]:
            return self._compare(parts[2], parts[3])
        if len(parts) == 3 and parts[0] == "reports":
            return self._report_file(parts[1], parts[2])
        self._error(HTTPStatus.NOT_FOUND, f"no such page: {path}")

    def _folder(self, name: str) -> Optional[Path]:
        folder = self.server.manager.reports / name
        return folder if _NAME.match(name) and folder.is_dir() else None

    def _read(self, name: str) -> dict:
        """The report named ``name``, its name set; ValueError when there is none."""
        folder = self._folder(name)
        if folder is None:
            raise ValueError(f"no report named {name!r}")
        report = lab_report.read_report(folder)
        report["name"] = name
        return report

    def _report(self, name: str) -> None:
        try:
            report = self._read(name)
        except ValueError as exc:
            return self._error(HTTPStatus.NOT_FOUND, str(exc))
        folder = self.server.manager.reports / name
        report["files"] = sorted(p.name for p in folder.iterdir()
                                 if p.suffix in REPORT_FILES and _NAME.match(p.name))
        self._json(HTTPStatus.OK, report)

    def _report_file(self, name: str, file: str) -> None:
        folder = self._folder(name)
        kind = REPORT_FILES.get(Path(file).suffix.lower())
        if folder is None or kind is None or not _NAME.match(file) or not (folder / file).is_file():
            return self._error(HTTPStatus.NOT_FOUND, f"no file {file!r} in report {name!r}")
        self._send(HTTPStatus.OK, (folder / file).read_bytes(), kind)

    def _compare(self, a: str, b: str) -> None:
        """Report B against report A: the facts that differ and, per section, B - A."""
        try:
            reports = self._read(a), self._read(b)
        except ValueError as exc:
            return self._error(HTTPStatus.NOT_FOUND, str(exc))
        self._json(HTTPStatus.OK, compare.compare_reports(*reports))

    # ------------------------------------------------------------------ POST

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError(f"request body over {MAX_BODY} bytes")
        data = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(data, dict):
            raise ValueError("the request body must be a JSON object")
        return data

    def _post(self, path: str) -> None:
        manager = self.server.manager
        try:
            if path == "/api/runs":
                body = self._body()
                options = body.get("options") or {}
                if not isinstance(options, dict):
                    raise ValueError("options must be a JSON object")
                status = manager.start(str(body.get("preset", "")), options)
                return self._json(HTTPStatus.ACCEPTED, status)
            if path == "/api/runs/cancel":
                return self._json(HTTPStatus.OK, manager.cancel())
        except (ValueError, presets.PresetError) as exc:  # bad JSON, unknown preset, bad option
            return self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except RunConflict as exc:
            return self._error(HTTPStatus.CONFLICT, str(exc))
        except lab_report.ReportDirError as exc:
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc))
        self._error(HTTPStatus.NOT_FOUND, f"no such action: {path}")
