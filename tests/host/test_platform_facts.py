"""The platform facts and their fallbacks, run here as they run on macOS and Windows.

Each system's CPython lacks some calls Linux has (host/platform_facts.py's table). The fallbacks
use only calls every system has (lseek/read/write, ftruncate, fsync), so they run on Linux
too: ``as_system`` makes ``platform_facts.facts()`` answer as that system's CPython would,
and the NVMe tier then runs, and fails, exactly through those fallbacks. The two Win32 calls
(msvcrt.locking, MoveFileExW) have stand-ins here; scripts/windows_check.sh runs the real ones
under wine.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import threading

import pytest
import torch

import test_nvme
import test_nvme_faults
from adambridge.nvme import direct_io
from adambridge.host import platform_facts
from adambridge.nvme.layout import read_committed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="runs the other systems' fallbacks from Linux")

SYSTEMS = ("darwin", "windows")


class FakeMsvcrt:
    """msvcrt.locking as the Windows C runtime does it (a byte range from the current
    position, EACCES when another handle holds it), kept with flock between descriptors."""

    LK_UNLCK, LK_LOCK, LK_NBLCK = 0, 1, 2

    def __init__(self, held_errno: int = errno.EACCES) -> None:
        self.offsets: list[int] = []
        self.held_errno = held_errno

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        assert mode == self.LK_NBLCK and nbytes == 1
        self.offsets.append(os.lseek(fd, 0, os.SEEK_CUR))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(self.held_errno, os.strerror(self.held_errno)) from None


class Calls:
    """What the stand-ins for the Win32 calls and the syncs were asked to do."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str]] = []
        self.fsyncs = 0
        self.fdatasyncs = 0


@contextlib.contextmanager
def as_system(system: str, held_errno: int = errno.EACCES):
    """platform_facts answers as ``system``'s CPython. Patched by hand, not by monkeypatch:
    the fault tests call monkeypatch.undo() in their middle, and the system must stay."""
    calls, fake = Calls(), FakeMsvcrt(held_errno)
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd):
        calls.fsyncs += 1
        real_fsync(fd)

    def fdatasync(fd):
        calls.fdatasyncs += 1
        real_fdatasync(fd)

    def move(source, target):
        calls.moves.append((source, target))
        os.replace(source, target)

    saved = (platform_facts.facts, platform_facts._msvcrt, platform_facts._move_durably,
             os.fsync, os.fdatasync)
    platform_facts.facts = lambda: platform_facts.facts_of(system)
    platform_facts._msvcrt = lambda: fake
    platform_facts._move_durably = move
    os.fsync, os.fdatasync = fsync, fdatasync
    try:
        yield calls, fake
    finally:
        (platform_facts.facts, platform_facts._msvcrt, platform_facts._move_durably,
         os.fsync, os.fdatasync) = saved


# -- the facts themselves ---------------------------------------------------------------------------

def test_platform_facts_of_this_python_are_linuxs():
    assert platform_facts.facts() == platform_facts.facts_of("linux")


def test_platform_facts_of_unknown_system_is_refused():
    with pytest.raises(ValueError, match=r"Invalid system: 'beos' \(expected one of linux, "
                                         r"darwin, windows\)"):
        platform_facts.facts_of("beos")


# -- each fallback on its own ---------------------------------------------------------------------

def test_platform_seek_io_from_many_threads_lands_each_record_at_its_offset(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    records = [bytes([k]) * (4096 + k) for k in range(16)]
    offsets = [sum(len(r) for r in records[:k]) for k in range(16)]
    try:
        with as_system("windows"):
            threads = [threading.Thread(target=platform_facts.pwritev, args=(fd, [r], o))
                       for r, o in zip(records, offsets)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got = []
            for record, offset in zip(records, offsets):
                view = memoryview(bytearray(len(record)))
                assert platform_facts.preadv(fd, [view], offset) == len(record)
                got.append(bytes(view))
            tail = memoryview(bytearray(100))
            short = platform_facts.preadv(fd, [tail], offsets[-1] + len(records[-1]) - 10)
        assert got == records
        assert short == 10 and bytes(tail[:10]) == records[-1][-10:]
        assert os.pread(fd, len(records[3]), offsets[3]) == records[3]  # the real file
    finally:
        os.close(fd)


@pytest.mark.parametrize("system", SYSTEMS)
def test_platform_reserve_extends_sparse_and_never_shrinks(system, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with as_system(system):
            platform_facts.reserve(fd, 10000)
            assert os.fstat(fd).st_size == 10000
            os.pwrite(fd, b"kept", 9996)
            platform_facts.reserve(fd, 5000)
        assert os.fstat(fd).st_size == 10000 and os.pread(fd, 4, 9996) == b"kept"
    finally:
        os.close(fd)


def test_platform_macos_sync_falls_back_to_fsync_where_full_fsync_is_refused(tmp_path, monkeypatch):
    # NOTE: 51 is macOS's F_FULLFSYNC; Linux refuses that fcntl command (EINVAL), as an SMB
    # mount on macOS refuses F_FULLFSYNC, so the fallback to fsync runs.
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with as_system("darwin") as (calls, _):
            platform_facts.data_sync(fd)
            platform_facts.sync_directory(tmp_path)
        assert (calls.fsyncs, calls.fdatasyncs) == (2, 0)
    finally:
        os.close(fd)


def test_platform_windows_rename_is_durable_itself_and_directories_are_not_opened(tmp_path):
    (tmp_path / "new").write_text("1")
    (tmp_path / "old").write_text("0")
    with as_system("windows") as (calls, _):
        platform_facts.replace(tmp_path / "new", tmp_path / "old")
        platform_facts.sync_directory(tmp_path / "no such directory")  # nothing opened
    assert calls.moves == [(str(tmp_path / "new"), str(tmp_path / "old"))]
    assert (tmp_path / "old").read_text() == "1" and not (tmp_path / "new").exists()
    assert calls.fsyncs == 0


# (errno 0: how wine 8.0's C runtime reports a held lock)
@pytest.mark.parametrize("held_errno", [errno.EACCES, errno.EDEADLK, 0])
def test_platform_windows_lock_sits_past_the_token_and_refuses_a_second_holder(held_errno, tmp_path):
    with as_system("windows", held_errno) as (_, fake):
        first = direct_io.lock_directory(tmp_path)
        token = direct_io.claim_directory(tmp_path, first)
        with pytest.raises(ValueError, match=r"is in use by another optimizer"):
            direct_io.lock_directory(tmp_path)
        direct_io.check_claim(tmp_path, token)  # the token is readable through another handle
        direct_io.release_lock(first)
        direct_io.release_lock(direct_io.lock_directory(tmp_path))
    assert fake.offsets == [platform_facts._MSVCRT_LOCK_OFFSET] * 3


def test_platform_windows_buffers_are_plain_anonymous_maps():
    with as_system("windows"):
        buffer = direct_io.AlignedBuffer(direct_io.ALIGN * 3)
    buffer.tensor.fill_(7)
    assert buffer.tensor.data_ptr() % direct_io.ALIGN == 0 and bytes(buffer.memory[:2]) == b"\x07\x07"


# -- the whole tier through the fallbacks ------------------------------------------------------------

@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("config", test_nvme.CONFIGS[1:3], ids=lambda c: c["desc"])
def test_platform_tier_through_fallbacks_equals_ram_bit_for_bit(system, config, tmp_path):
    with as_system(system) as (calls, _):
        tier_params, tier_opt = test_nvme._run(config, "torch", 3,
                                               **test_nvme._tier_args(tmp_path / system))
        assert f"io_uring is Linux-only, this is {system}" in tier_opt.nvme_tier.pool.describe()
        with pytest.raises(ValueError, match=r"is in use by another optimizer"):
            test_nvme._run(config, "torch", 1, **test_nvme._tier_args(tmp_path / system))
        committed = read_committed(tmp_path / system / "drive0")
        ram_params, ram_opt = test_nvme._run(config, "torch", 3)
        test_nvme._assert_same(ram_params, ram_opt, tier_params, tier_opt)
        tier_opt.nvme_tier.close()
    assert calls.fdatasyncs == 0 and calls.fsyncs > 0
    assert bool(calls.moves) == (system == "windows")
    # The files themselves hold the same bits as the Linux calls write.
    _, linux_opt = test_nvme._run(config, "torch", 3, **test_nvme._tier_args(tmp_path / "linux"))
    linux = read_committed(tmp_path / "linux" / "drive0")
    assert committed.keys() == linux.keys() and committed
    for index, state in committed.items():
        assert state.keys() == linux[index].keys()
        for key, value in state.items():
            assert value.dtype == linux[index][key].dtype
            assert torch.equal(value.view(-1).view(torch.uint8),
                               linux[index][key].view(-1).view(torch.uint8)), (index, key)


@pytest.mark.parametrize("system", SYSTEMS)
def test_platform_tier_auto_engine_says_io_uring_is_linux_only(system, tmp_path):
    with as_system(system):
        said = direct_io.describe_direct_io(str(tmp_path), "x")
        from adambridge.nvme import engine as nvme_engine
        engine = nvme_engine.open_engine("auto", 2)
        try:
            assert engine.describe() == ("a pool of pread/pwrite threads (io_uring unavailable: "
                                         f"io_uring is Linux-only, this is {system})")
        finally:
            engine.close()
    uncached = "F_NOCACHE files work" if system == "darwin" else "buffered files work"
    assert said == (f"no O_DIRECT on {system}; {uncached} in {tmp_path} (offload_dir=...; I/O "
                    f"by x; opt.placement() shows what goes there)")


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("case", test_nvme_faults.INJECTED, ids=lambda c: c["desc"])
def test_platform_tier_fault_through_fallbacks_keeps_previous_step(system, case, tmp_path,
                                                                   monkeypatch):
    with as_system(system):
        test_nvme_faults.test_tier_io_fault_raises_and_keeps_previous_step(
            case, "threads", tmp_path, monkeypatch)
