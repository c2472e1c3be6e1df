"""A C compiler for Windows Python under wine: zig cc on the Linux side, reached through files.

No Windows C compiler runs inside wine 8.0 (zig.exe fails on its cache's file locks), and a
Windows process cannot wait on a Linux one. So scripts/windows_check.sh starts this file on
Linux as a server (``serve``), and points ADAMBRIDGE_CC of the Windows Python at this same file
run by that Python (the client). adambridge's Windows build path then runs as it would on
Windows (compiler discovery, the plan and its key, every compile and link call through
subprocess, the cache's lock, publish and verification, the DLL load); only the compiler
itself runs on Linux, as ``zig cc -target x86_64-windows-gnu`` with the Windows paths of its
arguments translated through the wine prefix's drive letters.

    python3 scripts/wine_cc_proxy.py serve QUEUE_DIR WINEPREFIX   (Linux; until QUEUE_DIR/stop)
    python.exe scripts\\wine_cc_proxy.py ARGS...                  (Windows; AB_WINE_CC_QUEUE)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGET = "x86_64-windows-gnu"
WAIT_S = 600.0   # a client gives up after this long (the build's own deadline comes first)
_DRIVE = re.compile(r"(?<![A-Za-z])([A-Za-z]):\\")


def unix_path_of(arg: str, prefix: Path) -> str:
    """arg with a Windows path in it ("-IZ:\\a\\b", "C:\\users\\x.o") in Linux form."""
    found = _DRIVE.search(arg)
    if found is None:
        return arg
    root = os.path.realpath(prefix / "dosdevices" / f"{found.group(1).lower()}:")
    rest = arg[found.end():].replace("\\", "/")
    return arg[:found.start()] + os.path.join(root, rest)


def _answer(request: Path, prefix: Path) -> None:
    asked = json.loads(request.read_text())
    argv = [unix_path_of(a, prefix) for a in asked["argv"]]
    cwd = unix_path_of(asked["cwd"], prefix)
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", TARGET]
    done = subprocess.run(zig + argv, cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    answer = request.with_suffix(".answer")
    temp = answer.with_suffix(".tmp")
    temp.write_text(json.dumps({"rc": done.returncode, "stdout": done.stdout,
                                "stderr": done.stderr}))
    os.replace(temp, answer)
    request.unlink()


def serve(queue: Path, prefix: Path) -> None:
    queue.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    with ThreadPoolExecutor(4) as pool:
        while not (queue / "stop").exists():
            for request in sorted(queue.glob("*.request")):
                if request.name not in taken:
                    taken.add(request.name)
                    pool.submit(_answer, request, prefix)
            time.sleep(0.05)


def client(args: list[str]) -> int:
    queue = Path(os.environ["AB_WINE_CC_QUEUE"])
    name = f"{os.getpid()}-{time.monotonic_ns()}"
    temp = queue / f"{name}.tmp"
    temp.write_text(json.dumps({"argv": args, "cwd": os.getcwd()}))
    os.replace(temp, queue / f"{name}.request")
    answer = queue / f"{name}.answer"
    deadline = time.monotonic() + WAIT_S
    while not answer.exists():
        if time.monotonic() > deadline:
            print(f"wine_cc_proxy: no answer from the Linux side within {WAIT_S:g} s",
                  file=sys.stderr)
            return 124
        time.sleep(0.05)
    done = json.loads(answer.read_text())
    answer.unlink()
    sys.stdout.write(done["stdout"])
    sys.stderr.write(done["stderr"])
    return done["rc"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(client(sys.argv[1:]))
