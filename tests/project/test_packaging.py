"""The wheel: pure Python (py3-none-any), carrying the C and C++ sources built on first use."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_is_pure_python_and_carries_the_c_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheels = list(tmp_path.glob("adambridge-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    sources = {f"adambridge/csrc/{p.name}" for p in (REPO / "adambridge" / "csrc").iterdir()
               if p.suffix in (".c", ".h")}
    assert sources and sources <= names
    assert "adambridge/csrc_torch/plan_checks.cpp" in names  # the step plan's metadata pass
    assert "adambridge/_native/build.py" in names
    assert not any(n.endswith((".so", ".dll", ".dylib")) for n in names)
