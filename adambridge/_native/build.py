"""Compiling csrc/ into one shared library: compiler discovery, per-ISA flags, the cache, atomic publish.

Each ISA source is compiled with its own flags (no global -march=native), then everything is
linked into ``${ADAMBRIDGE_CACHE_DIR:-~/.cache/adambridge}/<key>/libadambridge.so``. The key
hashes the sources, the flags, the compiler's identity, the machine and the ABI version, so a
change to any of them builds a new library beside the old one. A build happens in a temp dir
inside the cache, under a file lock, and is published with ``os.replace``: N processes that
start at once build once, and nobody ever sees a half-written library.

ISA files that fail to compile (an old compiler) are dropped, not fatal: the other sources get
``-DAB_NO_<ISA>`` so dispatch.c leaves that ISA out of its table, and the build records why.

Standard library only; importing this module compiles nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

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
UNIX_LINK = ("-shared", "-pthread", "-lm")
# Linux: an undefined symbol (a source missing from csrc/) fails the link, not the first dlopen.
if sys.platform.startswith("linux"):
    UNIX_LINK += ("-Wl,-z,defs",)
# MSVC: /fp:precise does not contract a*b+c into an FMA unless /fp:contract is given.
MSVC_COMPILE = ("/nologo", "/O2", "/fp:precise", "/std:c11", "/experimental:c11atomics")
MSVC_LINK = ("/nologo", "/LD")


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


@dataclass(frozen=True)
class Built:
    """A library ready to load, and how it came to be."""
    path: Path
    key: str
    compiler: Compiler
    dropped: dict = field(default_factory=dict, hash=False)  # isa -> why its file failed to compile
    private: bool = False      # built outside the cache (see _insecure_reason)
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


def _run(argv: list, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=600)


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


def _identify(argv: tuple[str, ...]) -> tuple[Optional[Compiler], str]:
    """A Compiler when argv runs and reports a version, else (None, why not)."""
    exe = argv[0] if argv else ""
    if not exe or (shutil.which(exe) is None and not (os.path.isfile(exe) and os.access(exe, os.X_OK))):
        return None, "not found"
    msvc = Path(exe).name.lower() in ("cl", "cl.exe")
    try:
        done = _run(list(argv) if msvc else [*argv, "--version"])
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"does not run ({exc})"
    banner = (done.stdout + done.stderr).strip()
    if msvc and "Microsoft" in banner:
        return Compiler(argv, banner, msvc=True), ""
    if not msvc and done.returncode == 0 and banner:
        return Compiler(argv, banner), ""
    return None, f"--version exited with status {done.returncode}: {_tail(banner, 2)}"


_compilers: dict = {}


def find_compiler() -> Compiler:
    """The first working compiler (memoized per ADAMBRIDGE_CC and PATH); NoCompilerError if none."""
    memo = (os.environ.get("ADAMBRIDGE_CC", ""), os.environ.get("PATH", ""))
    if memo not in _compilers:
        tried = []
        for label, argv in _candidates():
            compiler, why = _identify(argv)
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

def make_plan(src_dir: Optional[Path] = None, compiler: Optional[Compiler] = None) -> Plan:
    src_dir = Path(src_dir) if src_dir is not None else CSRC
    compiler = compiler or find_compiler()
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
    digest.update(Path(__file__).read_bytes())  # a change to this build logic is a new library
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


def _compile(plan: Plan, unit: Unit, out_dir: Path, defines: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    c = plan.compiler
    src, obj = plan.src_dir / unit.source, out_dir / _object_name(unit.source, c)
    if c.msvc:
        argv = [*c.argv, *unit.flags, *defines, f"/I{plan.src_dir}", "/c", str(src), f"/Fo{obj}"]
    else:
        argv = [*c.argv, *unit.flags, *defines, f"-I{plan.src_dir}", "-c", str(src), "-o", str(obj)]
    return _run(argv, cwd=out_dir)


def _probe(plan: Plan, spec: IsaSource, unit: Unit, out_dir: Path) -> tuple[str, ...]:
    """spec.probe_flags + define when the compiler builds a snippet with them, else ()."""
    if not spec.probe_flags or plan.compiler.msvc:
        return ()
    snippet = out_dir / f"probe_{spec.isa}.c"
    snippet.write_text(_AVX512BF16_PROBE)
    done = _run([*plan.compiler.argv, *unit.flags, *spec.probe_flags, "-c", str(snippet),
                 "-o", str(out_dir / f"probe_{spec.isa}.o")], cwd=out_dir)
    return (*spec.probe_flags, spec.probe_define) if done.returncode == 0 else ()


def _compile_isa(plan: Plan, unit: Unit, out_dir: Path) -> tuple[Unit, tuple[str, ...], str]:
    """Compile one ISA file; returns (unit, the probed extra flags, "" or why it was dropped)."""
    spec = next(s for s in ISA_SOURCES if s.isa == unit.isa)
    extra = _probe(plan, spec, unit, out_dir)
    done = _compile(plan, unit, out_dir, extra)
    if done.returncode == 0:
        return unit, extra, ""
    return unit, extra, f"{unit.source} did not compile: {_tail(done.stderr + done.stdout, 3, 400)}"


def _failure(what: str, done: subprocess.CompletedProcess, compiler: Compiler,
             remedy: str = "use a newer gcc or clang (set ADAMBRIDGE_CC)") -> NativeBuildError:
    return NativeBuildError(
        f"adambridge could not build its native kernel: {what} with {compiler.describe()} exited with "
        f"status {done.returncode}: {_tail(done.stderr + done.stdout)}. To fix it, {remedy}, or set "
        f"ADAMBRIDGE_DISABLE_NATIVE=1 to use the torch backend; {INFO_HINT}.")


def compile_into(plan: Plan, out_dir: Path) -> dict:
    """Compile and link plan into out_dir/LIB_NAME.

    Returns {"dropped": {isa: why its file failed to compile}, "flags": {source: its flags}}.
    """
    jobs = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        isa_results = list(pool.map(lambda u: _compile_isa(plan, u, out_dir), plan.isa_units))
        dropped = {u.isa: why for u, _, why in isa_results if why}
        flag = "/D" if plan.compiler.msvc else "-D"
        defines = tuple(f"{flag}AB_NO_{isa.upper()}" for isa in sorted({*dropped, *plan.absent_isas}))
        done = list(pool.map(lambda u: (u, _compile(plan, u, out_dir, defines)), plan.common_units))
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
    linked = _run(argv, cwd=out_dir)
    if linked.returncode != 0 or not lib.is_file():
        raise _failure("linking", linked, plan.compiler,
                       "reinstall adambridge (an undefined symbol means csrc/ is incomplete)")
    for isa, why in sorted(dropped.items()):
        _warn_once(f"dropped-{isa}", f"adambridge built its native kernel without {isa}: {why}. "
                   f"The other instruction sets work; a newer compiler (ADAMBRIDGE_CC) restores it.")
    return {"dropped": dropped, "flags": flags}


# -- the cache -----------------------------------------------------------------------------------

def _insecure_reason(path: Path, follow: bool = True) -> Optional[str]:
    """Why another user could swap what we load from path, or None when it is ours alone."""
    if IS_WINDOWS:  # NOTE: no uid/mode bits; %LOCALAPPDATA% is per-user by default.
        return None
    st = os.stat(path) if follow else os.lstat(path)
    if not follow and stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is group- or world-writable (mode {oct(st.st_mode & 0o777)})"
    return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes, held for the with block (the file stays)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if IS_WINDOWS:
            import msvcrt
            while True:  # LK_LOCK gives up after ~10 s; keep waiting for the builder
                try:
                    msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
    finally:
        os.close(fd)  # closing also releases flock


def _built_from_cache(plan: Plan, keydir: Path) -> Optional[Built]:
    """The published library in keydir, None when it is not there or not safe to load."""
    lib = keydir / LIB_NAME
    if not lib.is_file():
        return None
    reason = _insecure_reason(keydir, follow=False) or _insecure_reason(lib, follow=False)
    if reason:
        return _private_build(plan, reason)
    try:
        dropped = json.loads((keydir / MANIFEST).read_text()).get("dropped", {})
    except (OSError, ValueError):
        dropped = {}
    return Built(lib, plan.key, plan.compiler, dropped)


def _publish(plan: Plan, root: Path) -> None:
    """Build in a temp dir inside root, then move the result into root/<key>/ with os.replace."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{plan.key}.tmp-", dir=root))
    try:
        start = time.perf_counter()
        report = compile_into(plan, tmp)
        (tmp / MANIFEST).write_text(json.dumps({"key": plan.key, "compiler": plan.compiler.describe(),
                                                **report}, indent=1))
        # NOTE: the linker honours the umask (often 002); the cache check rejects group-writable files.
        os.chmod(tmp / LIB_NAME, 0o755)
        os.chmod(tmp / MANIFEST, 0o644)
        keydir = root / plan.key
        keydir.mkdir(mode=0o700, exist_ok=True)
        os.replace(tmp / MANIFEST, keydir / MANIFEST)
        os.replace(tmp / LIB_NAME, keydir / LIB_NAME)  # last: a present library is a complete one
        log.info("adambridge: built %s in %.1f s", keydir / LIB_NAME, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_private: dict = {}


def _private_build(plan: Plan, reason: str, broken: Optional[Path] = None) -> Built:
    """Build into a fresh mkdtemp() dir that only this process uses (once per process)."""
    _warn_once("insecure-cache",
               f"adambridge does not use its build cache because {reason}, so another user could "
               f"replace the library it loads; it builds into a private temporary directory instead, "
               f"once per process. Make the directory yours and not group/world-writable, or set "
               f"ADAMBRIDGE_CACHE_DIR to one that is; {INFO_HINT}.")
    known = _private.get(plan.key)
    if known is None or (broken is not None and known.path == broken):
        out = Path(tempfile.mkdtemp(prefix="adambridge-"))
        atexit.register(shutil.rmtree, out, True)
        dropped = compile_into(plan, out)["dropped"]
        log.info("adambridge: built %s (private)", out / LIB_NAME)
        _private[plan.key] = Built(out / LIB_NAME, plan.key, plan.compiler, dropped, private=True)
    return _private[plan.key]


def _same_file(path: Path, seen: Optional[os.stat_result]) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    return seen is not None and (now.st_ino, now.st_size, now.st_mtime_ns) == \
        (seen.st_ino, seen.st_size, seen.st_mtime_ns)


def build(src_dir: Optional[Path] = None, cache_dir: Optional[Path] = None, *,
          broken: Optional[tuple[Path, os.stat_result]] = None) -> Built:
    """The library for src_dir, from the cache or compiled now (once across processes).

    broken: (path, stat) of a library that failed to load; if the cache still holds that very
    file it is deleted and rebuilt, if another process already replaced it the new one is used.
    """
    plan = make_plan(Path(src_dir) if src_dir is not None else CSRC)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = _insecure_reason(root)
    except OSError as exc:
        reason = f"{root} cannot be created ({exc.strerror})"
    if reason:
        return _private_build(plan, reason, broken[0] if broken else None)
    keydir = root / plan.key
    if broken is None:
        found = _built_from_cache(plan, keydir)  # the fast path: no lock once published
        if found is not None:
            return found
    with _file_lock(root / f"{plan.key}.lock"):
        if broken is not None and _same_file(keydir / LIB_NAME, broken[1]):
            (keydir / LIB_NAME).unlink()
        found = _built_from_cache(plan, keydir)  # another process may have built it meanwhile
        if found is None:
            _publish(plan, root)
            found = dataclasses.replace(_built_from_cache(plan, keydir), fresh=True)
    return found
