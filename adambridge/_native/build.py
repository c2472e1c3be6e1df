"""Compiling csrc/ into one shared library: compiler discovery, per-ISA flags, the cache key, time limits.

Each ISA source is compiled with its own flags (no global -march=native), then everything is
linked into one library. The key hashes the sources, the flags, the compiler's identity, the
machine and the ABI version, so a change to any of them builds a new library beside the old
one. Where that library lives, and how it is published and verified, is cache.py's business.

ISA files that fail to compile (an old compiler) are dropped, not fatal: the other sources get
``-DAB_NO_<ISA>`` so dispatch.c leaves that ISA out of its table, and the build records why.

Every compiler call runs in its own process group under one deadline per build
(``ADAMBRIDGE_BUILD_TIMEOUT`` seconds, default 120): a compiler that never returns is killed
with everything it started, and the build fails with one line naming it.

Standard library only; importing this module compiles nothing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

log = logging.getLogger("adambridge.build")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
HEADER = "adambridge.h"
IS_WINDOWS = sys.platform == "win32"
LIB_NAME = "libadambridge" + (".dll" if IS_WINDOWS else ".dylib" if sys.platform == "darwin" else ".so")
MANIFEST = "build.json"
INFO_HINT = "run python -m adambridge info"

# Flags for gcc, clang and zig cc. -ffp-contract=off: no fused multiply-add, so the C kernel
# rounds once per operation exactly like the torch twin (docs/numerics.md).
UNIX_COMPILE = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-fvisibility=hidden",
                "-fno-lto", "-pthread", "-std=c11")


def unix_link(platform: str = sys.platform) -> tuple[str, ...]:
    """Link flags for gcc, clang and zig cc on platform (a sys.platform value). On Linux an
    undefined symbol (a source missing from csrc/) fails the link, not the first dlopen; the
    macOS and Windows linkers refuse one by default."""
    return ("-shared", "-pthread", "-lm") + (("-Wl,-z,defs",) if platform.startswith("linux") else ())


UNIX_LINK = unix_link()
# MSVC: /fp:precise does not contract a*b+c into an FMA unless /fp:contract is given.
MSVC_COMPILE = ("/nologo", "/O2", "/fp:precise", "/std:c11", "/experimental:c11atomics")
MSVC_LINK = ("/nologo", "/LD")
DEFAULT_BUILD_TIMEOUT = 120.0   # seconds for all compiler calls of one build together
VERSION_TIMEOUT = 10.0          # seconds for one `--version`: a compiler answers it at once


@dataclass(frozen=True)
class IsaSource:
    """One optional ISA file: where it may be built and the flags it is built with."""
    isa: str
    source: str
    arch: str                  # "x86_64" or "aarch64"
    unix_flags: tuple[str, ...]
    msvc_flags: tuple[str, ...]
    probe_flags: tuple[str, ...] = ()   # added when the compiler accepts them (see _probe)
    probe_define: str = ""


ISA_SOURCES = (
    IsaSource("avx2", "kernel_avx2.c", "x86_64", ("-mavx2", "-mfma", "-mf16c"), ("/arch:AVX2",)),
    IsaSource("avx512", "kernel_avx512.c", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512vl"),
              ("/arch:AVX512",), probe_flags=("-mavx512bf16",), probe_define="-DAB_HAVE_AVX512BF16"),
    IsaSource("neon", "kernel_neon.c", "aarch64", (), ()),
)
ISA_BY_SOURCE = {s.source: s for s in ISA_SOURCES}

_AVX512BF16_PROBE = """#include <immintrin.h>
__m512bh ab_probe(__m512 a, __m512 b) { return _mm512_cvtne2ps_pbh(a, b); }
"""


class NativeBuildError(RuntimeError):
    """The native library could not be built or loaded; the message says why and what to do."""


class NoCompilerError(NativeBuildError):
    """No working C compiler was found."""


@dataclass(frozen=True)
class Compiler:
    argv: tuple[str, ...]      # the command, e.g. ("gcc",) or (python, "-m", "ziglang", "cc")
    identity: str              # its version banner, part of the cache key
    msvc: bool = False

    def describe(self) -> str:
        first = self.identity.splitlines()[0] if self.identity else "unknown version"
        return f"{first} ({' '.join(self.argv)})"


@dataclass(frozen=True)
class Unit:
    """One translation unit: a source file and its flags."""
    source: str
    flags: tuple[str, ...]
    isa: Optional[str] = None  # the optional ISA it carries, None for common files


@dataclass(frozen=True)
class Plan:
    """What will be compiled, and the key that names the result."""
    src_dir: Path
    compiler: Compiler
    isa_units: tuple[Unit, ...]
    common_units: tuple[Unit, ...]
    absent_isas: tuple[str, ...]  # not built here: other architecture, or no source file
    key: str
    lib_name: str = LIB_NAME   # the file the build leaves in its key directory
    # How to compile and link it (plan, out_dir, until) -> report; None: compile_into. The
    # torch-facts library (torch_build.py) brings its own, and shares the rest of the cache.
    compile: Optional[Callable] = field(default=None, compare=False)


@dataclass(frozen=True)
class Built:
    """A library ready to load, and how it came to be."""
    path: Path
    key: str
    compiler: Compiler
    dropped: dict = field(default_factory=dict, hash=False)  # isa -> why its file failed to compile
    private: bool = False      # built outside the cache (see cache._private_build)
    fresh: bool = False        # compiled by this call (a load failure then is not a stale file)


# -- small helpers -------------------------------------------------------------------------------

_warned: set = set()


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def machine() -> str:
    """The CPU architecture in the names ISA_SOURCES uses."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def abi_version(src_dir: Optional[Path] = None) -> int:
    text = (Path(src_dir if src_dir is not None else CSRC) / HEADER).read_text()
    found = re.search(r"^#define\s+AB_ABI_VERSION\s+(\d+)", text, re.M)
    if not found:
        raise NativeBuildError(f"{HEADER} defines no AB_ABI_VERSION; the csrc/ sources are incomplete, "
                               f"reinstall adambridge; {INFO_HINT}.")
    return int(found.group(1))


def cache_root() -> Path:
    env = os.environ.get("ADAMBRIDGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "adambridge"


def _tail(text: str, lines: int = 8, chars: int = 1500) -> str:
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " / ".join(kept)[-chars:] or "(no output)"


def build_timeout() -> float:
    """ADAMBRIDGE_BUILD_TIMEOUT in seconds (default 120); ValueError for a bad value."""
    value = os.environ.get("ADAMBRIDGE_BUILD_TIMEOUT", "").strip()
    try:
        seconds = float(value) if value else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):  # also refuses nan
        raise ValueError(f"Invalid ADAMBRIDGE_BUILD_TIMEOUT: {value!r} (a number of seconds > 0)")
    return seconds


def deadline() -> float:
    """The time.monotonic() by which a build that starts now must be done."""
    return time.monotonic() + build_timeout()


def _run(argv: list, cwd: Optional[Path] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """argv's output; on subprocess.TimeoutExpired (or Ctrl-C) it is killed with all it started.

    NOTE: its own session, so one killpg reaches cc1, as and ld too; killing the direct child
    alone leaves them holding the output pipes, and reading those would block.
    """
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=not IS_WINDOWS)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        if IS_WINDOWS:
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass  # already gone
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()


def _run_compiler(compiler: Compiler, argv: list, cwd: Path, until: float, what: str) -> subprocess.CompletedProcess:
    """_run for a build step; NativeBuildError in one line when the build's deadline passes."""
    try:
        return _run(argv, cwd, timeout=max(0.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise NativeBuildError(
            f"adambridge could not build its native kernel: {what} with {compiler.describe()} did "
            f"not finish within the {build_timeout():g} s that ADAMBRIDGE_BUILD_TIMEOUT allows a "
            f"build, so it was killed. To fix it, check that {compiler.argv[0]} is a working C "
            f"compiler (or set ADAMBRIDGE_CC to one), or raise ADAMBRIDGE_BUILD_TIMEOUT; "
            f"{INFO_HINT}.") from None


# -- compiler discovery --------------------------------------------------------------------------

def _have_ziglang() -> bool:
    return importlib.util.find_spec("ziglang") is not None


def _candidates() -> Iterator[tuple[str, tuple[str, ...]]]:
    """(label, argv) in the documented order: $ADAMBRIDGE_CC, cc, gcc, clang, zig cc, cl."""
    env = os.environ.get("ADAMBRIDGE_CC", "").strip()
    if env:
        yield f"ADAMBRIDGE_CC={env}", tuple(shlex.split(env, posix=not IS_WINDOWS))
    for name in ("cc", "gcc", "clang"):
        yield name, (name,)
    if _have_ziglang():
        yield "python -m ziglang cc", (sys.executable, "-m", "ziglang", "cc")
    if IS_WINDOWS:
        yield "cl", ("cl",)


def _identify(argv: tuple[str, ...], until: Optional[float]) -> tuple[Optional[Compiler], str]:
    """A Compiler when argv runs and reports a version (before until), else (None, why not)."""
    exe = argv[0] if argv else ""
    if not exe or (shutil.which(exe) is None and not (os.path.isfile(exe) and os.access(exe, os.X_OK))):
        return None, "not found"
    msvc = Path(exe).name.lower() in ("cl", "cl.exe")
    timeout = VERSION_TIMEOUT if until is None else max(0.0, min(VERSION_TIMEOUT, until - time.monotonic()))
    try:
        done = _run(list(argv) if msvc else [*argv, "--version"], timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"--version did not answer within {timeout:.3g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"does not run ({exc})"
    banner = (done.stdout + done.stderr).strip()
    if msvc and "Microsoft" in banner:
        return Compiler(argv, banner, msvc=True), ""
    if not msvc and done.returncode == 0 and banner:
        return Compiler(argv, banner), ""
    return None, f"--version exited with status {done.returncode}: {_tail(banner, 2)}"


_compilers: dict = {}


def find_compiler(until: Optional[float] = None) -> Compiler:
    """The first working compiler (memoized per ADAMBRIDGE_CC and PATH); NoCompilerError if none.

    Each candidate gets VERSION_TIMEOUT seconds to answer, and all of them end by until.
    """
    memo = (os.environ.get("ADAMBRIDGE_CC", ""), os.environ.get("PATH", ""))
    if memo not in _compilers:
        tried = []
        for label, argv in _candidates():
            compiler, why = _identify(argv, until)
            if compiler is not None:
                _compilers[memo] = compiler
                if tried and memo[0]:  # ADAMBRIDGE_CC was set and did not work
                    _warn_once("cc-env", f"adambridge ignores {tried[0]}; it uses {compiler.describe()}.")
                break
            tried.append(f"{label}: {why}")
        else:
            _compilers[memo] = NoCompilerError(
                "adambridge found no working C compiler (tried " + "; ".join(tried) + "), so the native "
                "kernel cannot be built and the slower torch backend is used. Install gcc or clang "
                "(or pip install ziglang), or set ADAMBRIDGE_CC to a C11 compiler; " + INFO_HINT + ".")
    found = _compilers[memo]
    if isinstance(found, NoCompilerError):
        raise NoCompilerError(str(found))
    return found


# -- the plan and its key ------------------------------------------------------------------------

def make_plan(src_dir: Optional[Path] = None, compiler: Optional[Compiler] = None,
              until: Optional[float] = None) -> Plan:
    src_dir = Path(src_dir) if src_dir is not None else CSRC
    compiler = compiler or find_compiler(until)
    sources = sorted(p.name for p in src_dir.glob("*.c"))
    arch = machine()
    base = MSVC_COMPILE if compiler.msvc else UNIX_COMPILE
    isa_units, absent = [], []
    for spec in ISA_SOURCES:
        if spec.arch != arch or spec.source not in sources:
            absent.append(spec.isa)
            continue
        extra = spec.msvc_flags if compiler.msvc else spec.unix_flags
        isa_units.append(Unit(spec.source, base + extra, spec.isa))
    common = tuple(Unit(s, base) for s in sources if s not in ISA_BY_SOURCE)
    if not common:
        raise NativeBuildError(f"{src_dir} holds no common C sources; the package is incomplete, "
                               f"reinstall adambridge; {INFO_HINT}.")
    digest = hashlib.sha256()
    for p in sorted(src_dir.iterdir()):
        if p.suffix in (".c", ".h"):
            digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for logic in ("build.py", "cache.py"):  # a change to how it is built or published is a new library
        digest.update(Path(__file__).with_name(logic).read_bytes())
    digest.update(json.dumps({
        "units": [[u.source, u.flags] for u in (*isa_units, *common)],
        "probes": [[s.isa, s.probe_flags, s.probe_define] for s in ISA_SOURCES],
        "link": MSVC_LINK if compiler.msvc else UNIX_LINK,
        "compiler": [compiler.argv, compiler.identity],
        "machine": arch, "platform": sys.platform, "abi": abi_version(src_dir),
    }, sort_keys=True).encode())
    return Plan(src_dir, compiler, tuple(isa_units), common, tuple(absent), digest.hexdigest()[:32])


# -- compiling -----------------------------------------------------------------------------------

def _object_name(source: str, compiler: Compiler) -> str:
    return Path(source).stem + (".obj" if compiler.msvc else ".o")


def _compile(plan: Plan, unit: Unit, out_dir: Path, until: float,
             defines: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    c = plan.compiler
    src, obj = plan.src_dir / unit.source, out_dir / _object_name(unit.source, c)
    if c.msvc:
        argv = [*c.argv, *unit.flags, *defines, f"/I{plan.src_dir}", "/c", str(src), f"/Fo{obj}"]
    else:
        argv = [*c.argv, *unit.flags, *defines, f"-I{plan.src_dir}", "-c", str(src), "-o", str(obj)]
    return _run_compiler(c, argv, out_dir, until, f"compiling {unit.source}")


def _probe(plan: Plan, spec: IsaSource, unit: Unit, out_dir: Path, until: float) -> tuple[str, ...]:
    """spec.probe_flags + define when the compiler builds a snippet with them, else ()."""
    if not spec.probe_flags or plan.compiler.msvc:
        return ()
    snippet = out_dir / f"probe_{spec.isa}.c"
    snippet.write_text(_AVX512BF16_PROBE)
    done = _run_compiler(plan.compiler, [*plan.compiler.argv, *unit.flags, *spec.probe_flags, "-c",
                                         str(snippet), "-o", str(out_dir / f"probe_{spec.isa}.o")],
                         out_dir, until, f"probing {' '.join(spec.probe_flags)}")
    return (*spec.probe_flags, spec.probe_define) if done.returncode == 0 else ()


def _compile_isa(plan: Plan, unit: Unit, out_dir: Path, until: float) -> tuple[Unit, tuple[str, ...], str]:
    """Compile one ISA file; returns (unit, the probed extra flags, "" or why it was dropped)."""
    spec = next(s for s in ISA_SOURCES if s.isa == unit.isa)
    extra = _probe(plan, spec, unit, out_dir, until)
    done = _compile(plan, unit, out_dir, until, extra)
    if done.returncode == 0:
        return unit, extra, ""
    return unit, extra, f"{unit.source} did not compile: {_tail(done.stderr + done.stdout, 3, 400)}"


def _failure(what: str, done: subprocess.CompletedProcess, compiler: Compiler,
             remedy: str = "use a newer gcc or clang (set ADAMBRIDGE_CC)") -> NativeBuildError:
    return NativeBuildError(
        f"adambridge could not build its native kernel: {what} with {compiler.describe()} exited with "
        f"status {done.returncode}: {_tail(done.stderr + done.stdout)}. To fix it, {remedy}, or set "
        f"ADAMBRIDGE_DISABLE_NATIVE=1 to use the torch backend; {INFO_HINT}.")


def compile_into(plan: Plan, out_dir: Path, until: Optional[float] = None) -> dict:
    """Compile and link plan into out_dir/LIB_NAME, every call done by until (see deadline()).

    Returns {"dropped": {isa: why its file failed to compile}, "flags": {source: its flags}}.
    """
    until = deadline() if until is None else until
    jobs = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        isa_results = list(pool.map(lambda u: _compile_isa(plan, u, out_dir, until), plan.isa_units))
        dropped = {u.isa: why for u, _, why in isa_results if why}
        flag = "/D" if plan.compiler.msvc else "-D"
        defines = tuple(f"{flag}AB_NO_{isa.upper()}" for isa in sorted({*dropped, *plan.absent_isas}))
        done = list(pool.map(lambda u: (u, _compile(plan, u, out_dir, until, defines)), plan.common_units))
    for unit, result in done:
        if result.returncode != 0:
            raise _failure(f"compiling {unit.source}", result, plan.compiler)
    flags = {u.source: [*u.flags, *extra] for u, extra, why in isa_results if not why}
    flags.update({u.source: [*u.flags, *defines] for u in plan.common_units})
    objects = [str(out_dir / _object_name(source, plan.compiler)) for source in flags]
    lib = out_dir / LIB_NAME
    if plan.compiler.msvc:
        argv = [*plan.compiler.argv, *MSVC_LINK, *objects, f"/Fe{lib}"]
    else:
        argv = [*plan.compiler.argv, *UNIX_LINK[:1], *objects, "-o", str(lib), *UNIX_LINK[1:]]
    linked = _run_compiler(plan.compiler, argv, out_dir, until, "linking")
    if linked.returncode != 0 or not lib.is_file():
        raise _failure("linking", linked, plan.compiler,
                       "reinstall adambridge (an undefined symbol means csrc/ is incomplete)")
    for isa, why in sorted(dropped.items()):
        _warn_once(f"dropped-{isa}", f"adambridge built its native kernel without {isa}: {why}. "
                   f"The other instruction sets work; a newer compiler (ADAMBRIDGE_CC) restores it.")
    return {"dropped": dropped, "flags": flags}
