"""The lab's phases that run the scripts under benchmarks/: kernels, step and finetune.

The scripts stay scripts (each runs on its own); the lab imports them from the source
checkout and turns the rows they print into report sections.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Iterator

from .phases import Context, PhaseError, source_file, stream
from . import report as lab_report
from .report import Section, bar_plot

KERNEL_PLOT, STEP_PLOT = "kernels-gbs.png", "step-ms.png"
DEEPSPEED = "DeepSpeed CPU Adam (fp32 update)"
ALTERNATIVE = "all-CPU torch AdamW(fused) + casts"


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (it is not part of the installed package)."""
    path = source_file(f"benchmarks/{name}.py")
    spec = importlib.util.spec_from_file_location(f"adambridge_lab_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def thread_counts_kept() -> Iterator[None]:
    """Run a benchmark in this process and leave torch's and the kernel's thread counts as
    they were.

    NOTE: the scripts set both (``--threads``), as a script may; in the lab's process (and a
    test's) another count would outlive the phase, and torch's CPU matmuls and reductions
    split their sums by thread count: a later training run would round differently.
    """
    import torch
    from .._native import loader
    kept = torch.get_num_threads(), loader.num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(kept[0])
        loader.set_num_threads(kept[1])


def _run_main(module: ModuleType, argv: list) -> None:
    try:
        with thread_counts_kept():
            module.main(argv)
    except SystemExit as exc:  # the scripts exit on a failed validation: a failed phase here
        if exc.code not in (None, 0):
            raise PhaseError(f"{module.__name__.split('_lab_')[-1]}.py stopped: {exc.code}") from None


# ---------------------------------------------------------------------------- kernels

def kernels(ctx: Context) -> Section:
    """bench_kernels.py at each size: ms, GB/s and the ratio to the all-CPU torch alternative."""
    bk = load_script("bench_kernels")
    measured = []
    printed = bk.report

    # NOTE: bench_kernels prints its table from report(numel, threads, medians, bytes_per,
    # verdict); wrapping it takes the very numbers it prints, without a second copy of its main().
    def capture(numel, threads, medians, bytes_per, verdict):
        measured.append(dict(numel=numel, threads=threads, medians_s=dict(medians),
                             bytes_per_param=dict(bytes_per), trust=verdict.figures,
                             trust_line=verdict.line))
        printed(numel, threads, medians, bytes_per, verdict)
    bk.report = capture
    sizes = ctx.options["sizes"]
    for i, size in enumerate(sizes):
        ctx.step(i / len(sizes), f"bench_kernels --numel {size}")
        argv = ["--numel", size, "--repeats", str(ctx.options["repeats"])]
        argv += ["--threads", str(ctx.options["threads"])] if ctx.options.get("threads") else []
        _run_main(bk, argv + ([] if ctx.options["torch_backend"] else ["--no-torch-backend"]))
    deepspeed_missing = importlib.util.find_spec("deepspeed") is None
    rows, groups = [], {}
    for size, m in zip(sizes, measured):
        alternative = m["medians_s"].get(ALTERNATIVE)
        bars = groups.setdefault(size, {})
        for name, seconds in m["medians_s"].items():
            gbs = m["bytes_per_param"][name] * m["numel"] / seconds / 1e9
            bars[name] = gbs
            vs = f"{alternative / seconds:.2f}x" if alternative else "-"
            rows.append([size, name, f"{seconds * 1e3:.2f}", f"{gbs:.1f}", vs])
        if DEEPSPEED not in m["medians_s"]:
            rows.append([size, DEEPSPEED, "not installed" if deepspeed_missing else "not measured",
                         "", ""])
    why_not = bar_plot(ctx.folder / KERNEL_PLOT, "host AdamW update, bf16 grads and weights",
                       "GB/s (minimum bytes moved)", groups)
    threads = measured[0]["threads"] if measured else None
    warnings = [f"{size}: {m['trust_line']}" for size, m in zip(sizes, measured) if not m["trust"]["trusted"]]
    return Section(name="kernels", title="Host AdamW kernels (bench_kernels.py)",
                   setup=f"{threads} threads, bf16 gradients in, bf16 weights out; median of "
                         f"{ctx.options['repeats']} interleaved repeats; GB/s counts the minimum "
                         "bytes each variant moves",
                   columns=["size", "variant", "ms", "GB/s", "vs all-CPU torch"], rows=rows,
                   notes=[why_not] if why_not else [], plots=[] if why_not else [KERNEL_PLOT],
                   figures=measured, conclusion=kernels_conclusion(sizes, measured, bool(warnings)),
                   warnings=warnings)


def kernels_conclusion(sizes: list, measured: list, untrusted: bool) -> str:
    """At the largest size: how many times faster each native precision is than the all-CPU torch."""
    if not measured:
        return "nothing was measured"
    size, m = sizes[len(measured) - 1], measured[-1]
    alternative = m["medians_s"].get(ALTERNATIVE)
    native = [(n.split()[1], s) for n, s in m["medians_s"].items() if n.startswith("native ")]
    if alternative is None or not native:
        return f"at {size}: no native kernel row to compare"
    ratios = " / ".join(f"{alternative / s:.2f}x" for _, s in native)
    line = (f"at {size}, native {' / '.join(p for p, _ in native)} moments: {ratios} the all-CPU "
            "torch alternative's speed")
    return line + (" (not to be trusted: see the warning)" if untrusted else "")


# ---------------------------------------------------------------------------- step

def step(ctx: Context) -> Section:
    """bench_step.py: the table it prints (torch AdamW vs AdamBridge sync and async)."""
    import torch
    bs = load_script("bench_step")
    preset = "gpu" if torch.cuda.is_available() else "cpu"
    names = ["torch AdamW"] + [f"adambridge {mode} {p}" for p in bs.PRECISIONS
                               for mode in ("sync", "async")]
    ctx.step(0.0, f"bench_step --preset {preset}")
    try:
        with thread_counts_kept():
            if ctx.options.get("threads"):
                from .._native import loader
                torch.set_num_threads(ctx.options["threads"])
                loader.set_num_threads(ctx.options["threads"])
            result = bs.run(preset, names, float(ctx.options["step_seconds"]))
    except SystemExit as exc:
        raise PhaseError(f"bench_step.py stopped: {exc.code}") from None
    printed = bs.table(result)
    print(printed)
    # The Markdown table bench_step prints is the section's table, cell for cell.
    cells = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in printed.splitlines() if line.startswith("|") and "---" not in line]
    why_not = bar_plot(ctx.folder / STEP_PLOT, f"training step ({preset} preset)", "median ms",
                       {"step": {r["variant"]: r["median_ms"] for r in result["rows"]}})
    untrusted = not result["trust"]["trusted"]
    return Section(name="step", title="Training step (bench_step.py)",
                   setup=printed.splitlines()[0], columns=cells[0], rows=cells[1:],
                   notes=[why_not] if why_not else [], plots=[] if why_not else [STEP_PLOT],
                   figures=result, conclusion=step_conclusion(result["rows"], untrusted),
                   warnings=[result["trust_line"]] if untrusted else [])


def step_conclusion(rows: list, untrusted: bool) -> str:
    """Each AdamBridge async variant's step time against torch AdamW's."""
    times = {r["variant"]: r["median_ms"] for r in rows}
    base = times.get("torch AdamW")
    ours = [(n.replace("adambridge ", ""), ms) for n, ms in times.items() if " async " in f" {n} "]
    if not base or not ours:
        return "no async variant to compare with torch AdamW"
    line = "step time against torch AdamW: " + ", ".join(f"{n} {ms / base:.2f}x" for n, ms in ours)
    return line + (" (not to be trusted: see the warning)" if untrusted else "")


# ---------------------------------------------------------------------------- finetune

def finetune(ctx: Context) -> Section:
    """finetune_llm.py in its own processes: a GPU model on CUDA, a tiny offline model on a CPU."""
    import torch
    script = source_file("benchmarks/finetune_llm.py")
    if importlib.util.find_spec("transformers") is None:
        return Section(name="finetune", title="Fine-tuning a causal LM (finetune_llm.py)",
                       status="skipped", error="not installed: transformers "
                                               "(pip install 'adambridge[finetune]')",
                       conclusion="skipped: transformers is not installed")
    with tempfile.TemporaryDirectory(prefix="adambridge-lab-") as tmp:
        out = Path(tmp) / "finetune"
        steps = ["--steps", str(ctx.options["finetune_steps"])] if ctx.options.get("finetune_steps") else []
        env = dict(os.environ)
        if torch.cuda.is_available():
            argv = ["--preset", "quick", "--device", "cuda"] + steps
        else:
            argv = ["--model-config", "tiny", "--text-file", _offline_text(Path(tmp)), "--device",
                    "cpu", "--batch", "2", "--seq-len", "64", "--noise-runs", "2"] + (steps or ["--steps", "20"])
            env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        rc = stream([sys.executable, str(script), *argv, "--out", str(out)],
                    lambda line: ctx.step(0.5, line) if line.startswith("[") else None, env=env)
        try:
            report = json.loads((out / "report.json").read_text())
        except (OSError, ValueError):
            raise PhaseError(f"finetune_llm.py exited with status {rc} without a report") from None
    section = Section(**report["sections"][0])
    section.notes.append("finetune_llm.py " + " ".join(argv))
    figures = section.figures or {}
    # NOTE: judged by each run's reduction from its own start: the bf16 runs start from the
    # model cast to bf16, so a final-loss difference would partly measure that cast.
    section.conclusion = "by each run's reduction from its own start, " + lab_report.verdicts_line(
        figures.get("runs", []), "adamw", figures.get("noise_band"))
    if report["status"] == "failed":
        section.status, section.error = "failed", "some configurations failed (see their rows)"
    return section


def _offline_text(folder: Path) -> str:
    """~200 KB of the standard library's source, the demo's corpus, as the offline text file."""
    from .demo_model import load_corpus
    tokens, _ = load_corpus(max_bytes=200_000)
    path = folder / "text.txt"
    path.write_bytes(bytes(tokens.tolist()))
    return str(path)
