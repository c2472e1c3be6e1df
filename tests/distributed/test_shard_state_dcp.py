"""shard_state's opt.sharded_state_dict() through torch.distributed.checkpoint, on 2 gloo ranks.

One launch (``ranks`` below) trains, saves each rank's ranges with DCP and resumes four ways:
``load_state_dict`` after ``dcp.load``, ``dcp.load`` alone (taken in place), on one rank of
a one-rank group from the two-rank checkpoint, and on both ranks from a one-rank group's
checkpoint; each must equal the uninterrupted run bit for bit. The parameters' ranges split
rows ((7, 300), (3, 5, 130)) and one parameter is smaller than a block. This process then
loads the two-rank checkpoint into an unsharded AdamBridge and into torch.optim.AdamW and
compares with what the gathered state_dict() gives; and measures a save's peak host RAM.
"""
from __future__ import annotations

import copy
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint",
                    reason="torch.distributed is not built into this torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import _distributed_workers as workers  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8")
SHAPES = ((7, 300), (1000,), (3, 5, 130), (50,))
DTYPES = (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)  # fp32: p is the master
SAVED_AT, STEPS = 3, 5
OPTIONS = dict(lr=1e-2, weight_decay=0.01, seed=5)
WAYS = ("resumed", "in_place", "two_to_one", "one_to_two")


# --------------------------------------------------------------------------- the ranks


def make_params(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape, dtype in zip(SHAPES, DTYPES)]


def _train(opt, params: list, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)  # the same gradients on every rank
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    for p in params:
        p.grad = None


def zero_lr_step(opt, params: list) -> None:
    """The state a load writes into (as DCP's get_optimizer_state_dict makes it)."""
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _model(params: list) -> dict:
    return {f"p{i}": p.detach() for i, p in enumerate(params)}


def _end_of(opt, params: list) -> dict:
    return {"params": [p.detach().clone() for p in params], "state": opt.state_dict()["state"]}


def _resume(precision: str, path: str, load_state_dict: bool, group=None) -> dict:
    from adambridge import AdamBridge
    params = make_params(1)  # other values: everything must come from the checkpoint
    opt = AdamBridge(params, precision=precision, shard_state=group or True, **OPTIONS)
    zero_lr_step(opt, params)
    sd = opt.sharded_state_dict()
    dcp.load({"model": _model(params), "optim": sd}, checkpoint_id=path, process_group=group)
    if load_state_dict:
        opt.load_state_dict(sd)
    _train(opt, params, range(SAVED_AT, STEPS))
    return _end_of(opt, params)


def _refusals(precision: str, path: str, rank: int) -> list:
    """Load ``path`` with a NaN planted in rank 1's range of a master, through
    load_state_dict() and in place (refused at the next step): the error each rank got."""
    from adambridge import AdamBridge
    found = []
    for load_state_dict in (True, False):
        params = make_params(1)
        opt = AdamBridge(params, precision=precision, shard_state=True, **OPTIONS)
        zero_lr_step(opt, params)
        sd = opt.sharded_state_dict()
        dcp.load({"optim": sd}, checkpoint_id=path)
        if rank == 1:
            opt.state[params[0]]["master"][0] = float("nan")  # this rank's range only
        try:
            if load_state_dict:
                opt.load_state_dict(sd)
            else:
                _train(opt, params, range(1))
            found.append(None)
        except (ValueError, RuntimeError) as error:
            found.append(str(error))
    return found


def ranks(rank: int, world: int, out_dir: str) -> dict:
    from adambridge import AdamBridge
    out = {}
    solo = dist.new_group([0])  # a one-rank shard_state world inside this one
    for precision in PRECISIONS:
        params = make_params(0)
        opt = AdamBridge(params, precision=precision, shard_state=True, **OPTIONS)
        _train(opt, params, range(SAVED_AT))
        path = os.path.join(out_dir, f"{precision}-sharded")
        sharded = opt.sharded_state_dict()
        if precision == "fp32":
            out["repr"] = repr(sharded["state"][0]["master"])
            try:
                sharded["state"][0]["master"] + 1
            except RuntimeError as error:
                out["aten_error"] = str(error)
            try:
                torch.save(sharded, io.BytesIO())
            except TypeError as error:
                out["save_error"] = str(error)
        dcp.save({"model": _model(params), "optim": sharded}, checkpoint_id=path)
        if precision == "fp32":
            out["refusals"] = _refusals(precision, path, rank)
        gathered = opt.state_dict()
        dcp.save({"optim": gathered}, checkpoint_id=os.path.join(out_dir, f"{precision}-gathered"))
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, f"{precision}-gathered.pt"))
        del sharded, gathered
        _train(opt, params, range(SAVED_AT, STEPS))
        out[precision, "uninterrupted"] = _end_of(opt, params)
        out[precision, "resumed"] = _resume(precision, path, True)
        out[precision, "in_place"] = _resume(precision, path, False)
        solo_path = os.path.join(out_dir, f"{precision}-solo")
        if rank == 0:
            out[precision, "two_to_one"] = _resume(precision, path, True, solo)
            params = make_params(0)
            opt = AdamBridge(params, precision=precision, shard_state=solo, **OPTIONS)
            _train(opt, params, range(SAVED_AT))
            dcp.save({"model": _model(params), "optim": opt.sharded_state_dict()},
                     checkpoint_id=solo_path, process_group=solo)
        dist.barrier()
        out[precision, "one_to_two"] = _resume(precision, solo_path, True)
    return out


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shard_state_dcp")
    return workers.launch("test_shard_state_dcp:ranks", 2, folder), folder


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for index in a:
        assert a[index].keys() == b[index].keys(), index
        for key, value in a[index].items():
            other = b[index][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (index, key)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_through_sharded_state_dict_is_bit_for_bit(launched, precision, way):
    results, _ = launched
    for result in results:
        if (precision, way) not in result:
            continue  # two_to_one: rank 0 only
        resumed, expected = result[precision, way], result[precision, "uninterrupted"]
        for i, (p, q) in enumerate(zip(resumed["params"], expected["params"], strict=True)):
            assert p.dtype == q.dtype and torch.equal(p, q), f"parameter {i}"
        _equal_states(resumed["state"], expected["state"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_checkpoint_has_the_gathered_checkpoints_metadata(launched, precision):
    _, folder = launched

    def metadata(name):
        md = dcp.FileSystemReader(str(folder / f"{precision}-{name}")).read_metadata()
        return {k: (v.size, v.properties.dtype) if hasattr(v, "size") else type(v)
                for k, v in md.state_dict_metadata.items() if k.startswith("optim.")}

    assert metadata("sharded") == metadata("gathered")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_checkpoint_loads_into_an_unsharded_adambridge(launched, precision):
    from adambridge import AdamBridge
    _, folder = launched
    gathered = torch.load(folder / f"{precision}-gathered.pt", weights_only=False)
    params = make_params(1)
    opt = AdamBridge(params, precision=precision, **OPTIONS)
    zero_lr_step(opt, params)
    sd = opt.state_dict()
    dcp.load({"optim": sd}, checkpoint_id=str(folder / f"{precision}-sharded"))
    _equal_states(sd["state"], gathered["state"])
    opt.load_state_dict(sd)
    _equal_states(opt.state_dict()["state"], gathered["state"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_checkpoint_loads_into_torch_adamw(launched, precision):
    from adambridge.checkpoint import to_torch_adamw
    from adambridge.dcp import LoadPlanner
    _, folder = launched
    gathered = torch.load(folder / f"{precision}-gathered.pt", weights_only=False)
    options = dict(lr=OPTIONS["lr"], weight_decay=OPTIONS["weight_decay"])
    params = make_params(1)
    adamw = torch.optim.AdamW(params, **options)
    zero_lr_step(adamw, params)
    sd = adamw.state_dict()
    dcp.load({"optim": sd}, checkpoint_id=str(folder / f"{precision}-sharded"),
             planner=LoadPlanner())
    adamw.load_state_dict(sd)
    reference_params = make_params(1)
    reference = torch.optim.AdamW(reference_params, **options)
    reference.load_state_dict(to_torch_adamw(copy.deepcopy(gathered)))
    for p, q in zip(params, reference_params, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = adamw.state[p][key], reference.state[q][key]
            assert a.dtype == b.dtype and torch.equal(a, b), key


def test_a_checkpoint_one_rank_refuses_is_refused_on_every_rank(launched):
    # Each rank checks its own ranges: a rank that went on alone would wait in the next
    # collective for the one that stopped, forever.
    refused, other = (result["refusals"] for result in launched[0][::-1])
    for mine, theirs in zip(refused, other):
        assert mine is not None and "NaN" in mine and "\n" not in mine, mine
        assert theirs is not None and "on another rank" in theirs and "\n" not in theirs


def test_an_operation_or_torch_save_of_a_sharded_entry_is_one_line(launched):
    for rank, result in enumerate(launched[0]):
        for error in (result["aten_error"], result["save_error"]):
            assert "\n" not in error and f"rank {rank}'s elements" in error, error
            assert "torch.distributed.checkpoint" in error and "opt.state_dict()" in error
        assert result["repr"].startswith("RankPiece(shape=(7, 300)")


def test_sharded_state_dict_without_shard_state_is_one_line():
    from adambridge import AdamBridge
    opt = AdamBridge(make_params(0), **OPTIONS)
    with pytest.raises(ValueError, match=r"shard_state=True.*call opt\.state_dict\(\)$"):
        opt.sharded_state_dict()


# --------------------------------------------------------------------------- memory

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint.py"
WIDTH, LAYERS = 2049, 4  # 16.8M bf16 parameters, each layer a quarter; ranges split rows
SLACK = 12 << 20  # as tests/checkpoint/test_checkpoint_memory.py: what does not grow


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="needs Linux: VmHWM and /proc/self/clear_refs")
@pytest.mark.parametrize("precision", ("fp32", "fp8"))
def test_sharded_save_and_load_add_at_most_one_parameters_state(tmp_path, precision):
    # The load takes the pieces dcp.load wrote into as they are (they are the state's own);
    # it copied them before, about one rank's state (6.0 B/param of fp32 on 2 ranks).
    from adambridge.update.state import HOST_BYTES_PER_PARAM
    spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    largest = HOST_BYTES_PER_PARAM[precision] * WIDTH * WIDTH
    for phase in ("save", "load"):  # the load reads what the save wrote
        ours = bench.measure(dict(width=WIDTH, layers=LAYERS, dir=str(tmp_path), threads=1,
                                  path="shard_state_dcp", optimizer=precision, phase=phase))
        assert "error" not in ours, ours
        assert ours["extra"] <= largest + SLACK, (
            f"{phase}: {ours['extra'] / 2**20:.1f} MiB beyond the steady state on a rank, one "
            f"parameter's state {largest / 2**20:.1f} MiB")
