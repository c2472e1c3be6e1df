"""adambridge.plan: will offload pay on this machine, and how should it be set up?

``plan(...)`` turns a model (a count or a config.json), the work per step, a GPU and the
host (measured here unless given) into a `Plan`: a row per setup (all-GPU AdamW, AdamBridge
at each moment precision in async mode, sharded over the ranks, in sync mode, with the NVMe
tier, and a GPU-side AdamW over streamed state) and a recommendation in the offload
article's order; ``estimate(model, ...)`` does the same for an nn.Module already built.
``python -m adambridge plan`` prints it; docs/planning.md names every formula. Importing
this package imports neither transformers nor the native library: each is loaded only when
a config is counted or the host is measured.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from . import arithmetic, setups
from .advise import Advice, advise, choose_precision
from .errors import PlanError, invalid
from .hardware import GpuSpec, HostSpec, resolve_gpu, resolve_host
from .model import ModelFacts, model_facts, parse_count
from .setups import Inputs, Nvme, Row, Work
from .shapes import SMALL_PARAM_THRESHOLD, count_module, layout

__all__ = ["plan", "estimate", "Plan", "Row", "Advice", "PlanError"]
PARALLEL = ("ddp", "fsdp2")
Number = Union[str, float, int]


@dataclass(frozen=True)
class Plan:
    """Everything a plan decided from, every row, and the recommendation."""
    model: ModelFacts
    work: Work
    gpu: GpuSpec
    host: HostSpec
    nvme: Nvme
    host_reserve: float
    gpu_usable_gb: float
    host_usable_gb: float
    rows: tuple
    advice: Advice
    notes: tuple
    activations: str = ""   # what the activations on the GPU are, and where they came from

    def row(self, name: str) -> Row:
        """The row whose name starts with ``name`` ("all-GPU", "AdamBridge bf16 moments")."""
        found = [r for r in self.rows if r.name.startswith(name)]
        if not found:
            raise KeyError(f"no row {name!r}; rows: {', '.join(r.name for r in self.rows)}")
        return found[0]

    def to_dict(self) -> dict:
        """The plan as JSON-ready data (what ``--json`` prints)."""
        data = dataclasses.asdict(self)
        data["rows"] = [dict(dataclasses.asdict(r), fits=r.fits) for r in self.rows]
        data["advice"]["numbers"] = dict(self.advice.numbers)
        return data


def _number(name: str, value: Number, *, minimum: float = 0.0, above: bool = True,
            whole: bool = False, below: Optional[float] = None) -> float:
    """A checked number: > minimum (or >= with above=False), optionally whole and < below."""
    try:
        number = float(str(value).strip())
    except ValueError:
        raise invalid(name, value, "expected a number") from None
    low_ok = number > minimum if above else number >= minimum
    if not math.isfinite(number) or not low_ok or (below is not None and number >= below):
        bound = f"{'>' if above else '>='} {minimum:g}" + (f" and < {below:g}" if below is not None else "")
        raise invalid(name, value, f"expected a number {bound}")
    if whole and number != int(number):
        raise invalid(name, value, "expected a whole number")
    return number


def _optional(name: str, value: Optional[Number], **kwargs) -> Optional[float]:
    return None if value is None else _number(name, value, **kwargs)


def plan(*, params: Optional[Number] = None, model: Optional[str] = None,
         trainable: Optional[Number] = None, lora_rank: Optional[Number] = None,
         lora_targets: Union[None, str, Sequence[str]] = None,
         small_param_threshold: Number = SMALL_PARAM_THRESHOLD, **machine) -> Plan:
    """The plan for a model on a GPU and this host (keywords mirror the command's flags:
    ``tokens_per_step`` is ``--tokens-per-step``; sizes in GB, rates in GB/s and TFLOP/s).

    The work and the machine are the keywords of ``estimate``. Deterministic for given
    inputs; only ``host_bw`` and ``host_ram`` left out are measured here (with ``host_bw``,
    the kernel's arithmetic ceiling ``host_update_ns`` unless given: ``{"fp8": 1.1}`` or
    ``"fp8=1.1"``, ns per element), and the GPU, when ``gpu`` is left out, is the CUDA card
    found.
    """
    threshold = int(_number("small_param_threshold", small_param_threshold, above=False, whole=True))
    facts = model_facts(params=params, model=model, trainable=trainable, lora_rank=lora_rank,
                        lora_targets=lora_targets, small_param_threshold=threshold)
    return _plan_for(facts, **machine)


def estimate(model, *, small_param_threshold: Number = SMALL_PARAM_THRESHOLD, **machine) -> Plan:
    """The plan for an nn.Module already built (as DeepSpeed's memory estimators take one):
    its parameters counted (shared ones once), its trainable ones (``requires_grad``) sized
    one by one for the gradients async mode keeps on the GPU, and, for a transformers model,
    its ``config``'s decoder shape for the activations. Nothing of the model is read but
    sizes, and nothing is allocated. Weights and gradients are counted at 2 B (the bf16
    mixed precision the plan is for), whatever the module's dtype now (its source says it).
    The other keywords are ``plan()``'s: tokens_per_step, accumulation, gpus, parallel,
    activations_gb, activation_checkpointing, gpu, gpu_name, gpu_memory, gpu_tflops, link_gbps,
    hbm_gbps, host_bw, host_ram, numa_nodes, host_reserve, host_update_ns, nvme_gbps,
    drive_tb, dwpd."""
    threshold = int(_number("small_param_threshold", small_param_threshold, above=False, whole=True))
    counted = count_module(model)
    trainable = sum(counted.trainable_numels)
    if trainable == 0:
        raise PlanError(f"Invalid model: {counted.name} has no parameter with requires_grad=True, "
                        f"so there is nothing to optimize")
    dtypes = "/".join(counted.dtypes)
    facts = ModelFacts(counted.total, trainable,
                       f"nn.Module {counted.name} ({dtypes}; counted as bf16 weights and gradients)",
                       "all parameters" if trainable == counted.total else
                       "the parameters with requires_grad", counted.shape, counted.shape_note,
                       layout(counted.trainable_numels, threshold))
    return _plan_for(facts, **machine)


def _plan_for(facts: ModelFacts, *, tokens_per_step: Number = 4096, accumulation: Number = 1,
              gpus: Number = 1, parallel: str = "ddp", activations_gb: Optional[Number] = None,
              activation_checkpointing: bool = False, gpu: Optional[str] = None,
              gpu_name: Optional[str] = None, gpu_memory: Optional[Number] = None, gpu_tflops: Optional[Number] = None,
              link_gbps: Optional[Number] = None, hbm_gbps: Optional[Number] = None,
              host_bw: Optional[Number] = None, host_ram: Optional[Number] = None,
              numa_nodes: Optional[Number] = None, host_reserve: Number = 0.10,
              host_update_ns: Union[None, str, Mapping[str, Number]] = None,
              nvme_gbps: Number = 7.0, drive_tb: Number = 3.84, dwpd: Number = 1.0) -> Plan:
    work = _work(tokens_per_step, accumulation, gpus, parallel, activations_gb,
                 activation_checkpointing)
    gpu_spec = resolve_gpu(gpu, memory_gb=_optional("gpu_memory", gpu_memory),
                           tflops=_optional("gpu_tflops", gpu_tflops),
                           link_gbps=_optional("link_gbps", link_gbps),
                           hbm_gbps=_optional("hbm_gbps", hbm_gbps), label=_name(gpu_name))
    nvme = Nvme(_number("nvme_gbps", nvme_gbps), _number("drive_tb", drive_tb), _number("dwpd", dwpd))
    reserve = _number("host_reserve", host_reserve, above=False, below=1.0)
    nodes = _optional("numa_nodes", numa_nodes, minimum=1, above=False, whole=True)
    host = resolve_host(bw_gbps=_optional("host_bw", host_bw), ram_gb=_optional("host_ram", host_ram),
                        numa_nodes=None if nodes is None else int(nodes),
                        update_ns=_update_ns(host_update_ns))
    return assemble(Inputs(facts, work, gpu_spec, host, nvme, reserve))


def _name(gpu_name: Optional[str]) -> Optional[str]:
    """The card's name as the output prints it, or None."""
    if gpu_name is None:
        return None
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise invalid("gpu_name", gpu_name, "expected the card's name, e.g. 'RTX 3060 12GB'")
    return gpu_name.strip()


def _update_ns(value: Union[None, str, Mapping[str, Number]]) -> Optional[tuple]:
    """((precision, ns per element), ...) from a mapping or 'fp8=1.1,bf16=0.7'; None if not given."""
    if value is None:
        return None
    pairs = value.items() if isinstance(value, Mapping) else (
        tuple(part.split("=", 1)) if "=" in part else (part, "")
        for part in str(value).split(",") if part.strip())
    parsed = []
    for precision, ns in pairs:
        precision = str(precision).strip()
        if precision not in arithmetic.PRECISIONS:
            raise PlanError(f"Invalid host_update_ns (--host-update-ns): {value!r} (give "
                            f"precision=ns pairs, precision one of {', '.join(arithmetic.PRECISIONS)})")
        parsed.append((precision, _number("host_update_ns", ns)))
    return tuple(parsed)


def _work(tokens_per_step, accumulation, gpus, parallel, activations_gb, checkpointing) -> Work:
    tokens = parse_count("tokens_per_step", tokens_per_step)
    if tokens != int(tokens):
        raise invalid("tokens_per_step", tokens_per_step, "expected a whole number of tokens")
    passes = int(_number("accumulation", accumulation, minimum=1, above=False, whole=True))
    if passes > tokens:
        raise invalid("accumulation", accumulation, f"more passes than the {tokens:,.0f} tokens per step")
    if parallel not in PARALLEL:
        raise invalid("parallel", parallel, f"one of {', '.join(PARALLEL)}")
    if not isinstance(checkpointing, bool):
        raise invalid("activation_checkpointing", checkpointing, "True or False")
    return Work(int(tokens), passes, int(_number("gpus", gpus, minimum=1, above=False, whole=True)),
                parallel, _optional("activations_gb", activations_gb, above=False), checkpointing)


def assemble(inp: Inputs) -> Plan:
    """The rows and the advice for checked inputs."""
    base = setups.all_gpu(inp)
    singles = {p: setups.offload(inp, p, base) for p in arithmetic.PRECISIONS}
    sharding = inp.work.parallel == "ddp" and inp.work.gpus > 1
    sharded = ({p: setups.offload(inp, p, base, sharded=True) for p in arithmetic.PRECISIONS}
               if sharding else {})
    chosen = choose_precision(sharded or singles)
    compared = chosen or "fp32"
    nvme_row = setups.nvme(inp, chosen or "fp8", base)
    rows = [base, *singles.values()]
    if sharded:
        rows.append(sharded[chosen or "bf16"])
    if inp.work.parallel != "fsdp2":  # (there every AdamBridge row is the synchronous step)
        rows.append(setups.sync(inp, compared, base, sharded=sharding))
    rows.append(setups.streamed(inp, compared, base, sharded=sharding))
    if nvme_row is not None:
        rows.append(nvme_row)
    return Plan(model=inp.model, work=inp.work, gpu=inp.gpu, host=inp.host, nvme=inp.nvme,
                host_reserve=inp.host_reserve, gpu_usable_gb=inp.gpu_usable / arithmetic.GB,
                host_usable_gb=inp.host_usable / arithmetic.GB, rows=tuple(rows),
                advice=advise(inp, base, singles, sharded, nvme_row, chosen),
                notes=_notes(inp), activations=_activations_line(inp))


def _activations_line(inp: Inputs) -> str:
    """The activations the GPU column counts, and how they were found."""
    work, shape = inp.work, inp.model.shape
    if work.activations_gb is not None:
        return f"activations: {work.activations_gb:,.2f} GB per GPU, given (--activations-gb)"
    both = inp.activations_both()
    if both is None:
        return (f"activations: not counted on the GPU: {inp.model.shape_note}; give "
                f"--activations-gb")
    without, with_ = (b / arithmetic.GB for b in both)
    counted = "with" if work.checkpointing else "without (--activation-checkpointing for with)"
    family = "GPT-2" if shape.family == "gpt2" else "Llama-style"
    return (f"activations: {inp.activation_bytes / arithmetic.GB:,.2f} GB per GPU at the peak of "
            f"a backward of {work.tokens_per_pass:,.0f} tokens, estimated for the {family} decoder "
            f"({shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab:,}; SDPA "
            f"attention): {without:,.2f} GB without activation checkpointing, {with_:,.2f} GB "
            f"with; counted: {counted}")


def _notes(inp: Inputs) -> tuple:
    notes = []
    if "NOT measured" in inp.host.bw_source:
        notes.append(f"host bandwidth {inp.host.bw_source}")
    if inp.host.numa_nodes > 1:
        notes.append(f"{inp.host.numa_nodes} NUMA nodes: each GPU's host work runs on its own "
                     f"node, so {min(inp.work.gpus, inp.host.numa_nodes)} of them share "
                     f"{arithmetic.effective_host_bw(inp.host.bw_gbps, inp.work.gpus, inp.host.numa_nodes):.0f} GB/s")
    if inp.work.parallel == "fsdp2":
        notes.append("FSDP2: AdamBridge rows use synchronous step() on the GPU shards (no overlap)")
    return tuple(notes)
