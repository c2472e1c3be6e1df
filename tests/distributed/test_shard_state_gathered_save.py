"""shard_state's opt.save_gathered(f): torch.save(opt.state_dict())'s file, on 2 gloo ranks.

One launch (``ranks`` below) trains, saves with save_gathered (rank 0 writes), saves the
gathered state_dict() beside it, meets the refusals (a file on both ranks, on none, a write
that fails on the writer) and resumes from the file; the resume must equal the
uninterrupted run bit for bit. The parameters are test_shard_state_dcp's: ranges that split
rows, and one parameter smaller than a block (one rank's range of it is empty). This
process compares the file with the gathered state_dict(), loads it into an unsharded
AdamBridge, and measures a save's peak host RAM on each rank.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint",
                    reason="torch.distributed is not built into this torch")
import torch.distributed as dist  # noqa: E402

import _distributed_workers as workers  # noqa: E402
from test_shard_state_dcp import (OPTIONS, PRECISIONS, SAVED_AT, STEPS, _end_of,  # noqa: E402
                                  _equal_states, _train, make_params)

# --------------------------------------------------------------------------- the ranks


def _refusals(opt, rank: int, out_dir: str) -> dict:
    """The error each way of calling save_gathered wrongly gives on this rank."""
    found = {}
    calls = {
        "two_writers": os.path.join(out_dir, f"both-{rank}.pt"),
        "no_writer": None,
        "failed_write": os.path.join(out_dir, "missing", "f.pt") if rank == 0 else None,
    }
    for name, f in calls.items():
        try:
            opt.save_gathered(f)
            found[name] = None
        except (ValueError, RuntimeError, OSError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _resume(precision: str, values: list, path: str) -> dict:
    from adambridge import AdamBridge
    params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = AdamBridge(params, precision=precision, shard_state=True, **OPTIONS)
    opt.load_state_dict(torch.load(path, weights_only=True))
    _train(opt, params, range(SAVED_AT, STEPS))
    return _end_of(opt, params)


def ranks(rank: int, world: int, out_dir: str) -> dict:
    from adambridge import AdamBridge
    out = {}
    for precision in PRECISIONS:
        params = make_params(0)
        opt = AdamBridge(params, precision=precision, shard_state=True, **OPTIONS)
        _train(opt, params, range(SAVED_AT))
        path = os.path.join(out_dir, f"{precision}.pt")
        if precision == "fp32":
            out["refusals"] = _refusals(opt, rank, out_dir)
        opt.save_gathered(path if rank == 0 else None)
        gathered = opt.state_dict()
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, f"{precision}-state_dict.pt"))
        values = [p.detach().clone() for p in params]
        if rank == 0:  # an fp32 parameter is its own master: a load keeps its values
            torch.save(values, os.path.join(out_dir, f"{precision}-params.pt"))
        _train(opt, params, range(SAVED_AT, STEPS))
        out[precision, "uninterrupted"] = _end_of(opt, params)
        dist.barrier()  # the file is written
        out[precision, "resumed"] = _resume(precision, values, path)
    return out


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shard_state_gathered")
    return workers.launch("test_shard_state_gathered_save:ranks", 2, folder), folder


@pytest.mark.parametrize("precision", PRECISIONS)
def test_save_gathered_resumes_bit_for_bit(launched, precision):
    for result in launched[0]:
        resumed, expected = result[precision, "resumed"], result[precision, "uninterrupted"]
        for i, (p, q) in enumerate(zip(resumed["params"], expected["params"], strict=True)):
            assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
        _equal_states(resumed["state"], expected["state"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_save_gathered_file_is_the_gathered_state_dict(launched, precision):
    _, folder = launched
    saved = torch.load(folder / f"{precision}.pt", weights_only=True)
    expected = torch.load(folder / f"{precision}-state_dict.pt", weights_only=True)
    assert saved.keys() == expected.keys()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["adambridge"] == expected["adambridge"]
    _equal_states(saved["state"], expected["state"])
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert value.shape == expected["state"][index][key].shape, (index, key)
            if key not in ("step", "ab_step"):  # a gathered piece: a storage of its bytes
                assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_save_gathered_file_loads_into_an_unsharded_adambridge(launched, precision):
    from adambridge import AdamBridge
    _, folder = launched
    expected = torch.load(folder / f"{precision}-state_dict.pt", weights_only=True)
    values = torch.load(folder / f"{precision}-params.pt", weights_only=True)
    opt = AdamBridge([torch.nn.Parameter(v) for v in values], precision=precision, **OPTIONS)
    opt.load_state_dict(torch.load(folder / f"{precision}.pt", weights_only=True))
    _equal_states(opt.state_dict()["state"], expected["state"])


REFUSALS = [
    dict(desc="a file on both ranks", call="two_writers", ranks=(0, 1),
         match=r"^ValueError: save_gathered\(f\): 2 ranks passed a file \(ranks \[0, 1\]\); "
               r"pass f on exactly one rank and None on the others$"),
    dict(desc="a file on no rank", call="no_writer", ranks=(0, 1),
         match=r"^ValueError: save_gathered\(f\): 0 ranks passed a file"),
    dict(desc="the writer's write fails: its own error", call="failed_write", ranks=(0,),
         match=r"missing"),
    dict(desc="the writer's write fails: the other rank stops with it", call="failed_write",
         ranks=(1,), match=r"^ValueError: save_gathered\(\) failed to write the file on another "
                           r"rank .*this rank stops with it$"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c["desc"] for c in REFUSALS])
def test_save_gathered_refusal_is_one_line_on_every_rank(launched, case):
    import re
    for rank in case["ranks"]:
        error = launched[0][rank]["refusals"][case["call"]]
        assert error is not None and "\n" not in error, error
        assert re.search(case["match"], error), error


def test_save_gathered_without_shard_state_is_one_line():
    from adambridge import AdamBridge
    opt = AdamBridge(make_params(0), **OPTIONS)
    with pytest.raises(ValueError, match=r"^save_gathered\(\) needs AdamBridge\(\.\.\., "
                                         r"shard_state=True\).*save\(opt\.state_dict\(\), f\)$"):
        opt.save_gathered("unused.pt")


# --------------------------------------------------------------------------- memory

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint.py"
WIDTH, LAYERS = 2049, 4  # 16.8M bf16 parameters, each layer a quarter; ranges split rows
SLACK = 12 << 20  # as tests/checkpoint/test_checkpoint_memory.py: what does not grow


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="needs Linux: VmHWM and /proc/self/clear_refs")
@pytest.mark.parametrize("precision", ("fp32", "fp8"))
def test_save_gathered_adds_at_most_one_parameters_state_on_every_rank(tmp_path, precision):
    # torch.save(opt.state_dict()) holds the whole state on every rank (12 B/param of fp32).
    from adambridge.update.state import HOST_BYTES_PER_PARAM
    spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    largest = HOST_BYTES_PER_PARAM[precision] * WIDTH * WIDTH
    ours = bench.measure(dict(width=WIDTH, layers=LAYERS, dir=str(tmp_path), threads=1,
                              path="shard_state_gathered", optimizer=precision, phase="save"))
    assert "error" not in ours, ours
    assert ours["extra"] <= largest + SLACK, (
        f"{ours['extra'] / 2**20:.1f} MiB beyond the steady state on a rank, one "
        f"parameter's state {largest / 2**20:.1f} MiB")
