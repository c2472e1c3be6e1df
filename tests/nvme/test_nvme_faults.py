"""NVMe tier faults: each raises one line at a defined point and leaves the previous step intact.

Injected in the I/O layer of both engines (the thread pool's direct_io._preadv/_pwritev, the
io_uring engine's uring._completed: EIO, ENOSPC, short transfers), made real
where this machine allows (a 1 MiB tmpfs that fills up, a read-only mount; both need root),
and done to the files from outside (truncation, a removed directory, a SIGKILL mid-step).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.nvme import direct_io, uring
from adambridge.nvme.tier import OffloadConfig
from adambridge.nvme.direct_io import TierError
from adambridge.nvme.layout import read_committed
from conftest import NEEDS_SIGKILL
from test_nvme import ENGINES
from _test_paths import folders

SIZES = (17, 1000, 4097)   # 17 stays in RAM under the budget below, the others go to files
BUDGET = 200
REPO = Path(__file__).resolve().parents[2]


def _params() -> list:
    gen = torch.Generator().manual_seed(5)
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]


def _grads(params: list, step: int) -> list:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _optimizer(params: list, dirs: list, budget=BUDGET, engine: str = "auto") -> AdamBridge:
    return AdamBridge(params, lr=1e-2, precision="bf16", backend="torch", host_budget=budget,
                      offload_dir=OffloadConfig(dirs, page_size=256, queue_depth=2,
                                                io_engine=engine))


def _step(opt: AdamBridge, params: list, step: int) -> None:
    for p, g in zip(params, _grads(params, step)):
        p.grad = g
    opt.step()


def _ram_run(steps: int) -> tuple[list, AdamBridge]:
    params = _params()
    opt = AdamBridge(params, lr=1e-2, precision="bf16", backend="torch")
    for step in range(1, steps + 1):
        _step(opt, params, step)
    return params, opt


def _drives(tmp_path: Path, count: int = 2) -> list:
    dirs = [tmp_path / f"drive{i}" for i in range(count)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def _snapshot(opt: AdamBridge, params: list) -> tuple:
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


def _assert_state(opt, params, snapshot) -> None:
    values, state = snapshot
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    now = opt.state_dict()["state"]
    for i in state:
        for key in state[i]:
            assert torch.equal(now[i][key].float(), state[i][key].float()), (i, key)


def _assert_committed_equals(directory: Path, ram_opt: AdamBridge, step: int) -> None:
    committed = read_committed(directory)
    assert sorted(committed) == [1, 2]
    ram_state = ram_opt.state_dict()["state"]
    for i, state in committed.items():
        assert int(state["step"]) == step
        for key, tensor in state.items():
            assert torch.equal(tensor.float(), ram_state[i][key].reshape(tensor.shape).float())


def _failing(real, after: int, error):
    calls = [0]

    def call(fd, buffers, offset):
        calls[0] += 1
        if calls[0] > after:
            if isinstance(error, int):
                return error  # a short transfer of this many bytes
            raise error
        return real(fd, buffers, offset)
    return call


def _failing_completion(kind: str, after: int, error):
    """The io_uring twin of _failing: the (after+1)-th and later completions of ``kind``
    ('reading' or 'writing') report ``error`` (-errno, or a short byte count)."""
    real, calls = uring._completed, [0]

    def completed(what, fd, offset, result):
        if what != kind:
            return real(what, fd, offset, result)
        calls[0] += 1
        if calls[0] > after:
            return error if isinstance(error, int) else -error.errno
        return real(what, fd, offset, result)
    return completed


def _inject(monkeypatch, engine: str, call: str, after: int, error) -> None:
    """Make the engine's ``call`` ('_preadv' or '_pwritev') fail after ``after`` good ones."""
    if engine == "threads":
        monkeypatch.setattr(direct_io, call, _failing(getattr(direct_io, call), after, error))
    else:
        kind = {"_preadv": "reading", "_pwritev": "writing"}[call]
        monkeypatch.setattr(uring, "_completed", _failing_completion(kind, after, error))


INJECTED = [
    dict(desc="EIO writing a page", call="_pwritev", error=OSError(errno.EIO, "Input/output error"),
         match=r"writing .*adambridge-p\d\.bin failed \(Input/output error\); check the drive"),
    dict(desc="ENOSPC writing a page", call="_pwritev",
         error=OSError(errno.ENOSPC, "No space left on device"),
         match=r"writing .*adambridge-p\d\.bin failed \(No space left on device\); free space"),
    dict(desc="a short write", call="_pwritev", error=0,
         match=r"writing .*adambridge-p\d\.bin failed \(No space left on device\)"),
    dict(desc="EIO reading a page", call="_preadv", error=OSError(errno.EIO, "Input/output error"),
         match=r"reading .*adambridge-p\d\.bin failed \(Input/output error\)"),
    dict(desc="a short read", call="_preadv", error=100,
         match=r"reading .*adambridge-p\d\.bin at byte \d+ returned 100 of 4096 bytes"),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", INJECTED, ids=lambda c: c["desc"])
def test_tier_io_fault_raises_and_keeps_previous_step(case, engine, tmp_path, monkeypatch):
    params = _params()
    dirs = _drives(tmp_path)
    opt = _optimizer(params, dirs, engine=engine)
    assert opt.nvme_tier.pool.name == engine
    for step in (1, 2):
        _step(opt, params, step)
    before = _snapshot(opt, params)
    _inject(monkeypatch, engine, case["call"], 3, case["error"])
    with pytest.raises(TierError, match=case["match"]) as info:
        _step(opt, params, 3)
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    _assert_state(opt, params, before)  # params (RAM ones too), steps and files as after step 2
    ram_params, ram_opt = _ram_run(3)
    _assert_committed_equals(dirs[0], _ram_run(2)[1], 2)
    opt.step()  # the same gradients again, now without the fault: as if nothing had happened
    for p, q in zip(params, ram_params):
        assert torch.equal(p, q)
    _assert_committed_equals(dirs[0], ram_opt, 3)


@pytest.mark.parametrize("engine", ENGINES)
def test_tier_truncated_file_is_named_before_anything_changes(engine, tmp_path):
    params = _params()
    dirs = _drives(tmp_path)
    opt = _optimizer(params, dirs, engine=engine)
    _step(opt, params, 1)
    values = [p.detach().clone() for p in params]
    os.truncate(dirs[1] / "adambridge-p2.bin", 100)
    with pytest.raises(TierError, match=r"adambridge-p2\.bin is 100 bytes, expected \d+: it was "
                                        r"truncated outside adambridge; restore the optimizer"):
        _step(opt, params, 2)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert [int(s["step"]) for s in opt.state.values()] == [1, 1, 1]


def test_tier_removed_directory_fails_at_publish_with_nothing_changed(tmp_path):
    params = _params()
    dirs = _drives(tmp_path)
    opt = _optimizer(params, dirs)
    _step(opt, params, 1)
    values = [p.detach().clone() for p in params]
    shutil.rmtree(dirs[0])  # the open files live on; the manifest cannot be published
    with pytest.raises(TierError, match=r"publishing the manifest .*drive0/adambridge-manifest"
                                        r"\.json failed \(No such file or directory\); the "
                                        r"directory was removed"):
        _step(opt, params, 2)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert [int(s["step"]) for s in opt.state.values()] == [1, 1, 1]


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    if getattr(os, "geteuid", lambda: -1)() != 0:
        pytest.skip("mounting a small tmpfs needs root (the injected ENOSPC test covers the "
                    "logic without it)")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        gc.collect()  # an optimizer that raised may still hold files open through its frames
        # Lazy: detaches the mount even if a file is still open, so no test leaves one behind.
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_tier_full_drive_fails_the_first_step_with_nothing_changed(tmp_path):
    with _tmpfs(tmp_path / "small", "size=1M") as small:
        # 20k elements need 79 pages x 2 slots x 4 KiB = 0.65 MB: the second one does not fit.
        params = [nn.Parameter(torch.randn(20_000)) for _ in range(3)]
        values = [p.detach().clone() for p in params]
        opt = _optimizer(params, [small], budget=0)
        with pytest.raises(TierError, match=r"reserving \d+ bytes for .*small/adambridge-p\d\.bin "
                                            r"failed \(No space left on device\); free space"):
            _step(opt, params, 1)
        assert all(torch.equal(p, v) for p, v in zip(params, values))
        assert all("exp_avg" not in s and int(s.get("step", 0)) == 0 for s in opt.state.values())


def test_tier_read_only_directory_is_refused_at_construction(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1M") as read_only:
        with pytest.raises(ValueError, match=r"creating .*ro/adambridge\.lock failed \(Read-only "
                                             r"file system\); pass a writable offload_dir"):
            _optimizer(_params(), [read_only])


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = {tests!r}
    from adambridge.nvme import direct_io, layout as nvme_layout, uring
    import test_nvme_faults as t
    params = t._params()
    opt = t._optimizer(params, [{d0!r}, {d1!r}])
    for step in (1, 2):
        t._step(opt, params, step)
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if {where!r} == "pages" and opt.nvme_tier.pool.name == "threads":
        real = direct_io._pwritev
        calls = [0]
        def write(fd, buffers, offset):
            calls[0] += 1
            if calls[0] == 4:
                die()
            return real(fd, buffers, offset)
        direct_io._pwritev = write
    elif {where!r} == "pages":  # io_uring: die as the fourth write completes
        real = uring._completed
        calls = [0]
        def completed(kind, fd, offset, result):
            calls[0] += kind == "writing"
            if calls[0] == 4:
                die()
            return real(kind, fd, offset, result)
        uring._completed = completed
    else:
        nvme_layout.os.replace = die  # the new manifest is written and fsynced, not renamed
    t._step(opt, params, 3)
""")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["pages", "manifest"])
@NEEDS_SIGKILL
def test_tier_kill_mid_step_leaves_previous_step_readable(where, engine, tmp_path):
    dirs = _drives(tmp_path)
    script = CRASH_SCRIPT.format(tests=folders(), d0=str(dirs[0]), d1=str(dirs[1]),
                                 where=where)
    env = dict(os.environ, PYTHONPATH=str(REPO), ADAMBRIDGE_NVME_IO=engine)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    _assert_committed_equals(dirs[0], _ram_run(2)[1], 2)


@pytest.mark.parametrize("engine", ENGINES)
def test_tier_state_dict_waits_for_in_flight_writes(engine, tmp_path, monkeypatch):
    params = _params()
    dirs = _drives(tmp_path)
    opt = _optimizer(params, dirs, budget=0, engine=engine)
    _step(opt, params, 1)
    started = threading.Event()
    real_write, real_completed = direct_io._pwritev, uring._completed

    def slow_write(fd, buffers, offset):
        started.set()
        time.sleep(0.01)  # widen the window in which a checkpoint could see half a step
        return real_write(fd, buffers, offset)

    def slow_completion(kind, fd, offset, result):
        if kind == "writing":
            started.set()
            time.sleep(0.01)
        return real_completed(kind, fd, offset, result)

    if engine == "threads":
        monkeypatch.setattr(direct_io, "_pwritev", slow_write)
    else:
        monkeypatch.setattr(uring, "_completed", slow_completion)
    stepping = threading.Thread(target=_step, args=(opt, params, 2))
    stepping.start()
    assert started.wait(30)
    saved = opt.state_dict()["state"]
    stepping.join(30)
    ram_state = _ram_run(2)[1].state_dict()["state"]
    for i in ram_state:
        assert int(saved[i]["step"]) == 2
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[i][key].float(), ram_state[i][key].reshape(-1).float())


@pytest.mark.parametrize("engine", ENGINES)
def test_tier_async_fault_raises_at_step_sync_and_keeps_previous_step(engine, tmp_path,
                                                                      monkeypatch):
    params = _params()
    dirs = _drives(tmp_path)
    opt = AdamBridge(params, lr=1e-2, precision="bf16", backend="torch", host_budget=BUDGET,
                     offload_dir=OffloadConfig(dirs, page_size=256, queue_depth=2,
                                               io_engine=engine),
                     chunk_size=256, small_param_threshold=64)
    opt.attach_hooks(nn.ParameterList(params))

    def backward(step: int) -> None:  # linear in each parameter: its gradient is _grads()
        sum((p * g).sum() for p, g in zip(params, _grads(params, step))).backward()

    for step in (1, 2):
        backward(step)
        opt.step_sync()
    values = [p.detach().clone() for p in params]
    _inject(monkeypatch, engine, "_pwritev", 3, OSError(errno.EIO, "Input/output error"))
    backward(3)
    with pytest.raises(RuntimeError, match=r"the update worker for cpu failed \(TierError: NVMe "
                                           r"tier: writing .*adambridge-p\d\.bin failed \(Input/"
                                           r"output error\).*no parameter or optimizer state"):
        opt.step_sync()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert [int(s["step"]) for s in opt.state.values()] == [2, 2, 2]
    _assert_committed_equals(dirs[0], _ram_run(2)[1], 2)
