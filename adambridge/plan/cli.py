"""python -m adambridge plan: the plan's flags, its table or JSON, --check and --bench-json."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import arithmetic, check, report
from .errors import PlanError
from .model import parse_count

EXAMPLES = """examples:
  python -m adambridge plan --params 7e9 --gpu H100 --tokens-per-step 8192
  python -m adambridge plan --model path/to/config.json --lora-rank 16 --lora-targets q_proj,v_proj
  python -m adambridge plan --params 70e9 --gpus 8 --gpu H200 --json
  python -m adambridge plan --params 1e9 --gpu RTX4090 --check     # measure the host update too
  python -m adambridge plan --params 1e9 --gpu-memory 12 --gpu-name "RTX 3060"   # a card not in the table
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        print(f"adambridge plan: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--params", help="parameter count, e.g. 7e9, 7B or 494M")
    group.add_argument("--model", help="a local Hugging Face config.json (or its folder), counted without "
                       "weights; nothing is downloaded")
    group.add_argument("--trainable", help="trainable parameters: a fraction (<= 1) or a count")
    group.add_argument("--lora-rank", help="LoRA rank r (needs --model and --lora-targets)")
    group.add_argument("--lora-targets", help="comma-separated module names (peft's matching) or all-linear")
    group.add_argument("--small-param-threshold", default="65536",
                       help="the optimizer's small_param_threshold: smaller parameters keep their "
                       "gradient on the GPU until step() in async mode (default 65536)")
    group = parser.add_argument_group("work")
    group.add_argument("--tokens-per-step", default="4096", help="tokens per optimizer step per GPU (default 4096)")
    group.add_argument("--accumulation", default="1", help="backward passes per step (default 1)")
    group.add_argument("--gpus", default="1", help="GPUs on this host (default 1)")
    group.add_argument("--parallel", default="ddp", help="ddp (default) or fsdp2")
    group.add_argument("--activations-gb", help="activation memory per GPU in GB (default: estimated "
                       "from --model's config; not counted with --params alone)")
    group.add_argument("--activation-checkpointing", action="store_true",
                       help="count the activations (and the recomputed forward) of activation "
                       "checkpointing, one region per decoder layer")
    group = parser.add_argument_group("GPU (default: the CUDA card found; any other card: "
                                      "--gpu-memory, with --gpu-name)")
    group.add_argument("--gpu", help="a name from the table: " + ", ".join(_known()))
    group.add_argument("--gpu-memory", help="GPU memory in GB (without --gpu or a CUDA card: a card "
                       "of that memory, the other figures defaults the output names)")
    group.add_argument("--gpu-name", help="the card's name as the output prints it")
    group.add_argument("--gpu-tflops", help="achieved bf16 TFLOP/s")
    group.add_argument("--link-gbps", help="host link GB/s (gigabytes per second, both directions on one budget)")
    group.add_argument("--hbm-gbps", help="GPU memory GB/s a fused AdamW reaches")
    group = parser.add_argument_group("host (default: measured here)")
    group.add_argument("--host-bw", help="host memory bandwidth in GB/s")
    group.add_argument("--host-ram", help="host RAM in GB")
    group.add_argument("--numa-nodes", help="NUMA nodes of the host")
    group.add_argument("--host-update-ns", help="the kernel's arithmetic per element where it is "
                       "slower than memory, e.g. fp8=1.1,bf16=0.7 (default: measured with --host-bw unset)")
    group.add_argument("--host-reserve", default="0.10", help="fraction of RAM left to the OS and data loader (0.10)")
    group = parser.add_argument_group("NVMe")
    group.add_argument("--nvme-gbps", default="7", help="drive GB/s, all drives together (default 7)")
    group.add_argument("--drive-tb", default="3.84", help="drive capacity in TB (default 3.84)")
    group.add_argument("--dwpd", default="1", help="rated drive writes per day over 5 years (default 1)")
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true", help="print the plan as JSON")
    group.add_argument("--check", action="store_true",
                       help="also run the host update here and print predicted vs measured")
    group.add_argument("--check-precisions", default=",".join(arithmetic.PRECISIONS),
                       help="moment precisions --check runs (default fp32,bf16,fp8)")
    group.add_argument("--check-size", default="16M",
                       help="elements --check updates, past the last-level cache (default 16M)")
    group.add_argument("--bench-json", help="a bench_step.py --json file: its params and tokens "
                       "are planned, and its measured step times and GPU peaks printed beside")


def _known() -> list:
    from .hardware import GPU_TABLE
    return [g.key for g in GPU_TABLE]


PLAN_ARGS = ("params", "model", "trainable", "lora_rank", "lora_targets", "small_param_threshold",
             "tokens_per_step", "accumulation", "gpus", "parallel", "activations_gb",
             "activation_checkpointing", "gpu", "gpu_name", "gpu_memory",
             "gpu_tflops", "link_gbps", "hbm_gbps", "host_bw", "host_ram", "numa_nodes",
             "host_reserve", "host_update_ns", "nvme_gbps", "drive_tb", "dwpd")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog="python -m adambridge plan", epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Will offload pay on this machine, and how should it be set up? "
                                 "Formulas: docs/planning.md.")
    _flags(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from . import plan
    kwargs = {name: getattr(args, name) for name in PLAN_ARGS}
    try:
        if args.bench_json:
            return _bench(args, kwargs, plan)
        planned = plan(**kwargs)
        checked = _check(args, planned) if args.check else None
    except (PlanError, RuntimeError) as exc:
        print(f"adambridge plan: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, PlanError) else 1
    if args.json:
        print(report.to_json(planned, checked))
    else:
        print(report.render(planned))
        if checked is not None:
            print("\n" + "\n".join(checked.lines()))
    return 0


def _check(args, planned) -> check.Check:
    precisions = [p.strip() for p in args.check_precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in arithmetic.PRECISIONS]
    if bad or not precisions:
        raise PlanError(f"Invalid check_precisions (--check-precisions): {args.check_precisions!r} "
                        f"(some of {', '.join(arithmetic.PRECISIONS)})")
    size = parse_count("check_size", args.check_size)
    return check.run_check(planned.host.bw_gbps, planned.host.bw_source, precisions, numel=int(size))


def _bench(args, kwargs: dict, plan) -> int:
    bench = check.read_bench(args.bench_json)
    given = {k: v for k, v in kwargs.items() if k not in ("params", "model", "tokens_per_step")}
    first = plan(params=bench["params"], tokens_per_step=bench["tokens_per_step"], **given)
    given.update(host_bw=first.host.bw_gbps, host_ram=first.host.ram_gb,
                 numa_nodes=first.host.numa_nodes,  # measured once, for every point
                 host_update_ns=dict(first.host.update_ns) or None)
    print(report.render(first) + "\n")
    print("\n".join(check.compare_bench(bench, lambda n, t: plan(params=n, tokens_per_step=t, **given))))
    if args.check:
        print("\n" + "\n".join(_check(args, first).lines()))
    return 0
