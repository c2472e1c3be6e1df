"""The folders from which tests import each other by name (a helper, another area's test
module, conftest's marks): tests/conftest.py puts them on sys.path for the tests, and a test
that runs Python in a subprocess puts them there for its script."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
_NOT_CODE = ("data", "__pycache__")


def folders() -> list:
    """tests/ itself, tests/helpers, then every area folder, as strings."""
    areas = sorted(p for p in TESTS.iterdir()
                   if p.is_dir() and p.name not in _NOT_CODE and p.name != "helpers"
                   and not p.name.startswith("."))
    return [str(TESTS), str(TESTS / "helpers")] + [str(p) for p in areas]
