"""Build both native libraries for another system with build.py's and torch_build.py's own code.

    python scripts/cross_build.py ZIG_TARGET SYS_PLATFORM OUT_DIR [TORCH_ROOT]

ZIG_TARGET is a zig target (aarch64-macos, x86_64-macos), SYS_PLATFORM the sys.platform of
that system (darwin). The kernel is planned and built by build.make_plan and
build.compile_into exactly as there (per-ISA units of that architecture, the bf16 probe, the
AB_NO_* defines, that system's link flags), with the compiler ``python -m ziglang cc -target
ZIG_TARGET``. With TORCH_ROOT (the torch folder of that system's wheel) the metadata library
is built too, by torch_build.compile_into, against that wheel's headers and libraries, and
on macOS its imports are read back: every torch symbol must be bound to one of the wheel's
libraries (the link found it there), only Python's C API left to load time. Any compiler or
linker output (a warning) is a failure. Used by scripts/cross_check.sh.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

from adambridge._native import build, torch_build

ARCH = {"aarch64": "aarch64", "x86_64": "x86_64"}
SUFFIX = {"darwin": ".dylib", "win32": ".dll"}
# Mach-O (https://github.com/apple-oss-distributions/xnu, EXTERNAL_HEADERS/mach-o/loader.h,
# nlist.h): the load commands that name a dylib, the symbol table's, and the library ordinals
# of an undefined symbol that -undefined dynamic_lookup leaves to load time (ld64 writes
# DYNAMIC_LOOKUP_ORDINAL, zig's linker 0).
MH_MAGIC_64, LC_SYMTAB, LOOKED_UP = 0xFEEDFACF, 0x2, {0x0, 0xFE}
LC_DYLIBS = {0xC, 0x18 | 0x80000000, 0x1F | 0x80000000, 0x20, 0x23 | 0x80000000}
TORCH_LIBS = {"libc10.dylib", "libtorch_cpu.dylib"}


def macho_imports(path: Path) -> dict:
    """{undefined symbol: the dylib it is bound to, or None when looked up at load time}."""
    data = path.read_bytes()
    magic, ncmds = struct.unpack_from("<I", data)[0], struct.unpack_from("<I", data, 16)[0]
    if magic != MH_MAGIC_64:
        raise ValueError(f"{path} is not a 64-bit little-endian Mach-O file")
    at, dylibs, symtab = 32, [], None
    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<II", data, at)
        if cmd in LC_DYLIBS:
            name_at = struct.unpack_from("<I", data, at + 8)[0]
            dylibs.append(data[at + name_at:at + size].split(b"\0", 1)[0].decode())
        elif cmd == LC_SYMTAB:
            symtab = struct.unpack_from("<III", data, at + 8)
        at += size
    symoff, nsyms, stroff = symtab
    imports = {}
    for i in range(nsyms):
        strx, kind, _, desc, _ = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
        if kind & 0x0E == 0 and kind & 0x01:  # N_UNDF and N_EXT: an import
            name = data[stroff + strx:].split(b"\0", 1)[0].decode()
            ordinal = desc >> 8
            imports[name] = (None if ordinal in LOOKED_UP else
                             Path(dylibs[ordinal - 1]).name if 0 < ordinal <= len(dylibs) else "")
    return imports


def check_torch_imports(lib: Path) -> str:
    """What the metadata library binds where; ValueError when a torch symbol was not found
    in the wheel's libraries (left to load time, it would fail only on a Mac)."""
    imports = macho_imports(lib)
    loose = sorted(n for n, where in imports.items() if where is None and not n.startswith(("_Py", "__Py")))
    bound = {where for where in imports.values() if where}
    if loose or not TORCH_LIBS <= bound:
        raise ValueError(f"{lib.name}: not linked against torch's libraries: left to load time "
                         f"{', '.join(loose[:5]) or 'nothing'}; bound to {', '.join(sorted(bound))}")
    python = sum(where is None for where in imports.values())
    torch_bound = sum(where in TORCH_LIBS for where in imports.values())
    return (f"{torch_bound} torch symbols bound to {', '.join(sorted(TORCH_LIBS))}; "
            f"{python} of Python's C API left to load time")


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
        try:
            linked = check_torch_imports(out / lib_name) if platform == "darwin" else "built"
        except ValueError as exc:
            linked, ok = f"FAILED: {exc}", False
        print(f"cross_build: {target} {out / lib_name} against {torch_root}: {linked}")
        ok = ok and (out / lib_name).is_file()
    for line in said:
        print(f"cross_build: compiler output (a warning): {line}", file=sys.stderr)
    return 0 if ok and not said else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]),
                  Path(sys.argv[4]) if len(sys.argv) > 4 else None))
