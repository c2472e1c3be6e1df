"""scripts/mutants.py stays current: each mutant's text occurs exactly once in the file it
mutates, and the tests it names exist (a moved line or file would make its mutant a no-op
that "survives" for the wrong reason)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mutants() -> list:
    spec = importlib.util.spec_from_file_location("adambridge_mutants", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTANTS


def test_every_mutant_text_occurs_once_in_its_file_and_its_tests_exist():
    mutants = _mutants()
    assert mutants
    for name, path, old, new, tests in mutants:
        text = (ROOT / path).read_text(encoding="utf-8")
        assert text.count(old) == 1, f"{name}: its text occurs {text.count(old)} times in {path}"
        assert old != new, name
        for test in tests:  # a test file (tests/x.py::name), or a command (bash scripts/x.sh)
            target = test.split()[1] if test.startswith("bash ") else test.split("::")[0]
            assert (ROOT / target).is_file(), f"{name}: no test file or script {test}"
