"""Peak host RAM of checkpoints: a save or a load adds at most the largest parameter's state beyond torch.optim.AdamW.

Each phase runs in a fresh process, measured as benchmarks/bench_checkpoint.py measures it
(VmHWM reset right before the phase; a load ends with the state resident), on 4 bf16
``Linear(2048, 2048)`` layers: 16.8M parameters, 201 MB of fp32 state, the largest parameter
a quarter of it. Before the moments were saved once, a load added 17 B/param (fp32 moments)
and 11 B/param (fp8): 4 and 7 times this bound. ``SLACK`` absorbs what does not grow with
the model (glibc's and the kernel's huge-page bookkeeping), measured here at up to 9 MiB.
"""
from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint.py"
WIDTH, LAYERS = 2048, 4
SLACK = 12 << 20
PRECISIONS = ("fp32", "fp8")
PHASES = (("torch", "save"), ("torch", "load"), ("mmap", "load"))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="needs Linux: VmHWM and /proc/self/clear_refs")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    bench = _bench()
    base = dict(width=WIDTH, layers=LAYERS, dir=str(tmp_path_factory.mktemp("peaks")),
                threads=1)
    optimizers = PRECISIONS + ("adamw",)
    with ThreadPoolExecutor(3) as pool:  # saves first: the loads read their files
        saves = {o: pool.submit(bench.measure, dict(base, path="torch", optimizer=o,
                                                    phase="save")) for o in optimizers}
        results = {("torch", "save", o): f.result() for o, f in saves.items()}
        loads = {(path, "load", o): pool.submit(bench.measure, dict(
            base, path=path, optimizer=o, phase="load")) for path in ("torch", "mmap")
            for o in optimizers}
        results.update({key: f.result() for key, f in loads.items()})
    files = {o: Path(bench._file(dict(base, path="torch", optimizer=o))).stat().st_size
             for o in optimizers}
    return results, files


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("path,phase", PHASES, ids=[f"{p} {f}" for p, f in PHASES])
def test_checkpoint_peak_is_within_one_parameter_of_adamw(peaks, path, phase, precision):
    from adambridge.update.state import HOST_BYTES_PER_PARAM
    results, _ = peaks
    ours, adamw = results[path, phase, precision], results[path, phase, "adamw"]
    assert "error" not in ours and "error" not in adamw, (ours, adamw)
    largest = HOST_BYTES_PER_PARAM[precision] * WIDTH * WIDTH
    assert ours["extra"] <= adamw["extra"] + largest + SLACK, (
        f"{path} {phase} {precision}: {ours['extra'] / 2**20:.1f} MiB beyond the steady "
        f"state, AdamW {adamw['extra'] / 2**20:.1f} MiB, one parameter {largest / 2**20:.1f} MiB")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_mmap_load_leaves_no_pages_of_the_file_mapped(peaks, precision):
    # Each piece read from the mapping is handed back (MADV_PAGEOUT, widened to whole
    # large folios): what stays mapped after the load is a piece or two, not a parameter.
    ours = peaks[0]["mmap", "load", precision]
    assert ours["mapped"] <= 16 << 20, f"{ours['mapped'] / 2**20:.1f} MiB left mapped"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_file_holds_the_state_once(peaks, precision):
    from adambridge.update.state import HOST_BYTES_PER_PARAM
    _, files = peaks
    state = HOST_BYTES_PER_PARAM[precision] * WIDTH * WIDTH * LAYERS
    assert state <= files[precision] <= state + (64 << 10)
