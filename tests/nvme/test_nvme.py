"""The NVMe tier (nvme/tier.py): bit-for-bit equal to in-RAM state, placement, checkpoints, stats."""
from __future__ import annotations

import errno
import gc
import logging
import os

import pytest
import torch
from torch import nn

from adambridge import AdamBridge, AutoTuneConfig
from adambridge.nvme import tier as nvme, engine as nvme_engine, direct_io
from adambridge.nvme.tier import OffloadConfig
from adambridge.nvme.direct_io import TierError
from adambridge.nvme.layout import PageLayout, fitted, read_committed
from conftest import NEEDS_FORK


def _uring_unavailable() -> str:
    """Why io_uring cannot be had here ('' when it can)."""
    try:
        nvme_engine.open_engine("io_uring", 2).close()
    except ValueError as exc:
        return str(exc)
    return ""


# What the io_uring tests wait for, and why this machine does not give it.
NEEDS_URING = pytest.mark.skipif(
    bool(_uring_unavailable()),
    reason=f"needs io_uring (Linux >= 5.6, kernel.io_uring_disabled=0, no seccomp filter "
           f"refusing io_uring_setup): {_uring_unavailable()}")

# Both I/O engines run every test that takes ``engine``; io_uring only where the kernel has it.
ENGINES = ["threads", pytest.param("io_uring", marks=NEEDS_URING)]

# Tail sizes around the 256-element pages used below: one short page, several pages with a
# short last one, a page-exact parameter, a single element (one fp8 block of one).
SIZES = (1, 17, 255, 256, 1000, 4097)

CONFIGS = [
    dict(desc="fp32 moments, fp32 params (the in-RAM master aliases p)", precision="fp32",
         dtype=torch.float32),
    dict(desc="bf16 moments, bf16 params", precision="bf16", dtype=torch.bfloat16),
    dict(desc="fp8 moments (block scales per page), fp32 params", precision="fp8",
         dtype=torch.float32),
    dict(desc="fp8 moments, fp16 params", precision="fp8", dtype=torch.float16),
]


def _params(dtype: torch.dtype) -> list:
    gen = torch.Generator().manual_seed(5)
    params = [nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]
    # A non-contiguous leaf: its gradient and write-back go through copies.
    params.append(nn.Parameter(torch.randn(40, 17, generator=gen).to(dtype).t()))
    return params


def _grads(params: list, steps: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)]


def _tier_args(tmp_path, dirs: int = 2, page_size: int = 256, budget: int = 300,
               engine: str = "auto") -> dict:
    paths = []
    for i in range(dirs):
        (tmp_path / f"drive{i}").mkdir(parents=True, exist_ok=True)
        paths.append(tmp_path / f"drive{i}")
    return dict(offload_dir=OffloadConfig(paths, page_size=page_size, queue_depth=2,
                                          io_engine=engine), host_budget=budget)


def _run(config: dict, backend: str, steps: int, **tier) -> tuple[list, AdamBridge]:
    params = _params(config["dtype"])
    opt = AdamBridge(params, lr=1e-2, weight_decay=0.1, precision=config["precision"],
                     backend=backend, **tier)
    for grads in _grads(params, steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def _assert_same(params_a, opt_a, params_b, opt_b) -> None:
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys(), i
        for key in state_a[i]:
            a, b = state_a[i][key].reshape(-1), state_b[i][key].reshape(-1)
            assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), (i, key)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["desc"])
def test_tier_step_equals_ram_bit_for_bit(config, backend, engine, tmp_path):
    ram_params, ram_opt = _run(config, backend, 3)
    tier_params, tier_opt = _run(config, backend, 3, **_tier_args(tmp_path, engine=engine))
    where = [placed.where for placed in tier_opt.placement()]
    assert where.count("ram") == 2 and where.count("file") == 5  # 1 and 17 fit 300 bytes
    assert {placed.io for placed in tier_opt.placement() if placed.where == "file"} == {engine}
    _assert_same(ram_params, ram_opt, tier_params, tier_opt)
    # The files themselves hold the same bits (what a crash would leave behind).
    ram_state = ram_opt.state_dict()["state"]
    committed = read_committed(tmp_path / "drive0")
    assert sorted(committed) == [i for i, w in enumerate(where) if w == "file"]
    for i, state in committed.items():
        assert int(state["step"]) == 3
        for key, tensor in state.items():
            # The files hold the stored bits: the checkpoint's ab_* entries where torch's
            # decoded form differs from them (docs/checkpoints.md).
            expected = ram_state[i].get("ab_" + key) if key != "step" else None
            expected = ram_state[i][key] if expected is None else expected
            assert torch.equal(tensor.float(), expected.reshape(tensor.shape).float()), (i, key)


class Net(nn.Module):
    """w1 (960) and w2 are chunked at chunk_size=256; wt is non-contiguous; biases grouped."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(24, 40)
        self.wt = nn.Parameter(torch.randn(17, 40).t() * 0.2)
        self.w2 = nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.w1(x))
        return self.w2(h @ self.wt.to(h.dtype))


def _train_model(config: dict, backend: str, hooks: bool, **tier) -> tuple[list, AdamBridge]:
    torch.manual_seed(0)
    model = Net().to(config["dtype"])
    opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend,
                     precision=config["precision"], chunk_size=256, small_param_threshold=64,
                     **tier)
    if hooks:
        opt.attach_hooks(model)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 24, generator=gen), torch.randn(8, 5, generator=gen)
        ((model(x.to(config["dtype"])).float() - y) ** 2).mean().backward()
        stats = opt.step_sync() if hooks else opt.step()
        opt.zero_grad()
    if hooks:
        assert stats.io_read_bytes > 0 and stats.io_write_bytes == stats.io_read_bytes
    return list(model.parameters()), opt


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("config", CONFIGS[1:3], ids=lambda c: c["desc"])
def test_tier_async_equals_ram_sync_bit_for_bit(config, backend, engine, tmp_path):
    ram_params, ram_opt = _train_model(config, backend, hooks=False)
    tier_params, tier_opt = _train_model(config, backend, hooks=True,
                                         **_tier_args(tmp_path, budget=1200, engine=engine))
    # wt and w1.weight in files; w1.bias, w2.weight and w2.bias in RAM.
    assert [p.where for p in tier_opt.placement()] == ["file", "file", "ram", "ram", "ram"]
    _assert_same(ram_params, ram_opt, tier_params, tier_opt)


def test_place_smallest_first_under_the_budget():
    sizes = [(0, 1000), (1, 10), (2, 500), (3, 10)]
    per_param = 12  # fp32: master + m + v
    assert nvme.place(sizes, "fp32", budget=20 * per_param) == {
        0: "file", 1: "ram", 2: "file", 3: "ram"}
    assert nvme.place(sizes, "fp32", budget=520 * per_param)[2] == "ram"
    assert set(nvme.place(sizes, "fp32", budget=None).values()) == {"file"}
    assert set(nvme.place(sizes, "fp32", budget=10**9).values()) == {"ram"}


def test_placement_without_tier_is_all_ram():
    opt = AdamBridge([nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))])
    assert [(p.index, p.numel, p.where, p.state_bytes) for p in opt.placement()] == [
        (0, 5, "ram", 60), (1, 3, "ram", 36)]


@pytest.mark.parametrize("into", ["ram", "files"])
def test_tier_checkpoint_resume_equals_uninterrupted(into, tmp_path):
    config = CONFIGS[2]
    full_params, full_opt = _run(config, "torch", 4)
    params, opt = _run(config, "torch", 2, **_tier_args(tmp_path / "a"))
    saved = opt.state_dict()
    resumed = [nn.Parameter(p.detach().clone()) for p in params]
    tier = _tier_args(tmp_path / "b", dirs=1, page_size=384) if into == "files" else {}
    new_opt = AdamBridge(resumed, lr=1e-2, weight_decay=0.1, precision="fp8", backend="torch",
                         **tier)
    new_opt.load_state_dict(saved)
    for grads in _grads(resumed, 4)[2:]:
        for p, g in zip(resumed, grads):
            p.grad = g.clone()
        new_opt.step()
    _assert_same(full_params, full_opt, resumed, new_opt)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tier_checkpoint_is_committed_state(tmp_path, mode):
    # state_dict() of a file-backed parameter reads the committed generation: equal to the
    # in-RAM optimizer's state after the same steps.
    config = CONFIGS[1]
    ram_params, ram_opt = _train_model(config, "torch", hooks=False)
    tier_params, tier_opt = _train_model(config, "torch", hooks=mode == "async",
                                         **_tier_args(tmp_path, budget=0))
    assert {p.where for p in tier_opt.placement()} == {"file"}
    _assert_same(ram_params, ram_opt, tier_params, tier_opt)


def test_tier_stats_bytes_and_endurance(tmp_path):
    config = CONFIGS[0]
    params, opt = _run(config, "torch", 2, **_tier_args(tmp_path, budget=0))
    # (parameters smaller than a page have pages of their own size)
    records = [fitted("fp32", 256, p.numel()).record_bytes for p in params]
    per_step = sum(-(-p.numel() // 256) * record for p, record in zip(params, records))
    stats = opt.last_step_stats
    assert stats.io_read_bytes == stats.io_write_bytes == per_step
    assert stats.num_params == len(params) and stats.io_wait_s >= 0.0
    tier = opt._tier
    assert tier.bytes_written == 2 * per_step  # the first step reads nothing, writes all
    capacity = 10**9
    expected = per_step / 0.5 * 86400 / (capacity * 2)  # two drives share the writes
    assert tier.drive_writes_per_day(capacity, step_s=0.5) == pytest.approx(expected)
    assert tier.drive_writes_per_day(capacity) > 0.0


def test_tier_reuses_its_buffers_across_steps(tmp_path):
    params, opt = _run(CONFIGS[1], "torch", 1, **_tier_args(tmp_path, budget=0))
    ring = [id(b) for b in opt._tier.stream.buffers]
    assert len(ring) == 3  # queue_depth 2 + 1: read k+1, update k, write k-1
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert [id(b) for b in opt._tier.stream.buffers] == ring


def test_tier_falls_back_to_buffered_io_with_one_warning(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    direct_io._warned_dirs.clear()
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        tier_params, tier_opt = _run(CONFIGS[1], "torch", 2, **_tier_args(tmp_path, dirs=1))
    warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1
    assert not any(f.direct for files in tier_opt._tier._files.values() for f in files.files)
    ram_params, ram_opt = _run(CONFIGS[1], "torch", 2)
    _assert_same(ram_params, ram_opt, tier_params, tier_opt)


def test_describe_direct_io_says_whether_o_direct_works(tmp_path, monkeypatch):
    said = nvme_engine.describe_tier_io(str(tmp_path))
    assert said.startswith(f"O_DIRECT works in {tmp_path} (offload_dir=...; I/O by ")
    engine = "a pool of pread/pwrite threads (io_uring unavailable" if _uring_unavailable() else \
        "io_uring;"
    assert engine in said
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    assert direct_io.describe_direct_io(str(tmp_path), "io_uring") == (
        f"O_DIRECT refused in {tmp_path} (Invalid argument): an offload_dir there is buffered")
    assert os.listdir(tmp_path) == []


def test_tier_files_use_o_direct_where_allowed(tmp_path):
    _, opt = _run(CONFIGS[0], "torch", 1, **_tier_args(tmp_path, dirs=1))
    files = [f for param_files in opt._tier._files.values() for f in param_files.files]
    assert files and all(f.direct for f in files)


ARG_ERRORS = [
    dict(desc="budget without a directory", kwargs=dict(host_budget=10),
         match=r"host_budget=10 needs offload_dir"),
    dict(desc="negative budget", kwargs=dict(offload_dir="{d}", host_budget=-1),
         match=r"Invalid host_budget: -1"),
    dict(desc="missing directory", kwargs=dict(offload_dir="{d}/nope"),
         match=r"offload_dir '.*/nope' is not an existing directory; create it first"),
    dict(desc="a directory twice", kwargs=dict(offload_dir=["{d}", "{d}/."]),
         match=r"offload_dir lists a directory twice"),
    dict(desc="empty list", kwargs=dict(offload_dir=[]), match=r"an empty list"),
    dict(desc="page size off the fp8 block", kwargs=dict(page_size=100),
         match=r"Invalid page_size: 100 \(expected a positive multiple of 128"),
    dict(desc="queue depth of one", kwargs=dict(queue_depth=1),
         match=r"Invalid queue_depth: 1 \(expected an int >= 2"),
    dict(desc="an unknown I/O engine", kwargs=dict(io_engine="libaio"),
         match=r"Invalid io_engine: 'libaio' \(expected one of auto, io_uring, threads\)"),
    dict(desc="autotune precision step-down", kwargs=dict(offload_dir="{d}", autotune=True),
         match=r"offload_dir cannot be combined with autotune precision step-down"),
]


@pytest.mark.parametrize("case", ARG_ERRORS, ids=lambda c: c["desc"])
def test_tier_arguments_refused_in_one_line(case, tmp_path):
    kwargs = {k: (v.format(d=tmp_path) if isinstance(v, str) else
                  [x.format(d=tmp_path) for x in v] if isinstance(v, list) else v)
              for k, v in case["kwargs"].items()}
    if {"page_size", "queue_depth", "io_engine"} & kwargs.keys():
        kwargs = dict(offload_dir=OffloadConfig([tmp_path], **kwargs))
    with pytest.raises(ValueError, match=case["match"]) as info:
        AdamBridge([nn.Parameter(torch.randn(3))], **kwargs)
    assert "\n" not in str(info.value)


def test_tier_directory_is_locked_to_one_optimizer(tmp_path):
    first = AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=tmp_path)
    with pytest.raises(ValueError, match=r"is in use by another optimizer; give each"):
        AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=tmp_path)
    free = tmp_path / "free"
    free.mkdir()
    with pytest.raises(ValueError, match=r"in use by another optimizer"):
        AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=[free, tmp_path])
    AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=free)  # its lock was let go
    del first
    gc.collect()  # the lock goes with the optimizer
    AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=tmp_path,
               autotune=AutoTuneConfig(tune_precision=False))  # what the autotune error suggests


def test_a_failed_constructor_lets_go_of_its_directory(tmp_path, monkeypatch):
    # The traceback of the failure (kept by a notebook, or `info` here) holds the half-made
    # optimizer; its directory must still be free for the next try.
    from adambridge._native import loader

    def no_compiler():
        raise RuntimeError("no C compiler (simulated)")
    monkeypatch.setattr(loader, "load", no_compiler)
    with pytest.raises(RuntimeError, match="simulated") as info:
        AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=tmp_path, backend="native")
    monkeypatch.undo()
    AdamBridge([nn.Parameter(torch.randn(3))], offload_dir=tmp_path, backend="torch")
    assert info.value is not None  # still alive while the directory was taken again


def test_close_lets_go_of_the_directory_and_the_closed_tier_refuses_in_one_line(tmp_path):
    params = [nn.Parameter(torch.randn(300))]
    first = AdamBridge(params, offload_dir=tmp_path, host_budget=0, backend="torch")
    params[0].grad = torch.ones(300)
    first.step()
    saved = first.state_dict()
    first.nvme_tier.close()
    first.nvme_tier.close()  # idempotent
    second = AdamBridge(params, offload_dir=tmp_path, host_budget=0, backend="torch")
    second.load_state_dict(saved)  # while `first` is still alive
    for call in (first.step, first.state_dict, lambda: first.load_state_dict(saved)):
        with pytest.raises(TierError, match=r"tier was closed \(opt\.nvme_tier\.close\(\)\); "
                                            r"build a new AdamBridge") as info:
            call()
        assert "\n" not in str(info.value)
    second.step()


class _RefusingLibrary:
    """The native library as seen where io_uring_setup fails with ``errno`` (a seccomp
    filter gives EPERM, an old kernel ENOSYS): everything else is the real library."""

    def __init__(self, lib, err: int) -> None:
        self._lib, self._err = lib, err

    def ab_uring_open(self, entries, ring) -> int:
        return -self._err

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.mark.parametrize("err, why", [(errno.EPERM, r"io_uring_setup refused \(EPERM: kernel"
                                                    r"\.io_uring_disabled or a seccomp filter"),
                                      (errno.ENOSYS, r"io_uring_setup is not supported by this "
                                                     r"kernel or this build")])
def test_auto_falls_back_to_threads_where_io_uring_is_refused(err, why, tmp_path, monkeypatch):
    real = nvme_engine.uring_library()[0]
    monkeypatch.setattr(nvme_engine, "uring_library", lambda: (_RefusingLibrary(real, err), ""))
    ram_params, ram_opt = _run(CONFIGS[1], "torch", 2)
    params, opt = _run(CONFIGS[1], "torch", 2, **_tier_args(tmp_path / "auto"))
    assert {p.io for p in opt.placement() if p.where == "file"} == {"threads"}
    assert opt.nvme_tier.io_engine.startswith("a pool of pread/pwrite threads (io_uring "
                                              "unavailable: io_uring_setup")
    _assert_same(ram_params, ram_opt, params, opt)
    with pytest.raises(ValueError, match=r"io_engine='io_uring' is not available here: " + why +
                                         r".*; pass io_engine='threads'") as info:
        _run(CONFIGS[1], "torch", 1, **_tier_args(tmp_path / "forced", engine="io_uring"))
    assert "\n" not in str(info.value)
    assert "io_uring unavailable" in nvme_engine.describe_tier_io(str(tmp_path))


def test_auto_falls_back_to_threads_without_the_native_library(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_DISABLE_NATIVE", "1")
    _, opt = _run(CONFIGS[0], "torch", 1, **_tier_args(tmp_path))
    assert opt.nvme_tier.io_engine == ("a pool of pread/pwrite threads (io_uring unavailable: "
                                       "the native library is disabled by "
                                       "ADAMBRIDGE_DISABLE_NATIVE)")


@pytest.mark.parametrize("value, expected", [("threads", "threads"), ("", None),
                                             ("auto", None)])
def test_environment_chooses_the_engine_under_auto(value, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_NVME_IO", value)
    _, opt = _run(CONFIGS[0], "torch", 1, **_tier_args(tmp_path))
    default = "threads" if _uring_unavailable() else "io_uring"
    assert opt.nvme_tier.pool.name == (expected or default)
    # An explicit io_engine is the user's own choice: the environment does not override it.
    _, forced = _run(CONFIGS[0], "torch", 1, **_tier_args(tmp_path / "x", engine="threads"))
    assert forced.nvme_tier.pool.name == "threads"


def test_environment_engine_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMBRIDGE_NVME_IO", "uring")
    with pytest.raises(ValueError, match=r"Invalid ADAMBRIDGE_NVME_IO: 'uring' \(expected one "
                                         r"of auto, io_uring, threads\)"):
        _run(CONFIGS[0], "torch", 1, **_tier_args(tmp_path))


class _NoPinningLibrary(_RefusingLibrary):
    """The native library where io_uring_register refuses to pin buffers (RLIMIT_MEMLOCK)."""

    def ab_uring_open(self, entries, ring) -> int:
        return self._lib.ab_uring_open(entries, ring)

    def ab_uring_register_buffers(self, ring, addrs, lens, count) -> int:
        return -errno.ENOMEM


@NEEDS_URING
@pytest.mark.parametrize("pinned", [True, False], ids=["registered", "memlock refused"])
def test_io_uring_registers_the_page_ring_or_runs_without(pinned, tmp_path, monkeypatch):
    if not pinned:
        real = nvme_engine.uring_library()[0]
        monkeypatch.setattr(nvme_engine, "uring_library",
                            lambda: (_NoPinningLibrary(real, 0), ""))
    ram_params, ram_opt = _run(CONFIGS[2], "torch", 3)
    params, opt = _run(CONFIGS[2], "torch", 3, **_tier_args(tmp_path, engine="io_uring"))
    _assert_same(ram_params, ram_opt, params, opt)
    engine = opt.nvme_tier.pool
    ring = {b.tensor.data_ptr() for b in opt.nvme_tier.stream.buffers}
    if pinned:  # the page ring is what the kernel pinned
        assert set(engine._registered) == ring and opt.nvme_tier.io_engine == "io_uring"
    else:
        assert engine._registered == {}
        assert opt.nvme_tier.io_engine == ("io_uring (buffers not registered: Cannot allocate "
                                           "memory)")


@NEEDS_URING
@NEEDS_FORK
def test_io_uring_is_refused_in_a_forked_child(tmp_path):
    _, opt = _run(CONFIGS[1], "torch", 1, **_tier_args(tmp_path, engine="io_uring"))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child shares the parent's ring: it must not submit to it
        message = b"no error"
        try:
            opt.nvme_tier.pool.read(None, opt.nvme_tier.stream.buffers[0], 0, 4096)
        except direct_io.TierError as exc:
            message = str(exc).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    said = os.read(read, 4096).decode()
    assert said.startswith("NVMe tier: this optimizer's io_uring belongs to the process that "
                           "made it"), said
    # The parent's ring is untouched: its next step still streams.
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


class _ScriptedRequest:
    """A request that is done only once the stream waits for it (a slow write) or at once."""

    def __init__(self, kind: str, page: int, done: bool) -> None:
        self.kind, self.page, self.finished = kind, page, done

    def done(self) -> bool:
        return self.finished


class _ScriptedEngine:
    """Reads land at once; a write lands only when waited for: the order of those waits is
    the order in which the stream blocked on writes."""

    queue_depth = 4

    def __init__(self, record: int) -> None:
        self.record, self.blocked_on, self.updated = record, [], 0

    def register(self, buffers: list) -> None:
        pass

    def read(self, file, buffer, offset: int, nbytes: int) -> _ScriptedRequest:
        return _ScriptedRequest("read", offset // (2 * self.record), True)

    def write(self, file, buffer, offset: int, nbytes: int) -> _ScriptedRequest:
        return _ScriptedRequest("write", offset // (2 * self.record), False)

    def wait(self, request) -> None:
        if request is not None and not request.finished:
            self.blocked_on.append((request.page, self.updated))
            request.finished = True

    def drain(self, requests: list):
        for request in requests:
            self.wait(request)
        return None


def test_stream_reads_ahead_without_blocking_on_writes_it_does_not_need(tmp_path, monkeypatch):
    # While writes are slow, the page ring must only wait for the write whose buffer the
    # next page to update needs (page i - ring size), never for a newer one just to read
    # further ahead: that would leave the disk one write to work on during each update.
    from adambridge.nvme import layout as nvme_layout, stream as nvme_stream
    layout = PageLayout("fp32", 256)
    files = nvme_layout.ParamFiles((tmp_path,), 0, 20 * 256, layout)
    engine = _ScriptedEngine(layout.record_bytes)
    stream = nvme_stream.PageStream(engine)

    def update(*args) -> None:
        engine.updated += 1

    monkeypatch.setattr(nvme_stream.PageStream, "_update", staticmethod(update))
    # (the scripted reads bring no records: nothing to check)
    monkeypatch.setattr(nvme_layout.ParamFiles, "check", lambda *args: None)
    job = nvme_stream.StreamJob(None, None, 1, None, None, files, None, generation=1)
    stream.run(None, [job], "native")
    ring = engine.queue_depth + 1
    # (page whose write was waited for, pages updated by then): page w's write blocks only
    # when page w + ring is next, then the final drain waits for the last ones.
    assert engine.blocked_on == ([(w, w + ring) for w in range(20 - ring)] +
                                 [(w, 20) for w in range(20 - ring, 20)])
    files.close()


def _vm_flags(address: int) -> list:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                mapping = low <= address < high
            elif head == "VmFlags:" and mapping:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"),
                    reason="needs a Linux kernel (reads the mapping's flags in /proc/self/smaps)")
def test_page_buffers_are_private_aligned_and_advised_huge():
    # A record's physically contiguous runs become its DMA segments: a buffer of 256 KiB
    # or more starts on a 2 MiB boundary in private memory advised for huge pages ('hg'),
    # not MAP_SHARED shmem ('sh'), which transparent huge pages leave out.
    for nbytes in (3 << 20, 1552 << 10):  # fp32 and fp8 records of the default page size
        big = direct_io.AlignedBuffer(nbytes)
        address = big.tensor.data_ptr()
        assert address % (2 << 20) == 0 and big.tensor.numel() == len(big.memory) == nbytes
        flags = _vm_flags(address)
        assert "hg" in flags and "sh" not in flags
    small = direct_io.AlignedBuffer(5000)
    assert small.tensor.data_ptr() % direct_io.ALIGN == 0 and small.nbytes == 8192
    assert "sh" not in _vm_flags(small.tensor.data_ptr())
    big.tensor.fill_(7)  # the whole buffer is usable memory
    assert bytes(big.memory[-3:]) == b"\x07\x07\x07"


_FINALIZE_UNDER_THREADING_LOCK = """
import sys, threading, torch
from adambridge import AdamBridge
from adambridge.nvme.tier import OffloadConfig
p = torch.nn.Parameter(torch.randn(1000))
opt = AdamBridge([p], offload_dir=OffloadConfig([sys.argv[1]], page_size=256,
                 io_engine=sys.argv[2]), host_budget=0)
p.grad = torch.randn(1000)
opt.step()  # the helper threads exist now
finalizer = opt.nvme_tier._finalizer
# Where the cyclic GC can run a finalizer: inside Thread._set_tstate_lock of a starting
# thread, which holds this lock; a finalizer that joins a thread then waits for it forever.
with threading._shutdown_locks_lock:
    finalizer()
print("closed")
"""


@pytest.mark.skipif(not hasattr(__import__("threading"), "_shutdown_locks_lock"),
                    reason="needs a CPython whose threading module has _shutdown_locks_lock "
                           "(3.11 and 3.12 do), the lock the deadlock went through")
@pytest.mark.parametrize("engine", ENGINES)
def test_tier_finalizer_never_joins_a_thread(engine, tmp_path):
    # Seen as a hang of the suite: a Thread.start() waiting forever for a new thread whose
    # registration had run the GC, which finalized an old tier, which joined its helpers.
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _FINALIZE_UNDER_THREADING_LOCK, str(tmp_path),
                           engine], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr[-2000:]


_FORKED_CHILD_KEEPS_NO_LOCK = """
import multiprocessing as mp, sys, torch
from adambridge import AdamBridge
from adambridge.nvme.tier import OffloadConfig
from adambridge.nvme.direct_io import TierError

def child(opt, p, ready, release):
    p.grad = torch.ones(300)
    try:
        opt.step()
        ready.put("stepped")
    except TierError as exc:
        ready.put(str(exc))
    release.wait(30)  # alive, holding whatever it inherited, while the parent goes on

if __name__ == "__main__":
    p = torch.nn.Parameter(torch.randn(300))
    config = OffloadConfig([sys.argv[1]], page_size=128, io_engine=sys.argv[2])
    opt = AdamBridge([p], offload_dir=config, host_budget=0, backend="torch")
    p.grad = torch.ones(300)
    opt.step()
    ctx = mp.get_context("fork")  # as a DataLoader worker is made
    ready, release = ctx.Queue(), ctx.Event()
    worker = ctx.Process(target=child, args=(opt, p, ready, release))
    worker.start()
    print(ready.get(timeout=30))
    opt.nvme_tier.close()
    AdamBridge([p], offload_dir=sys.argv[1], host_budget=0, backend="torch")
    print("relocked while the child lives")
    release.set()
    worker.join(30)
"""


@pytest.mark.parametrize("engine", ENGINES)
@NEEDS_FORK
def test_a_forked_child_neither_steps_the_tier_nor_keeps_its_directory_locked(engine, tmp_path):
    # Two processes writing one set of files would corrupt them silently; and an flock held
    # through a DataLoader worker's inherited descriptor kept the directory locked after
    # the optimizer let it go.
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _FORKED_CHILD_KEEPS_NO_LOCK, str(tmp_path),
                           engine], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.splitlines()
    assert said[0].startswith("NVMe tier: this optimizer's files belong to process ")
    assert said[0].endswith("not to this forked child; build the optimizer in the process "
                            "that trains")
    assert said[1] == "relocked while the child lives"
