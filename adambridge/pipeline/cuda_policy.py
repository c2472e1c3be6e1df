"""What attach_hooks decides for its devices: staging made on the workers, pool placement,
and the guards against setups whose hooks cannot overlap or update (graph capture, compile).

Kept out of pipeline/hooks.py, which calls these at attach time and at the top of each hook.
"""
from __future__ import annotations

import functools
import gc
import logging
import sys
from typing import Any, Optional, Sequence

import torch

from ..host import topology

_log = logging.getLogger("adambridge")
_warned: set = set()


def prepare_lanes(lanes: dict, hooked: Sequence[torch.Tensor], owned: Sequence[torch.Tensor],
                  timeout_s: float) -> None:
    """Make each transport's staging buffers on its lane's worker thread.

    The worker is pinned to its device's NUMA node, so the pages it first touches (and
    locks) are node-local; the first backward then allocates nothing. A transport
    without ``prepare`` (a test double) allocates on first use instead.
    """
    hooked_ids = {id(p) for p in hooked}
    # Frozen parameters get no slot: they have no gradient (one set by hand is still sent,
    # through a buffer made when it first appears).
    rest = [p for p in owned if id(p) not in hooked_ids and p.requires_grad]
    calls = []
    for device, lane in lanes.items():
        prepare = getattr(lane.transport, "prepare", None)
        if prepare is not None:
            mine = [p for p in hooked if p.device == device]
            calls.append((lane, lane.call(functools.partial(prepare, mine, rest))))
    for lane, unit in calls:
        lane.wait(unit, timeout_s)


def pool_plan(cpus: tuple[int, ...], devices: Sequence[torch.device],
              root: str = "/") -> tuple[tuple[int, ...], Optional[int]]:
    """(CPUs to pin the native pool to, thread count or None for the default).

    NOTE: On a one-node machine "the GPU's node" is every CPU: a pool
    pinned one thread per CPU takes the core the autograd thread needs to launch backward's
    kernels. There the pool stays unpinned, one thread short of the CPUs.
    """
    if cpus and any(d.type == "cuda" for d in devices) and len(topology.numa_nodes(root)) <= 1:
        return (), max(1, len(cpus) - 1)
    return cpus, None


def check_hook(p: torch.Tensor) -> None:
    """Run first in every gradient hook: refuse graph capture, say when compile defeats overlap."""
    if _capturing(p):
        # NOTE: Raised out of backward: a captured graph's replay would
        # re-run the copies but never the host update, silently training nothing.
        raise RuntimeError("adambridge: attach_hooks() does not work under CUDA graph capture "
                           "(a replay would update nothing); capture without hooks "
                           "(opt.detach_hooks()) and call opt.step() after each replay")
    if _compiled_backward():
        warn_once("compiled", "adambridge: the backward is compiled (compiled autograd), so "
                  "every gradient hook fires at its end and the host updates cannot overlap "
                  "backward; the results are the same as step()")


def check_model(model: Optional[torch.nn.Module]) -> None:
    """At attach_hooks: a torch.compile'd module runs backward as one graph."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(optimized, "OptimizedModule", None)
    if model is not None and kind is not None and isinstance(model, kind):
        warn_once("compiled", "adambridge: the model is torch.compile'd, so its backward is "
                  "one graph whose gradients all appear at its end; the host updates then "
                  "overlap little of backward (the results are the same as step())")


def check_compiled_elsewhere(model: Optional[torch.nn.Module]) -> None:
    """At the first step: attach_hooks was given the plain module, but its forward may run
    through torch.compile (``model.compile()``, or a ``torch.compile(model)`` wrapper kept
    beside it), whose backward is one graph as well."""
    if model is None or "torch._dynamo" not in sys.modules:  # nothing compiled without it
        return
    if getattr(model, "_compiled_call_impl", None) is not None or _wrapped_by_compile(model):
        warn_once("compiled", "adambridge: the model given to attach_hooks() runs through "
                  "torch.compile, so its backward is one graph whose gradients all appear "
                  "at its end; the host updates then overlap little of backward (the "
                  "results are the same as step())")


def _wrapped_by_compile(model: torch.nn.Module) -> bool:
    # NOTE: an OptimizedModule holds the module in its _modules dict, which its own __dict__
    # holds: the wrapper is found up to three referrers away, through dicts only. Run once
    # per attach_hooks, at the first (held) step.
    kind = getattr(getattr(torch._dynamo, "eval_frame", None), "OptimizedModule", None)
    if kind is None:
        return False
    level = [model]
    for _ in range(3):
        refs = [r for x in level for r in gc.get_referrers(x)]
        if any(isinstance(r, kind) and getattr(r, "_orig_mod", None) is model for r in refs):
            return True
        # (module namespaces lead everywhere; each get_referrers walks the whole heap)
        level = [r for r in refs if isinstance(r, dict) and "__builtins__" not in r][:16]
    return False


def _capturing(p: torch.Tensor) -> bool:
    # Only a CUDA tensor can be captured (and a CPU-only torch has no capture query).
    return p.is_cuda and torch.cuda.is_current_stream_capturing()


def _compiled_backward() -> bool:
    # Never imports dynamo (slow, and inside every hook): compiled autograd can be on only
    # if its module has been imported already.
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    in_region = getattr(compiled_autograd, "in_compiled_autograd_region", False)
    return bool(in_region) or torch.compiler.is_compiling()


def warn_once(key: Any, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)
