"""Checkpoint memory and time: the host RAM a save or a load adds, per path and precision, beside torch AdamW.

    python benchmarks/bench_checkpoint.py                      # 51.2M parameters, 5 layers
    python benchmarks/bench_checkpoint.py --params 6M --layers 6 --paths torch,mmap
    python benchmarks/bench_checkpoint.py --paths nvme_trainer,nvme_accelerate,nvme_lightning,lightning
    python benchmarks/bench_checkpoint.py --paths nvme_trainer --framework-saves own   # before

The framework paths save through the framework, with adambridge.integrations' streaming
saves (``--framework-saves own``: the framework's own ``torch.save``, as before them): the
HF Trainer's ``_save_optimizer_and_scheduler`` (optimizer and scheduler), accelerate's
``save_state`` (model as safetensors, optimizer, RNG states) and Lightning's CheckpointIO
given Lightning's checkpoint dict (``state_dict`` and ``optimizer_states``); their file
column is the whole folder or file the framework writes, model included.

The model is ``layers`` equal bf16 ``Linear(w, w, bias=False)`` layers. Every phase (one save
or one load, one optimizer) runs in a fresh process: it builds the model and the optimizer,
takes one step on seeded gradients (a save) or leaves the optimizer fresh (a load), drops
the gradients, saves and loads a one-layer model the same way (so imports and first-call
caches, which do not grow with the model, are not counted), returns freed heap to the OS
(``malloc_trim``), resets the peak RSS
(``/proc/self/clear_refs`` "5", so VmHWM restarts from the current RSS), runs the phase and
reads VmHWM. Peak extra is VmHWM minus the RSS before the phase minus, for a load, the state
the optimizer holds afterwards beyond what it held before (the steady state it was loading,
the NVMe tier's page buffers included: ``host_memory_bytes()['nvme_buffers']``; the
``shard_state_dcp`` load writes into a state made before the measure, by a zero-lr step as
DCP's get_optimizer_state_dict makes one); a load ends with one read
of every state tensor, as the first step would, so a state left in a file mapping counts as
resident too. Two-rank paths run each rank as its own process over gloo on 127.0.0.1 and
report the larger rank. Figures are bytes per parameter of the whole model; "budget" is the
largest parameter's state, the most a phase may add beyond torch AdamW's figure on the same
path. The file column is the bytes the save wrote per parameter.

Linux only (VmHWM, clear_refs). Times are single runs on a shared machine: compare them
within a run, as ratios.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

OPTIMIZERS = ("fp32", "bf16", "fp8", "adamw")
PRECISION_BYTES = {"fp32": 12.0, "bf16": 8.0, "fp8": 6.0 + 8.0 / 128}
# path -> (ranks, has a save phase, has a load phase, the save phase whose files it loads)
PATHS = {
    "torch": (1, True, True, "torch"),
    "mmap": (1, False, True, "torch"),
    "dcp_own": (1, True, False, "dcp_own"),
    "dcp": (1, True, True, "dcp"),
    "nvme": (1, True, True, "nvme"),
    "nvme_mmap": (1, False, True, "nvme"),
    "nvme_stream": (1, True, False, "nvme_stream"),
    "nvme_dcp": (1, True, False, "nvme_dcp"),
    "shard_state": (2, True, True, "shard_state"),
    "shard_state_mmap": (2, False, True, "shard_state"),
    "shard_state_dcp": (2, True, True, "shard_state_dcp"),
    "shard_state_gathered": (2, True, True, "shard_state_gathered"),
    "fsdp2": (2, True, True, "fsdp2"),
    "nvme_trainer": (1, True, False, "nvme_trainer"),
    "nvme_accelerate": (1, True, False, "nvme_accelerate"),
    "nvme_lightning": (1, True, False, "nvme_lightning"),
    "lightning": (1, True, False, "lightning"),
}
FRAMEWORKS = ("trainer", "accelerate", "lightning")  # the last word of a framework path
TITLES = {
    "torch": "torch.save(opt.state_dict()) / opt.load_state_dict(torch.load(f))",
    "mmap": "opt.load_state_dict(torch.load(f, mmap=True))",
    "dcp_own": "dcp.save({'optim': opt.state_dict()})",
    "dcp": "DCP get_/set_optimizer_state_dict + dcp.save / dcp.load",
    "nvme": "NVMe tier (offload_dir, host_budget=0): torch.save / torch.load",
    "nvme_mmap": "NVMe tier: opt.load_state_dict(torch.load(f, mmap=True))",
    "nvme_stream": "NVMe tier: adambridge.checkpoint.save(opt.state_dict(), f)",
    "nvme_dcp": "NVMe tier: dcp.save(get_optimizer_state_dict)",
    "shard_state": "shard_state=True, 2 gloo ranks: torch.save / torch.load",
    "shard_state_mmap": "shard_state=True, 2 gloo ranks: torch.load(f, mmap=True)",
    "shard_state_dcp": "shard_state=True, 2 gloo ranks: DCP of opt.sharded_state_dict()",
    "shard_state_gathered": "shard_state=True, 2 gloo ranks: opt.save_gathered / torch.load",
    "fsdp2": "FSDP2 (fully_shard), 2 gloo ranks: DCP get_/set_",
    "nvme_trainer": "NVMe tier: HF Trainer's optimizer and scheduler save",
    "nvme_accelerate": "NVMe tier: accelerate's save_state",
    "nvme_lightning": "NVMe tier: Lightning's CheckpointIO.save_checkpoint",
    "lightning": "Lightning's CheckpointIO.save_checkpoint",
}


# --------------------------------------------------------------------------- the phase


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _settle() -> None:
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed gradients otherwise


def _model(spec: dict):
    import torch
    torch.manual_seed(0)
    w = spec["width"]
    layers = [torch.nn.Linear(w, w, bias=False) for _ in range(spec["layers"])]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _optimizer(spec: dict, model):
    import torch
    from adambridge import AdamBridge
    params = list(model.parameters())
    if spec["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    extra = {}
    if spec["path"].startswith("nvme"):
        tier = os.path.join(spec["dir"], f"tier-{spec['phase']}-{spec['optimizer']}")
        os.makedirs(tier, exist_ok=True)
        extra = dict(offload_dir=tier, host_budget=0)
    if spec["path"].startswith("shard_state"):
        extra = dict(shard_state=True)
    return AdamBridge(params, lr=1e-3, precision=spec["optimizer"], seed=3, **extra)


def _step(model, opt) -> None:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = (distribute_tensor(grad, p.device_mesh, p.placements)
                  if isinstance(p, DTensor) else grad)
    opt.step()
    for p in model.parameters():
        p.grad = None


def _state_bytes(opt) -> int:
    """Host bytes of the optimizer's state tensors (each storage once), DTensors' local."""
    import torch
    seen, total = set(), 0
    for state in opt.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            value = value.to_local() if hasattr(value, "to_local") else value
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _held(opt) -> int:
    """The optimizer's steady state in host RAM: its state and the NVMe tier's buffers."""
    memory = opt.host_memory_bytes() if hasattr(opt, "host_memory_bytes") else {}
    return _state_bytes(opt) + memory.get("nvme_buffers", 0)


def _touch(opt) -> None:
    """Read every state tensor once, as the first step would (a mapped file is then resident)."""
    import torch
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                # one byte of every page, through a strided view: nothing is allocated
                value.reshape(-1).view(torch.uint8)[::4096].sum()


def _file(spec: dict) -> str:
    return os.path.join(spec["dir"], f"{PATHS[spec['path']][3]}-{spec['optimizer']}")


def _save(spec: dict, model, opt) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    path, target = spec["path"], _file(spec)
    if path in ("torch", "nvme", "shard_state"):
        saved = opt.state_dict()  # a collective under shard_state
        if spec["rank"] == 0:
            torch.save(saved, target)
    elif path == "shard_state_gathered" and spec["optimizer"] != "adamw":
        opt.save_gathered(target if spec["rank"] == 0 else None)  # a collective
    elif path == "shard_state_gathered":  # AdamW: every rank holds the whole state
        if spec["rank"] == 0:
            torch.save(opt.state_dict(), target)
    elif path == "nvme_stream":
        from adambridge.checkpoint import save
        save(opt.state_dict(), target)
    elif path == "dcp_own" or (path == "shard_state_dcp" and spec["optimizer"] == "adamw"):
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=target)
    elif path == "shard_state_dcp":
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=target)
    else:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=target)


def _framework_saver(spec: dict, model, opt):
    """The framework path's save, set up (imports, wrappers) before the measure."""
    import torch
    target, plain = _file(spec), spec.get("framework_saves") == "own"
    framework = spec["path"].rsplit("_", 1)[-1]
    if framework == "trainer":
        import transformers
        from adambridge.integrations.transformers import stream_saves
        args = transformers.TrainingArguments(os.path.join(spec["dir"], "hf"), use_cpu=True,
                                              report_to=[], disable_tqdm=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, schedule))
        if not plain:
            stream_saves(trainer)
        os.makedirs(target, exist_ok=True)
        return lambda: trainer._save_optimizer_and_scheduler(target)
    if framework == "accelerate":
        from accelerate import Accelerator
        from adambridge.integrations.accelerate import stream_saves
        accelerator = Accelerator(cpu=True)
        accelerator.prepare(model, opt)
        if not plain:
            stream_saves(accelerator)
        return lambda: accelerator.save_state(target)
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from adambridge.integrations.lightning import AdamBridgeCheckpointIO
    io = TorchCheckpointIO() if plain else AdamBridgeCheckpointIO()
    return lambda: io.save_checkpoint(
        {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}, target)


def _load(spec: dict, model, opt) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    path, source = spec["path"], _file(spec)
    if path in ("torch", "nvme", "shard_state", "shard_state_gathered") or path.endswith("mmap"):
        opt.load_state_dict(torch.load(source, weights_only=True, mmap=path.endswith("mmap")))
    elif path == "shard_state_dcp":  # AdamW: its own state_dict(), as it was saved
        osd = opt.state_dict() if spec["optimizer"] == "adamw" else opt.sharded_state_dict()
        dcp.load({"optim": osd}, checkpoint_id=source)
        opt.load_state_dict(osd)
    else:
        osd = get_optimizer_state_dict(model, opt)
        dcp.load({"optim": osd}, checkpoint_id=source)
        set_optimizer_state_dict(model, opt, osd)


def _zero_lr_step(model, opt) -> None:
    """A step of lr 0 on zero gradients: the state a DCP load writes into."""
    import torch
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    for p in model.parameters():
        p.grad = None


def _warm_up(spec: dict) -> None:
    """One save and load of a one-layer model through the same path, before the measure:
    imports and first-call caches are not counted as the phase's (they do not grow with
    the model)."""
    import torch
    torch.ones(1 << 22).isfinite().sum()  # starts torch's thread pool, as training has
    tiny = dict(spec, width=8, layers=1, path="torch", dir=os.path.join(spec["dir"], "warm"))
    model = _model(tiny)
    opt = _optimizer(tiny, model)
    _step(model, opt)
    os.makedirs(tiny["dir"], exist_ok=True)
    shared = os.path.join(tiny["dir"], f"{spec['phase']}-{spec['optimizer']}")  # DCP's folders
    target = f"{shared}-{spec.get('rank', 0)}.pt"  # each rank's: two writing one file raced
    torch.save(opt.state_dict(), target)
    loaded = torch.load(target, weights_only=True, mmap=spec["path"].endswith("mmap"))
    _optimizer(tiny, model).load_state_dict(loaded)
    if spec["path"] in ("dcp", "dcp_own", "fsdp2", "nvme_dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                             set_optimizer_state_dict)
        folder = shared
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
        fresh = _optimizer(tiny, model)
        osd = get_optimizer_state_dict(model, fresh)
        dcp.load({"optim": osd}, checkpoint_id=folder)
        set_optimizer_state_dict(model, fresh, osd)
    if spec["path"].rsplit("_", 1)[-1] in FRAMEWORKS:
        framework = dict(tiny, path=spec["path"], phase="warm")
        warm = _optimizer(framework, model)
        _step(model, warm)
        _framework_saver(framework, model, warm)()
    if spec["path"] == "shard_state_gathered" and spec["optimizer"] != "adamw":
        gathered = dict(tiny, path="shard_state_gathered")
        model = _model(gathered)
        opt = _optimizer(gathered, model)  # a collective: every rank warms up
        _step(model, opt)
        opt.save_gathered(shared + "-gathered.pt" if spec.get("rank") == 0 else None)
    if spec["path"] == "shard_state_dcp" and spec["optimizer"] != "adamw":
        import torch.distributed.checkpoint as dcp
        sharded = dict(tiny, path="shard_state_dcp")
        model = _model(sharded)
        opt = _optimizer(sharded, model)  # a collective: every rank warms up
        _step(model, opt)
        folder = shared + "-sharded"
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=folder)
        osd = opt.sharded_state_dict()
        dcp.load({"optim": osd}, checkpoint_id=folder)
        opt.load_state_dict(osd)


def run_phase(spec: dict) -> dict:
    """One phase in this process: {'extra', 'seconds', 'state'} in bytes and seconds."""
    import torch
    import torch.distributed.checkpoint.state_dict  # noqa: F401 (imported before the measure)
    torch.set_num_threads(spec.get("threads", 2))
    model = _model(spec)
    if spec["path"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = _optimizer(spec, model)
    if spec["phase"] == "save":
        _step(model, opt)
    elif spec["path"] == "shard_state_dcp":
        # The state the load writes into, made before the measure: a resumed run has taken
        # this zero-lr step (as DCP's get_optimizer_state_dict takes it) before it loads.
        _zero_lr_step(model, opt)
    save = (_framework_saver(spec, model, opt) if spec["path"].rsplit("_", 1)[-1] in FRAMEWORKS
            else lambda: _save(spec, model, opt))
    _warm_up(spec)
    _settle()
    held_before = _held(opt)
    before, file_before = _kib("VmRSS"), _kib("RssFile")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM restarts from the current RSS
    began = time.perf_counter()
    if spec["phase"] == "save":
        save()
    else:
        _load(spec, model, opt)
        _touch(opt)
    seconds = time.perf_counter() - began
    peak = _kib("VmHWM")
    state = 0
    if spec["phase"] == "load":  # the steady state it loaded (beyond what it held before)
        state = _held(opt) - held_before
    # what the phase left mapped from files (a checkpoint read with mmap=True, say)
    mapped = _kib("RssFile") - file_before
    return {"extra": peak - before - state, "seconds": seconds, "state": state,
            "mapped": mapped}


def _child(spec: dict) -> None:
    if spec["world"] > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                                rank=spec["rank"], world_size=spec["world"])
    result = run_phase(spec)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown of gloo's or DCP's threads


# --------------------------------------------------------------------------- the driver


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(spec: dict, timeout_s: float = 600.0) -> dict:
    """Run one phase in fresh processes (one per rank); the larger rank's extra and time."""
    world = PATHS[spec["path"]][0]
    port = _port()
    children = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child",
         json.dumps(dict(spec, rank=rank, world=world, port=port))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=timeout_s)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if child.returncode != 0 or not lines:
            last = (err.strip().splitlines() or ["no output"])[-1]
            results.append({"error": last})
            continue
        results.append(json.loads(lines[-1]))
    if any("error" in r for r in results):
        return next(r for r in results if "error" in r)
    return {"extra": max(r["extra"] for r in results),
            "seconds": max(r["seconds"] for r in results),
            "state": sum(r["state"] for r in results),
            "mapped": max(r["mapped"] for r in results)}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def parse_count(text: str) -> int:
    units = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].isalpha() else int(text)


def run(params: int, layers: int, paths: list, optimizers: list, folder: str,
        framework_saves: str = "streamed") -> dict:
    """{(path, optimizer): {'save': ..., 'load': ..., 'file': bytes}} for a model of about
    ``params`` parameters in ``layers`` layers."""
    width = int(math.sqrt(params / layers))
    base = dict(width=width, layers=layers, dir=folder, framework_saves=framework_saves)
    results = {}
    for path in paths:
        _, saves, loads, source = PATHS[path]
        for optimizer in optimizers:
            if path == "fsdp2" and optimizer == "fp8":
                results[path, optimizer] = {"refused": "fp8 on FSDP2 is refused by state_dict()"}
                continue
            row = {}
            if saves:
                row["save"] = measure(dict(base, path=path, optimizer=optimizer, phase="save"))
                row["file"] = _size(_file(dict(base, path=path, optimizer=optimizer)))
            if loads:
                if not os.path.exists(_file(dict(base, path=source, optimizer=optimizer))):
                    measure(dict(base, path=source, optimizer=optimizer, phase="save"))
                row["load"] = measure(dict(base, path=path, optimizer=optimizer, phase="load"))
            results[path, optimizer] = row
    return results


def _cell(row: dict, key: str, numel: int, field: str = "extra") -> str:
    if "refused" in row:
        return "refused"
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, dict) and "error" in value:
        return "error"
    if field == "seconds":
        return f"{value['seconds']:.2f}"
    nbytes = value if isinstance(value, int) else value[field]
    return f"{nbytes / numel:.1f}"


def report(results: dict, params: int, layers: int, paths: list, optimizers: list) -> str:
    import torch
    import adambridge
    width = int(math.sqrt(params / layers))
    numel = width * width * layers
    lines = [f"{numel / 1e6:.1f}M parameters ({layers} x Linear({width}, {width}), bf16), "
             f"torch {torch.__version__}, adambridge {adambridge.__version__} "
             f"from {os.path.dirname(adambridge.__file__)}",
             "budget (largest parameter's state), B/param: " + ", ".join(
                 f"{o} {PRECISION_BYTES[o] / layers:.1f}" for o in optimizers if o != "adamw")]
    header = f"{'path':<64} {'':<11}" + "".join(f"{o:>8}" for o in optimizers)
    for label, key, field in (("peak extra, B/param", "save", "extra"),
                              ("peak extra, B/param", "load", "extra"),
                              ("file, B/param", "file", "extra"),
                              ("seconds", "save", "seconds"), ("seconds", "load", "seconds")):
        lines += ["", f"{label} ({key})" if key != "file" else label, header]
        for path in paths:
            cells = [_cell(results[path, o], key, numel, field) for o in optimizers]
            if any(c != "-" for c in cells):
                lines.append(f"{TITLES[path]:<64} {key:<11}" + "".join(f"{c:>8}" for c in cells))
    errors = [f"{path} {o} {k}: {v['error']}" for (path, o), row in results.items()
              for k, v in row.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + ([""] + errors if errors else []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="51.2M", help="about this many parameters")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--paths", default=",".join(PATHS), help=",".join(PATHS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--framework-saves", choices=("streamed", "own"), default="streamed",
                        help="framework paths: adambridge.integrations' streaming saves, or "
                             "the framework's own torch.save (before them)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
    paths, optimizers = args.paths.split(","), args.optimizers.split(",")
    unknown = [p for p in paths if p not in PATHS] + [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown path or optimizer: {', '.join(unknown)}")
    folder = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint-")
    os.makedirs(folder, exist_ok=True)
    try:
        params = parse_count(args.params)
        results = run(params, args.layers, paths, optimizers, folder, args.framework_saves)
        print(report(results, params, args.layers, paths, optimizers))
        if args.json:
            with open(args.json, "w") as out:
                json.dump({f"{p}|{o}": v for (p, o), v in results.items()}, out, indent=1)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
