"""Build both native libraries for another system with build.py's and torch_build.py's own code.

    python scripts/cross_build.py ZIG_TARGET SYS_PLATFORM OUT_DIR [TORCH_ROOT]

ZIG_TARGET is a zig target (aarch64-macos, x86_64-macos), SYS_PLATFORM the sys.platform of
that system (darwin). The kernel is planned and built by build.make_plan and
build.compile_into exactly as there (per-ISA units of that architecture, the bf16 probe, the
AB_NO_* defines, that system's link flags), with the compiler ``python -m ziglang cc -target
ZIG_TARGET``. With TORCH_ROOT (the torch folder of that system's wheel) the metadata library
is built too, by torch_build.compile_into, against that wheel's headers and libraries. Any
compiler or linker output (a warning) is a failure. Used by scripts/cross_check.sh.
"""
from __future__ import annotations

import sys
from pathlib import Path

from adambridge._native import build, torch_build

ARCH = {"aarch64": "aarch64", "x86_64": "x86_64"}
SUFFIX = {"darwin": ".dylib", "win32": ".dll"}


def zig(target: str, tool: str, cwd: Path) -> build.Compiler:
    argv = (sys.executable, "-m", "ziglang", tool, "-target", target)
    banner = build._run([*argv, "--version"], cwd=cwd).stdout
    return build.Compiler(argv, banner)


def _quiet_runs() -> list:
    """Every compiler call's output, collected: a build that prints anything has a warning."""
    said = []
    real = build._run

    def run(argv, cwd=None, timeout=None):
        done = real(argv, cwd, timeout)
        if (done.stdout + done.stderr).strip():
            said.append(f"{' '.join(map(str, argv[-3:]))}: {(done.stdout + done.stderr).strip()}")
        return done
    build._run = run
    return said


def main(target: str, platform: str, out: Path, torch_root: Path | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    arch = ARCH[target.split("-")[0]]
    # The target system's facts, as build.py reads them there.
    build.machine = lambda: arch
    build.LIB_NAME = "libadambridge" + SUFFIX[platform]
    build.UNIX_LINK = build.unix_link(platform)
    cc, cxx = zig(target, "cc", out), zig(target, "c++", out)
    said = _quiet_runs()
    plan = build.make_plan(compiler=cc)
    report = build.compile_into(plan, out)
    print(f"cross_build: {target} {out / build.LIB_NAME}: {', '.join(sorted(report['flags']))}; "
          f"dropped {report['dropped'] or 'none'}, absent {', '.join(plan.absent_isas) or 'none'}")
    ok = not report["dropped"] and (out / build.LIB_NAME).is_file()
    if torch_root is not None:
        lib_name = "libadambridge_torch" + SUFFIX[platform]
        link_flags = torch_build._link_flags
        torch_build._link_flags = lambda: link_flags(platform, torch_root / "lib")
        unit = build.Unit(torch_build.SOURCE, torch_build._flags(torch_root / "include"))
        plan = build.Plan(torch_build.CSRC_TORCH, cxx, (), (unit,), (), "cross", lib_name,
                          torch_build.compile_into)
        torch_build.compile_into(plan, out)
        print(f"cross_build: {target} {out / lib_name}")
        ok = ok and (out / lib_name).is_file()
    for line in said:
        print(f"cross_build: compiler output (a warning): {line}", file=sys.stderr)
    return 0 if ok and not said else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]),
                  Path(sys.argv[4]) if len(sys.argv) > 4 else None))
