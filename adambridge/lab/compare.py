"""Two lab reports compared: for each section both have, each numeric cell of B minus A's,
and B / A where a ratio means something; rows matched by their labels, not their order.

Works on the tables as reports show them (the strings of ``Section.rows``), so every
producer's section compares the same way, old reports included. A is the earlier report.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence

# A number as the tables write it: a sign, digits (with thousands commas), a unit, then
# perhaps a verdict word ("-0.0001 tie", "+2 MiB", "95.0%", "1.84x", "5.0973").
_CELL = re.compile(r"^(?P<sign>[+-]?)(?P<digits>\d[\d,]*(?:\.(?P<fraction>\d+))?)\s*"
                   r"(?P<unit>%|x|ms|s|B|KiB|MiB|GiB|GB/s)?(?:\s+(?P<word>[A-Za-z][A-Za-z ]*))?$")
ONLY_IN = "only in {}"
NOTE = ("B - A: each number of B minus A's (pp: percentage points); B/A in brackets where "
        "both are positive amounts, not for signed differences or percentages; "
        "a → b where a label or a verdict changed. Rows are matched by their labels.")


@dataclasses.dataclass(frozen=True)
class Number:
    """One table cell read as a number."""
    value: float
    unit: str
    signed: bool    # written with a sign: a difference itself, whose ratio means nothing
    decimals: int
    word: str       # a verdict after the number ("tie", "worse"), or ""


def parse_cell(text: Any) -> Optional[Number]:
    """The number a cell shows, or None for a label, a dash or an empty cell."""
    match = _CELL.match(str(text).strip())
    if match is None:
        return None
    value = float(match["digits"].replace(",", ""))
    return Number(value=-value if match["sign"] == "-" else value, unit=match["unit"] or "",
                  signed=bool(match["sign"]), decimals=len(match["fraction"] or ""),
                  word=(match["word"] or "").strip())


def difference(a: Any, b: Any) -> str:
    """One cell of the difference table: B - A (B/A) for two numbers in the same unit."""
    x, y = parse_cell(a), parse_cell(b)
    if x is None or y is None or x.unit != y.unit:
        return str(a) if str(a) == str(b) else f"{a or '-'} → {b or '-'}"
    unit = {"%": " pp", "x": ""}.get(x.unit, f" {x.unit}" if x.unit else "")
    text = f"{y.value - x.value:+.{max(x.decimals, y.decimals)}f}{unit}"
    if x.value > 0 and y.value >= 0 and not (x.signed or y.signed) and x.unit != "%":
        text += f" ({y.value / x.value:.2f}x)"
    if x.word != y.word:
        text += f" ({x.word or '-'} → {y.word or '-'})"
    return text


def _numeric_columns(columns: Sequence[str], *tables: Sequence[Sequence[Any]]) -> set:
    """The columns where any row of either table holds a number."""
    return {name for i, name in enumerate(columns)
            if any(i < len(row) and parse_cell(row[i]) is not None for rows in tables for row in rows)}


def _keys(rows: Sequence[Sequence[Any]], width: int) -> list:
    """Each row's label: its first ``width`` cells, and which occurrence of them it is."""
    seen: dict = {}
    keys = []
    for row in rows:
        label = tuple(str(c) for c in row[:width])
        keys.append(label + (seen.get(label, 0),))
        seen[label] = seen.get(label, 0) + 1
    return keys


def _key_width(columns: Sequence[str], numeric: set, a_rows: list, b_rows: list) -> int:
    """The fewest leading label columns that tell every row of both tables apart (all of the
    leading label columns, the occurrence deciding the rest, when none does)."""
    leading = 0  # and at least one column left to compare
    while leading < len(columns) - 1 and columns[leading] not in numeric:
        leading += 1
    for width in range(1, leading + 1):
        if all(len({tuple(map(str, r[:width])) for r in rows}) == len(rows) for rows in (a_rows, b_rows)):
            return width
    return leading


def _aligned(columns: Sequence[str], source_columns: Sequence[str], row: Sequence[Any]) -> list:
    """``row`` (laid out as ``source_columns``) with one cell per name of ``columns``."""
    at = {name: i for i, name in enumerate(source_columns)}
    return [row[at[name]] if at.get(name, len(row)) < len(row) else "" for name in columns]


def compare_section(a: Mapping, b: Mapping) -> dict:
    """The difference table of one section that both reports have (``Section.to_dict()``s)."""
    columns = [c for c in a.get("columns", []) if c in b.get("columns", [])]
    notes = [f"column {c!r} only in {side}" for side, s, other in (("A", a, b), ("B", b, a))
             for c in s.get("columns", []) if c not in other.get("columns", [])]
    if a.get("status") != b.get("status"):
        notes.insert(0, f"status {a.get('status')} in A, {b.get('status')} in B")
    if not columns:
        return dict(name=a["name"], title=a.get("title", a["name"]), columns=[], rows=[],
                    notes=notes + ["no column in common"])
    a_rows = [_aligned(columns, a["columns"], r) for r in a.get("rows", [])]
    b_rows = [_aligned(columns, b["columns"], r) for r in b.get("rows", [])]
    numeric = _numeric_columns(columns, a_rows, b_rows)
    width = _key_width(columns, numeric, a_rows, b_rows)
    by_key = dict(zip(_keys(b_rows, width), b_rows))
    rows = []
    for key, row in zip(_keys(a_rows, width), a_rows):
        other = by_key.pop(key, None)
        rows.append(row[:width] + ([difference(x, y) for x, y in zip(row[width:], other[width:])]
                                   if other is not None else _only(columns, width, "A")))
    rows += [row[:width] + _only(columns, width, "B") for row in by_key.values()]
    heads = [c if i < width or c not in numeric else f"{c}: B - A" for i, c in enumerate(columns)]
    return dict(name=a["name"], title=a.get("title", a["name"]), columns=heads, rows=rows,
                notes=notes)


def _only(columns: Sequence[str], width: int, side: str) -> list:
    return [ONLY_IN.format(side)] + [""] * (len(columns) - width - 1)


def facts(report: Mapping) -> dict:
    """What a report ran on, as the page's fact table names it."""
    machine, isa, threads = (report.get(k) or {} for k in ("machine", "isa", "threads"))
    versions = report.get("versions") or {}
    options = report.get("options") or {}
    return {"cpu": f"{machine.get('cpu')} ({machine.get('cpus')} CPUs)",
            "backend": str(isa.get("backend", "?")), "isa": str(isa.get("isa active", "-")),
            "threads": f"{threads.get('native')} native, {threads.get('torch')} torch",
            "versions": f"adambridge {versions.get('adambridge')}, torch {versions.get('torch')}",
            "preset": str(report.get("preset")), "status": str(report.get("status")),
            "options": "  ".join(f"{k}={v}" for k, v in sorted(options.items()) if v is not None)}


def compare_reports(a: Mapping, b: Mapping) -> dict:
    """B against A: the facts that differ, then a difference table per section both have."""
    fa, fb = facts(a), facts(b)
    b_sections = {s["name"]: s for s in b.get("sections", [])}
    a_names = [s["name"] for s in a.get("sections", [])]
    both = [(s, b_sections[s["name"]]) for s in a.get("sections", []) if s["name"] in b_sections]
    sections = [compare_section(x, y) for x, y in both if x.get("columns") and y.get("columns")]
    notes = [f"section {name!r} only in {side}" for side, names, other in
             (("A", a_names, b_sections), ("B", list(b_sections), a_names))
             for name in names if name not in other]
    notes += [f"section {x['name']!r} has no table in {'A' if not x.get('columns') else 'B'}"
              for x, y in both if not (x.get("columns") and y.get("columns"))]
    return dict(a=a.get("name"), b=b.get("name"), note=NOTE,
                facts=[[k, fa[k], fb[k]] for k in fa if fa[k] != fb[k]],
                sections=sections, notes=notes)
