"""Compiling csrc_torch/ (the step plan's metadata pass) against the installed torch.

The kernel (build.py) is plain C and never sees torch; this second, optional library reads
torch's tensor metadata through its C++ API, so it is built with a C++ compiler against the
headers that ship inside the installed torch wheel, with torch's own libstdc++ ABI setting.
Its cache key adds torch's version and location and Python's, so a new torch builds a new
library. It is published, verified and loaded by the same cache as the kernel (cache.py,
trusted.py), under its own key directory.

A machine without a C++ compiler or torch headers simply has no such library: the step plan
then does its checks in Python, with the same results (sync/step_plan.py).

Standard library and torch only; importing this module compiles nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from . import build
from .build import Compiler, NativeBuildError, Plan, Unit

CSRC_TORCH = Path(__file__).resolve().parent.parent / "csrc_torch"
SOURCE = "plan_checks.cpp"
LIB_NAME = "libadambridge_torch" + (".dylib" if sys.platform == "darwin" else ".so")
CXX_CANDIDATES = (("c++",), ("g++",), ("clang++",))  # after $ADAMBRIDGE_CXX
CXX_COMPILE = ("-O2", "-fPIC", "-std=c++20",  # torch builds its extensions as C++20
               "-fvisibility=hidden", "-fno-lto", "-w")


def _torch_dirs() -> tuple[Path, Path]:
    import torch
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def find_cxx(until: Optional[float] = None) -> Compiler:
    """$ADAMBRIDGE_CXX, else c++, g++, clang++: the first that answers --version."""
    env = os.environ.get("ADAMBRIDGE_CXX", "").strip()
    candidates = [tuple(shlex.split(env))] if env else []
    candidates += list(CXX_CANDIDATES)
    tried = []
    for argv in candidates:
        compiler, why = build._identify(argv, until)
        if compiler is not None and not compiler.msvc:
            return compiler
        tried.append(f"{' '.join(argv)}: {why or 'MSVC is not supported'}")
    raise NativeBuildError("adambridge found no C++ compiler for its torch metadata pass (tried "
                           + "; ".join(tried) + "); install g++ or set ADAMBRIDGE_CXX.")


def _flags(include: Optional[Path] = None) -> tuple[str, ...]:
    """Compile flags against torch's headers in include (default: the installed torch's)."""
    import torch
    include = include or _torch_dirs()[0]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return (*CXX_COMPILE, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{sysconfig.get_paths()['include']}",
            f"-I{include}")


def _link_flags(platform: str = sys.platform, lib: Optional[Path] = None) -> tuple[str, ...]:
    """Link flags on platform against torch's libraries in lib (default: the installed torch's).

    The Python C API stays undefined here: the interpreter that loads the library has it.
    NOTE: macOS's linker refuses undefined symbols unless told they come at load time.
    """
    lib = lib or _torch_dirs()[1]
    lookup = ("-undefined", "dynamic_lookup") if platform == "darwin" else ()
    return ("-shared", *lookup, f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}")


def plan(until: Optional[float] = None) -> Plan:
    """The Plan of the torch-facts library for this torch, Python and compiler (cache.build's
    ``planner``); NativeBuildError when it cannot be built here."""
    import torch
    if sys.platform == "win32":
        raise NativeBuildError("adambridge's torch metadata pass is not built on Windows")
    include, _ = _torch_dirs()
    if not (include / "torch" / "csrc" / "autograd" / "python_variable.h").is_file():
        raise NativeBuildError(f"torch's C++ headers are not under {include}")
    compiler = find_cxx(until)
    unit = Unit(SOURCE, _flags())
    digest = hashlib.sha256((CSRC_TORCH / SOURCE).read_bytes())
    for logic in ("build.py", "cache.py", "torch_build.py"):
        digest.update(Path(__file__).with_name(logic).read_bytes())
    digest.update(json.dumps({
        "unit": [unit.source, unit.flags], "link": _link_flags(), "torch": torch.__version__,
        "torch_dir": str(include), "python": sys.version, "compiler": [compiler.argv, compiler.identity],
        "machine": build.machine(), "platform": sys.platform,
    }, sort_keys=True).encode())
    return Plan(CSRC_TORCH, compiler, (), (unit,), (), digest.hexdigest()[:32], LIB_NAME, compile_into)


def compile_into(plan: Plan, out_dir: Path, until: Optional[float] = None) -> dict:
    """Compile and link plan's one C++ unit into out_dir/plan.lib_name; the report for build.json."""
    until = build.deadline() if until is None else until
    (unit,) = plan.common_units
    lib = out_dir / plan.lib_name
    argv = [*plan.compiler.argv, *unit.flags, str(plan.src_dir / unit.source), "-o", str(lib),
            *_link_flags()]
    done = build._run_compiler(plan.compiler, argv, out_dir, until, f"compiling {unit.source}")
    if done.returncode != 0 or not lib.is_file():
        raise NativeBuildError(f"adambridge could not build its torch metadata pass: "
                               f"{plan.compiler.describe()} exited with status {done.returncode}: "
                               f"{build._tail(done.stderr + done.stdout, 3, 600)}")
    return {"dropped": {}, "flags": {unit.source: list(unit.flags)}}
