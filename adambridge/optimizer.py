"""AdamBridge: a torch.optim.Optimizer whose AdamW state lives in host memory; no math here.

The class validates arguments, owns param_groups and the per-parameter state dicts, turns
gradients into UpdateItems and hands them to ``functional.adamw_update`` in one batch.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Optional, Union

import torch

from . import _validation as check
from . import autotune, checkpoint
from .distributed import fsdp
from .nvme import tier
from .update import state as host_state
from .sync import scaler_clip, step_plan
from .pipeline import interception, rank_pool
from .sync import transfer
from .distributed import zero
from ._validation import UNSUPPORTED_TORCH_FLAGS
from .autotune import Tuner
from .update.functional import UpdateItem, adamw_update
from .params import ParamOwner, first_listings
from .update.state import can_alias_master
from .stats import StepStats

# Settings of the whole optimizer that checkpoints carry in every group (see checkpoint.py).
_OPTIMIZER_WIDE = ("seed", "precision", "numerics")
# The keyword-only constructor arguments: optimizer-wide, never a group's own. NOTE:
# ZeroRedundancyOptimizer builds its local optimizer from groups that hold every argument it
# was given (they are its defaults) and copies its groups' values in before each step, so a
# group may hold one when it equals the optimizer's; any other value is refused.
_SETTINGS = ("precision", "stochastic_rounding", "backend", "numa_aware", "num_threads",
             "chunk_size", "release_grads", "overlap_writeback", "autotune", "seed",
             "small_param_threshold", "max_grad_norm", "offload_dir", "host_budget",
             "shard_state", "numerics")


class AdamBridge(ParamOwner, torch.optim.Optimizer):
    """AdamW with fp32 master weights and both moments in host RAM, updated by a fused kernel.

    A drop-in replacement for ``torch.optim.AdamW`` (``backward(); step(); zero_grad()``)
    with the same arithmetic. Parameters may be fp32, bf16 or fp16 on any device; after each
    update a parameter receives its fp32 master rounded to nearest even. See README.md for
    every argument.
    """

    # GradScaler hands this optimizer ``grad_scale`` and ``found_inf`` instead of unscaling
    # p.grad itself: asynchronous mode unscales the host copies (see pipeline/corrections.py).
    _step_supports_amp_scaling = True

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
        max_grad_norm: Optional[float] = None,
        offload_dir: Any = None,
        host_budget: Optional[int] = None,
        shard_state: Any = False,
        **torch_flags: Any,
    ) -> None:
        check.torch_flags(torch_flags, UNSUPPORTED_TORCH_FLAGS)
        self._settings = dict(stochastic_rounding=stochastic_rounding, backend=backend,
                              numa_aware=numa_aware, num_threads=num_threads,
                              chunk_size=chunk_size, release_grads=release_grads,
                              overlap_writeback=overlap_writeback, autotune=autotune,
                              small_param_threshold=small_param_threshold,
                              max_grad_norm=max_grad_norm, offload_dir=offload_dir,
                              host_budget=host_budget, shard_state=shard_state)
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
        self.max_grad_norm = check.max_grad_norm(max_grad_norm)
        self.autotune_config = check.autotune(autotune)
        # NVMe tier: validated here, created once the parameters are known.
        offload = tier.check_offload(offload_dir, host_budget, self.autotune_config)
        # ZeRO-2 style host state under DDP (distributed/zero.py): the process group, or None.
        self._shard_group = zero.process_group(shard_state, offload)
        self.autotune_log: list = []
        # The precision tuner (async mode) lives as long as the optimizer; see autotune.py.
        self._tuner = None if self.autotune_config is None else Tuner(
            self.autotune_config, self.autotune_log, origin=self._precision)
        self.last_step_stats = None
        self._resolved_backend: Optional[str] = None
        self._param_index: dict[torch.Tensor, int] = {}
        self._layout: dict[torch.Tensor, tuple[torch.Size, torch.dtype]] = {}
        self._writeback: dict[torch.Tensor, torch.Tensor] = {}
        # (version, data_ptr) of each parameter when this optimizer last wrote it back.
        self._written: dict[torch.Tensor, tuple[int, int]] = {}
        self._pipeline = None  # set by attach_hooks (asynchronous mode)
        self._tier: Optional[tier.Tier] = None  # the NVMe tier, made once params are known
        self._plan: Optional[step_plan.StepPlan] = None  # the cached sync step
        # What the last state_dict() handed out, and why an in-place load into it was refused.
        self._handed: Optional[checkpoint.HandedOut] = None
        self._in_place_refusal: Optional[str] = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        # Its tensors stay on the host; a whole dict written into it is taken or refused.
        self.state = host_state.host_states(self.state, owner=self)
        if offload is not None:
            _refuse_dtensors_with_offload(p for g in self.param_groups for p in g["params"])
            self._tier = tier.Tier(self, offload, host_budget)
        if self._backend_request == "native":
            try:
                self.resolve_backend()  # fail now, not at the first step
            except BaseException:
                # The traceback keeps this half-made optimizer alive: its tier must not keep
                # the directories locked against the user's next try.
                if self._tier is not None:
                    self._tier.close()
                raise

    # ------------------------------------------------------------------ public attributes

    @property
    def precision(self) -> str:
        """How m and v are stored: 'fp32', 'bf16' or 'fp8'."""
        return self._precision

    @property
    def backend(self) -> str:
        """'native/<isa>' (e.g. 'native/avx2') or 'torch'. Resolving may build the kernel."""
        self.resolve_backend()
        if self._resolved_backend == "native":
            from ._native import loader
            return f"native/{loader.isa_name()}"
        return "torch"

    # -- the door the pipeline, the distributed paths, the tier and the tuner use

    @property
    def pipeline(self) -> Any:
        """The attached pipeline (asynchronous mode: attach_hooks), or None."""
        return self._pipeline

    @property
    def tuner(self) -> Optional[Tuner]:
        """The precision tuner (``autotune``), or None."""
        return self._tuner

    @property
    def shard_group(self) -> Any:
        """shard_state's process group, or None."""
        return self._shard_group

    @property
    def resolved_backend(self) -> Optional[str]:
        """The backend the first step picked ("native" or "torch"); None before it."""
        return self._resolved_backend

    def writeback_buffer(self, p: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer the kernel writes p's new low-precision values into before they go
        back to p: kept per parameter, made again when its size changes."""
        buffer = self._writeback.get(p)
        if buffer is None or buffer.numel() != numel:
            buffer = self._writeback[p] = host_state.host_empty(numel, dtype)
        return buffer

    def kept_writeback(self, p: torch.Tensor) -> torch.Tensor:
        """The buffer writeback_buffer() made for p."""
        return self._writeback[p]

    def switch_precision(self, precision: str) -> None:
        """The tuner's switch, once it has re-encoded every state's moments."""
        self._precision = precision

    @property
    def nvme_tier(self) -> Optional["tier.Tier"]:
        """The NVMe tier (``offload_dir``): bytes_written, drive_writes_per_day(); else None."""
        return self._tier

    def placement(self) -> list:
        """Where each parameter's state lives: a list of tier.Placed (index, numel, 'ram' or
        'file', state_bytes) in state_dict order; all 'ram' without ``offload_dir``."""
        return tier.placement(self)

    def host_state_bytes(self) -> int:
        """Bytes of host memory held by all parameters' master weights and moments.

        Not the page-locked copy buffers: ``host_memory_bytes()`` gives the whole picture.
        """
        return sum(host_state.state_bytes(s) for p, s in self.state.items()
                   if isinstance(p, torch.Tensor) and s)

    def host_memory_bytes(self) -> dict:
        """Host bytes by kind: state, pinned_staging (unswappable), writeback, total."""
        from . import memory
        return memory.breakdown(self)

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("Invalid params of a param group: a set (its order changes between "
                            "runs, and the order names checkpoint entries); use a list")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # Weight tying: one tensor reached twice gets one state (torch.optim warns instead).
        unique, seen = [], set()
        for p in params:
            key = p[1] if isinstance(p, tuple) else p
            if isinstance(key, torch.Tensor):
                if key in seen:
                    continue
                seen.add(key)
                _check_new_param(key, len(self._param_index) + len(unique))
            unique.append(p)
        for key in _SETTINGS:
            if key in param_group and not self._is_setting(key, param_group[key]):
                raise ValueError(f"Invalid param group option {key!r}: "
                                 f"{param_group[key]!r} (it is optimizer-wide; pass it "
                                 f"to AdamBridge(...) instead)")
        check.group_flags(param_group, "a param group")
        check.hyperparameters(*(param_group.get(k, self.defaults[k])
                                for k in ("lr", "betas", "eps", "weight_decay")))
        if getattr(self, "_tier", None) is not None:  # None while __init__ adds the groups
            _refuse_dtensors_with_offload(p for p in unique if isinstance(p, torch.Tensor))
        if getattr(self, "_pipeline", None) is not None:
            # NOTE: refused here, before anything changes: the hooks know only the
            # parameters they were attached with, so the next step would update the others
            # and then find these never updated.
            raise RuntimeError("add_param_group() while hooks are attached: call "
                               "opt.detach_hooks(), add the group, then "
                               "opt.attach_hooks(model)")
        super().add_param_group(dict(param_group, params=unique))
        self._index_params()

    def _is_setting(self, key: str, value: Any) -> bool:
        """Whether ``value`` is what this optimizer was built with for setting ``key``."""
        current = self._setting(key)
        try:
            return bool(value is current or value == current)
        except Exception:  # noqa: BLE001 - a value that cannot be compared is not the same
            return False

    def _setting(self, key: str) -> Any:
        now = {"precision": self._precision, "seed": self.seed,
               "numerics": host_state.NUMERICS_VERSION}
        return now[key] if key in now else self._settings.get(key)

    def _check_group_settings(self) -> None:
        """Refuse a group whose copy of an optimizer-wide setting was changed (it would be
        ignored): ZeroRedundancyOptimizer copies its groups' values in before each step."""
        for i, group in enumerate(self.param_groups):
            for key in _SETTINGS:
                if key in group and not self._is_setting(key, group[key]):
                    raise ValueError(f"param_groups[{i}][{key!r}] is {group[key]!r}, but it is "
                                     f"optimizer-wide and this AdamBridge was built with "
                                     f"{key}={self._setting(key)!r}"
                                     f"; build a new AdamBridge to change it")

    def refuse_repeated_params(self) -> None:
        """A step over groups that list a tensor more than once is refused (torch.optim would
        update it once per listing); state_dict() takes such groups, as torch's does."""
        index = self.repeated_param()
        if index is not None:
            p = self._indexed[index]
            raise ValueError(f"param_groups list parameter {index} (shape {tuple(p.shape)}) "
                             f"more than once, so torch.optim would update it once per "
                             f"listing each step; list each tensor once "
                             f"(param_groups.extend(param_groups) lists every one twice)")

    def follow_groups(self) -> None:
        """Index the parameters put into, taken out of or replaced in param_groups[i]['params']
        since the index was made, checked as add_param_group checks them.

        torch.optim steps whatever the groups hold (DeepSpeed's ZeRO-offload hands its CPU
        optimizer its partitions so), so the synchronous step does too: the parameters are
        indexed in group order, as if the optimizer had been built with these groups. A
        parameter taken out keeps its state in opt.state but is no longer stepped or saved.
        With hooks attached, or with shard_state (whose ranges follow the index), a change is
        refused in one line instead.
        """
        if not self.groups_changed():
            return
        flat = [p for group in self.param_groups for p in group["params"]]
        if self._pipeline is not None or self._shard_group is not None:
            raise self._groups_refusal(flat)
        known, seen = set(map(id, self._indexed)), set()
        for i, p in enumerate(flat):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"Invalid param_groups entry {i}: {type(p).__name__} (expected "
                                f"a parameter tensor)")
            if id(p) in seen:
                raise ValueError(f"Invalid param_groups: parameter {i} (shape {tuple(p.shape)}) "
                                 f"is listed twice; list each tensor once")
            seen.add(id(p))
            if id(p) not in known:
                _check_new_param(p, i)
                if self._tier is not None:
                    _refuse_dtensors_with_offload([p])
        self._index_params()

    def _groups_refusal(self, flat: list) -> RuntimeError:
        """The one-line error for param_groups changed under hooks or shard_state."""
        now, before = {id(p) for p in flat}, {id(p) for p in self._indexed}
        added = [(i, p) for i, p in enumerate(flat) if id(p) not in before]
        removed = [(i, p) for i, p in enumerate(self._indexed) if id(p) not in now]
        if added or removed:
            i, p = added[0] if added else removed[0]
            what = (f"parameter {i} (shape {tuple(p.shape)}) was "
                    f"{'put into' if added else 'taken out of'} param_groups")
        else:  # the same tensors in another order: the index (and the rounding keys) would move
            i, p = next((i, p) for i, (p, q) in enumerate(zip(first_listings(flat),
                                                               self._indexed)) if p is not q)
            what = (f"param_groups were reordered (position {i} now holds the parameter of "
                    f"shape {tuple(p.shape)} that was {self._param_index[p]})")
        if self._pipeline is not None:
            return RuntimeError(f"param_groups changed after attach_hooks(): {what}, which the "
                                f"hooks do not follow; call opt.detach_hooks(), then "
                                f"opt.attach_hooks(model)")
        return RuntimeError(f"param_groups changed after construction with shard_state=True: "
                            f"{what}, and each rank's host ranges follow the index; build a new "
                            f"AdamBridge over the new groups")

    # ------------------------------------------------------------------ backend

    def resolve_backend(self) -> str:
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
        rank_pool.configure(self)  # under torchrun: this rank's node or share of the CPUs
        return "native"

    # ------------------------------------------------------------------ step

    # NOTE: torch.compile(opt.step), or a compiled function that calls it, runs this step
    # eagerly, whole: dynamo cannot trace the native call, and inductor (torch 2.13, CPU)
    # generated the int64 hash of the stream keys as float vector code, which failed to build.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW update of every parameter that has a gradient; returns closure's loss.

        With hooks attached (``attach_hooks``) this finishes the step that backward started,
        as ``step_sync()`` does; ``opt.last_step_stats`` then holds its StepStats.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_group_settings()
        self.refuse_repeated_params()
        if self._pipeline is not None:  # async mode: backward began this step, finish it
            self._pipeline.finish()
            return loss
        stats, began = self._step_wide_facts()
        if stats.skipped:
            return loss
        updated = self._sync_path()(stats, began)
        if updated is not None:
            self._finish_stats(stats, updated, began)
        return loss

    def _step_wide_facts(self) -> tuple:
        """Before a synchronous step: what must hold first, then GradScaler and clipping on
        p.grad. (StepStats, the start time); ``stats.skipped`` when GradScaler skips it."""
        if self._handed is not None or self._in_place_refusal is not None:
            self.settle_in_place()  # before anything changes (async: at each gradient)
        interception.check_sync_step(self)  # a parameter another optimizer's hooks update
        if self.autotune_config is not None:
            autotune.tune_threads_once(self)
        began = time.perf_counter()
        stats = StepStats()
        self.last_step_stats = stats
        if not scaler_clip.sync_amp(self):
            stats.skipped = True
        elif self.max_grad_norm is not None:
            stats.grad_norm = scaler_clip.sync_clip(self)
        return stats, began

    def _sync_path(self) -> Callable[[StepStats, float], Optional[int]]:
        """The synchronous step's path, picked once: each takes (stats, start time) and
        returns how many parameters it updated, or None where it fills the stats itself."""
        if self._shard_group is not None:
            return self._step_sharded
        if self._plan is not None and self._plan.fits(self):  # before the O(params) DTensor scan
            return self._step_cached_plan
        self.release_plan()
        self.follow_groups()  # parameters put into param_groups[i]["params"] directly
        if fsdp.holds_dtensors(self):
            return self._step_fsdp2
        return self._step_params

    def _step_sharded(self, stats: StepStats, began: float) -> None:
        """shard_state: this rank's ranges, then the all-gather."""
        self.follow_groups()  # refused: the ranges follow the index
        zero.sync_step(self, stats, began)

    def _step_cached_plan(self, stats: StepStats, began: float) -> int:
        """The same parameters as the last step: the kept native batch, refreshed."""
        self._plan.run(self)
        return len(self._plan)

    def _step_fsdp2(self, stats: StepStats, began: float) -> None:
        """FSDP2: each rank updates its local shards."""
        if self._tier is not None:  # DTensors put into param_groups behind our back
            _refuse_dtensors_with_offload(p for g in self.param_groups for p in g["params"])
        fsdp.sync_step(self, stats, began)

    def _step_params(self, stats: StepStats, began: float) -> int:
        """Every parameter with a gradient: a new cached plan where one fits, else the NVMe
        tier's parameters streamed from files and the rest updated in one call."""
        work = self._collect_work()
        if not work:
            return 0
        backend = self.resolve_backend()
        if step_plan.eligible(self, work, backend):
            # NOTE: later steps over the same parameters reuse this plan.
            self._plan = step_plan.StepPlan(self, work)
            self._plan.run(self)
            return len(work)
        rest = work if self._tier is None else self._tier.step(work, backend, stats)
        # NOTE: device gradients and weights move through pinned staging with one wait per
        # step (sync/transfer.py), not 2N blocking copies.
        staged = transfer.Staged(self, [p for p, _, _, _ in rest], self._stages_out)
        items = [self._update_item(p, group, state, step, staged)
                 for p, group, state, step in rest]
        adamw_update(items, backend)
        for p, _, state, step in rest:
            state["step"].fill_(step)
        staged.write_back([(p, state) for p, _, state, _ in rest], self._write_back)
        self.mark_written([p for p, _, _, _ in work])
        return len(work)

    @staticmethod
    def _finish_stats(stats: StepStats, count: int, began: float) -> None:
        stats.num_params, stats.num_batches = count, int(bool(count))
        stats.host_update_s = stats.wall_s = time.perf_counter() - began

    def _collect_work(self) -> list:
        """Validate every gradient first, so a bad one leaves everything untouched."""
        work = []
        for i, group in enumerate(self.param_groups):
            check.group_flags(group, f"param_groups[{i}]")  # set after construction or load
            for p in group["params"]:
                if p.grad is None:
                    continue
                check.gradient(p, self._param_index[p], self._layout.get(p))
                work.append((p, group))
        prepared = []
        for p, group in work:
            state = self.ensure_state(p)
            prepared.append((p, group, state, int(state["step"].item()) + 1))
        return prepared

    def _update_item(self, p: torch.Tensor, group: dict, state: dict, step: int,
                     staged: "transfer.Staged") -> UpdateItem:
        return self.range_item(p, group, state, step, staged.grad(p),
                               staged.out(p, self.out_buffer), 0)

    def _stages_out(self, p: torch.Tensor) -> bool:
        # A CUDA parameter: the kernel writes its copy (fp32 too) into pinned staging, so
        # the way back is one non_blocking copy, not a pageable one.
        return transfer.on_device(p) and not can_alias_master(p)

    def out_buffer(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the kernel writes the rounded copy: into p itself when it can."""
        if can_alias_master(p):
            return None
        if p.is_cpu and p.is_contiguous():
            return p.detach().view(-1)
        if p.dtype == torch.float32:
            return None  # the master itself is the fp32 copy
        return self.writeback_buffer(p, p.numel(), p.dtype)

    def _write_back(self, p: torch.Tensor, state: dict) -> None:
        if p.is_cpu and p.is_contiguous():
            return  # the kernel wrote into p directly
        source = state["master"] if p.dtype == torch.float32 else self.kept_writeback(p)
        p.detach().copy_(source.view(p.shape))

    # --- asynchronous mode (pipeline/hooks.py)

    def attach_hooks(self, model: Optional[torch.nn.Module] = None, *,
                     accumulation_steps: int = 1,
                     closes_window: Optional[Callable[[], bool]] = None,
                     edits_grads: bool = False, verify_steps: Optional[int] = None) -> None:
        """Update each parameter as soon as backward has produced its gradient.

        Hooks go on ``model``'s parameters that this optimizer owns (all of them when
        ``model`` is None); then ``loss.backward()`` drives the updates and ``step()`` (or
        ``step_sync()``) finishes the step. Parameters under ``small_param_threshold``
        elements, and gradients without a hook, are updated when the step finishes, one
        buffer each way. A backward pass updates only when it closes the accumulation
        window: every ``accumulation_steps``-th pass, or when ``closes_window()`` returns
        True (frameworks that know it, e.g. accelerate's ``sync_gradients``), and never
        inside ``with opt.accumulate():``. Clipping (``max_grad_norm``, or torch's
        ``clip_grad_norm_`` on these parameters) and GradScaler work as in ``step()``.

        Between backward and ``step()`` the loop may read, edit, replace or zero any
        gradient: ``p.grad`` is a view of the step's gradient (docs/async.md). A loop whose
        first change to a gradient comes after its first step passes ``edits_grads=True``
        (a copy of each update's state is kept, so any change is redone exactly).

        ``verify_steps=N`` (default: the environment's ``ADAMBRIDGE_VERIFY_ASYNC``, else 0)
        checks the first N steps against sync mode bit for bit and raises one line naming
        the parameter, the step and the likely cause at the first difference.
        """
        from .pipeline import verify
        edits_grads = check.boolean("edits_grads", edits_grads)
        verify_steps = verify.steps_to_verify(verify_steps)
        from .distributed import ddp as ddp_async
        from .pipeline import hooks as pipeline
        if self._pipeline is not None:
            raise RuntimeError("attach_hooks() called twice; call opt.detach_hooks() first")
        self.follow_groups()  # the hooks cover the groups as they are now
        sharded = self._shard_group is not None
        fsdp2 = not sharded and fsdp.holds_dtensors(self)
        if not sharded and not fsdp2:
            ddp_async.refuse_unknown_wrapper(model, "attach_hooks()")
        self.release_plan()  # the pipeline reads the write records and owns the steps now
        if (sharded or fsdp2) and verify_steps:
            raise ValueError(f"{verify.ENV}={verify_steps} checks the async mode of one process's "
                             f"hooks; {'shard_state=True' if sharded else 'FSDP2'} runs its own "
                             f"(the synchronous step's code on each shard): unset it there")
        if sharded:  # shard_state: this rank's ranges, from DDP's hook
            from .distributed import zero_async
            self._pipeline = zero_async.attach(self, model, accumulation_steps, closes_window)
            self._pipeline.holds_always = edits_grads  # (no copy to redo from: hold instead)
            return
        if fsdp2:  # FSDP2: shards updated as their grads land
            from .distributed import fsdp_async
            self._pipeline = fsdp_async.attach(self, model, accumulation_steps, closes_window)
            self._pipeline.holds_always = edits_grads
            return
        ddp = ddp_async.wrapper_in(model)
        if ddp is not None:
            ddp_async.refuse_foreign_comm_hook(ddp)
        # Several ranks and no DDP in sight (its .module, perhaps): no gradient hook until a
        # DDP's forward is seen running the model (distributed/ddp.py).
        late = ddp is None and ddp_async.world_size() > 1
        self._pipeline = pipeline.new(self, model, accumulation_steps=accumulation_steps,
                                      closes_window=closes_window,
                                      hook_grads=ddp is None and not late,
                                      edits_grads=edits_grads, verify_steps=verify_steps)
        pipeline.start(self._pipeline)
        if ddp is not None:  # DDP: updates start from its all-reduced buckets instead
            ddp_async.hand_over_reduced(ddp, self._pipeline)
        elif late:
            ddp_async.bind_when_wrapped(model, self._pipeline)

    def detach_hooks(self) -> None:
        """Remove the hooks (always) and go back to synchronous ``step()``."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.detach()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with hooks attached, refused between a backward and its step()."""
        # (pipeline/hooks.py's pipeline checks; the FSDP2 and shard_state ones have no such record)
        check = getattr(self._pipeline, "check_zero_grad", None)
        if check is not None:
            check()
        super().zero_grad(set_to_none)
        if not set_to_none and hasattr(self._pipeline, "zero_grads_kept"):
            # the gradients the last step consumed are zeros again, as torch's would be
            self._pipeline.zero_grads_kept()

    def step_sync(self) -> StepStats:
        """``step()`` with hooks attached, returning the step's StepStats.

        Waits for this step's updates; the device's current stream then sees the new
        weights. Re-raises any error of the step (a bad gradient, a failed update, an
        interrupted backward) here; see adambridge/pipeline/hooks.py for what the parameters and
        state are then.
        """
        if self._pipeline is None:
            raise RuntimeError("step_sync() needs hooks: call opt.attach_hooks(model) first, "
                               "or use opt.step() in synchronous mode")
        self.step()
        return self.last_step_stats

    def accumulate(self) -> ContextManager[None]:
        """``with opt.accumulate(): loss.backward()`` adds to the gradients without updating.

        The first backward outside the block then updates with the accumulated gradients.
        In synchronous mode gradients accumulate anyway, so this is a no-op there.
        """
        return self._pipeline.accumulate() if self._pipeline is not None else nullcontext()

    def aliases_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is its own fp32 master (an fp32, contiguous CPU parameter)."""
        return can_alias_master(p)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """torch's layout, loadable by torch.optim.AdamW, plus what an exact resume needs.

        See adambridge/checkpoint.py and docs/checkpoints.md for the keys.
        """
        return self._state_dict(sharded=False)

    def sharded_state_dict(self) -> dict:
        """shard_state=True: state_dict()'s dict for torch.distributed.checkpoint, holding
        this rank's ranges only (a collective: every rank calls it).

        The keys, shapes and dtypes are state_dict()'s, so the checkpoint is the one a
        gathered save writes and loads wherever that one loads (an unsharded AdamBridge,
        torch.optim.AdamW, shard_state on any number of ranks). Each per-element entry
        (``master``, the moments, fp8 codes and scales) is a tensor of the whole shape
        that holds this rank's range of it, a view of the state (no copy);
        ``step`` and ``ab_step`` are plain. Any operation on such an entry but DCP's is
        refused: read it through DCP, or call state_dict() for a gathered copy::

            dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
            sd = opt.sharded_state_dict()
            dcp.load({"optim": sd}, checkpoint_id=path)
            opt.load_state_dict(sd)

        ``dcp.load`` writes into the state itself, so a load with no load_state_dict() is
        taken at the next step as after load_state_dict() when the checkpoint holds a
        current AdamBridge state, else refused at the next step in one line (as for
        state_dict(), docs/checkpoints.md).
        """
        if self._shard_group is None:
            raise ValueError("sharded_state_dict() needs AdamBridge(..., shard_state=True); "
                             "without it every rank holds the whole state: call "
                             "opt.state_dict()")
        return self._state_dict(sharded=True)

    def save_gathered(self, f: Any) -> None:
        """shard_state=True: write ``torch.save(opt.state_dict(), f)``'s file, gathering one
        tensor of the state at a time (a collective: every rank calls it; one rank passes
        the file or path, the others None).

        ``state_dict()`` gathers the whole state on every rank; this holds at most one
        tensor of one parameter's state beyond the steady state, on the writing rank only.
        Load the file with ``torch.load`` and ``load_state_dict()``, on any number of ranks,
        sharded or not (docs/multi-gpu.md).
        """
        if self._shard_group is None:
            raise ValueError("save_gathered() needs AdamBridge(..., shard_state=True); without "
                             "it every rank holds the whole state: adambridge.checkpoint."
                             "save(opt.state_dict(), f)")
        from .distributed import zero_gathered  # imports torch.distributed.checkpoint
        zero_gathered.save(self, self.sharded_state_dict(), f)

    def _state_dict(self, sharded: bool) -> dict:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self.follow_groups()  # ids are positions in the groups as they are now
        self.settle_in_place(strict=False)  # a load into the previous one: taken or recorded
        meta = checkpoint.group_meta(self.seed, self._precision)
        # torch's own AdamW flags too: DCP loads a checkpoint only into keys it holds.
        groups = [{**checkpoint.torch_group_flags(),
                   **{k: v for k, v in group.items() if k != "params"}, **meta,
                   "params": [self._param_index[p] for p in group["params"]]}
                  for group in self.param_groups]
        state, handed = self._saved_states(sharded)
        self._handed = checkpoint.HandedOut(state, handed)
        saved = {"state": state, "param_groups": groups, "adambridge": dict(meta)}
        if self._tuner is not None:  # where the precision tuner is, for a resume
            saved["adambridge"]["autotune"] = self._tuner.state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, saved)
            saved = saved if result is None else result
        return saved

    def _saved_states(self, sharded: bool = False) -> tuple:
        """(the saved 'state', (index, p, why its tensors are copies) per parameter entry);
        ``sharded``: shard_state's entries of this rank's ranges (zero_saved.py)."""
        # The NVMe tier's committed state, read after any step in flight (DeepSpeed #7549).
        filed = self._tier.committed_states() if self._tier is not None else {}
        state, handed = {}, []
        for key, value in self.state.items():
            if not isinstance(key, torch.Tensor):
                # Not a parameter's: kept as torch keeps it; the table made it a HostState,
                # which torch.load(weights_only=True) of the re-saved file would refuse.
                state[key] = dict(value) if isinstance(value, host_state.HostState) else value
            elif value and self._shard_group is None and key in self._param_index:
                index = self._param_index[key]  # (else taken out of param_groups: not saved)
                copied = None  # every saved tensor is a view of the state's own
                if key in filed:
                    value = filed[key]  # a file-backed state: its committed tensors
                    copied = "keeps its state in the NVMe tier's files, which its entries read"
                state[index] = fsdp.saved_entry(key, value)
                handed.append((index, key, copied))
        if self._shard_group is not None and sharded:  # a collective: this rank's ranges
            from .distributed import zero_saved  # imports torch.distributed.checkpoint
            found, handed = zero_saved.sharded_states(self)
            state.update(found)
        elif self._shard_group is not None:  # a collective: the whole state, on every rank
            state.update(zero.saved_state(self))
            by_index = {i: p for p, i in self._param_index.items()}
            handed = [(i, by_index[i], "is sharded by shard_state, saved as gathered copies")
                      for i in state if i in by_index]
        return state, handed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint (ours, or torch.optim.AdamW's), converting the precision.

        Every value is checked before anything changes: a checkpoint that does not fit, or
        holds a value out of range, raises and leaves the optimizer as it was.
        """
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        self._refuse_load_mid_step()
        self.follow_groups()  # the checkpoint's ids name the groups' parameters as they are
        params = [p for group in self.param_groups for p in group["params"]]
        # A tuned run resumes in the precision its tuner had reached (autotune.py).
        precision, tuned = autotune.resumed(self, state_dict)
        try:
            if self._shard_group is not None:  # whole checkpoint in, this rank's ranges kept
                from .distributed import zero_saved  # (or this rank's ranges of it)
                restored = zero_saved.restore(self, state_dict)
            else:
                restored = fsdp.restore(state_dict, self.param_groups, params, precision,
                                        self._handed, own=self.state.get)
            # Checked whole; built one parameter at a time (file-placed ones into the files).
            if self._tier is not None:
                new_state = self._tier.adopt(restored.states(kept=self._tier.keeps_in_ram))
            else:
                new_state = dict(restored.states())
        except BaseException:
            if self._handed is not None and self._handed.written():
                self._in_place_refusal = checkpoint.REFUSED_AFTER_IN_PLACE
            raise
        self._handed, self._in_place_refusal = None, None
        self.release_plan()
        self.state.clear()
        self._layout.clear()
        self._written.clear()  # the next step compares each parameter with its master
        for key, value in host_state.host_states(new_state).items():
            self.state[key] = value
            if isinstance(key, torch.Tensor):
                self._layout[key] = (key.shape, key.dtype)
        self.param_groups = restored.groups
        self._index_params()
        self.seed = restored.meta.get("seed", self.seed)
        if tuned is not None and self._shard_group is None:
            self._precision = precision
            self._tuner.load_state_dict(tuned)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _refuse_load_mid_step(self) -> None:
        """A load between backward() and step() with hooks on the NVMe tier, refused.

        NOTE: the hooks have begun this step (its updates of file-placed parameters may
        already be committed in the files, the rest are queued with the old state), so a
        load would end with the loaded state and this step's mixed, not the load followed
        by the step as in sync mode."""
        in_flight = getattr(self._pipeline, "step_in_flight", None)  # (the distributed ones
        if self._tier is None or in_flight is None or not in_flight():   # have no tier)
            return
        raise RuntimeError("load_state_dict() between backward() and step() with hooks on "
                           "the NVMe tier (offload_dir): this step's updates have begun and "
                           "would mix with the loaded state; call opt.step() first and load "
                           "after it, or load before backward()")

    def take_written_state(self, p: torch.Tensor, value: dict) -> dict:
        """The HostState for a plain dict written into ``opt.state[p]`` from outside
        (ZeroRedundancyOptimizer.load_state_dict writes each saved entry so), or a one-line
        refusal. A parameter's entry is checked and converted as load_state_dict() does
        (torch's form, ours, any precision); the next step compares p with its master."""
        if p not in self._param_index:
            return host_state.HostState(value)  # not a parameter's: kept as is, as torch does
        index = self._param_index[p]
        where = f"opt.state[p] of parameter {index} was written from outside"
        if self._pipeline is not None:
            raise RuntimeError(f"{where} while hooks are attached; call opt.detach_hooks() "
                               f"first, or load with opt.load_state_dict()")
        if self._tier is not None or self._shard_group is not None or \
                fsdp.is_dtensor(p):
            kind = ("the NVMe tier (offload_dir)" if self._tier is not None else
                    "shard_state=True" if self._shard_group is not None else "FSDP2")
            raise RuntimeError(f"{where}, which {kind} does not take (its state is not a "
                               f"plain host dict); load with opt.load_state_dict()")
        try:
            restored = checkpoint.written_entry(index, value, p, self._precision)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        self.release_plan()  # it holds pointers into the state being replaced
        self._written.pop(p, None)  # the next step compares p with the new master
        if restored:
            self._layout[p] = (p.shape, p.dtype)
        return host_state.HostState(restored)

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict:
        # Everything but the hooks (as torch) and the async pipeline: its threads and hooks
        # belong to the original, so a copy or an unpickled optimizer is in synchronous mode.
        state = {k: v for k, v in self.__dict__.items()
                 if not (k.startswith("_optimizer_") and k.endswith("_hooks"))}
        state["_pipeline"] = None
        state["_handed"] = None  # its version counter is this optimizer's, not a copy's
        # The plan holds raw pointers into this optimizer's tensors: a copy builds its own.
        state["_plan"], state["_written"] = None, self.written_records()
        return state

    def __setstate__(self, state: dict) -> None:
        had_flag = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)
        self.__dict__.setdefault("_tier", None)  # pickled before the NVMe tier existed
        self.__dict__.setdefault("_shard_group", None)  # pickled before shard_state existed
        self.__dict__.setdefault("_plan", None)  # pickled before the step plan existed
        self.__dict__.setdefault("_tuner", None)  # pickled before the tuner was the optimizer's
        self.__dict__.setdefault("_handed", None)  # pickled before in-place loads were seen
        self.__dict__.setdefault("_in_place_refusal", None)
        self.__dict__.setdefault("_settings", {})  # pickled before groups could hold them
        self.state = host_state.host_states(self.state, owner=self)  # plain dicts, perhaps
        if "_indexed" not in self.__dict__:  # pickled before param_groups were followed
            self.__dict__["_indexed"] = [p for g in self.param_groups for p in g["params"]]
        if not had_flag:  # torch adds it for its own optimizers; ours refuses the flag
            self.defaults.pop("differentiable", None)


def _check_new_param(p: torch.Tensor, index: int) -> None:
    """What add_param_group checks of each parameter it adds."""
    check.parameter(p, index)
    fsdp.check_parameter(p, index)


def _refuse_dtensors_with_offload(params: Iterable) -> None:
    """offload_dir with FSDP2 (DTensor) parameters: refused when the pairing is first seen,
    before a tier exists, so neither step() nor attach_hooks() meets it later."""
    if any(fsdp.is_dtensor(p) for p in params):
        raise ValueError("offload_dir with FSDP2 (DTensor) parameters is not supported, in "
                         "either mode; remove offload_dir (each rank's shard then stays in "
                         "host RAM)")


_can_alias_master = can_alias_master  # the name pipeline code of before the seams imported


OptiComputeAdamW = AdamBridge
