"""Predicted against measured GPU memory: a small transformers decoder trained a step in async
mode and in sync mode, the peak bytes its step allocates beyond what was there before it,
set beside estimate()'s gradients and activations for the same model and tokens.

``python -m adambridge.plan.measure`` runs it on cuda:0 (scripts/gpu_check.sh does, with
``torch.cuda.max_memory_allocated``); tests/plan/test_plan_memory.py runs the same code on the
CPU, where the peak is read from the profiler's allocation records of the training thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch

GB = 1e9
AGREEMENT = 0.25   # measured within 25% of predicted counts as agreeing
# A Llama-style decoder (~220M parameters) and a step of 4 x 1024 tokens: small enough for
# any GPU in the table, its activations (about 5 GB) large against the CUDA allocator's rounding.
CONFIG = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
              max_position_embeddings=4096, tie_word_embeddings=False)
BATCH, SEQ = 4, 1024
MODES = ("async", "sync")


@dataclass(frozen=True)
class Comparison:
    """One mode: what its step allocated at the peak beyond the step's start, and what the
    plan predicts for it (the gradients the mode holds plus the activations)."""
    mode: str
    predicted_gb: float
    grads_gb: float
    activations_gb: float
    measured_gb: float
    reserved_gb: Optional[float]   # CUDA only: the caching allocator's reserved peak
    in_flight_gb: float            # predicted: released gradients still being copied

    @property
    def ratio(self) -> float:
        return self.measured_gb / self.predicted_gb

    def line(self) -> str:
        verdict = "within" if abs(self.ratio - 1) <= AGREEMENT else "OUTSIDE"
        reserved = "" if self.reserved_gb is None else (
            f"; reserved peak {self.reserved_gb:.3f} GB (predicted in flight up to "
            f"{self.in_flight_gb:.3f} GB)")
        return (f"{self.mode}: predicted {self.predicted_gb:.3f} GB (gradients "
                f"{self.grads_gb:.3f} + activations {self.activations_gb:.3f}), measured "
                f"{self.measured_gb:.3f} GB: {self.ratio:.2f}x ({verdict} {AGREEMENT:.0%}){reserved}")


class CudaPeak:
    """Peak bytes allocated on a CUDA device during ``run(fn)``, beyond those at its start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def run(self, fn: Callable[[], None]) -> tuple[float, Optional[float]]:
        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device)
        start_reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - start,
                torch.cuda.max_memory_reserved(self.device) - start_reserved)


class ProfilerPeak:
    """Peak bytes the calling thread allocates on the CPU during ``run(fn)``: the profiler's
    allocation records summed in time order (a worker thread's are not recorded)."""

    def run(self, fn: Callable[[], None]) -> tuple[float, Optional[float]]:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                         key=lambda e: e.start_ns())
        current = peak = 0
        for record in records:
            current += record.nbytes()
            peak = max(peak, current)
        return float(peak), None


def build(config: dict, device: torch.device):
    """The decoder of ``config``, in bf16 on ``device``, with SDPA attention."""
    import transformers
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    return model.to(device=device, dtype=torch.bfloat16).train()


def _attach_hooks(opt, model) -> None:
    opt.attach_hooks(model)


def compare(mode: str, config: dict, device: torch.device, *, batch: int = BATCH, seq: int = SEQ,
            meter=None, attach: Callable = _attach_hooks, step_in_window: bool = True,
            **opt_args) -> Comparison:
    """Train ``mode`` one warm-up step and one measured step; the plan's figures beside it.

    ``step_in_window`` False measures forward and backward only (on the CPU the update of a
    synchronous step runs on the measured thread, and its temporaries are host memory)."""
    from ..optimizer import AdamBridge
    from . import estimate
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (one of {', '.join(MODES)})")
    model = build(config, device)
    opt = AdamBridge(model.parameters(), lr=1e-5, **opt_args)
    if mode == "async":
        attach(opt, model)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))

    def step(with_update: bool = True) -> None:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
        if with_update:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # the first step: state, staging and the held first update, outside the window
    meter = meter or CudaPeak(device)
    measured, reserved = meter.run(lambda: step(step_in_window))
    if not step_in_window:
        opt.step()
    if mode == "async":
        opt.detach_hooks()
    planned = estimate(model, tokens_per_step=batch * seq, gpu="H100", gpu_memory=1000,
                       host_bw=100, host_ram=1000, numa_nodes=1,
                       small_param_threshold=opt.small_param_threshold)
    row = next(r for r in planned.rows if r.kind == ("offload" if mode == "async" else "sync"))
    grads = _step_grads(planned, mode)
    return Comparison(mode, (grads + row.gpu_activations_gb * GB) / GB, grads / GB,
                      row.gpu_activations_gb, measured / GB,
                      None if reserved is None else reserved / GB, row.gpu_in_flight_gb)


def _step_grads(planned, mode: str) -> float:
    """Gradient bytes the plan has a step allocate: in async mode the largest gradient and the
    small group's (their device slots exist before the step), in sync mode every one."""
    from . import arithmetic as ar
    if mode == "sync":
        return ar.grad_bytes(planned.model.trainable)
    grads = planned.model.grads
    return ar.grad_bytes(grads.largest + grads.small)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adambridge.plan.measure",
                                     description="The plan's GPU memory against a measured step.")
    parser.add_argument("--json", help="also write the comparisons to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("adambridge.plan.measure: torch sees no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("adambridge.plan.measure: needs transformers (the test extra) for its decoder",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    print(f"GPU memory of one training step beyond its start, {torch.cuda.get_device_name(0)}: "
          f"a {CONFIG['num_hidden_layers']}-layer Llama-style decoder (hidden "
          f"{CONFIG['hidden_size']}, vocabulary {CONFIG['vocab_size']}), {BATCH} x {SEQ} tokens, "
          f"torch.cuda.max_memory_allocated against the plan (estimate())")
    results = [compare(mode, CONFIG, device) for mode in MODES]
    for result in results:
        print(result.line())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump([dict(asdict(r), ratio=r.ratio) for r in results], out, indent=2)
    return 0 if all(abs(r.ratio - 1) <= AGREEMENT for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
