"""The wheel: pure Python (py3-none-any), carrying the C and C++ sources built on first use."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _wheel_names(tmp_path) -> set:
    """The files of a wheel built from the tracked files alone (a checkout's build/ folder
    keeps modules since deleted, which setuptools would put in the wheel)."""
    source = tmp_path / "source"
    for name in _tracked(""):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((REPO / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    wheels = list(tmp_path.glob("adambridge-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl")
    return set(zipfile.ZipFile(wheels[0]).namelist())


def _tracked(under: str) -> list:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", under or "."],
                         check=True, capture_output=True, text=True).stdout
    return [name for name in out.split("\0") if name and (REPO / name).is_file()]


def test_wheel_is_pure_python_and_carries_the_c_sources(tmp_path):
    names = _wheel_names(tmp_path)
    sources = {f"adambridge/csrc/{p.name}" for p in (REPO / "adambridge" / "csrc").iterdir()
               if p.suffix in (".c", ".h")}
    assert sources and sources <= names
    assert "adambridge/csrc_torch/plan_checks.cpp" in names  # the step plan's metadata pass
    assert "adambridge/_native/build.py" in names
    assert not any(n.endswith((".so", ".dll", ".dylib")) for n in names)


def test_wheel_carries_every_module_of_the_package(tmp_path):
    # pyproject.toml lists the packages by name: a new folder left off the list installs
    # without its modules (adambridge.checkpoint once did), which an editable install hides.
    modules = {name for name in _tracked("adambridge") if name.endswith(".py")}
    names = _wheel_names(tmp_path)
    assert modules and sorted(modules - names) == []
    assert sorted(n for n in names if n.endswith(".py") and n not in modules) == []
