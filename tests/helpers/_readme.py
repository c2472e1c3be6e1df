"""The README's examples (and those of a docs/ page), for the tests that run them."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def example(after: str, path=README) -> str:
    """The first ```python block of ``path`` (README.md; a relative path is taken from the
    repository's root, e.g. "docs/async.md") that follows the text ``after``.
    tests/project/test_doc_examples.py finds these calls to know which blocks a test runs."""
    path = Path(path)
    text = (path if path.is_absolute() else ROOT / path).read_text(encoding="utf-8")
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start:text.index("```", start)]
