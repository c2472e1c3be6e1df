"""adambridge/lab/compare.py: the difference table the lab shows above two compared reports
(B - A and B/A per numeric cell, rows matched by their labels), on the tables the lab's
producers write (the kernel and demo sections' cells as they print them)."""
from __future__ import annotations

import pytest

from adambridge.lab import compare

KERNEL_COLUMNS = ["size", "variant", "ms", "GB/s", "vs all-CPU torch"]
DEMO_COLUMNS = ["configuration", "mode", "val loss", "vs reference", "gain kept", "bf16 changed",
                "ms/step", "RSS growth", "state B/param"]


def kernels(*rows, status="ok"):
    return dict(name="kernels", title="Host AdamW kernels", status=status, columns=KERNEL_COLUMNS,
                rows=[list(r) for r in rows])


def report(name, *sections, threads=2):
    return dict(name=name, preset="quick", status="complete", options={"sizes": ["256K"]},
                machine=dict(cpu="EPYC", cpus=2), isa={"backend": "native", "isa active": "avx2"},
                threads=dict(native=threads, torch=2), versions=dict(adambridge="0.1", torch="2.13"),
                sections=list(sections))


@pytest.mark.parametrize("cell, number", [
    ("5.0973", (5.0973, "", False, 4, "")),
    ("-0.0001 tie", (-0.0001, "", True, 4, "tie")),
    ("+0.0098 worse", (0.0098, "", True, 4, "worse")),
    ("+2 MiB", (2.0, "MiB", True, 0, "")),
    ("95.0%", (95.0, "%", False, 1, "")),
    ("15.71x", (15.71, "x", False, 2, "")),
    ("1,234.5 GB/s", (1234.5, "GB/s", False, 1, "")),
    ("-0.0001 noise run", (-0.0001, "", True, 4, "noise run")),
], ids=["plain", "verdict", "worse", "signed unit", "percent", "times", "thousands", "two words"])
def test_parse_cell_reads_the_numbers_the_tables_print(cell, number):
    assert tuple(vars(compare.parse_cell(cell)).values()) == number


@pytest.mark.parametrize("cell", ["", "-", "256K", "native fp32 moments", "3 of 4", "1e-3",
                                  "not installed (pip install bitsandbytes)", "failed: boom"])
def test_parse_cell_leaves_labels_dashes_and_other_text(cell):
    assert compare.parse_cell(cell) is None


@pytest.mark.parametrize("a, b, shown", [
    ("0.50", "0.26", "-0.24 (0.52x)"),                 # a time: difference and ratio
    ("20.6", "28.6", "+8.0 (1.39x)"),                  # GB/s
    ("1.84x", "2.07x", "+0.23 (1.12x)"),               # a speed-up: no 'x' on the difference
    ("5.0973", "5.0972", "-0.0001 (1.00x)"),           # the finer of the two precisions
    ("95.0%", "84.4%", "-10.6 pp"),                    # percentage points, no ratio
    ("+2 MiB", "+5 MiB", "+3 MiB"),                    # signed: a difference has no ratio
    ("-0.0001 tie", "+0.0024 worse", "+0.0025 (tie → worse)"),
    ("0", "3", "+3"),                                  # nothing to divide by
    ("12.00", "12.00", "+0.00 (1.00x)"),
    ("-", "-", "-"), ("sync", "sync", "sync"), ("sync", "async", "sync → async"),
    ("", "3.2", "- → 3.2"), ("2 MiB", "2 GiB", "2 MiB → 2 GiB"),  # no number, or two units
], ids=["ms", "GB/s", "times", "precision", "percent", "signed", "verdict", "zero", "same",
        "dashes", "same label", "label", "missing", "units"])
def test_difference_is_b_minus_a_with_the_ratio_where_it_means_something(a, b, shown):
    assert compare.difference(a, b) == shown


def test_rows_are_matched_by_their_labels_and_rows_of_one_report_say_so():
    a = kernels(["256K", "native fp32 moments", "0.26", "28.6", "1.84x"],
                ["1M", "native fp32 moments", "1.42", "20.6", "15.71x"],
                ["256K", "torch", "0.47", "22.2", "1.00x"])
    b = kernels(["1M", "native fp32 moments", "1.00", "29.2", "20.00x"],   # another order
                ["256K", "native fp32 moments", "0.13", "57.2", "3.62x"],
                ["64M", "native fp32 moments", "40.0", "48.0", "2.50x"])
    table = compare.compare_section(a, b)
    assert table["columns"] == ["size", "variant", "ms: B - A", "GB/s: B - A",
                                "vs all-CPU torch: B - A"]
    assert table["rows"] == [
        ["256K", "native fp32 moments", "-0.13 (0.50x)", "+28.6 (2.00x)", "+1.78 (1.97x)"],
        ["1M", "native fp32 moments", "-0.42 (0.70x)", "+8.6 (1.42x)", "+4.29 (1.27x)"],
        ["256K", "torch", "only in A", "", ""],
        ["64M", "native fp32 moments", "only in B", "", ""]]
    assert table["notes"] == []


def test_the_fewest_leading_labels_that_tell_rows_apart_are_the_key():
    row = ["AdamW, fp32 weights", "sync", "5.0973", "-", "-", "95.0%", "2.2", "+2 MiB", "8.00"]
    a = dict(name="demo", title="Demo", columns=DEMO_COLUMNS, rows=[row])
    b = dict(a, rows=[[row[0], "async", "5.0970", "-", "-", "95.5%", "3.3", "+4 MiB", "8.00"]])
    table = compare.compare_section(a, b)
    # the configuration alone names the row, so a changed mode is compared, not a new row
    assert table["rows"] == [["AdamW, fp32 weights", "sync → async", "-0.0003 (1.00x)", "-", "-",
                              "+0.5 pp", "+1.1 (1.50x)", "+2 MiB", "+0.00 (1.00x)"]]
    assert table["columns"][:3] == ["configuration", "mode", "val loss: B - A"]


def test_repeated_labels_are_matched_in_their_order():
    a = dict(name="t", columns=["name", "ms"], rows=[["x", "1.0"], ["x", "2.0"]])
    b = dict(a, rows=[["x", "1.5"], ["x", "3.0"], ["x", "4.0"]])
    assert compare.compare_section(a, b)["rows"] == [["x", "+0.5 (1.50x)"], ["x", "+1.0 (1.50x)"],
                                                     ["x", "only in B"]]


def test_columns_and_status_of_one_report_only_are_noted():
    a = kernels(["1M", "native", "1.0", "20.0", "2.00x"])
    b = dict(kernels(["1M", "native", "2.0", "10.0", "1.00x"], status="failed"),
             columns=["size", "variant", "ms", "vs all-CPU torch", "spread"])
    b["rows"][0] = ["1M", "native", "2.0", "1.00x", "12%"]
    table = compare.compare_section(a, b)
    assert table["columns"] == ["size", "variant", "ms: B - A", "vs all-CPU torch: B - A"]
    assert table["rows"] == [["1M", "native", "+1.0 (2.00x)", "-1.00 (0.50x)"]]
    assert table["notes"] == ["status ok in A, failed in B", "column 'GB/s' only in A",
                              "column 'spread' only in B"]


def test_compare_reports_gives_the_setup_that_differs_and_every_shared_section():
    demo = dict(name="demo", title="Demo", columns=["configuration", "val loss"],
                rows=[["AdamW", "5.10"]])
    failed = dict(name="step", title="Step", status="failed", columns=[], rows=[])
    a = report("20260101-000000-quick", kernels(["1M", "native", "1.0", "20.0", "2.00x"]), demo,
               failed, threads=1)
    b = report("20260102-000000-quick", kernels(["1M", "native", "0.5", "40.0", "4.00x"]), failed,
               dict(name="plan", title="Plan", columns=["a", "b"], rows=[]))
    diff = compare.compare_reports(a, b)
    assert (diff["a"], diff["b"]) == ("20260101-000000-quick", "20260102-000000-quick")
    assert diff["facts"] == [["threads", "1 native, 2 torch", "2 native, 2 torch"]]
    assert [s["name"] for s in diff["sections"]] == ["kernels"]
    assert diff["sections"][0]["rows"] == [["1M", "native", "-0.5 (0.50x)", "+20.0 (2.00x)",
                                            "+2.00 (2.00x)"]]
    assert diff["notes"] == ["section 'demo' only in A", "section 'plan' only in B",
                             "section 'step' has no table in A"]
    assert "B - A" in diff["note"]


def test_tables_without_a_column_in_common_are_not_compared():
    a = dict(name="t", title="T", columns=["x", "ms"], rows=[["a", "1.0"]])
    b = dict(a, columns=["y", "s"], rows=[["a", "2.0"]])
    assert compare.compare_section(a, b) == dict(
        name="t", title="T", columns=[], rows=[],
        notes=["column 'x' only in A", "column 'ms' only in A", "column 'y' only in B",
               "column 's' only in B", "no column in common"])
