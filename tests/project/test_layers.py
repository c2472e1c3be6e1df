"""The package's shape, enforced: import-linter's contracts (.importlinter: the layers, and the
update's math knowing nothing of how steps are driven), and no import circle in adambridge/
or benchmarks/, so the next change that adds one fails here."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")


def _lint(root: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter", reason="needs import-linter (the test extra)")
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", _LINT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_linter_contracts_are_kept():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contracts(tmp_path):
    # The contracts can fail: the update's codecs importing the pipeline is refused.
    shutil.copytree(ROOT / "adambridge", tmp_path / "adambridge",
                    ignore=shutil.ignore_patterns("__pycache__", "csrc*", "lab"))
    shutil.copytree(ROOT / "adambridge" / "lab", tmp_path / "adambridge" / "lab",
                    ignore=shutil.ignore_patterns("__pycache__", "static", "*.html", "*.js"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    codecs = tmp_path / "adambridge" / "update" / "codecs.py"
    codecs.write_text(codecs.read_text() + "\nfrom ..pipeline import hooks  # noqa\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "adambridge.update is not allowed to import adambridge.pipeline" in done.stdout


def _circles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_inside_the_package():
    grimp = pytest.importorskip("grimp", reason="needs import-linter's grimp (the test extra)")
    sys.path.insert(0, str(ROOT))
    try:
        graph = grimp.build_graph("adambridge", cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert _circles(edges) == []


def test_no_import_circle_between_the_benchmarks():
    scripts = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    edges = {}
    for name, path in scripts.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        edges[name] = {m for m in imported if m in scripts and m != name}
    assert _circles(edges) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
