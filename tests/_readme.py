"""The README's examples, for the integration tests that run them."""
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def example(after: str) -> str:
    """The first ```python block of README.md that follows the text ``after``."""
    text = README.read_text(encoding="utf-8")
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start:text.index("```", start)]
