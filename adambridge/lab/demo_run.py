"""One demo configuration's run: the presets, the configurations, and training one of them.

`demo.py` runs these in its own process, or (with --peers) each in a fresh one through
`demo_fresh.py`; either way every configuration starts from the same weights and sees the
same batches in the same order.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Optional

import torch

from . import demo_model as dm
from . import demo_peers, trust
from .demo_memory import MemoryProbe


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model size, batch shape and schedule of one demo size."""
    width: int
    layers: int
    heads: int
    ctx: int
    batch: int
    steps: int           # fine-tuning steps per configuration
    pretrain_steps: int  # shared pretraining steps, run once
    pretrain_lr: float
    lr: float            # peak fine-tuning learning rate
    eval_windows: int    # validation sequences
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup: float = 0.1  # fraction of the steps spent warming up, then cosine decay to 0
    small_param_threshold: int = 65536  # AdamBridge's: tensors this large get a backward hook


# NOTE: every tensor of the tiny and small models is under AdamBridge's default
# small_param_threshold, so their async rows would hook nothing; 1024 hooks the weight
# matrices and embeddings and leaves the biases and norms to step_sync(), as the default
# does on a model the size of the gpu preset.
PRESETS = {
    "tiny": Preset(width=32, layers=1, heads=2, ctx=32, batch=4, steps=12, pretrain_steps=12,
                   pretrain_lr=3e-3, lr=1e-4, eval_windows=8, small_param_threshold=1024),
    "small": Preset(width=96, layers=2, heads=4, ctx=64, batch=16, steps=250, pretrain_steps=300,
                    pretrain_lr=3e-3, lr=4e-5, eval_windows=64, small_param_threshold=1024),
    "gpu": Preset(width=512, layers=8, heads=8, ctx=256, batch=32, steps=600,
                  pretrain_steps=1500, pretrain_lr=1e-3, lr=3e-5, eval_windows=512),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One optimizer configuration: how the weights are stored and who updates them."""
    name: str
    label: str
    weights: torch.dtype
    optimizer: str                  # "adamw" (torch.optim.AdamW), "adambridge" or "peer"
    precision: Optional[str] = None  # AdamBridge moment precision


CONFIGS = {c.name: c for c in [
    Config("reference", "AdamW, fp32 weights", torch.float32, "adamw"),
    Config("adambridge-fp32", "AdamBridge fp32 moments", torch.bfloat16, "adambridge", "fp32"),
    Config("adambridge-bf16", "AdamBridge bf16 moments", torch.bfloat16, "adambridge", "bf16"),
    Config("adambridge-fp8", "AdamBridge fp8 moments", torch.bfloat16, "adambridge", "fp8"),
    Config("bf16-only", "BF16-only AdamW", torch.bfloat16, "adamw"),
]}
PEER_CONFIGS = {p.name: Config(p.name, p.label, p.weights, "peer") for p in demo_peers.PEERS.values()}


@dataclasses.dataclass
class Setup:
    """Everything the runs share: data, initial weights, device and hyperparameters."""
    preset: Preset
    steps: int
    device: torch.device
    compute_dtype: torch.dtype
    train: torch.Tensor
    windows: torch.Tensor
    init_state: dict
    seed: int
    below_half_ulp: Optional[float] = None  # share of weights where an update of lr rounds away
    start_dtype: torch.dtype = torch.float32  # what the shared starting weights were rounded to


def lr_lambda(steps: int, warmup: float):
    """Linear warm-up over the first `warmup` fraction of the steps, then cosine decay to 0."""
    warm = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
    return factor


def base_lrs(opt) -> list[float]:
    """Each param group's learning rate now, as a float (a schedule's peak)."""
    return [float(group["lr"]) for group in opt.param_groups]


def set_lr(group: dict, lr: float) -> None:
    """Write a scheduled learning rate into a param group in the form its optimizer holds."""
    # NOTE: torchao's optimizers hold lr as a tensor (so a new value does not recompile their
    # step) and refuse a float written over it; a float lr stays a float.
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def make_optimizer(config: Config, model: torch.nn.Module, preset: Preset,
                   seed: int) -> tuple[Any, str, str]:
    """The optimizer for a configuration, its mode ("sync"/"async") and its backend."""
    hyper = dict(lr=preset.lr, betas=preset.betas, weight_decay=preset.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **hyper), "sync", "torch"
    if config.optimizer == "peer":
        peer = demo_peers.PEERS[config.name]
        device = next(model.parameters()).device
        opt = peer.build(list(model.parameters()), hyper, device)
        return opt, "sync", f"{peer.package} {demo_peers.version(peer.package)}"
    from ..optimizer import AdamBridge
    opt = AdamBridge(model.parameters(), precision=config.precision, seed=seed,
                     small_param_threshold=preset.small_param_threshold, **hyper)
    backend = opt.backend  # resolve (and build) the kernel now, outside the timed steps
    return opt, attach(opt, model, f"adambridge demo: {config.name}"), backend


def attach(opt: Any, model: torch.nn.Module, name: str) -> str:
    """attach_hooks(model) where it hooks something; returns the mode that then runs: "async"
    (some update overlaps backward) or "sync" (async mode failed here, or hooked no tensor)."""
    if not hasattr(opt, "attach_hooks"):
        return "sync"
    try:
        opt.attach_hooks(model)
    except Exception as exc:  # async mode unavailable here (e.g. not implemented): use step()
        print(f"{name}: attach_hooks failed ({exc}); using step()")
        return "sync"
    if not opt.pipeline.hooked:  # every tensor under small_param_threshold: nothing overlaps
        opt.detach_hooks()
        return "sync"
    return "async"


def hooked(opt: Any, mode: str) -> Optional[list[int]]:
    """[tensors hooked, tensors owned] of an async run (what its mode column says), else None."""
    if mode != "async":
        return None
    return [len(opt.pipeline.hooked), len(opt.pipeline.owned)]


def build_model(setup: Setup, weights: torch.dtype) -> dm.TinyGPT:
    p = setup.preset
    model = dm.TinyGPT(p.width, p.layers, p.heads, p.ctx)
    model.load_state_dict(setup.init_state)
    model = model.to(setup.device, weights)
    model.compute_dtype = setup.compute_dtype
    return model


def train_steps(model, opt, mode: str, setup: Setup, starts: torch.Tensor, bar, on_eval=None,
                monitor: Optional[trust.LoadMonitor] = None,
                overlap: Optional[list] = None) -> tuple[list[float], list[float]]:
    """Run the optimizer over the given batches; returns per-step losses and times (s).

    `monitor` reads the machine's load before each step, outside the timed part; `overlap`
    ([0, 0]) adds up the async steps' elements updated during backward and at step_sync()."""
    # NOTE: the schedule is written into param_groups directly (what an LR scheduler does):
    # in async mode there is no opt.step() for torch's schedulers to count.
    factor = lr_lambda(len(starts), setup.preset.warmup)
    base_lr = base_lrs(opt)
    cuda = setup.device.type == "cuda"
    losses, times = [], []
    for step, batch_starts in enumerate(starts):
        seqs = dm.gather(setup.train, batch_starts, setup.preset.ctx).to(setup.device)
        for group, lr in zip(opt.param_groups, base_lr):
            set_lr(group, lr * factor(step))
        if monitor is not None:
            monitor.sample()
        t0 = time.perf_counter()
        loss = dm.lm_loss(model, seqs)
        loss.backward()
        stats = opt.step_sync() if mode == "async" else opt.step()
        if overlap is not None and mode == "async":
            overlap[0] += stats.elems_in_backward
            overlap[1] += stats.elems_in_step
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        bar.update(1)
        if on_eval is not None:
            on_eval(step + 1)
    return losses, times


def run_config(setup: Setup, config: Config, data_seed: int, bar) -> dict:
    """Fine-tune the shared initial weights with one configuration; returns its results."""
    started = time.perf_counter()
    # NOTE: an optimizer that draws from torch's generator (torchao's stochastic rounding)
    # draws the same numbers in this process or a fresh one, so a run repeats exactly.
    torch.manual_seed(setup.seed)
    probe = MemoryProbe(setup.device)
    probe.start()
    model = build_model(setup, config.weights)
    opt, mode, backend = make_optimizer(config, model, setup.preset, setup.seed)
    batch = setup.preset.batch
    val_curve = [(0, dm.evaluate(model, setup.windows, batch, setup.device))]
    every = max(1, setup.steps // 10)

    def on_eval(step: int) -> None:
        if step % every == 0 or step == setup.steps:
            val_curve.append((step, dm.evaluate(model, setup.windows, batch, setup.device)))

    starts = dm.batch_starts(len(setup.train), setup.preset.ctx, batch, setup.steps, data_seed)
    monitor = trust.LoadMonitor(torch.get_num_threads())
    overlap = [0, 0]  # elements updated during backward, at step_sync()
    losses, times = train_steps(model, opt, mode, setup, starts, bar, on_eval, monitor,
                                overlap)
    memory = probe.stop()
    numel = sum(p.numel() for p in model.parameters())
    result = dict(
        config=config.name, label=config.label, data_seed=data_seed, mode=mode, backend=backend,
        hooked=hooked(opt, mode),
        off_path=overlap[0] / sum(overlap) if sum(overlap) else None,
        weights=str(config.weights).replace("torch.", ""),
        start_val_loss=val_curve[0][1], final_val_loss=val_curve[-1][1],
        val_curve=val_curve, train_curve=losses,
        bf16_changed=dm.bf16_changed_fraction(setup.init_state, model.state_dict()),
        **step_timing(times, monitor),
        state_bytes_per_param=demo_peers.state_bytes_per_param(opt, numel), **memory,
        seconds=round(time.perf_counter() - started, 1))
    _release(opt)
    return result


def warmup_steps(steps: int) -> int:
    """Steps left out of the timing: the first ones allocate the state, build plans, compile."""
    return min(3, steps // 4)


def step_timing(times: list, monitor: trust.LoadMonitor) -> dict:
    """The median step time and whether it can be trusted, by the benchmarks' rule
    (trust.judge): its steps spread past trust.SPREAD_LIMIT of their median, or other
    work wanted the CPUs while it ran, and it is not a speed figure."""
    timed = times[warmup_steps(len(times)):]
    verdict = trust.judge({"step": timed}, monitor)
    figures = verdict.figures
    spread, others = figures["spread"]["step"], figures.get("other_runnable")
    reasons = [f"its steps spread {spread:.0%} of their median"] if spread > figures["spread_limit"] else []
    if others is not None and others + monitor.threads > monitor.cpus:
        reasons.append(f"{others:g} other runnable threads beside its {monitor.threads} on "
                       f"{monitor.cpus} CPUs")
    return dict(ms_per_step=1000 * statistics.median(timed), step_ms=[1000 * t for t in timed],
                step_spread=spread, other_runnable=others, timing_trusted=verdict.trusted,
                timing_reasons=reasons)


def _release(opt: Any) -> None:
    for name in ("detach_hooks", "close"):
        if callable(getattr(opt, name, None)):
            getattr(opt, name)()
            break


