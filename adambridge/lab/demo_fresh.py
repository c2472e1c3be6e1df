"""One demo configuration in a fresh Python process: the protocol of `demo --peers`.

Every configuration, ours and the peers', runs in a process of its own, so that what one
package loads, builds, compiles or leaks (DeepSpeed's JIT-built CPU Adam, torchao's compiled
steps) is never counted against another, and a peer that crashes costs only its own row. The
parent saves the shared setup (data, starting weights, schedule) once; each child loads it,
runs `demo_run.run_config` and writes its result, or the one-line reason it could not run.

    python -m adambridge.lab.demo_fresh SETUP CONFIG DATA_SEED RESULT   (the parent's call)
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from . import demo_peers
from .demo_run import CONFIGS, PEER_CONFIGS, Config, Preset, Setup, run_config

STEP_LINE = "adambridge-demo-step"  # what a child prints after each step (the parent's progress)
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def save_setup(setup: Setup, path: Path) -> None:
    """The shared setup as plain data (tensors, numbers, names), loadable with weights_only."""
    data = {f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)}
    data.update(preset=dataclasses.asdict(setup.preset), device=str(setup.device),
                compute_dtype=str(setup.compute_dtype), start_dtype=str(setup.start_dtype),
                threads=torch.get_num_threads())
    torch.save(data, path)


def load_setup(path: Path) -> Setup:
    """The setup save_setup wrote, with the parent's intra-op thread count applied here."""
    data = torch.load(path, weights_only=True)
    torch.set_num_threads(data.pop("threads"))
    preset = data.pop("preset")
    return Setup(**dict(data, preset=Preset(**dict(preset, betas=tuple(preset["betas"]))),
                        device=torch.device(data["device"]),
                        compute_dtype=_DTYPES[data["compute_dtype"]],
                        start_dtype=_DTYPES[data["start_dtype"]]))


# ---------------------------------------------------------------------------- the parent

def _env() -> dict:
    # NOTE: the child must import this very adambridge, also when it runs from a checkout
    # that is not installed (python -m from the source tree).
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root] + ([path] if path else [])))


def run_fresh(setup_file: Path, config: Config, data_seed: int, steps: int, bar: Any) -> dict:
    """Run one configuration in a fresh process; its result, or a row saying why it has none."""
    result = setup_file.with_name(f"{config.name}-{data_seed}.json")
    cmd = [sys.executable, "-m", "adambridge.lab.demo_fresh", str(setup_file), config.name,
           str(data_seed), str(result)]
    with tempfile.TemporaryFile("w+") as err:
        # NOTE: the child leads a process group of its own, so that an interrupted run (Ctrl-C
        # reaches this process alone) ends it with everything it started (a peer's compile
        # workers, a JIT build), not the child alone.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env(),
                                start_new_session=_POSIX)
        try:
            done = sum(_progress(line, bar) for line in proc.stdout)
            status = proc.wait()
        except BaseException:
            end_group(proc)
            raise
        err.seek(0)
        said = [line.strip() for line in err.read().splitlines() if line.strip()]
    if result.exists():
        return json.loads(result.read_text())
    bar.update(max(0, steps - done))  # the steps it never ran, so the bar still ends full
    return dict(config=config.name, label=config.label, data_seed=data_seed,
                error=f"the process ended with status {status}" + (f": {said[-1][:200]}" if said else ""))


_POSIX = hasattr(os, "killpg")


def end_group(proc: subprocess.Popen) -> None:
    """Kill a child started with start_new_session and every process of its group, and reap
    it; a second Ctrl-C meanwhile does not stop this."""
    while True:
        try:
            if _POSIX:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # the group has ended already
                    pass
            else:
                proc.kill()
            proc.wait()
            return
        except KeyboardInterrupt:
            continue


def _progress(line: str, bar: Any) -> int:
    if line.strip() != STEP_LINE:
        return 0
    bar.update(1)
    return 1


# ---------------------------------------------------------------------------- the child

class _StepLines:
    """The child's progress bar: one line per step on stdout, which the parent counts."""

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            print(STEP_LINE, flush=True)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def run_isolated(setup: Setup, config: Config, data_seed: int) -> dict:
    """Prepare what the configuration needs, outside its memory probe, then run it; an
    exception becomes the row's one-line reason, and a peer's own warnings are kept."""
    peer = demo_peers.PEERS.get(config.name)
    try:
        if peer is not None:
            peer.prepared()
        elif config.optimizer == "adambridge":
            from .._native import loader
            loader.native_or_none()  # load (or build) the kernel before the run, as a peer's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_config(setup, config, data_seed, _StepLines())
    except Exception as exc:  # the peer's own failure, measured: its row says it in one line
        return dict(config=config.name, label=config.label, data_seed=data_seed, error=one_line(exc))
    if peer is not None:
        own = [str(w.message).strip().splitlines()[0] for w in caught
               if f"{os.sep}{peer.package}{os.sep}" in str(w.filename)]
        result["warnings"] = list(dict.fromkeys(own))
    return result


def main(argv: Sequence[str]) -> int:
    setup_file, name, data_seed, result_file = argv
    setup = load_setup(Path(setup_file))
    config = {**CONFIGS, **PEER_CONFIGS}[name]
    result = run_isolated(setup, config, int(data_seed))
    Path(result_file).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
