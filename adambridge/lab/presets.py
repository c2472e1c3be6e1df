"""The lab's presets: which phases a run has, the options it takes, and the checks on them."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional

PHASE_TITLES = {
    "tests": "Test suite (pytest)",
    "kernels": "Host AdamW kernels (bench_kernels.py)",
    "step": "Training step (bench_step.py)",
    "demo": "Fine-tuning comparison (demo)",
    "finetune": "Fine-tuning a causal LM (finetune_llm.py)",
    "plan": "Will offload pay here? (adambridge plan)",
}


class PresetError(ValueError):
    """An unknown preset or option, or an option value out of range: one line for the page."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One run option: how it is checked and what it means."""
    check: Callable[[str, Any], Any]
    help: str


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    phases: tuple
    defaults: Mapping[str, Any]


def _int(low: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        try:
            number = int(str(value).strip())
        except ValueError:
            raise PresetError(f"Invalid option {name}: {value!r} (a whole number)") from None
        if number < low:
            raise PresetError(f"Invalid option {name}: {number} (at least {low})")
        return number
    return check


_SIZE = re.compile(r"^\d+(\.\d+)?[KMG]?$", re.IGNORECASE)


def _sizes(name: str, value: Any) -> list:
    sizes = [s.strip() for s in (value if isinstance(value, list) else str(value).split(","))]
    bad = [s for s in sizes if not _SIZE.match(s)]
    if not sizes or bad:
        raise PresetError(f"Invalid option {name}: {value!r} (sizes such as 256K,1M,64M)")
    return sizes


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise PresetError(f"Invalid option {name}: {value!r} (one of {', '.join(choices)})")
        return value
    return check


def _bool(name: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise PresetError(f"Invalid option {name}: {value!r} (true or false)")
    return text in ("true", "1", "yes")


def _test_targets(name: str, value: Any) -> list:
    # NOTE: only paths and node ids reach pytest, never its flags: the page is local but
    # its input still goes onto a command line.
    targets = [str(t) for t in value] if isinstance(value, list) else str(value).split()
    if not targets or any(t.startswith("-") for t in targets):
        raise PresetError(f"Invalid option {name}: {value!r} (test paths such as tests/project/test_cli.py)")
    return targets


def _plan_params(name: str, value: Any) -> str:
    from ..plan.errors import PlanError
    from ..plan.model import parse_count
    try:
        parse_count(name, value)
    except PlanError:
        raise PresetError(f"Invalid option {name}: {value!r} (a parameter count such as 7e9 or 7B)") from None
    return str(value)


def _plan_gpu(name: str, value: Any) -> str:
    from ..plan.hardware import known_gpus, table_gpu
    if table_gpu(str(value)) is None:
        raise PresetError(f"Invalid option {name}: {value!r} (one of {known_gpus()})")
    return str(value)


OPTIONS = {
    "threads": Option(_int(1), "threads for the kernels and torch (default: all CPUs)"),
    "sizes": Option(_sizes, "kernel sizes in parameters, comma-separated (e.g. 1M,8M)"),
    "repeats": Option(_int(1), "timed repeats per kernel variant (the median is reported)"),
    "torch_backend": Option(_bool, "also time the (slow) pure-torch backend in the kernel table"),
    "demo_preset": Option(_choice("tiny", "small", "gpu"), "demo model size"),
    "demo_steps": Option(_int(1), "demo fine-tuning steps per configuration"),
    "step_seconds": Option(_int(1), "time budget of the step benchmark's timed rounds"),
    "finetune_steps": Option(_int(1), "fine-tuning steps per configuration (finetune_llm.py)"),
    "tests": Option(_test_targets, "what pytest runs (paths or node ids)"),
    "plan_params": Option(_plan_params, "plan: the model's parameter count (e.g. 7e9)"),
    "plan_gpu": Option(_plan_gpu, "plan: the GPU (default: the CUDA card found, else H100)"),
    "plan_tokens": Option(_int(1), "plan: tokens per step per GPU"),
    "plan_check": Option(_bool, "plan: also run the host update and print predicted vs measured"),
}

_COMMON = dict(threads=None, sizes="8M,64M", repeats=9, torch_backend=True, demo_preset=None, demo_steps=None,
               step_seconds=240, finetune_steps=None, tests="tests", plan_params="7e9", plan_gpu=None,
               plan_tokens=4096, plan_check=True)

PRESETS = {p.name: p for p in [
    Preset("quick", "two small kernel sizes and a tiny demo: a minute or so on 2 cores",
           ("kernels", "demo"), dict(_COMMON, sizes="256K,1M", repeats=3, torch_backend=False,
                                     demo_preset="tiny",
                                     demo_steps=6)),
    Preset("kernels", "bench_kernels.py at 8M and 64M parameters", ("kernels",), _COMMON),
    Preset("step", "bench_step.py: step time of torch AdamW vs AdamBridge sync and async",
           ("step",), _COMMON),
    Preset("finetune", "finetune_llm.py (a GPU model; offline tiny model on a CPU)",
           ("finetune",), _COMMON),
    Preset("tests", "the test suite (pytest) with a table per test file", ("tests",), _COMMON),
    Preset("all", "tests, kernels, step, demo, finetune and plan, one after another",
           ("tests", "kernels", "step", "demo", "finetune", "plan"), _COMMON),
]}


def resolve(name: str, options: Optional[Mapping[str, Any]] = None) -> tuple[Preset, dict]:
    """The preset and its checked options (defaults filled in); PresetError on bad input."""
    if name not in PRESETS:
        raise PresetError(f"Unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    given = dict(options or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise PresetError(f"Unknown option(s) {', '.join(unknown)}: choose from {', '.join(OPTIONS)}")
    resolved = {}
    for key, default in preset.defaults.items():
        value = given.get(key)
        value = default if value in (None, "") else value
        resolved[key] = None if value is None else OPTIONS[key].check(key, value)
    return preset, resolved


def describe() -> list:
    """The presets and options as the page lists them."""
    return [dict(name=p.name, description=p.description, phases=list(p.phases),
                 defaults={k: v for k, v in p.defaults.items() if v is not None})
            for p in PRESETS.values()]
