"""Fine-tune a Hugging Face causal LM on WikiText-2 with AdamBridge and its peers (needs a GPU).

The README's "Fine-tuning a real LLM" experiment. Every configuration starts from the same
weights, sees the same batches in the same order (a fixed number of steps, linear warm-up
then cosine decay) and runs in a fresh process, so memory numbers are its own. Validation
loss is measured on the whole validation split.

  python benchmarks/finetune_llm.py                    # Qwen/Qwen2.5-0.5B, 200 x 8 x 512 tokens
  python benchmarks/finetune_llm.py --preset quick     # HuggingFaceTB/SmolLM2-135M, 60 x 8 x 256
  python benchmarks/finetune_llm.py --model-config tiny --text-file FILE --device cpu  # offline

Configurations: all-device AdamW (the reference: fp32 weights, bf16 autocast), AdamBridge
with fp32/bf16/fp8 moments (bf16 weights), BF16-only AdamW (bf16 weights, no fp32 master),
and whichever peers import (the demo's list, adambridge/lab/demo_peers.py): bitsandbytes
AdamW8bit and PagedAdamW8bit, DeepSpeed's CPU Adam with an fp32 host master and fp32 states
or a bf16 master and bf16 states, torchao's AdamW8bit, AdamW4bit, AdamWFp8 and
CPUOffloadOptimizer. Writes an adambridge-lab report (report.json, report.md) into --out;
peers that do not import get a "not installed" row, and one that raises a row with its error.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

try:
    import adambridge
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import adambridge
from adambridge.lab import demo_peers, report as lab_report, trust
from adambridge.lab.demo_fresh import one_line
from adambridge.lab.demo_memory import MemoryProbe
from adambridge.lab.demo_model import bf16_changed_fraction, split_tokens
from adambridge.lab.demo_peers import HostMasterOptimizer  # noqa: F401  (tests use it from here)
from adambridge.lab.demo_report import mode_cell, step_ms_cell, why_no_result
from adambridge.lab.demo_run import attach, hooked, lr_lambda, set_lr, step_timing

GIB = 1 << 30
PRESETS = {
    "full": dict(model="Qwen/Qwen2.5-0.5B", steps=200, batch=8, seq_len=512),
    "quick": dict(model="HuggingFaceTB/SmolLM2-135M", steps=60, batch=8, seq_len=256),
}
# A randomly initialised model built from a config (no download), with byte-level tokens.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            tie_word_embeddings=True)


# ---------------------------------------------------------------------------- configurations

def _adamw(params, hyper, device):
    return torch.optim.AdamW(params, fused=device.type == "cuda", **hyper)


def _adambridge(precision: str):
    def make(params, hyper, device):
        return adambridge.AdamBridge(params, precision=precision, **hyper)
    return make


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    label: str
    weights: torch.dtype         # how the model's weights are stored on the device
    make: Callable
    needs: Optional[str] = None  # the package a peer needs (skipped when it does not import)


CONFIGS = {c.name: c for c in [
    Config("adamw", "AdamW, all on the device (reference)", torch.float32, _adamw),
    Config("adambridge-fp32", "AdamBridge fp32 moments", torch.bfloat16, _adambridge("fp32")),
    Config("adambridge-bf16", "AdamBridge bf16 moments", torch.bfloat16, _adambridge("bf16")),
    Config("adambridge-fp8", "AdamBridge fp8 moments", torch.bfloat16, _adambridge("fp8")),
    *(Config(p.name, p.label, p.weights, p.build, p.package) for p in demo_peers.PEERS.values()),
    Config("bf16-only", "BF16-only AdamW", torch.bfloat16, _adamw),
]}


# ---------------------------------------------------------------------------- data and model

def load_texts(args: argparse.Namespace) -> tuple[str, str, str]:
    """Train text, validation text and where they came from."""
    if args.text_file:
        data = torch.frombuffer(bytearray(Path(args.text_file).read_bytes()), dtype=torch.uint8)
        train, val = split_tokens(data)
        decode = lambda t: bytes(t.tolist()).decode("utf-8", errors="replace")  # noqa: E731
        return decode(train), decode(val), f"{args.text_file} (every 10th block held out)"
    from datasets import load_dataset
    ds = load_dataset("wikitext", "wikitext-2-raw-v1")
    return ("".join(ds["train"]["text"]), "".join(ds["validation"]["text"]),
            "WikiText-2 (wikitext-2-raw-v1), train / whole validation split")


def tokenize(args: argparse.Namespace, text: str) -> torch.Tensor:
    """Token ids: the model's tokenizer, or UTF-8 bytes for --model-config tiny."""
    if args.model_config == "tiny":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int32)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    return torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.int32)


def prepare_data(args: argparse.Namespace, path: Path) -> dict:
    """Tokenize once in the parent; every worker loads the same ids."""
    train, val, source = load_texts(args)
    data = dict(train=tokenize(args, train), val=tokenize(args, val), source=source)
    torch.save(data, path)
    return data


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """The initial fp32 model on the CPU: pretrained weights, or a seeded tiny random model."""
    from transformers import AutoModelForCausalLM
    if args.model_config == "tiny":
        from transformers import Qwen2Config
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(Qwen2Config(**TINY), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)


def train_batches(train: torch.Tensor, args: argparse.Namespace, data_seed: int) -> torch.Tensor:
    """(steps, batch, seq_len) token ids: shuffled non-overlapping blocks, one order per seed."""
    blocks = train[: len(train) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    need = args.steps * args.batch
    gen = torch.Generator().manual_seed(data_seed)
    order = torch.cat([torch.randperm(len(blocks), generator=gen)
                       for _ in range(-(-need // len(blocks)))])[:need]
    return blocks[order].view(args.steps, args.batch, args.seq_len).long()


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args: argparse.Namespace, device, autocast) -> float:
    """Mean next-token loss over the whole validation split, in blocks of seq_len."""
    model.eval()
    n = len(val) // args.seq_len * args.seq_len
    chunks = list(torch.split(val[:n].view(-1, args.seq_len), args.batch))
    if len(val) - n >= 2:
        chunks.append(val[n:].unsqueeze(0))  # the shorter last block
    total = count = 0.0
    for ids in chunks:
        ids = ids.long().to(device)
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss.float().item()
        predicted = ids.shape[0] * (ids.shape[1] - 1)
        total, count = total + loss * predicted, count + predicted
    model.train()
    return total / count


# ---------------------------------------------------------------------------- one configuration

def build(config: Config, model, args, device) -> tuple[Any, str, Callable]:
    """The configuration's optimizer, its mode, and the autocast context for its forward pass."""
    hyper = dict(lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    opt = config.make(list(model.parameters()), hyper, device)
    mode = attach(opt, model, config.name)  # "sync" where no tensor would be hooked
    # NOTE: fp32 weights compute in bf16 autocast on a GPU (the usual mixed precision);
    # bf16 weights compute in bf16 as they are.
    use_autocast = device.type == "cuda" and config.weights == torch.float32
    autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=use_autocast)  # noqa: E731
    return opt, mode, autocast


def train(model, opt, mode: str, autocast, batches: torch.Tensor, args, device,
          monitor: trust.LoadMonitor) -> list[float]:
    """Run the fixed batches with warm-up and cosine decay; returns the step times (s).
    `monitor` reads the machine's load before each step, outside the timed part."""
    factor = lr_lambda(len(batches), args.warmup)
    times = []
    for step, ids in enumerate(batches):
        for group in opt.param_groups:
            set_lr(group, args.lr * factor(step))
        ids = ids.to(device)
        monitor.sample()
        t0 = time.perf_counter()
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step_sync() if mode == "async" else opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def run_worker(args: argparse.Namespace) -> dict:
    """Fine-tune with one configuration in this (fresh) process; returns its measurements, or
    the one-line error a peer raised."""
    config = CONFIGS[args.worker]
    try:
        if config.needs is not None:
            demo_peers.PEERS[config.name].prepared()  # import, build: outside the measurements
        return measure(config, args)
    except Exception as exc:  # the configuration's own failure, measured: its row says it
        return dict(config=config.name, label=config.label, data_seed=args.data_seed,
                    error=one_line(exc))


def measure(config: Config, args: argparse.Namespace) -> dict:
    """Every measurement of one configuration's run, from its own start loss to its final one."""
    device = torch.device(args.device)
    data = torch.load(Path(args.out) / "data.pt")
    probe = MemoryProbe(device)
    probe.start()
    model = load_model(args).to(device, config.weights)
    opt, mode, autocast = build(config, model, args, device)
    start_loss = evaluate(model, data["val"], args, device, autocast)
    batches = train_batches(data["train"], args, args.data_seed)
    monitor = trust.LoadMonitor(torch.get_num_threads())
    times = train(model, opt, mode, autocast, batches, args, device, monitor)
    memory = probe.stop()
    final_loss = evaluate(model, data["val"], args, device, autocast)
    numel = sum(p.numel() for p in model.parameters())
    initial = dict(load_model(args).named_parameters())  # after the memory readings
    changed = bf16_changed_fraction({k: v.detach() for k, v in initial.items()},
                                    dict(model.named_parameters()))
    return dict(config=config.name, label=config.label, data_seed=args.data_seed, mode=mode,
                hooked=hooked(opt, mode),
                weights=str(config.weights).replace("torch.", ""), start_val_loss=start_loss,
                final_val_loss=final_loss, bf16_changed=changed, parameters=numel,
                **step_timing(times, monitor),
                state_bytes_per_param=demo_peers.state_bytes_per_param(opt, numel),
                backend=opt.backend if isinstance(opt, adambridge.AdamBridge) else None,
                **memory)


# ---------------------------------------------------------------------------- the parent

def available(config: Config) -> bool:
    return config.needs is None or importlib.util.find_spec(config.needs) is not None


def plan_runs(args: argparse.Namespace) -> list[tuple[Config, int, bool]]:
    """(configuration, data seed, is a noise run) for each worker, the reference first."""
    names = args.configs.split(",") if args.configs else list(CONFIGS)
    configs = [CONFIGS[n] for n in names if available(CONFIGS[n]) or args.configs]
    plan = [(c, args.seed, False) for c in configs]
    if "adamw" in names:
        plan += [(CONFIGS["adamw"], args.seed + k, True) for k in range(1, args.noise_runs + 1)]
    return plan


def spawn(argv: Sequence[str], config: Config, data_seed: int, out: Path) -> dict:
    """Run one configuration in a fresh Python process and read back its result."""
    result = out / f"{config.name}-seed{data_seed}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", config.name,
           "--data-seed", str(data_seed), "--result", str(result)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not result.exists():
        tail = proc.stdout.strip().splitlines()[-3:]
        return dict(config=config.name, label=config.label, data_seed=data_seed,
                    error=" / ".join(tail) or f"exit status {proc.returncode}")
    return json.loads(result.read_text())


def not_installed(args: argparse.Namespace) -> list[dict]:
    """A row for each peer left out of the default plan because its package does not import."""
    if args.configs:
        return []  # asked for by name: planned, and a failed import is its error
    return [dict(config=c.name, label=c.label, not_installed=c.needs)
            for c in CONFIGS.values() if not available(c)]


def section(report: dict) -> lab_report.Section:
    """The runs as a lab report section: the table a README quotes, and every number."""
    s, runs, band = report["setup"], report["runs"], report["noise_band"]
    ref = next((r for r in runs if r["config"] == "adamw" and "final_val_loss" in r
                and not r.get("noise_run")), None)
    setup = (f"Setup: {s['device']}, torch {s['torch']}, adambridge {s['adambridge']}; "
             f"{s['steps']} steps of {s['batch']} x {s['seq_len']} tokens on {s['data']}, "
             f"peak lr {s['lr']:g}, warm-up {s['warmup']:.0%} then cosine decay; "
             f"validation loss at start {report['start_val_loss']}.")
    columns = ["configuration", "weights", "mode", "val loss", "vs reference", "bf16 changed",
               "ms/step", "peak GPU GiB", "RSS growth GiB †", "state B/param"]
    notes = ["vs reference: the reference's loss reduction from its own start minus this "
             "run's (positive: worse), so a run that starts from a cast is judged by its optimizer.",
             lab_report.noise_note(runs, "adamw", band) + ".",
             "ms/step: median step time after the warm-up steps; (in brackets): rejected by the "
             f"trust rule (steps spread past {trust.SPREAD_LIMIT:.0%} of their median, or other "
             "work competed for the CPUs), not a speed figure.",
             "† growth of the process's resident memory beyond the reference's.",
             "state B/param: bytes the optimizer holds per parameter, counted from its state "
             "tensors and host master copies, wherever they live (host or GPU)."]
    return lab_report.Section(name="finetune", title=f"Fine-tuning {s['model']}", setup=setup,
                              columns=columns, rows=[_row(r, ref, band) for r in runs],
                              notes=notes, figures=dict(setup=s, runs=runs, noise_band=band))


def _row(r: dict, ref: Optional[dict], band: Optional[float]) -> list[str]:
    why = why_no_result(r)
    if why is not None:
        return [r["label"], why] + [""] * 8
    delta = "-"
    if ref is not None and r is not ref:
        # NOTE: judged by each run's own reduction: a bf16 run starts from a cast of the
        # weights, so its start loss differs, and a final-loss difference would measure that
        # cast, not the optimizer.
        delta = (f"{lab_report.loss_delta(r, ref, by_reduction=True):+.4f} "
                 f"({lab_report.verdict(r, ref, band, by_reduction=True)})")
    gpu = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / GIB:.2f}"
    rss = r["rss_growth_bytes"] - (ref["rss_growth_bytes"] if ref else 0)
    return [r["label"], r["weights"], mode_cell(r), f"{r['final_val_loss']:.4f}", delta,
            f"{r['bf16_changed']:.1%}", step_ms_cell(r), gpu, f"{rss / GIB:+.2f}",
            f"{r['state_bytes_per_param']:.2f}"]


# ---------------------------------------------------------------------------- command line

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--model", help="Hugging Face model id or path (default: the preset's)")
    ap.add_argument("--model-config", choices=["tiny"],
                    help="build a tiny random model from a config instead (offline; byte tokens)")
    ap.add_argument("--text-file", help="train and validate on this file instead of WikiText-2")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default 2e-5)")
    ap.add_argument("--warmup", type=float, default=0.1, help="warm-up fraction (default 0.1)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--configs", help=f"comma-separated subset of: {', '.join(CONFIGS)} "
                                      "(default: all whose packages import)")
    ap.add_argument("--noise-runs", type=int, default=2, help="reference re-runs with other data orders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="report folder (default: out/finetune-llm-<time>)")
    for hidden in ("--worker", "--result", "--data-seed"):  # set by the parent for its workers
        ap.add_argument(hidden, help=argparse.SUPPRESS, type=int if hidden == "--data-seed" else str)
    args = ap.parse_args(list(argv))
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [c for c in (args.configs or "").split(",") if c and c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s): {', '.join(unknown)}")
    return args


def describe(args: argparse.Namespace, data: dict) -> dict:
    device = args.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name(torch.device(device))})"
    model = f"a tiny random Qwen2 ({TINY['num_hidden_layers']} x {TINY['hidden_size']})" \
        if args.model_config == "tiny" else args.model
    return dict(model=model, device=device, data=data["source"], train_tokens=len(data["train"]),
                val_tokens=len(data["val"]), steps=args.steps, batch=args.batch,
                seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                weight_decay=args.weight_decay, seed=args.seed, noise_runs=args.noise_runs,
                torch=torch.__version__, adambridge=adambridge.__version__)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(run_worker(args), indent=2))
        return 0
    out = lab_report.check_writable(
        Path(args.out or f"out/finetune-llm-{datetime.datetime.now():%Y%m%d-%H%M%S}"))
    data = prepare_data(args, out / "data.pt")
    forwarded = [a for a in argv] + (["--out", str(out)] if not args.out else [])
    runs = []
    for i, (config, data_seed, noise) in enumerate(plan_runs(args)):
        print(f"[{i + 1}] {config.name} (data order {data_seed}) ...", flush=True)
        run = spawn(forwarded, config, data_seed, out=out)
        run["noise_run"] = noise
        runs.append(run)
    runs += not_installed(args)
    start = next((r["start_val_loss"] for r in runs if r.get("start_val_loss") is not None), None)
    report = dict(setup=describe(args, data), runs=runs, noise_band=lab_report.noise_band(runs, "adamw"),
                  start_val_loss=None if start is None else round(start, 4))
    (out / "data.pt").unlink()
    failed = any("error" in r for r in runs)
    lab_report.write_report(out, preset="finetune", title=f"Fine-tuning {report['setup']['model']}",
                            sections=[section(report)], status="failed" if failed else "complete",
                            options=dict(argv=list(argv)), extra=report)
    print((out / "report.md").read_text())
    print(f"reports: {out / 'report.json'}, {out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
