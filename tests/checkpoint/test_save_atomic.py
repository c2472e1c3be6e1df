"""adambridge.checkpoint.save to a path is atomic: a kill or a full drive never costs the previous checkpoint.

Kills are real (SIGKILL of a child process that saves in a loop, while a file is being written);
a full drive is a small tmpfs the test mounts, skipped where it cannot mount one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from adambridge.checkpoint import save

_SAVER = textwrap.dedent("""
    import sys, torch
    from adambridge.checkpoint import save
    path, numel = sys.argv[1], int(sys.argv[2])
    for i in range(1, 1000):
        print(f"writing {i}", flush=True)
        save({"version": i, "values": torch.full((numel,), float(i))}, path)
""")


def _writing(folder: Path, numel: int) -> bool:
    """Whether a checkpoint is being written in ``folder``: a file there holds less than a
    whole one (the target truncated and refilled in place, or a partial file beside it)."""
    for entry in folder.iterdir():
        try:
            if entry.stat().st_size < numel * 4:
                return True
        except FileNotFoundError:  # renamed meanwhile
            continue
    return False


def _kill_while_saving(path: Path, version: int, numel: int) -> None:
    """Start a child that saves versions 1, 2, ... to ``path``; SIGKILL it while it writes
    ``version`` (seen as a file of less than a whole checkpoint)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _SAVER, str(path), str(numel)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in child.stdout:
            if line.strip() == f"writing {version}":
                while not _writing(path.parent, numel) and child.poll() is None:
                    pass
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL


KILLS = [{"desc": "while writing the second", "version": 2},
         {"desc": "while writing the third", "version": 3},
         {"desc": "while writing the fifth", "version": 5}]


@pytest.mark.parametrize("case", KILLS, ids=lambda c: c["desc"])
def test_save_killed_midway_leaves_the_previous_checkpoint_whole(case, tmp_path):
    path, numel = tmp_path / "optim.pt", 1 << 22  # 16 MiB: the kill lands inside the write
    _kill_while_saving(path, case["version"], numel)
    loaded = torch.load(path, weights_only=True)
    # The save that was killed either finished (rename done) or left the last one whole.
    assert loaded["version"] in (case["version"] - 1, case["version"])
    assert torch.equal(loaded["values"], torch.full((numel,), float(loaded["version"])))
    save({"version": 0}, path)  # the next save removes what the killed one left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optim.pt"]


def test_save_to_a_path_writes_no_partial_file_beside_it(tmp_path):
    save({"a": torch.arange(10)}, tmp_path / "x.pt")
    save({"a": torch.arange(3)}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


@pytest.fixture
def small_drive(tmp_path):
    """A 3 MiB tmpfs mounted for the test (needs root and mount(2))."""
    mount = tmp_path / f"drive-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root on Linux")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        # (lazy: a test that failed may still hold a file there until it is collected)
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_save_onto_a_full_drive_names_the_path_and_space_and_keeps_the_previous(small_drive):
    path = small_drive / "optim.pt"
    save({"values": torch.ones(1000)}, path)
    with pytest.raises(OSError, match=r"no space left on the drive of .*optim\.pt: the "
                                      r"checkpoint needs about 4\.2 MB, 3\.\d MB were free; "
                                      r"free space there or save to another drive") as info:
        save({"values": torch.zeros(1 << 20)}, path)
    assert "\n" not in str(info.value)
    assert torch.equal(torch.load(path, weights_only=True)["values"], torch.ones(1000))
    assert [p.name for p in small_drive.iterdir()] == ["optim.pt"]
