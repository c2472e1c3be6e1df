"""adambridge-lab's server without a browser: the token gate, bad input, one real quick run,
a cancel that kills the whole run, and a report folder that cannot be written."""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from adambridge.lab import report as lab_report
from adambridge.lab.server import LabServer


@pytest.fixture
def lab(tmp_path):
    server = LabServer(tmp_path / "reports")
    server.serve_in_thread()
    yield server
    server.shutdown_all()


def call(server, path, body=None, token=None, headers=None):
    """(status, parsed JSON or raw bytes) of one request; the server's token unless told otherwise."""
    sep = "&" if "?" in path else "?"
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    if token is not False:
        url += f"{sep}token={server.token if token is None else token}"
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers=headers or {},
                                     method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            status, raw, kind = reply.status, reply.read(), reply.headers["Content-Type"]
    except urllib.error.HTTPError as err:
        status, raw, kind = err.code, err.read(), err.headers["Content-Type"]
    return status, json.loads(raw) if kind == "application/json" else raw


def wait_until_done(server, timeout=300):  # quick: 40 s to 4 minutes on a shared 2-vCPU VM
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = call(server, "/api/status")[1]["run"]
        if not status["running"]:
            return status
        time.sleep(0.2)
    raise AssertionError(f"the run did not finish in {timeout} s: {status}")


def test_server_binds_loopback_and_puts_the_token_in_the_url(lab):
    assert lab.server_address[0] == "127.0.0.1"
    assert lab.url.endswith(f"/?token={lab.token}") and len(lab.token) >= 24
    status, page = call(lab, "/")
    assert status == 200 and f"app.js?token={lab.token}".encode() in page
    assert call(lab, "/app.js")[0] == 200 and call(lab, "/style.css")[0] == 200


@pytest.mark.parametrize("path", ["/", "/app.js", "/api/status", "/api/presets", "/api/reports",
                                  "/api/reports/x", "/reports/x/plot.png"])
def test_server_refuses_every_request_without_the_right_token(lab, path):
    for token in (False, "", "wrong", lab.token[:-1]):
        status, body = call(lab, path, token=token)
        assert status == 403 and "token" in body["error"], (path, token)
    assert call(lab, path, token=False, headers={"X-Lab-Token": "wrong"})[0] == 403
    assert call(lab, "/api/runs", body={"preset": "quick"}, token="wrong")[0] == 403


def test_server_accepts_the_token_as_a_header_and_refuses_a_foreign_host(lab):
    assert call(lab, "/api/status", token=False, headers={"X-Lab-Token": lab.token})[0] == 200
    # a DNS name rebound to 127.0.0.1 sends its own Host: refused even with the token
    assert call(lab, "/api/status", headers={"Host": f"evil.example:{lab.server_address[1]}"})[0] == 403


@pytest.mark.parametrize("body, message", [
    ({"preset": "nope"}, r"Unknown preset 'nope': choose one of quick, kernels"),
    ({}, r"Unknown preset ''"),
    ({"preset": "quick", "options": {"sizes": "lots"}}, r"Invalid option sizes: 'lots'"),
    ({"preset": "quick", "options": {"threads": 0}}, r"Invalid option threads: 0 \(at least 1\)"),
    ({"preset": "quick", "options": {"colour": "red"}}, r"Unknown option\(s\) colour"),
    ({"preset": "tests", "options": {"tests": "--co tests"}}, r"Invalid option tests"),
    ({"preset": "quick", "options": ["threads"]}, r"options must be a JSON object"),
    (b"{not json", r"Expecting property name"),
], ids=["unknown preset", "no preset", "bad sizes", "zero threads", "unknown option",
        "pytest flag", "options not an object", "not json"])
def test_server_bad_input_is_a_400_with_its_message_and_starts_nothing(lab, body, message):
    import re
    status, reply = call(lab, "/api/runs", body=body)
    assert status == 400 and re.search(message, reply["error"]), reply
    assert call(lab, "/api/status")[1] == {"run": None}
    assert not any(lab.manager.reports.iterdir())


def test_server_unknown_paths_and_files_are_404(lab):
    assert call(lab, "/nope")[0] == 404
    assert call(lab, "/api/reports/nope")[0] == 404
    assert call(lab, "/reports/..%2F..%2Fetc/passwd")[0] == 404
    assert call(lab, "/api/runs/cancel", body={})[0] == 409  # nothing to cancel


def test_server_quick_run_finishes_and_its_report_has_tables_and_plots(lab):
    status, started = call(lab, "/api/runs", body={"preset": "quick"})
    assert status == 202 and started["run"]["preset"] == "quick" and started["run"]["running"]
    status, again = call(lab, "/api/runs", body={"preset": "quick"})
    assert status == 409 and "a run is in progress" in again["error"]
    done = wait_until_done(lab)
    assert done["state"] == "complete" and done["fraction"] == 1.0 and done["exit_code"] == 0
    assert "adambridge lab: phase 2/2: demo" in done["log_tail"]
    # past every phase, with a closing message rather than the last phase's last step
    assert done["phase"] is None and done["phase_index"] == 2
    assert re.fullmatch(r"2 of 2 phases ran in \d+ s", done["message"]), done["message"]
    reports = call(lab, "/api/reports")[1]["reports"]
    assert [r["name"] for r in reports] == [done["name"]] and reports[0]["status"] == "complete"
    report = call(lab, f"/api/reports/{done['name']}")[1]
    assert report["format"] == lab_report.FORMAT and report["isa"]["backend"]
    assert report["machine"]["cpus"] >= 1 and report["threads"]["torch"] >= 1
    kernels, demo = report["sections"]
    assert (kernels["name"], demo["name"]) == ("kernels", "demo")
    assert kernels["conclusion"].startswith("at 1M, native fp32 / bf16 / fp8 moments: ")
    assert demo["conclusion"].startswith("against AdamW, fp32 weights: ")
    assert {row[0] for row in kernels["rows"]} == {"256K", "1M"}
    native = [row for row in kernels["rows"] if row[1] == "native fp32 moments"]
    assert len(native) == 2 and all(float(row[3]) > 0 for row in native)  # GB/s
    if "DeepSpeed CPU Adam (fp32 update)" not in {n for m in kernels["figures"] for n in m["medians_s"]}:
        ds = [row for row in kernels["rows"] if row[1].startswith("DeepSpeed")]
        assert len(ds) == 2 and ds[0][2] in ("not installed", "not measured")
    for plot in kernels["plots"] + demo["plots"]:
        status, png = call(lab, f"/reports/{done['name']}/{plot}")
        assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n"
    status, md = call(lab, f"/reports/{done['name']}/report.md")
    assert status == 200 and b"| 1M | native fp32 moments |" in md


MACHINE = dict(machine=dict(cpu="cpu", cpus=2), versions=dict(adambridge="0", torch="t", python="3"),
               isa=dict(backend="native"), threads=dict(native=2, torch=2), facts={})


def _write(root, name, ms, gbs, threads=2):
    folder = root / name
    folder.mkdir(parents=True)
    rows = [["1M", "native fp32 moments", ms, gbs, "2.00x"], ["1M", "all-CPU torch", "2.00", "10.0", "1.00x"]]
    section = lab_report.Section("kernels", "Host AdamW kernels",
                                 columns=["size", "variant", "ms", "GB/s", "vs all-CPU torch"], rows=rows)
    lab_report.write_report(folder, preset="kernels", title="T", sections=[section], status="complete",
                            machine=dict(MACHINE, threads=dict(native=threads, torch=2)))


def test_server_compare_gives_b_minus_a_for_each_numeric_cell(lab):
    root = lab.manager.reports
    _write(root, "20260101-000000-kernels", "1.00", "20.0", threads=1)
    _write(root, "20260102-000000-kernels", "0.80", "25.0")
    status, diff = call(lab, "/api/compare/20260101-000000-kernels/20260102-000000-kernels")
    assert status == 200 and (diff["a"], diff["b"]) == ("20260101-000000-kernels", "20260102-000000-kernels")
    assert diff["facts"] == [["threads", "1 native, 2 torch", "2 native, 2 torch"]]
    kernels, = diff["sections"]
    assert kernels["columns"] == ["size", "variant", "ms: B - A", "GB/s: B - A", "vs all-CPU torch: B - A"]
    assert kernels["rows"] == [["1M", "native fp32 moments", "-0.20 (0.80x)", "+5.0 (1.25x)", "+0.00 (1.00x)"],
                               ["1M", "all-CPU torch", "+0.00 (1.00x)", "+0.0 (1.00x)", "+0.00 (1.00x)"]]
    status, reply = call(lab, "/api/compare/20260101-000000-kernels/nope")
    assert status == 404 and reply["error"] == "no report named 'nope'"
    assert call(lab, "/api/compare/..%2F..%2Fetc/20260101-000000-kernels")[0] == 404
    assert call(lab, "/api/compare/20260101-000000-kernels/x", token="wrong")[0] == 403


SLOW_TEST = """
    import os, time
    def test_waits():
        with open(os.environ["LAB_MARKER"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)  # stands for a long benchmark; the lab must kill it
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has been killed; its reaper is not ours


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see the kill")
def test_server_cancel_kills_the_run_and_its_children_and_keeps_a_report(lab, tmp_path, monkeypatch):
    test_file = tmp_path / "test_slow_lab_target.py"
    test_file.write_text(textwrap.dedent(SLOW_TEST))
    marker = tmp_path / "pytest-pid"
    monkeypatch.setenv("LAB_MARKER", str(marker))
    status, _ = call(lab, "/api/runs", body={"preset": "tests", "options": {"tests": str(test_file)}})
    assert status == 202
    deadline = time.monotonic() + 180  # pytest starting under load
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, call(lab, "/api/status")[1]
        time.sleep(0.1)
    pytest_pid = int(marker.read_text())
    status, cancelled = call(lab, "/api/runs/cancel", body={})
    assert status == 200 and cancelled["run"]["state"] == "cancelled" and not cancelled["run"]["running"]
    deadline = time.monotonic() + 10
    while not _gone(pytest_pid):
        assert time.monotonic() < deadline, "the run's pytest survived the cancel"
        time.sleep(0.1)
    name = cancelled["run"]["name"]
    report = call(lab, f"/api/reports/{name}")[1]
    assert report["status"] == "cancelled"
    assert call(lab, "/api/runs/cancel", body={})[0] == 409


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="kills the run's process group (POSIX only)")
def test_server_a_run_that_dies_is_failed_in_status_and_history(lab):
    status, started = call(lab, "/api/runs", body={"preset": "quick"})
    assert status == 202
    os.killpg(lab.manager._run.proc.pid, 9)  # an out-of-memory kill, say: not our cancel
    lab.manager._run.proc.wait()
    run = call(lab, "/api/status")[1]["run"]
    assert run["state"] == "failed" and "exited with status -9" in run["message"]
    listed = call(lab, "/api/reports")[1]["reports"]
    assert [(r["name"], r["status"]) for r in listed] == [(run["name"], "failed")]
    report = call(lab, f"/api/reports/{run['name']}")[1]
    assert "log.txt" in report["files"] and "report.md" in report["files"]


def test_server_reports_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(lab_report.ReportDirError, match="cannot write reports to .*a-file"):
        LabServer(blocker / "reports")
    # writable at start, then replaced by a file: the start fails with the reason, nothing runs
    server = LabServer(tmp_path / "reports")
    server.serve_in_thread()
    try:
        os.rmdir(tmp_path / "reports")
        (tmp_path / "reports").write_text("")
        status, reply = call(server, "/api/runs", body={"preset": "quick"})
        assert status == 500 and "cannot write reports to" in reply["error"]
        assert call(server, "/api/status")[1] == {"run": None}
        assert call(server, "/api/reports")[1] == {"reports": []}
    finally:
        server.shutdown_all()
