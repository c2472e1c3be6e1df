"""The README's Quickstart as a newcomer and CI read it: the tested torch for CPU and for CUDA
installed first, and exactly one line that installs and runs the tests (the one .ci/run runs)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    return README[start:README.index("\n## ", start + 1)]


def _tested_torch() -> str:
    version, = re.findall(r"pip install --quiet torch==(\S+)", CI)
    assert f"Tested with torch {version}." in README
    return version


def test_readme_quickstart_installs_the_tested_torch_for_cpu_and_for_cuda():
    quick, version = _section("Quickstart"), _tested_torch()
    cpu = f"pip install torch=={version} --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in quick
    cuda = re.findall(rf"pip install torch=={re.escape(version)} --index-url "
                      rf"https://download.pytorch.org/whl/cu\d+", quick)
    assert len(cuda) == 1
    # torch comes first: adambridge's own install must find it there and keep it
    demo = quick.index('\npip install ".[demo]" && python -m adambridge demo')
    assert quick.index(cpu) < demo and quick.index(cuda[0]) < demo


def test_readme_has_one_test_line_and_ci_installs_torch_before_running_it():
    lines = [line for line in README.splitlines() if re.match(r"^pip install .*pytest", line)]
    assert lines == ['pip install -e ".[test]" && python -m pytest -q']
    assert lines[0] in _section("Quickstart")
    install = CI.index(f"pip install --quiet torch=={_tested_torch()}")
    assert install < CI.index("grep -m1 -E '^pip install .*pytest' README.md")
