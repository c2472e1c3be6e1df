"""Every ```python block of README.md and docs/*.md runs in the test suite, so no example a
reader copies can rot: a test claims it (a call of tests/helpers/_readme.py::example, found here by
reading the tests' source, so a test that skips still claims its block), or this file runs
it, each page's unclaimed blocks in order in one fresh interpreter, as a reader would paste
them. A block that is neither claimed nor runnable fails, named by its file and first line;
a fragment that is not meant to run is not ```python. Links between the pages are checked
too: a moved section must not leave a dead #anchor behind."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

from _readme import ROOT, example

TESTS = ROOT / "tests"
FENCE = re.compile(r"^[ \t]*```python[ \t]*\n", re.M)
OPENER = "```python\n"


def _pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _blocks(path: Path) -> list:
    """(first line of the block's code, offset of its code, its code) for each ```python block."""
    text = path.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        start = fence.end()
        code = text[start:text.index("```", start)]
        found.append((text.count("\n", 0, start) + 1, start, code))
    return found


# -- the claims: example(after[, path]) in the tests' source -----------------------------------

def _literal_path(node, where: str) -> Path:
    """The page an example() call's path argument names: README.md when absent, a string taken
    from the repository's root, or ROOT / "docs" / "x.md"."""
    if node is None:
        return ROOT / "README.md"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ROOT / node.value
    parts = []
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)):
            break
        parts.insert(0, node.right.value)
        node = node.left
    if isinstance(node, ast.Name) and node.id == "ROOT" and parts:
        return ROOT.joinpath(*parts)
    raise AssertionError(f"{where}: example()'s path is not a string, ROOT / '...' or absent: "
                         f"write it so that tests/project/test_doc_examples.py can read the claim")


def _parametrized(function, name: str) -> list:
    """The values pytest.mark.parametrize gives the argument ``name`` of ``function``."""
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call)
                and getattr(decorator.func, "attr", "") == "parametrize"):
            continue
        names, values = (ast.literal_eval(arg) for arg in decorator.args[:2])
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            at = names.index(name)
            return [value[at] if len(names) > 1 else value for value in values]
    return []


@lru_cache(maxsize=None)
def _claims() -> tuple:
    """(test file:line, page, anchor text) for every example() call under tests/."""
    claims = []
    for source in sorted(TESTS.rglob("*.py")):
        if source.name in ("_readme.py", Path(__file__).name):
            continue
        tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
        functions = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call)
                    and getattr(call.func, "id", getattr(call.func, "attr", None)) == "example"):
                continue
            where = f"{_name(source)}:{call.lineno}"
            arguments = list(call.args) + [None] * 2
            keywords = {k.arg: k.value for k in call.keywords}
            after, path = keywords.get("after", arguments[0]), keywords.get("path", arguments[1])
            page = _literal_path(path, where)
            if isinstance(after, ast.Constant) and isinstance(after.value, str):
                anchors = [after.value]
            elif isinstance(after, ast.Name):
                around = [f for f in functions if f.lineno <= call.lineno <= f.end_lineno]
                anchors = _parametrized(around[-1], after.id) if around else []
            else:
                anchors = []
            assert anchors, (f"{where}: example()'s anchor is neither a string nor a parametrized "
                             f"argument: write it so that tests/project/test_doc_examples.py can read it")
            claims.extend((where, page, anchor) for anchor in anchors)
    return tuple(claims)


def _claimed_offset(page: Path, anchor: str, where: str) -> int:
    """Where the code of the block that example(anchor, page) returns starts, found as it finds
    it, and checked against it."""
    text = page.read_text(encoding="utf-8")
    assert anchor in text, f"{where}: the anchor {anchor!r} is not in {_name(page)}"
    start = text.index(OPENER, text.index(anchor)) + len(OPENER)
    assert example(anchor, page) == text[start:text.index("```", start)]
    return start


@lru_cache(maxsize=None)
def _claimed() -> dict:
    """{(page, offset): the test file:line that runs it}."""
    return {(page, _claimed_offset(page, anchor, where)): where
            for where, page, anchor in _claims()}


def test_every_claim_names_a_block_that_exists():
    claims = _claims()
    assert len(claims) >= 8  # the README's and the docs' examples that the other tests run
    for (page, offset), where in _claimed().items():
        assert any(start == offset for _, start, _ in _blocks(page)), (where, _name(page))


# -- the unclaimed blocks, run -----------------------------------------------------------------

RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1], encoding="utf-8"))
    names = {"__name__": "__main__"}
    for where, code in blocks:
        try:
            exec(compile(code, where, "exec"), names)
        except BaseException:
            traceback.print_exc()
            print("FAILED " + where, flush=True)
            sys.exit(1)
""")


def run_blocks(blocks: list, workdir: Path, timeout: float = 300) -> None:
    """Run (where, code) blocks in order in one fresh interpreter; fail naming the first that
    raises, or the page when they take longer than ``timeout`` together."""
    listing = workdir / "blocks.json"
    listing.write_text(json.dumps([[w, textwrap.dedent(c)] for w, c in blocks]), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, str(listing)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        places = ", ".join(w for w, _ in blocks)
        raise AssertionError(f"the blocks at {places} took over {timeout} s together: "
                             f"make them faster, or claim them in a test") from None
    failed = re.findall(r"^FAILED (.+)$", done.stdout, re.M)
    assert done.returncode == 0, (f"the ```python block at {failed[0] if failed else blocks[0][0]} "
                                  f"is claimed by no test (tests/helpers/_readme.py::example) and does not "
                                  f"run as it stands: give it what it needs, claim it, or make it "
                                  f"```text\n{done.stderr[-3000:]}")


def _unclaimed(page: Path, claimed: dict) -> list:
    return [(f"{_name(page)}:{line}", code) for line, start, code in _blocks(page)
            if (page, start) not in claimed]


@pytest.mark.parametrize("page", [_name(p) for p in _pages()])
def test_unclaimed_blocks_run_as_they_stand(page, tmp_path):
    blocks = _unclaimed(ROOT / page, _claimed())
    if blocks:
        run_blocks(blocks, tmp_path)


def test_a_fragment_nobody_claims_fails_with_its_place(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nText.\n\n```python\nopt.step()  # a fragment\n```\n",
                    encoding="utf-8")
    blocks = [(f"page.md:{line}", code) for line, _, code in _blocks(page)]
    assert blocks == [("page.md:6", "opt.step()  # a fragment\n")]
    with pytest.raises(AssertionError, match=r"block at page\.md:6 is claimed by no test"):
        run_blocks(blocks, tmp_path)


# -- links between the pages -------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"(?ms)^[ \t]*```.*?^[ \t]*```", "", path.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [_name(p) for p in [*_pages(), ROOT / "benchmarks" / "README.md"]])
def test_links_between_the_pages_resolve(page):
    source = ROOT / page
    for target in LINK.findall(source.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (source.parent / file).resolve() if file else source
        assert linked.exists(), f"{page}: the link {target} names no file"
        if anchor:
            assert anchor in _anchors(linked), f"{page}: the link {target} names no heading"
