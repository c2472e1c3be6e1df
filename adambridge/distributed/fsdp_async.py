"""Asynchronous mode on FSDP2 (DTensor) parameters: each shard is updated as its gradient lands.

The hook point. FSDP2's ``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py) runs, per FSDP group, the reduce-scatter, the divide, the cast to the
parameter's dtype, the copy to host memory under ``CPUOffloadPolicy`` (a blocking copy when
the parameter has post-accumulate-grad hooks) and the accumulation into
``sharded_param.grad``, and only then calls the sharded parameter's post-accumulate-grad
hooks. A hook registered with ``register_post_accumulate_grad_hook`` on the DTensor parameter
therefore sees its final local gradient, once per reduce, while backward goes on.
(``FSDPModule.set_all_reduce_hook`` is not used: it sees the group's flat reduce-scatter
output before the divide and the cast, and only one hook per module.)

The hook hands the shard to a worker thread that updates every shard that has landed in one
batch (fsdp.update_shards, the synchronous step's own code, so the bits are those of
``step()``); ``step()`` waits for it, updates any parameter no hook delivered, and raises
what failed. With ``release_grads`` (the default) it then sets every gradient it applied to
None (FSDP2 keeps the sharded gradient in ``p.grad``), so a loop without ``zero_grad()``
never adds a backward onto an applied gradient.

Limits, each refused in one line: the local shards must be in host memory (CPU training, or
``CPUOffloadPolicy`` on GPUs); no ``max_grad_norm``, torch clipping, GradScaler or autotune
(a step-wide fact that exists only after the last shard was updated); accumulation is
FSDP2's own (``model.set_requires_gradient_sync(False)`` on the accumulating passes: FSDP2
then reduces nothing and calls no hook), so ``accumulation_steps``, ``closes_window`` and
``opt.accumulate()`` are refused, and a second reduced gradient before ``step()`` is an
error. The first step after ``attach_hooks`` is held (updated by ``step()``), so a clip or a
GradScaler there is refused with nothing changed; in a later step the shards that landed
before the clip have been updated unclipped, and the error says so.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from . import fsdp
from .landed_worker import LandedWorker, with_suffix
from ..stats import StepStats

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor


def attach(opt: OptimizerDoor, model: Optional[torch.nn.Module], accumulation_steps: int,
           closes_window: Optional[Callable[[], bool]]) -> "ShardUpdater":
    """attach_hooks() for an optimizer holding DTensor parameters (FSDP2)."""
    if accumulation_steps != 1 or closes_window is not None:
        raise ValueError("attach_hooks(accumulation_steps=..., closes_window=...) on FSDP2 "
                         "parameters is not supported; call model.set_requires_gradient_sync"
                         "(False) on the accumulating passes instead")
    # offload_dir never gets here: AdamBridge refuses it with DTensor parameters.
    for name, value in (("max_grad_norm", opt.max_grad_norm),
                        ("autotune", opt.autotune_config)):
        if value is not None:
            raise ValueError(f"attach_hooks() on FSDP2 parameters with {name} is not "
                             f"supported; use synchronous opt.step(), or drop {name}")
    owned = [p for group in opt.param_groups for p in group["params"]]
    if model is not None:
        ids = {id(p) for p in model.parameters()}
        owned = [p for p in owned if id(p) in ids]
    for p in owned:
        device = fsdp.local_of(p).device
        if device.type != "cpu":
            raise ValueError(f"attach_hooks() on FSDP2 parameter {opt.index(p)} whose shard is "
                             f"on {device} is not supported; shard with offload_policy="
                             f"CPUOffloadPolicy() (the shards then live in host memory)")
    return ShardUpdater(opt, [p for p in owned if p.requires_grad])


class ShardUpdater(LandedWorker):
    """The FSDP2 counterpart of pipeline.Pipeline: hooks, one worker thread, finish()."""

    def __init__(self, opt: OptimizerDoor, params: list) -> None:
        self.opt = opt
        self._group_of = fsdp.GroupLookup(opt)  # the groups as they are at each hook
        self._hooked = set(params)
        self._start_worker("fsdp2", "FSDP2")
        hook = _hook(weakref.ref(self))
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def hooks(self, p: torch.Tensor) -> bool:
        return p in self._hooked

    # ------------------------------------------------------------------ in backward

    def on_grad(self, p: torch.Tensor) -> None:
        self._note_hyper()
        self._note_grad(p)  # FSDP2 has written the sharded gradient before this hook
        if self._held or not self._first_of_step(p):
            return
        try:
            self.opt.check_gradient(p)
            work = fsdp.shard_work(self.opt, p, self._group_of(p))
        except (RuntimeError, ValueError) as exc:
            self._fail(exc)
            return
        self._enqueue(work)

    def _fingerprint(self, grad: Any) -> Any:
        # NOTE: torch 2.13's DTensor moves neither its own version counter nor its local
        # tensor's when torch's clip_grads_with_norm_ scales it in place (mul_ by a plain
        # tensor), so a write is seen by the values: the wrapping sum of the local shard's
        # bit patterns (one read of the shard, in its hook; a changed value changes it,
        # unless another change cancels it exactly).
        local = grad.to_local() if fsdp.is_dtensor(grad) else grad
        bits = local.detach().reshape(-1).view(_BITS[local.element_size()])
        return grad._version, int(torch.sum(bits, dtype=torch.int64))

    def _second_gradient(self, p: torch.Tensor) -> str:
        return (f"parameter {self.opt.index(p)} received a second reduced gradient before the "
                f"optimizer step (its shard was updated with the first); call "
                f"model.set_requires_gradient_sync(False) on the accumulating passes")

    def _update(self, batch: list) -> None:
        fsdp.update_shards(self.opt, batch)

    # ------------------------------------------------------------------ step

    def finish(self) -> None:
        """opt.step(): wait for the worker, update what no hook delivered, raise failures."""
        began = time.perf_counter()
        done, errors, held = self._end_step()
        edited = self._check_grad_edits(done)
        if edited is not None:
            errors.append(edited)
        if errors:
            raise _step_error(errors[0], len(done))
        if getattr(self.opt, "grad_scale", None) is not None or \
                getattr(self.opt, "found_inf", None) is not None:
            raise self._refusal("GradScaler", held, len(done))
        self._check_hyper_writes(len(done))
        stats = StepStats()
        self.opt.last_step_stats = stats
        fsdp.sync_step(self.opt, stats, began, skip=done)
        stats.num_params += len(done)
        self._held = self._holds_always
        self._release_grads()

    def _refusal(self, what: str, held: bool, updated: int) -> RuntimeError:
        done = ("nothing was changed" if held else
                f"{updated} shards of this step were already updated without it")
        return RuntimeError(f"{what} with attach_hooks() on FSDP2 parameters is not supported "
                            f"({done}); detach_hooks() and use synchronous opt.step()")

    def _refuse_fact(self, what: str) -> None:
        with self._cond:
            updated, held = len(self._done) + self._pending, self._held
        raise self._refusal(what, held, updated)

    def accumulate(self) -> Any:
        raise RuntimeError("opt.accumulate() on FSDP2 parameters with hooks attached is not "
                           "supported; call model.set_requires_gradient_sync(False) on the "
                           "accumulating passes instead")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            self._wait()
        finally:
            self._stop_worker()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _step_error(exc: BaseException, updated: int) -> BaseException:
    return with_suffix(exc, f" ({updated} shards of this step were updated before it; the "
                            f"others were not)" if updated else
                       " (nothing was updated in this step)")


def _hook(ref: "weakref.ref[ShardUpdater]") -> Callable[[torch.Tensor], None]:
    def on_reduced(p: torch.Tensor) -> None:
        updater = ref()
        if updater is not None and updater.opt.pipeline is updater:
            updater.on_grad(p)
    return on_reduced
