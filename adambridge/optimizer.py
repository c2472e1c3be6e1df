"""AdamBridge: a torch.optim.Optimizer whose AdamW state lives in host memory; no math here.

The class validates arguments, owns param_groups and the per-parameter state dicts, turns
gradients into UpdateItems and hands them to ``functional.adamw_update`` in one batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Optional, Union

import torch

from . import _validation as check
from . import checkpoint, nvme, state as host_state
from .codecs import FP8_BLOCK, stream_key
from .functional import Hyper, UpdateItem, adamw_update
from .stats import StepStats

# torch.optim.AdamW flags this optimizer does not implement: refused when truthy.
UNSUPPORTED_TORCH_FLAGS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")


class AdamBridge(torch.optim.Optimizer):
    """AdamW with fp32 master weights and both moments in host RAM, updated by a fused kernel.

    A drop-in replacement for ``torch.optim.AdamW`` (``backward(); step(); zero_grad()``)
    with the same arithmetic. Parameters may be fp32, bf16 or fp16 on any device; after each
    update a parameter receives its fp32 master rounded to nearest even. See README.md for
    every argument.
    """

    def __init__(
        self,
        params: Iterable,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        precision: str = "fp32",
        stochastic_rounding: bool = True,
        backend: str = "auto",
        numa_aware: bool = True,
        num_threads: Optional[int] = None,
        chunk_size: Optional[int] = None,
        release_grads: bool = True,
        overlap_writeback: bool = True,
        autotune: Any = False,
        seed: int = 0,
        small_param_threshold: int = 65536,
        offload_dir: Any = None,
        host_budget: Optional[int] = None,
        **torch_flags: Any,
    ) -> None:
        check.torch_flags(torch_flags, UNSUPPORTED_TORCH_FLAGS)
        check.hyperparameters(lr, betas, eps, weight_decay)
        self._precision = check.precision(precision)
        self._backend_request = check.backend(backend)
        self.stochastic_rounding = check.boolean("stochastic_rounding", stochastic_rounding)
        self.numa_aware = check.boolean("numa_aware", numa_aware)
        self.num_threads = check.optional_positive_int("num_threads", num_threads)
        self.chunk_size = check.chunk_size(chunk_size)
        self.release_grads = check.boolean("release_grads", release_grads)
        self.overlap_writeback = check.boolean("overlap_writeback", overlap_writeback)
        self.seed = check.seed(seed)
        self.small_param_threshold = check.non_negative_int("small_param_threshold",
                                                            small_param_threshold)
        self.autotune_config = check.autotune(autotune)
        # NVMe tier (issue 14): validated here, created once the parameters are known.
        offload = nvme.check_offload(offload_dir, host_budget, self.autotune_config)
        self.autotune_log: list = []
        self.last_step_stats = None
        self._resolved_backend: Optional[str] = None
        self._param_index: dict[torch.Tensor, int] = {}
        self._layout: dict[torch.Tensor, tuple[torch.Size, torch.dtype]] = {}
        self._writeback: dict[torch.Tensor, torch.Tensor] = {}
        self._pipeline = None  # set by attach_hooks (asynchronous mode)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._tier = nvme.Tier(self, offload, host_budget) if offload is not None else None
        if self._backend_request == "native":
            self._resolve_backend()  # fail now, not at the first step

    # ------------------------------------------------------------------ public attributes

    @property
    def precision(self) -> str:
        """How m and v are stored: 'fp32', 'bf16' or 'fp8'."""
        return self._precision

    @property
    def backend(self) -> str:
        """'native/<isa>' (e.g. 'native/avx2') or 'torch'. Resolving may build the kernel."""
        self._resolve_backend()
        if self._resolved_backend == "native":
            from ._native import loader
            return f"native/{loader.isa_name()}"
        return "torch"

    @property
    def nvme_tier(self) -> Optional["nvme.Tier"]:
        """The NVMe tier (``offload_dir``): bytes_written, drive_writes_per_day(); else None."""
        return self._tier

    def placement(self) -> list:
        """Where each parameter's state lives: a list of nvme.Placed (index, numel, 'ram' or
        'file', state_bytes) in state_dict order; all 'ram' without ``offload_dir``."""
        if self._tier is not None:
            return self._tier.placement()
        per_param = host_state.HOST_BYTES_PER_PARAM[self._precision]
        return [nvme.Placed(i, p.numel(), "ram", int(per_param * p.numel()))
                for p, i in sorted(self._param_index.items(), key=lambda kv: kv[1])]

    def host_state_bytes(self) -> int:
        """Bytes of host memory held by all parameters' master weights and moments."""
        return sum(host_state.state_bytes(s) for s in self.state.values() if s)

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # Weight tying: one tensor reached twice gets one state (torch.optim warns instead).
        unique, seen = [], set()
        for p in params:
            key = p[1] if isinstance(p, tuple) else p
            if isinstance(key, torch.Tensor):
                if key in seen:
                    continue
                seen.add(key)
                check.parameter(key, len(self._param_index) + len(unique))
            unique.append(p)
        param_group = dict(param_group, params=unique)
        if "lr" in param_group or "betas" in param_group or "eps" in param_group:
            check.hyperparameters(param_group.get("lr", self.defaults["lr"]),
                                  param_group.get("betas", self.defaults["betas"]),
                                  param_group.get("eps", self.defaults["eps"]),
                                  param_group.get("weight_decay", self.defaults["weight_decay"]))
        super().add_param_group(param_group)
        self._index_params()

    def _index_params(self) -> None:
        # The parameter index seeds the stochastic-rounding hash; it is the state_dict order.
        flat = [p for group in self.param_groups for p in group["params"]]
        self._param_index = {p: i for i, p in enumerate(flat)}

    # ------------------------------------------------------------------ backend

    def _resolve_backend(self) -> str:
        if self._resolved_backend is None:
            self._resolved_backend = self._pick_backend()
        return self._resolved_backend

    def _pick_backend(self) -> str:
        if self._backend_request == "torch":
            return "torch"
        from ._native import loader
        if self._backend_request == "native":
            loader.load()  # raises a clear error when the kernel cannot be built
        elif loader.native_or_none() is None:
            return "torch"
        if self.num_threads is not None:
            loader.set_num_threads(self.num_threads)
        return "native"

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW update of every parameter that has a gradient."""
        self._check_sync_mode()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect_work()
        if not work:
            return loss
        backend = self._resolve_backend()
        if self._tier is not None:  # NVMe tier: streams and commits its parameters first
            work = self._tier.step(work, backend)
        items = [self._update_item(p, group, state, step) for p, group, state, step in work]
        adamw_update(items, backend)
        for p, _, state, step in work:
            state["step"].fill_(step)
            self._write_back(p, state)
        return loss

    def _collect_work(self) -> list:
        """Validate every gradient first, so a bad one leaves everything untouched."""
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                check.gradient(p, self._param_index[p], self._layout.get(p))
                work.append((p, group))
        prepared = []
        for p, group in work:
            state = self.state[p]
            if not state:
                state.update(self._new_state(p))
            prepared.append((p, group, state, int(state["step"].item()) + 1))
        return prepared

    def _new_state(self, p: torch.Tensor) -> dict:
        self._layout[p] = (p.shape, p.dtype)
        if self._tier is not None and self._tier.holds(p):
            return self._tier.new_state(p)
        return host_state.new_state(p.detach(), self._precision, alias=_can_alias_master(p))

    def _update_item(self, p: torch.Tensor, group: dict, state: dict, step: int) -> UpdateItem:
        return self._range_item(p, group, state, step, _host_grad(p), self._out_buffer(p), 0)

    def _out_buffer(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the kernel writes the rounded copy: into p itself when it can."""
        if _can_alias_master(p):
            return None
        if p.is_cpu and p.is_contiguous():
            return p.detach().view(-1)
        if p.dtype == torch.float32:
            return None  # the master itself is the fp32 copy
        buffer = self._writeback.get(p)
        if buffer is None:
            buffer = self._writeback[p] = host_state.host_empty(p.numel(), p.dtype)
        return buffer

    def _write_back(self, p: torch.Tensor, state: dict) -> None:
        if p.is_cpu and p.is_contiguous():
            return  # the kernel wrote into p directly
        source = state["master"] if p.dtype == torch.float32 else self._writeback[p]
        p.detach().copy_(source.view(p.shape))

    # --- asynchronous mode (pipeline.py)

    def attach_hooks(self, model: Optional[torch.nn.Module] = None) -> None:
        """Update each parameter as soon as backward has produced its gradient.

        Hooks go on ``model``'s parameters that this optimizer owns (all of them when
        ``model`` is None); then ``loss.backward()`` drives the updates and ``step_sync()``
        finishes the step. Parameters under ``small_param_threshold`` elements, and this
        optimizer's parameters outside ``model``, get no hook: they are updated at
        ``step_sync()``, one buffer each way. Global gradient clipping is impossible here
        (the first layers update before the last gradients exist); use ``step()`` for it.
        """
        from . import pipeline
        if self._pipeline is not None:
            raise RuntimeError("attach_hooks() called twice; call opt.detach_hooks() first")
        pipeline.attach(self, model)

    def detach_hooks(self) -> None:
        """Back to synchronous use (``step()``); call ``step_sync()`` first if a step is running."""
        if self._pipeline is not None:
            self._pipeline.detach()
            self._pipeline = None

    def step_sync(self) -> StepStats:
        """Wait for this step's updates; the device's current stream then sees the new weights.

        Returns the step's StepStats (also ``opt.last_step_stats``). Re-raises any error of
        the step (a bad gradient, a failed update) here; see adambridge/pipeline.py for what
        the parameters and state are then.
        """
        if self._pipeline is None:
            raise RuntimeError("step_sync() needs hooks: call opt.attach_hooks(model) first, "
                               "or use opt.step() in synchronous mode")
        return self._pipeline.sync()

    def accumulate(self) -> ContextManager[None]:
        """``with opt.accumulate(): loss.backward()`` adds to the gradients without updating.

        The first backward outside the block then updates with the accumulated gradients.
        In synchronous mode gradients accumulate anyway, so this is a no-op there.
        """
        return self._pipeline.accumulate() if self._pipeline is not None else nullcontext()

    def _check_sync_mode(self) -> None:
        if self._pipeline is not None:
            raise RuntimeError("step() cannot run while hooks are attached: call "
                               "opt.step_sync() after backward(), or opt.detach_hooks() first")
        if self.autotune_config is not None:
            from . import autotune
            autotune.tune_threads_once(self)

    def _range_item(self, p: torch.Tensor, group: dict, state: dict, step: int,
                    grad: torch.Tensor, out: Optional[torch.Tensor], start: int) -> UpdateItem:
        """_update_item for elements [start, start + grad.numel()) of p, with given host views.

        The state is sliced (fp8 scales per 128-block; start is a multiple of 128), and the
        item's offset is ``start``, so a chunk draws the same rounding bits as the whole.
        """
        numel = grad.numel()
        beta1, beta2 = group["betas"]
        hyper = Hyper.for_step(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                               weight_decay=group["weight_decay"], step=step)
        if _can_alias_master(p):
            state["master"] = p.detach().view(-1)
        views = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
        if start == 0 and numel == state["master"].numel():
            ranged = {k: state.get(k) for k in views}  # the whole parameter: no slicing
        else:
            end = start + numel
            first_block, end_block = start // FP8_BLOCK, -(-end // FP8_BLOCK)
            ranged = {k: state[k][start:end] for k in views[:3]}
            ranged.update({k: state[k][first_block:end_block] if k in state else None
                           for k in views[3:]})
        return UpdateItem(
            **ranged, grad=grad, out=out, offset=start,
            key=stream_key(self.seed, step, self._param_index[p]),
            precision=host_state.precision_of(state), stochastic_rounding=self.stochastic_rounding,
            hyper=hyper)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["adambridge"] = {"seed": self.seed, "precision": self._precision}
        if self._tier is not None:
            self._tier.fill_state_dict(saved)  # waits for in-flight writes
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint (ours, or torch.optim.AdamW's), converting the precision.

        Everything is validated before anything changes: a mismatched checkpoint raises
        and leaves the optimizer as it was.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        params = [p for group in self.param_groups for p in group["params"]]
        new_state, new_groups = checkpoint.restore(state_dict, self.param_groups, params,
                                                   self._precision)
        if self._tier is not None:
            new_state = self._tier.adopt(new_state)  # file-placed states go into their files
        self.state.clear()
        for p, s in new_state.items():
            self.state[p] = s
            self._layout[p] = (p.shape, p.dtype)
        self.param_groups = new_groups
        self._index_params()
        self.seed = state_dict.get("adambridge", {}).get("seed", self.seed)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _can_alias_master(p: torch.Tensor) -> bool:
    """An fp32, contiguous CPU parameter is its own master: no copy, no write-back."""
    return p.is_cpu and p.dtype == torch.float32 and p.is_contiguous()


def _host_grad(p: torch.Tensor) -> torch.Tensor:
    grad = p.grad.detach()
    if not grad.is_cpu:
        grad = grad.to("cpu")  # synchronous mode: a blocking device-to-host copy
    return grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)


OptiComputeAdamW = AdamBridge
