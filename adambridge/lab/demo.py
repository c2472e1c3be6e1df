"""python -m adambridge demo: fine-tune a small byte-level GPT with AdamBridge and its peers.

The experiment of the README's "Fine-tuning a real LLM", made to need no download. A small
GPT is first pretrained (shared, once, fp32 AdamW at a pretraining learning rate) on the
standard library's source; every configuration then fine-tunes those same weights on the
same batches at a fine-tuning learning rate, where an AdamW update is smaller than half a
bf16 ulp of most weights. Without an fp32 master (BF16-only AdamW) such updates round away.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import demo_model as dm
from . import demo_peers
from . import demo_report as report_mod
from . import report as lab_report
from .demo_fresh import run_fresh, save_setup
from .demo_run import (CONFIGS, PEER_CONFIGS, PRESETS, Config, Preset, Setup,  # noqa: F401
                       build_model, lr_lambda, run_config, train_steps)

ProgressFn = Optional[Callable[[int, int, str], None]]  # (steps done, steps in all, what runs now)


# ---------------------------------------------------------------------------- the experiment

def pretrain(setup: Setup, bar) -> dict:
    """Shared pretraining with fp32 AdamW; returns the fp32 weights every configuration starts from."""
    p = setup.preset
    model = build_model(setup, torch.float32)
    if p.pretrain_steps == 0:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    hyper = dict(lr=p.pretrain_lr, betas=(0.9, 0.95), weight_decay=p.weight_decay)
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    # NOTE: a data order of its own, so pretraining batches do not repeat fine-tuning batches.
    starts = dm.batch_starts(len(setup.train), p.ctx, p.batch, p.pretrain_steps, setup.seed + 10_000)
    train_steps(model, opt, "sync", setup, starts, bar)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def prepare(args: argparse.Namespace, preset: Preset, device: torch.device) -> tuple[Setup, str]:
    """Load and split the text, build the initial model; returns the setup and the text's source."""
    tokens, source = dm.load_corpus(args.text)
    train, val = dm.split_tokens(tokens)
    windows = dm.val_windows(val, preset.ctx, preset.eval_windows)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    init = dm.TinyGPT(preset.width, preset.layers, preset.heads, preset.ctx).state_dict()
    setup = Setup(preset=preset, steps=args.steps or preset.steps, device=device,
                  compute_dtype=compute, train=train, windows=windows, init_state=init,
                  seed=args.seed)
    return setup, source


def stored_dtype(configs: Sequence[Config]) -> torch.dtype:
    """The dtype whose values every configuration's weights hold exactly: bf16 when any stores bf16."""
    low = {c.weights for c in configs} - {torch.float32}
    assert len(low) <= 1, f"one start cannot be exact in each of {low}"  # CONFIGS use fp32 and bf16
    return low.pop() if low else torch.float32


def shared_start(state: dict, dtype: torch.dtype) -> dict:
    """The pretrained weights rounded to `dtype` (kept as fp32 tensors): the start of every run.

    Rounded once for all, so that a configuration storing bf16 weights starts from the very
    values, and so the very loss, of the fp32 reference: the comparison then measures the
    optimizers, never the cast.
    """
    return {k: v.to(dtype).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def run_all(setup: Setup, configs: list[Config], noise_runs: int,
            progress: ProgressFn = None, fresh: bool = False) -> list[dict]:
    """Pretrain once, then fine-tune every configuration (and the reference's noise runs),
    each in this process or, with `fresh`, each in a fresh one (demo_fresh)."""
    plan = [(c, setup.seed, False) for c in configs]
    if "reference" in [c.name for c in configs]:
        plan += [(CONFIGS["reference"], setup.seed + k, True) for k in range(1, noise_runs + 1)]
    bar = report_mod.progress_bar(setup.preset.pretrain_steps + len(plan) * setup.steps, progress)
    try:
        bar.set_description("pretraining (shared)")
        setup.start_dtype = stored_dtype(configs)
        setup.init_state = shared_start(pretrain(setup, bar), setup.start_dtype)
        setup.below_half_ulp = dm.below_half_ulp_fraction(setup.init_state, setup.preset.lr)
        with tempfile.TemporaryDirectory(prefix="adambridge-demo-") as folder:
            setup_file = Path(folder) / "setup.pt"
            if fresh:
                save_setup(setup, setup_file)
            runs = []
            for config, data_seed, noise in plan:
                bar.set_description(config.name + (f" (order {data_seed})" if noise else ""))
                run = (run_fresh(setup_file, config, data_seed, setup.steps, bar) if fresh
                       else run_config(setup, config, data_seed, bar))
                if noise:
                    run.update(noise_run=True, label=f"{config.label}, data order {data_seed}")
                runs.append(run)
    finally:
        bar.close()
    return runs


def peer_configs(names: Optional[str]) -> tuple[list[Config], list[dict]]:
    """The peers to run (--peers), and a row for each of them whose package is not installed."""
    if names is None:
        return [], []
    peers = demo_peers.pick(names)
    missing = [dict(config=p.name, label=p.label, not_installed=p.package)
               for p in peers if not demo_peers.installed(p.package)]
    absent = {row["config"] for row in missing}
    return [PEER_CONFIGS[p.name] for p in peers if p.name not in absent], missing


# ---------------------------------------------------------------------------- command line

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m adambridge demo", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: gpu on a GPU, else small)")
    ap.add_argument("--steps", type=int, help="fine-tuning steps per configuration (default: the preset's)")
    ap.add_argument("--pretrain-steps", type=int, help="shared pretraining steps (default: the preset's)")
    ap.add_argument("--lr", type=float, help="peak fine-tuning learning rate (default: the preset's)")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--text", metavar="FILE", help="train on this file instead of the standard library")
    ap.add_argument("--out", metavar="DIR", help="report folder (default: ./adambridge-demo-<time>)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    ap.add_argument("--noise-runs", type=int, default=2,
                    help="re-run the reference with this many other data orders (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="weights and data-order seed (default 0)")
    ap.add_argument("--peers", nargs="?", const="all", metavar="NAMES",
                    help="also run the peers (all, or a comma-separated subset of: "
                         f"{', '.join(demo_peers.PEERS)}), every configuration then in a fresh "
                         f"process; {demo_peers.INSTALL} installs them")
    args = ap.parse_args(list(argv))
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s): {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.peers is not None:
        try:
            demo_peers.pick(args.peers)
        except ValueError as exc:
            ap.error(str(exc))
    for name in ("steps", "pretrain_steps", "noise_runs"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "steps" else 0):
            ap.error(f"Invalid --{name.replace('_', '-')}: {value}")
    return args


class DeviceError(ValueError):
    """--device names a device this machine cannot run the demo on: one line why."""


def pick_device(requested: Optional[str]) -> torch.device:
    """The demo's device: the one asked for once it is known to work here, else cuda or cpu."""
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise DeviceError(f"Invalid --device {requested!r}: choose cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"this torch (CUDA {torch.version.cuda}) sees no GPU")
        raise DeviceError(f"Invalid --device {requested!r}: {why}; use --device cpu (or install "
                          "a CUDA build of torch on a machine with a GPU)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"Invalid --device {requested!r}: this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"Invalid --device {requested!r}: the demo runs on cpu or cuda")
    return device


def pick_preset(args: argparse.Namespace, device: torch.device) -> Preset:
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "small")]
    changes = {k: v for k, v in [("pretrain_steps", args.pretrain_steps), ("lr", args.lr)]
               if v is not None}
    return dataclasses.replace(preset, **changes)


def describe(setup: Setup, args: argparse.Namespace, source: str) -> dict:
    p = setup.preset
    numel = sum(v.numel() for v in setup.init_state.values())
    device = str(setup.device)
    if setup.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(setup.device)})"
    return dict(
        model=f"byte-level GPT, {p.layers} x {p.width} ({numel:,} parameters)",
        preset=args.preset or ("gpu" if setup.device.type == "cuda" else "small"),
        device=device, compute_dtype=str(setup.compute_dtype).replace("torch.", ""),
        text=source, train_bytes=len(setup.train), val_sequences=len(setup.windows),
        steps=setup.steps, batch=p.batch, ctx=p.ctx, lr=p.lr, pretrain_steps=p.pretrain_steps,
        pretrain_lr=p.pretrain_lr, weight_decay=p.weight_decay, betas=list(p.betas),
        warmup=p.warmup, schedule="linear warm-up, cosine decay to 0", seed=setup.seed,
        small_param_threshold=p.small_param_threshold,
        lr_below_half_bf16_ulp=setup.below_half_ulp, start_weights=_start_weights(setup.start_dtype),
        noise_runs=args.noise_runs, torch=torch.__version__, threads=torch.get_num_threads(),
        host=f"{lab_report.cpu_name()}, {os.cpu_count()} CPUs", date=f"{datetime.date.today()}",
        processes="a fresh process each" if args.peers is not None else "one process for all",
        peers={p: demo_peers.version(p) for p in demo_peers.PACKAGES if demo_peers.installed(p)})


def _start_weights(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "from the same pretrained fp32 weights"
    return f"from the same weights: the pretrained ones rounded to {dm.DTYPE_NAMES[dtype]}"


def _start_loss(runs: list[dict]) -> Optional[float]:
    measured = [r for r in runs if "start_val_loss" in r]
    ref = [r for r in measured if r["config"] == "reference"]
    return (ref or measured or [{}])[0].get("start_val_loss")


def _load() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def experiment(args: argparse.Namespace, progress: ProgressFn = None) -> dict:
    """Run the whole comparison; returns the report (setup, runs, noise band, table)."""
    device = pick_device(args.device)
    setup, source = prepare(args, pick_preset(args, device), device)
    peers, not_installed = peer_configs(args.peers)
    configs = [CONFIGS[c] for c in args.configs.split(",")] + peers
    print(f"adambridge demo: {len(configs)} configurations + {args.noise_runs} noise runs "
          f"on {device}; text: {source}")
    if args.peers is None:
        print(f"adambridge demo: {demo_peers.skipped_line()}")
    t0, load_before = time.perf_counter(), _load()
    runs = run_all(setup, configs, args.noise_runs, progress, fresh=args.peers is not None)
    runs += not_installed
    described = dict(describe(setup, args, source), load_average=[load_before, _load()])
    report = dict(setup=described, runs=runs,
                  noise_band=lab_report.noise_band(runs, "reference"),
                  start_val_loss=_start_loss(runs), wall_seconds=round(time.perf_counter() - t0, 1))
    report["table"] = report_mod.format_table(report)
    return report


PLOT = "loss_curves.png"


def write_files(report: dict, out: Path) -> Optional[str]:
    """The demo's plot and its lab report (report.json, report.md) in `out`; why no plot, or None."""
    why_not = report_mod.write_plot(report, out / PLOT)
    section = report_mod.section(report, [] if why_not else [PLOT])
    if why_not:
        section.notes.append(why_not)
    lab_report.write_report(out, preset="demo", title="adambridge demo", sections=[section],
                            status="complete", wall_seconds=report["wall_seconds"], extra=report)
    return why_not


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"adambridge-demo-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    try:
        pick_device(args.device)  # before the report folder exists
        made = not out.exists()
        lab_report.check_writable(out)
    except (DeviceError, lab_report.ReportDirError) as exc:
        print(f"adambridge demo: {exc}", file=sys.stderr)
        return 1
    try:
        report = experiment(args)
    except KeyboardInterrupt:
        return _interrupted(out, made)
    print(report["table"])
    why_not = write_files(report, out)
    print(f"report: {out / 'report.json'}" + (f"; {why_not}" if why_not else f", plot: {out / PLOT}"))
    return 0


def _interrupted(out: Path, made: bool) -> int:
    """Ctrl-C before the results: remove the report folder this run made (it is still empty)."""
    if made and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        where = f"removed the empty {out}"
    else:
        where = f"left {out} as it was"
    print(f"\nadambridge demo: interrupted before any result; nothing was written ({where})",
          file=sys.stderr)
    return 130
