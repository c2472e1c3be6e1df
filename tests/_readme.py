"""The README's examples (and those of a docs/ page), for the tests that run them."""
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def example(after: str, path: Path = README) -> str:
    """The first ```python block of ``path`` (README.md) that follows the text ``after``."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start:text.index("```", start)]
