"""docs/async.md's StepStats table names every field of StepStats, and only those, so a
field added to adambridge/stats.py (or renamed there) fails here until the page says it."""
from __future__ import annotations

import dataclasses
import re

from _readme import ROOT

from adambridge import StepStats

PAGE = ROOT / "docs" / "async.md"
HEADER = "| field | meaning |"


def table_fields(text: str) -> list:
    """The `names` in the first cell of each row of the table under HEADER, in order."""
    rows = []
    for line in text[text.index(HEADER):].splitlines()[2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append(line)
    return [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]


def test_async_page_tables_every_step_stats_field():
    tabled = table_fields(PAGE.read_text(encoding="utf-8"))
    fields = [f.name for f in dataclasses.fields(StepStats)]
    assert sorted(tabled) == sorted(fields), (
        f"docs/async.md's StepStats table lacks {sorted(set(fields) - set(tabled))} and names "
        f"{sorted(set(tabled) - set(fields))}, which StepStats does not have")
    assert len(tabled) == len(set(tabled)), "a field is in the table twice"


def test_table_fields_reads_the_first_cell_of_each_row_up_to_the_table_end():
    page = (f"text\n\n{HEADER}\n|---|---|\n| `a`, `b` | two, not `c` |\n| `d` | one |\n\n"
            "| `e` | after the table |\n")
    assert table_fields(page) == ["a", "b", "d"]
