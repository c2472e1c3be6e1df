"""The native kernel against the torch backend, bit for bit, for every ISA this CPU runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adambridge import AdamBridge
from adambridge.update import codecs
from adambridge.update import state as host_state
from adambridge._native import loader
from adambridge.update.functional import Hyper, UpdateItem, adamw_update

from conftest import native_available

pytestmark = pytest.mark.skipif(os.environ.get("ADAMBRIDGE_DISABLE_NATIVE") == "1",
                                reason="ADAMBRIDGE_DISABLE_NATIVE=1: the torch backend alone is tested")

ISAS = ["scalar", "avx2", "avx512", "neon"]
SIZES = [0, 1, 15, 16, 17, 4097]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=ISAS)
def isa(request):
    if not native_available():
        pytest.fail("the native kernel did not build; run python -m adambridge info")
    native = loader.load()
    index = ISAS.index(request.param)
    if not native.lib.ab_isa_supported(index):
        pytest.skip(f"this CPU (or this build) lacks {request.param}")
    previous = native.lib.ab_isa_active()
    assert native.lib.ab_set_isa(index) == 0
    yield request.param
    native.lib.ab_set_isa(previous)


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    before = loader.num_threads()
    loader.set_num_threads(request.param)
    yield request.param
    loader.set_num_threads(before)


def _problem(numel, precision, grad_dtype, out_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    state = host_state.new_state(master, precision, alias=True)
    grad = (torch.randn(numel, generator=gen) * 1e-2).to(grad_dtype)
    out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
    return state, grad, out


def _items(state, grad, out, precision, step, ranges, sr=True, base=0):
    hyper = Hyper.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step)
    items = []
    for start, end in ranges:
        blocks = slice(start // 128, -(-end // 128))
        scale = {k: state[k][blocks] if k in state else None
                 for k in ("exp_avg_scale", "exp_avg_sq_scale")}
        items.append(UpdateItem(
            master=state["master"][start:end], grad=grad[start:end],
            exp_avg=state["exp_avg"][start:end], exp_avg_sq=state["exp_avg_sq"][start:end],
            **scale, out=None if out is None else out[start:end], offset=base + start,
            key=codecs.stream_key(9, step, 4), precision=precision, stochastic_rounding=sr,
            hyper=hyper))
    return items


def _run(backend, numel, precision, grad_dtype, out_dtype, ranges, steps=3, sr=True, base=0):
    """``base``: the global index of the state's first element (an FSDP2 shard's start)."""
    state, grad, out = _problem(numel, precision, grad_dtype, out_dtype)
    for step in range(1, steps + 1):
        adamw_update(_items(state, grad, out, precision, step, ranges, sr, base), backend)
    tensors = [state[k] for k in sorted(state) if k != "step"]
    return tensors + ([out] if out is not None else [])


def _assert_bitwise_equal(ours, ref):
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("numel", SIZES)
def test_native_equals_torch_backend_bitwise(isa, threads, precision, numel):
    for grad_dtype, out_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, None),
                                  (torch.float16, torch.float16), (torch.float32, torch.float32)]:
        whole = [(0, numel)]
        ours = _run("native", numel, precision, grad_dtype, out_dtype, whole)
        ref = _run("torch", numel, precision, grad_dtype, out_dtype, whole)
        _assert_bitwise_equal(ours, ref)


# An FSDP2 shard of a parameter may start at any element (a bias of 33 rows on 2 ranks: the
# second shard starts at 17); its fp8 blocks start at the shard. 2**32 - 17 and 2**32 - 300:
# the crossing of 2**32 (where the hash key changes) falls inside a block, at its start too.
@pytest.mark.parametrize("base", [17, 2**32 - 17, 2**32 - 300, 3 * 2**32 - 128 * 5 - 1])
@pytest.mark.parametrize("numel", [1, 16, 300, 4097])
def test_native_fp8_shard_off_a_block_boundary_equals_torch_backend(isa, threads, base, numel):
    for grad_dtype, out_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, None)]:
        for ranges in ([(0, numel)], [(s, min(s + 256, numel)) for s in range(0, numel, 256)]):
            ours = _run("native", numel, "fp8", grad_dtype, out_dtype, ranges, base=base)
            ref = _run("torch", numel, "fp8", grad_dtype, out_dtype, [(0, numel)], base=base)
            _assert_bitwise_equal(ours, ref)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_native_nearest_rounding_equals_torch_backend(isa, precision):
    ours = _run("native", 4097, precision, torch.bfloat16, torch.bfloat16, [(0, 4097)], sr=False)
    ref = _run("torch", 4097, precision, torch.bfloat16, torch.bfloat16, [(0, 4097)], sr=False)
    _assert_bitwise_equal(ours, ref)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_native_large_tensor_and_chunkings_agree(isa, threads, precision):
    numel = 3 * 2**20 + 5  # a 3M tensor: the pool split, non-temporal stores and a tail
    whole = _run("native", numel, precision, torch.bfloat16, torch.bfloat16, [(0, numel)], steps=2)
    for chunk in (128 * 1000, 2**20):
        ranges = [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)]
        chunked = _run("native", numel, precision, torch.bfloat16, torch.bfloat16, ranges, steps=2)
        _assert_bitwise_equal(chunked, whole)
    if isa == "avx2" or isa == "avx512":  # the torch backend once on the big tensor (slow)
        ref = _run("torch", numel, precision, torch.bfloat16, torch.bfloat16, [(0, numel)], steps=2)
        _assert_bitwise_equal(whole, ref)


def test_native_many_small_tensors_in_one_call_equal_one_by_one(threads):
    sizes = [(i * 37) % 300 + 1 for i in range(600)]  # more tensors than pool pieces
    def run(batched):
        problems = [_problem(n, "bf16", torch.bfloat16, torch.bfloat16, seed=i)
                    for i, n in enumerate(sizes)]
        items = [_items(s, g, o, "bf16", 1, [(0, g.numel())])[0] for s, g, o in problems]
        if batched:
            adamw_update(items, "native")
        else:
            for item in items:
                adamw_update([item], "torch")
        return [t for s, g, o in problems for t in (s["master"], s["exp_avg"], o)]
    _assert_bitwise_equal(run(True), run(False))


def test_hash_agrees_with_the_torch_twin():
    lib = loader.load().lib
    assert lib.ab_mix32(1) == codecs.mix32(1) == 0x688990C0
    for key, index in [(0x12345678, 5), (1, 2**32 + 3), (0xFFFFFFFF, 2**40 + 17)]:
        assert lib.ab_hash(key, index) == codecs.element_hash(key, index, 1).item()


def test_native_rejects_an_invalid_range_without_touching_memory():
    state, grad, out = _problem(300, "fp8", torch.bfloat16, torch.bfloat16)
    before = {k: v.clone() for k, v in state.items()}
    items = _items(state, grad, out, "fp8", 1, [(0, 128), (128, 300)])
    items[1].offset = -1  # no element has it: the C validation must refuse the whole call
    with pytest.raises(RuntimeError, match=r"ab_adamw_update failed: .*\(status -1\)"):
        adamw_update(items, "native")
    for key, value in before.items():
        assert torch.equal(value, state[key])


def test_optimizer_reports_the_forced_isa(isa):
    opt = AdamBridge([torch.nn.Parameter(torch.zeros(3))], backend="native")
    assert opt.backend == f"native/{isa}"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler named cc")
def test_c_selftest_builds_with_one_command_and_passes(tmp_path):
    # The README's command, verbatim apart from the output path.
    exe = tmp_path / "selftest"
    subprocess.run(["cc", "-O2", "-pthread", "-o", str(exe), "tests/native/selftest.c", "-lm"],
                   cwd=REPO, check=True)
    result = subprocess.run([str(exe)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert " 0 failed" in result.stdout


_IMPORT_AND_STEP = """\
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import torch, adambridge
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(1000).bfloat16())
opt = adambridge.AdamBridge([p], backend="native", precision="bf16")
p.grad = torch.ones_like(p)
opt.step()
print(opt.backend, p.float().sum().item())
"""


def test_eight_processes_importing_and_stepping_with_an_empty_cache_build_once(tmp_path):
    # The real package, as users start it: 8 processes at once, one empty cache.
    env = dict(os.environ, ADAMBRIDGE_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("ADAMBRIDGE_ISA", None)
    procs = [subprocess.Popen([sys.executable, "-c", _IMPORT_AND_STEP], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-1500:] for _, _, err in results]
    assert len({out for _, out, _ in results}) == 1  # same backend, same weights
    assert results[0][1].startswith("native/")
    assert sum(err.count("adambridge: built") for _, _, err in results) == 1


# -- non-finite gradients (docs/numerics.md section 6) -------------------------------------------

NONFINITE = [("inf", float("inf")), ("-inf", float("-inf")), ("nan", float("nan"))]
# NaNs whose payloads IEEE arithmetic would carry through: quiet, negative, signalling.
ODD_NAN_BITS = [0x7FC00000, 0xFFC12345, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF]


def _as_f32(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _nonfinite_steps(backend, precision, bad_index, bad_value, steps=3, numel=300):
    """AdamW steps on numel elements where element bad_index's gradient is bad_value at
    step 1 (None: 0 at every step), with the functional API, returning (master, m, v) fp32."""
    state, _, _ = _problem(numel, precision, torch.float32, None)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen) * 1e-2
        grad[bad_index] = 0.0 if bad_value is None or step > 1 else bad_value
        adamw_update(_items(state, grad, None, precision, step, [(0, numel)]), backend)
    m, v = host_state.decode_moments(state)
    return state["master"].clone(), m, v, state


def _torch_adamw_steps(bad_index, bad_value, steps=3, numel=300):
    master, _, _ = _problem(numel, "fp32", torch.float32, None)
    p = torch.nn.Parameter(master["master"].clone())
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen) * 1e-2
        grad[bad_index] = bad_value if step == 1 else 0.0
        p.grad = grad
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


# Per precision: how close a finite element stays to torch.optim.AdamW after 3 steps at lr 1e-3
# (fp32 is the arithmetic contract; bf16 and fp8 moments add their rounding to each step).
NONFINITE_TOL = {"fp32": (1e-6, 1e-7), "bf16": (0, 2e-5), "fp8": (0, 4e-4)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("kind,value", NONFINITE, ids=[k for k, _ in NONFINITE])
def test_native_nonfinite_gradient_spoils_only_its_own_element_as_in_torch(isa, precision, kind,
                                                                           value):
    bad = 130  # inside the second fp8 block, away from its edges
    p, m, v, state = _nonfinite_steps("native", precision, bad, value)
    ref_p, ref_m, ref_v = _torch_adamw_steps(bad, value)
    for ours, ref in ((p, ref_p), (m, ref_m), (v, ref_v)):
        assert torch.equal(~torch.isfinite(ours), ~torch.isfinite(ref))  # the same elements
        assert torch.nonzero(~torch.isfinite(ours)).flatten().tolist() == [bad]
        finite = torch.isfinite(ref)
        rtol, atol = NONFINITE_TOL[precision]
        torch.testing.assert_close(ours[finite], ref[finite], rtol=rtol, atol=atol)
    # Exactly: every other element, the fp8 block scales included, has the bits of a run in
    # which the bad element's gradient was 0 (it takes no part in its block's maxima).
    clean_p, clean_m, clean_v, clean_state = _nonfinite_steps("native", precision, bad, None)
    others = torch.arange(p.numel()) != bad
    for ours, ref in ((p, clean_p), (m, clean_m), (v, clean_v)):
        assert torch.equal(ours[others].view(torch.int32), ref[others].view(torch.int32))
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        if key in state:
            assert torch.equal(state[key], clean_state[key])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("numel", [17, 4097])
def test_native_nonfinite_values_equal_torch_backend_bitwise(isa, threads, precision, grad_dtype,
                                                             numel):
    # NaNs of every payload and infinities in the gradient and in the master, at vector lanes
    # and in tails, over several steps (the fp8 NaN codes are decoded again at later steps).
    def run(backend):
        state, grad, out = _problem(numel, precision, grad_dtype, torch.bfloat16)
        where = [0, 5, 16, numel - 1]
        state["master"][3] = _as_f32(ODD_NAN_BITS[1])
        for step in range(1, 4):
            g = grad.float()
            for j, bits in enumerate(ODD_NAN_BITS[: len(where)]):
                g[(where[j] + step) % numel] = _as_f32(bits)
            g[(7 * step) % numel] = float("inf") if step % 2 else float("-inf")
            adamw_update(_items(state, g.to(grad_dtype), out, precision, step, [(0, numel)]),
                         backend)
        state = {k: t for k, t in state.items() if k != "step"}
        return dict(state, out=out)
    ours, ref = run("native"), run("torch")
    _assert_bitwise_equal([ours[k] for k in sorted(ours)], [ref[k] for k in sorted(ref)])
    master = ours["master"]
    nans = master.view(torch.int32)[torch.isnan(master)]
    assert nans.numel() >= 4 and (nans == 0x7FC00000).all()  # one canonical NaN
    assert (ours["out"].view(torch.int16)[torch.isnan(master)] == 0x7FC0).all()


# -- the cached native batch ---------------------------------------------------------------------

def test_stream_keys_equal_stream_key_per_parameter():
    from adambridge.update.functional import stream_keys
    indices = [0, 1, 7, 2**31 + 5, 2**32 - 1]
    assert stream_keys(3, 11, indices).tolist() == [codecs.stream_key(3, 11, i) for i in indices]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_native_batch_with_refreshed_steps_equals_adamw_update(threads, precision):
    from adambridge.update.functional import NativeBatch, stream_keys
    sizes = [1, 17, 300, 1000, 129]

    def problems():
        return [_problem(n, precision, torch.bfloat16, torch.bfloat16, seed=i)
                for i, n in enumerate(sizes)]
    plain, cached = problems(), problems()
    batch = None
    for step in (1, 2, 3):
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + i)).to(
            torch.bfloat16 if step != 2 else torch.float32) for i, n in enumerate(sizes)]
        hyper = Hyper.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                               step=step)
        items = []
        for i, (st, _, out) in enumerate(plain):
            item = _items(st, grads[i], out, precision, step, [(0, sizes[i])])[0]
            item.key = codecs.stream_key(5, step, i)
            items.append(item)
        adamw_update(items, "native")
        if batch is None:
            batch = NativeBatch([_items(st, grads[i], out, precision, 1, [(0, sizes[i])])[0]
                                 for i, (st, _, out) in enumerate(cached)])
        batch.set_grads(grads)
        batch.set_step(stream_keys(5, step, range(len(sizes))), hyper)
        batch.run()
    for (a, _, oa), (b, _, ob) in zip(plain, cached):
        keys = sorted(k for k in a if k != "step")
        _assert_bitwise_equal([a[k] for k in keys] + [oa], [b[k] for k in keys] + [ob])


def test_native_batch_rejects_a_gradient_of_the_wrong_size():
    from adambridge.update.functional import NativeBatch
    state, grad, out = _problem(100, "fp32", torch.float32, None)
    batch = NativeBatch(_items(state, grad, out, "fp32", 1, [(0, 100)]))
    with pytest.raises(ValueError, match=r"Invalid grad: the native kernel needs a contiguous CPU "
                                         r"tensor of 100 elements"):
        batch.set_grads([torch.zeros(99)])


def test_native_batch_of_items_with_different_hyperparameters_equals_one_by_one():
    # Rows of one call share Hyper objects per group; three groups interleaved must each get
    # their own scalars.
    lrs = [1e-3, 3e-2, 1e-3, 5e-4, 3e-2]
    def run(batched):
        problems = [_problem(100, "fp32", torch.float32, None, seed=i) for i in range(len(lrs))]
        hypers = {lr: Hyper.for_step(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                     step=2) for lr in lrs}
        items = []
        for (state, grad, out), lr in zip(problems, lrs):
            item = _items(state, grad, out, "fp32", 2, [(0, 100)])[0]
            item.hyper = hypers[lr]
            items.append(item)
        if batched:
            adamw_update(items, "native")
        else:
            for item in items:
                adamw_update([item], "native")
        return [s["master"] for s, _, _ in problems]
    _assert_bitwise_equal(run(True), run(False))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_descriptors_of_few_rows_equal_the_columns_of_many(precision, monkeypatch):
    # A few rows are packed one struct at a time, more column by column: the same bytes.
    lrs = [1e-3, 3e-2, 1e-3]
    items = []
    for i, (lr, out_dtype) in enumerate(zip(lrs, [torch.bfloat16, None, torch.float16])):
        state, grad, out = _problem(300, precision, torch.bfloat16, out_dtype, seed=i)
        item = _items(state, grad, out, precision, 3, [(128, 300)], sr=i != 1)[0]
        item.hyper = Hyper.for_step(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                    step=3)
        item.key = codecs.stream_key(2**40 + 3, 7, i)  # keys above 2**31 wrap the same way
        items.append(item)
    packed = loader.descriptors(items)
    monkeypatch.setattr(loader, "_SMALL_BATCH", 0)
    assert torch.equal(packed, loader.descriptors(items))
