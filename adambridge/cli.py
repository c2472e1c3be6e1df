"""python -m adambridge: info (diagnose and self-check), build, bench, demo, lab, plan."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from .diagnostics import Facts, environment_facts, native_facts, tier_facts, topology_facts

SOURCE_ROOT = Path(__file__).resolve().parent.parent
BENCH_SCRIPT = SOURCE_ROOT / "benchmarks" / "bench_kernels.py"


def _field(name: str, value: object) -> None:
    print(f"{name + ':':<16}{value}")


def _print_facts(facts: Facts) -> None:
    for name, value in facts:
        _field(name, value)


def _tiny_items(precision: str, seed: int = 1234, n: int = 333):
    """Two identical sets of UpdateItems (bf16 grads, bf16 out) for one tiny step, one per backend."""
    import torch
    from .update import codecs, functional
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen, dtype=torch.float32)
    grad = (torch.randn(n, generator=gen, dtype=torch.float32) * 1e-2).to(torch.bfloat16)
    m = torch.randn(n, generator=gen, dtype=torch.float32) * 1e-3
    v = torch.rand(n, generator=gen, dtype=torch.float32) * 1e-5
    moment = torch.float32 if precision == "fp32" else torch.bfloat16
    hyper = functional.Hyper.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.01, step=3)
    key = codecs.stream_key(seed, 3, 0)

    def item():
        return functional.UpdateItem(
            master=master.clone(), grad=grad.clone(), exp_avg=m.to(moment, copy=True),
            exp_avg_sq=v.to(moment, copy=True),
            exp_avg_scale=None, exp_avg_sq_scale=None, out=torch.empty(n, dtype=torch.bfloat16),
            offset=0, key=key, precision=precision, stochastic_rounding=True, hyper=hyper)
    return [item()], [item()]


def _same_bits(a, b) -> bool:
    import torch
    as_int = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def _self_check() -> bool:
    """One tiny AdamW step natively and with torch; True when they agree bit for bit."""
    from .update import functional
    ok = True
    for precision in ("fp32", "bf16"):
        native, torch_items = _tiny_items(precision)
        try:
            functional.adamw_update(native, backend="native")
            functional.adamw_update(torch_items, backend="torch")
        except Exception as exc:  # noqa: BLE001 - report, do not crash the diagnosis
            _field(f"check {precision}", f"FAIL ({type(exc).__name__}: {exc})")
            ok = False
            continue
        a, b = native[0], torch_items[0]
        bad = [name for name in ("master", "exp_avg", "exp_avg_sq", "out")
               if not _same_bits(getattr(a, name), getattr(b, name))]
        _field(f"check {precision}", "PASS" if not bad else f"FAIL (differs from torch in {', '.join(bad)})")
        ok = ok and not bad
    return ok


def cmd_info(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="python -m adambridge info",
                            description="Print the setup and run a tiny native-vs-torch step.").parse_args(argv)
    _print_facts(environment_facts())
    native, native_ok = native_facts()
    _print_facts(native)
    _print_facts(topology_facts())
    _print_facts(tier_facts())
    ok = native_ok and _self_check()
    _field("result", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def cmd_build(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="python -m adambridge build",
                            description="Compile the native kernel now and print its path.").parse_args(argv)
    from ._native import build, loader
    try:
        print(loader.load().path)
    except (build.NativeBuildError, ValueError) as exc:
        print(f"adambridge: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    if not BENCH_SCRIPT.is_file():
        print(f"adambridge bench needs a source checkout: it runs {BENCH_SCRIPT}, which is not there. "
              "Clone the adambridge repository and run it from there.", file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, str(BENCH_SCRIPT), *argv])


def cmd_demo(argv: Sequence[str]) -> int:
    from .lab import demo
    return int(demo.main(list(argv)) or 0)


def invoked_as() -> str:
    """This command as the user typed it: the `adambridge` console script, else python -m."""
    # NOTE: pip's console scripts run with sys.argv[0] the script's path (.exe on Windows);
    # python -m adambridge runs with it adambridge/__main__.py.
    return "adambridge" if Path(sys.argv[0]).stem == "adambridge" else "python -m adambridge"


def cmd_lab(argv: Sequence[str]) -> int:
    from .lab import app
    return app.main(list(argv), prog=f"{invoked_as()} lab")


def cmd_plan(argv: Sequence[str]) -> int:
    from .plan import cli as plan_cli
    return plan_cli.main(list(argv))


COMMANDS = {
    "info": (cmd_info, "print versions, ISA, NUMA and cache facts; run a tiny native-vs-torch step"),
    "build": (cmd_build, "compile the native kernel now and print the library path"),
    "bench": (cmd_bench, "run benchmarks/bench_kernels.py (source checkout only); arguments forwarded"),
    "demo": (cmd_demo, "run the demo (adambridge.lab.demo); arguments forwarded"),
    "lab": (cmd_lab, "serve the adambridge-lab page; `lab run --preset quick` runs headless"),
    "plan": (cmd_plan, "will offload pay here? bytes, seconds and a recommendation (docs/planning.md)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=invoked_as(),
                                     description="adambridge: host-RAM AdamW with fused SIMD kernels.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    if not argv:
        parser.print_help()
        return 2
    if argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help for -h, or the error for an unknown command; exits
        return 2
    # Each command parses its own arguments, so bench, demo and lab see theirs untouched.
    return COMMANDS[argv[0]][0](argv[1:])
