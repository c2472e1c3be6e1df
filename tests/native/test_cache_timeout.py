"""A build never hangs: compiler calls share one bounded time, and temp dirs of killed builds are removed by the next build.

a compiler that never returned blocked the first step for up to 600 s per compiler
tried, and a killed build left its ``.KEY.tmp-*`` directory behind for good.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adambridge._native import build, cache as cachemod
from conftest import NEEDS_PROC, NEEDS_SIGKILL
from test_build import NATIVE_INIT, NATIVE_ONLY, X86, _fresh_memos, cache, mini_src  # noqa: F401

pytestmark = pytest.mark.skipif(os.name == "nt", reason="the fake compilers are POSIX shell scripts")


def _fake_cc(tmp_path: Path, body: str) -> Path:
    """A compiler script: answers --version at once, then runs body (it records its pid)."""
    script = tmp_path / "hanging-cc"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = --version ]; then echo "hanging-cc 1.0"; exit 0; fi
        echo $$ >> {tmp_path / "pids"}
        {body}
        """))
    script.chmod(0o755)
    return script


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie waits only for a parent that may never reap it


def _temps(root: Path) -> list:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)


@NEEDS_PROC
def test_build_compiler_that_never_returns_is_killed_after_the_timeout(mini_src, cache, tmp_path, monkeypatch):
    # `sleep` as a child, not exec'd: it holds the output pipe after sh is killed, as cc1 would.
    body = f"sleep 1000 & echo $! >> {tmp_path / 'pids'}; wait; echo never"
    monkeypatch.setenv("ADAMBRIDGE_CC", str(_fake_cc(tmp_path, body)))
    monkeypatch.setenv("ADAMBRIDGE_BUILD_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(build.NativeBuildError) as caught:
        cachemod.build(mini_src, cache)
    assert time.monotonic() - start < 15
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(rf"compiling main\.c with hanging-cc 1\.0 \({re.escape(str(tmp_path))}/hanging-cc\) did not "
                     rf"finish within the 1 s that ADAMBRIDGE_BUILD_TIMEOUT allows.*python -m adambridge info\.$",
                     message)
    assert _temps(cache) == []  # this build's own temp dir is removed on the way out
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "the compiler or its child was left running"


@pytest.mark.skipif(not X86, reason="the ISA file of this test is x86")
def test_build_timeout_bounds_all_compiler_calls_together(mini_src, cache, tmp_path, monkeypatch):
    # Each call sleeps 0.4 s and then really compiles: alone well under the 1.2 s limit, but the
    # probe, the ISA file, main.c and the link run one after another and pass it together.
    real = " ".join(build.find_compiler().argv)
    (mini_src / "kernel_avx512.c").write_text("int mini_avx512;\n")
    monkeypatch.setenv("ADAMBRIDGE_CC", str(_fake_cc(tmp_path, f'sleep 0.4; exec {real} "$@"')))
    monkeypatch.setenv("ADAMBRIDGE_BUILD_TIMEOUT", "1.2")
    with pytest.raises(build.NativeBuildError, match=r"did not finish within the 1\.2 s"):
        cachemod.build(mini_src, cache)
    monkeypatch.setenv("ADAMBRIDGE_BUILD_TIMEOUT", "60")
    assert cachemod.build(mini_src, cache).fresh  # the same compiler, given the time, builds


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_build_timeout_env_rejects_a_bad_value(monkeypatch, value):
    monkeypatch.setenv("ADAMBRIDGE_BUILD_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"^Invalid ADAMBRIDGE_BUILD_TIMEOUT: '{value}' \(a number of seconds > 0\)$"):
        build.build_timeout()


_BUILD_AND_HANG = NATIVE_ONLY + "native.cache.build(sys.argv[2], sys.argv[3])\n"


@NEEDS_SIGKILL
def test_build_removes_temp_dirs_of_killed_builds_only(mini_src, cache, tmp_path):
    # A build killed with SIGKILL mid-compile leaves its temp dir ...
    env = dict(os.environ, ADAMBRIDGE_CC=str(_fake_cc(tmp_path, "exec sleep 1000")), ADAMBRIDGE_BUILD_TIMEOUT="300")
    victim = subprocess.Popen([sys.executable, "-c", _BUILD_AND_HANG, NATIVE_INIT, str(mini_src), str(cache)], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    for pid in (tmp_path / "pids").read_text().split():
        os.kill(int(pid), signal.SIGKILL)  # its compiler, in a session of its own, lives on
    killed = _temps(cache)
    assert len(killed) == 1 and re.match(rf"\.[0-9a-f]{{32}}\.tmp-.+-{victim.pid}-", killed[0])
    # ... beside a live build's, one from another host (its pid means nothing here), and two
    # from before pids were in the name: one old, one recent.
    key = "0" * 32
    with subprocess.Popen(["sleep", "60"]) as live_build:
        live = cache / f".{key}.tmp-{cachemod._host()}-{live_build.pid}-abc123"
        other_host = cache / f".{key}.tmp-otherhost-{victim.pid}-def456"
        old, recent = cache / f".{key}.tmp-k2j4_x9q", cache / f".{key}.tmp-p0o9i8u7"
        for path in (live, other_host, old, recent):
            path.mkdir()
        hours_ago = time.time() - 2 * cachemod.STALE_AFTER
        os.utime(old, (hours_ago, hours_ago))
        cachemod.build(mini_src, cache)  # the next build, with the real compiler
        live_build.kill()
    assert _temps(cache) == sorted([live.name, other_host.name, recent.name])
