"""The cached plan of a synchronous step() over CPU parameters: built once, refreshed per step.

NOTE: Building UpdateItems and packing descriptors for every parameter on every
step costs microseconds per parameter and allocates several container objects each, whose
number triggers the cyclic GC (0.38 s for 10,000 small parameters, against 7 ms for one
tensor of the same total). A plan holds a NativeBatch over the whole range of each parameter
with a gradient, and the facts that say it still fits: the groups, the parameters, which of
them have a gradient, each one's data pointer, layout and state tensors and, for a parameter
that is not its own master, its autograd version. A step checks those facts in C-level
passes (``map`` over the parameters, identity and integer compares), computes the stream
keys as one tensor and one Hyper per (group, step), and refreshes the gradient column only
when a p.grad tensor object changed. The step counters are 0-d views of one tensor held by
the plan, so ``state["step"]`` is always current and advancing them is one add.

Anything the facts do not match sends the step down the full path (optimizer.py), which
validates, raises its usual errors and builds a new plan; so does anything a plan does not
cover: the torch backend, the NVMe tier, hooks, DTensors, device or non-contiguous tensors.

A plan over at least FACTS_MIN_PARAMS parameters reads the tensor facts in native passes
(_native/plan_checks.py, C++ against torch's headers) instead of the Python ones, where that
library builds: the same facts, compared the same way, about a fifth of the time per
parameter. The first such plan starts the library's build (about 10 s, once per torch
version) on a thread and checks in Python until it is ready. The Python passes stay for
small plans and for machines without a C++ compiler.
"""
from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, eq, is_, is_not, itemgetter
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .. import _validation as check
from . import transfer
from .._native import plan_checks
from ..update.functional import Hyper, NativeBatch, stream_keys
from ..update.state import can_alias_master

if TYPE_CHECKING:  # the optimizer's door (adambridge/door.py)
    from ..door import OptimizerDoor

_grad_of = attrgetter("grad")
_version_of = attrgetter("_version")
# One call for two facts of a tensor: its shape and dtype. The tuple holds no tensor, so
# comparing two of them never calls Tensor.__eq__ (a torch.Size compares its ints, a
# torch.dtype is a singleton).
_facts = attrgetter("shape", "dtype")
_shape_of = itemgetter(0)  # of a _facts tuple
_new_grad_facts = attrgetter("is_cpu", "shape", "dtype")  # a new gradient's device too
_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_MOMENTS = ("master", "exp_avg", "exp_avg_sq")
_SCALES = ("exp_avg_scale", "exp_avg_sq_scale")
# What the plan reads from a state dict, in one lookup per dict (raises KeyError if one went).
_state_refs = itemgetter("step", *_MOMENTS)
_scale_refs = itemgetter(*_SCALES)
_STATE_KEYS = ("step", *_MOMENTS)  # in _state_refs' order
# Below this many parameters the Python passes cost little and no C++ build is started.
FACTS_MIN_PARAMS = 64


def _same(a: Sequence, b: Sequence) -> bool:
    """The same objects in the same order (identity, never Tensor.__eq__)."""
    return len(a) == len(b) and all(map(is_, a, b))


def _plain_cpu(t: torch.Tensor) -> bool:
    # Not empty: the checks per step take an unchanged data pointer to mean the same CPU
    # memory (CUDA's unified addressing never hands out a host address), and an empty
    # tensor's pointer, 0 on any device, says nothing.
    return t.is_cpu and t.layout == torch.strided and t.is_contiguous() and t.numel() > 0 \
        and not transfer.on_device(t)


def _plain_step(state: dict) -> bool:
    step = state["step"]
    return isinstance(step, torch.Tensor) and step.dim() == 0 and step.is_cpu \
        and step.dtype == torch.float32


def eligible(opt: OptimizerDoor, work: Sequence[tuple], backend: str) -> bool:
    """Whether a plan can carry this step's ``work`` ((p, group, state, step) per parameter)."""
    if backend != "native" or opt.nvme_tier is not None or opt.pipeline is not None:
        return False
    return all(_plain_cpu(p) and _plain_cpu(p.grad) and _plain_step(state)
               for p, _, state, _ in work)


class StepPlan:
    """The NativeBatch of one set of parameters with a gradient and the facts it was built on.

    Made by the full path from its validated ``work``, whose states exist; ``fits(opt)`` says
    whether this step can use it, ``run(opt)`` does the step.
    """

    def __init__(self, opt: OptimizerDoor, work: Sequence[tuple]) -> None:
        self.groups = list(opt.param_groups)
        self.where = [f"param_groups[{i}]" for i in range(len(self.groups))]
        self.flat = list(chain.from_iterable(g["params"] for g in self.groups))
        self.grads_all = list(map(_grad_of, self.flat))
        self.params = [p for p, _, _, _ in work]
        self.states = [state for _, _, state, _ in work]
        position = {id(p): i for i, p in enumerate(self.flat)}
        self.pick_grads = itemgetter(*[position[id(p)] for p in self.params])
        self.stochastic_rounding = opt.stochastic_rounding
        self._share_steps()
        self.batch = NativeBatch([opt.range_item(p, group, state, step, p.grad,
                                                 opt.out_buffer(p), 0)
                                  for p, group, state, step in work])
        self.grads = [item.grad for item in self.batch.items]
        self.grad_ptrs = list(map(_data_ptr, self.grads))
        self._grad_facts(list(map(_facts, self.grads)))  # as the dtype column was written
        self.ptrs = list(map(_data_ptr, self.params))
        self.facts = list(map(_facts, self.params))
        self.state_refs = list(chain.from_iterable(map(_state_refs, self.states)))
        self.state_ptrs = list(map(_data_ptr, self.state_refs))
        self.fp8 = [state for state in self.states if _SCALES[0] in state]
        self.scale_refs = list(chain.from_iterable(map(_scale_refs, self.fp8)))
        self.scale_ptrs = list(map(_data_ptr, self.scale_refs))
        # Parameters that are not their own master: a write by anyone else must reach the
        # master, which the full path does (ParamOwner.ensure_state), so a changed version
        # sends the step there.
        self.copied = [p for p in self.params if not can_alias_master(p)]
        self.versions = None  # of ``copied``, read after each write-back of this plan
        # opt.state as a whole: any entry added, removed or replaced rebuilds the plan.
        self.state = opt.state
        self.state_keys, self.state_values = list(opt.state.keys()), list(opt.state.values())
        self.ran = False
        self._index_rows(opt, work)
        self.native: Optional[_NativeFacts] = None
        self.wants_native = len(self.params) >= FACTS_MIN_PARAMS
        self._take_native_checks()

    def _take_native_checks(self) -> None:
        # Called where the plan's facts are those of the tensors now (at construction, and
        # after Python checks that passed), so rows read now are the plan's.
        if not self.wants_native or self.native is not None:
            return
        lib = plan_checks.loaded()
        if lib is None:
            if plan_checks.unavailable_reason() is not None:
                self.wants_native = False  # not to be had in this process
            else:
                plan_checks.start_loading()  # built meanwhile; a later step takes it up
            return
        self.native = _NativeFacts.make(self, lib)
        self.wants_native = self.native is not None  # a tensor it cannot read: never again

    def __len__(self) -> int:
        return len(self.params)

    def _share_steps(self) -> None:
        # One tensor of every step counter; each state's "step" becomes a 0-d view of it.
        self.steps = torch.stack([state["step"] for state in self.states])
        for state, view in zip(self.states, self.steps.unbind(0)):
            state["step"] = view

    def _index_rows(self, opt: OptimizerDoor, work: Sequence[tuple]) -> None:
        # The full path lists a group's parameters together, in group order: one segment each.
        self.segments, start = [], 0
        for i, (_, group, _, _) in enumerate(work):
            if i + 1 == len(work) or work[i + 1][1] is not group:
                self.segments.append((group, start, i + 1))
                start = i + 1
        self.param_index = torch.tensor([opt.index(p) for p in self.params], dtype=torch.int64)

    # ------------------------------------------------------------------ does it still fit

    def fits(self, opt: OptimizerDoor) -> bool:
        """Whether this step's parameters, gradients and states are the plan's; new gradient
        tensors that pass every check of the full path are taken in. Raises what the full
        path raises for a group flag; changes nothing else when it answers False."""
        if opt.stochastic_rounding != self.stochastic_rounding or opt.pipeline is not None \
                or opt.nvme_tier is not None or opt.resolved_backend != "native":
            return False
        if not _same(opt.param_groups, self.groups):
            return False
        for group, where in zip(self.groups, self.where):
            check.group_flags(group, where)  # set after construction: refused as in full path
        if self.native is not None:
            return self.native.fits(self, opt)
        flat = list(chain.from_iterable(g["params"] for g in self.groups))
        if not (_same(flat, self.flat) and self._same_params() and self._same_states(opt)):
            return False
        grads_all = list(map(_grad_of, flat))
        if not ((_same(grads_all, self.grads_all) and self._same_grads())
                or self._take_grads(grads_all)):
            return False
        self._take_native_checks()  # once the library has been built
        return True

    # NOTE: each pass below is one C-level call per tensor, and after the kernel
    # has streamed the state through the caches each one also waits for that tensor's
    # metadata to come back from memory: the fewer passes, the faster. What is checked is
    # what the kernel's row relies on (data pointer, shape, dtype, contiguity), plus the
    # device of a new gradient; an unchanged pointer of a (never empty) plan tensor is
    # the same host memory, so its device is not read again. Nothing is inferred from the
    # autograd version: p.data = ..., g.data = ... and swap_tensors change a layout (even
    # keeping the pointer: a view, a transpose, another dtype) without bumping it.

    def _same_params(self) -> bool:
        """Same storage, shape, dtype, contiguity and (if not their own master) nobody
        else's writes."""
        params = self.params
        return (all(map(eq, map(_data_ptr, params), self.ptrs))
                and all(map(eq, map(_facts, params), self.facts))
                and all(map(_is_contiguous, params))
                and (not self.copied or list(map(_version_of, self.copied)) == self.versions))

    def same_state_dicts(self, opt: OptimizerDoor) -> bool:
        """opt.state is the plan's, with the same keys and the same state dict objects."""
        # Reading opt.state in order hashes no tensor (Tensor.__hash__ is Python code).
        return (opt.state is self.state and _same(list(self.state.keys()), self.state_keys)
                and _same(list(self.state.values()), self.state_values))

    def _same_states(self, opt: OptimizerDoor) -> bool:
        """The same state dicts, holding the same tensors (replacing one rebuilds the plan)."""
        if not self.same_state_dicts(opt):
            return False
        try:
            same = (all(map(is_, chain.from_iterable(map(_state_refs, self.states)),
                            self.state_refs))
                    and all(map(is_, chain.from_iterable(map(_scale_refs, self.fp8)),
                                self.scale_refs)))
        except KeyError:
            return False  # an entry was deleted: the full path says which
        # The same tensors may hold new storage (t.data = ...; no version bump): the rows
        # hold addresses, so a moved one must rebuild the plan, or the kernel writes where
        # the old storage was (freed memory, if nothing else holds it).
        return (same and all(map(eq, map(_data_ptr, self.state_refs), self.state_ptrs))
                and all(map(eq, map(_data_ptr, self.scale_refs), self.scale_ptrs)))

    def _same_grads(self) -> bool:
        """The plan's gradient objects still have the storage, shape, dtype and contiguity
        they were taken in with (g.data = ... and resize_ keep the object)."""
        grads = self.grads
        return (all(map(eq, map(_data_ptr, grads), self.grad_ptrs))
                and all(map(eq, map(_facts, grads), self.grad_facts))
                and all(map(_is_contiguous, grads)))

    def _grad_facts(self, facts: list) -> None:
        # (shape, dtype) of the gradients the columns hold; with is_cpu True, what a new one
        # must show to take their place without a dtype column write.
        self.grad_facts = facts
        self.new_grad_facts = [(True, *f) for f in facts]

    def _take_grads(self, grads_all: list) -> bool:
        """New gradient tensors (or new storage) on the same parameters: checked as the full
        path checks them (anything it would refuse or copy answers False, so the full path
        does that), then their pointers (and, if a dtype changed, dtypes) are written."""
        if sum(map(is_not, grads_all, repeat(None))) != len(self.params):
            return False
        grads = self.pick_grads(grads_all)
        grads = list(grads) if isinstance(grads, tuple) else [grads]
        if not all(map(is_not, grads, repeat(None))):
            return False
        try:
            # data_ptr() raises for every layout without a storage (sparse, mkldnn), so a
            # pointer for each is also the check that each is strided.
            pointers = list(map(_data_ptr, grads))
            # (compared as made: a list of 10,000 tuples would start the cyclic GC)
            same_facts = all(map(eq, map(_new_grad_facts, grads), self.new_grad_facts))
        except RuntimeError:
            return False  # the full path refuses it with its own message
        if not all(map(_is_contiguous, grads)):
            return False
        if same_facts:  # on the CPU, the parameters' shapes, the dtypes of the column
            self.batch.take_checked_grads(grads, pointers)
        else:  # (rare: a dtype changed, or something the full path refuses)
            facts = list(map(_facts, grads))
            if not all(map(eq, map(_shape_of, facts), map(_shape_of, self.facts))):
                return False
            try:
                # checks the device, dtype and contiguity, then writes both columns
                pointers = self.batch.set_grads(grads, numels_checked=True)
            except ValueError:
                return False  # the full path refuses it (or copies it) with its own message
            self._grad_facts(facts)
        self.grads, self.grads_all, self.grad_ptrs = grads, grads_all, pointers
        return True

    # ------------------------------------------------------------------ the step

    def run(self, opt: OptimizerDoor) -> None:
        """One update of every parameter of the plan: keys, hyperparameters, one native call,
        then the counters and the autograd versions (as ParamOwner.mark_written bumps them)."""
        steps = self.steps + 1
        keys, hypers, index = self._step_columns(opt.seed, steps)
        self.batch.set_step(keys, hypers[0] if index is None else hypers, index)
        self.batch.run()
        self.steps.copy_(steps)  # every state's "step" is a view of it
        if self.native is not None:
            self.native.after_write(self)
        else:
            torch.autograd.graph.increment_version(self.params)
            if self.copied:
                self.versions = list(map(_version_of, self.copied))
        self.ran = True

    def _step_columns(self, seed: int, steps: torch.Tensor) -> tuple:
        """Stream keys (one int64 tensor), the Hypers and, if more than one, each row's."""
        keys, hypers, index = [], [], []
        for group, start, end in self.segments:
            counts, indices = steps[start:end], self.param_index[start:end]
            low, high = (int(x) for x in counts.aminmax())
            if low == high:  # the common case: the group's parameters took the same steps
                keys.append(stream_keys(seed, low, indices))
                index.append(torch.full((end - start,), len(hypers), dtype=torch.int64))
                hypers.append(Hyper.for_group(group, low))
                continue
            # Parameters that joined later (or counters set by hand): one Hyper per count.
            # (torch.where, not boolean indexing, which starts a parallel region early.)
            part_keys = part_index = torch.zeros(end - start, dtype=torch.int64)
            for step in torch.unique(counts).tolist():
                rows = counts == step
                part_keys = torch.where(rows, stream_keys(seed, int(step), indices), part_keys)
                part_index = torch.where(rows, len(hypers), part_index)
                hypers.append(Hyper.for_group(group, int(step)))
            keys.append(part_keys)
            index.append(part_index)
        return torch.cat(keys), hypers, (None if len(hypers) == 1 else torch.cat(index))

    # ------------------------------------------------------------------ handing back

    def written_records(self) -> dict:
        """ParamOwner's write records of the plan's parameters, as mark_written would have
        left them after the plan's last step (empty if it never ran)."""
        if not self.ran:
            return {}
        # A parameter that is its own master: whatever anyone wrote is the master.
        records = {p: (p._version, ptr) for p, ptr in zip(self.params, self.ptrs)}
        ptr_of = dict(zip(map(id, self.params), self.ptrs))
        versions = self.versions.tolist() if isinstance(self.versions, torch.Tensor) \
            else self.versions or ()
        for p, version in zip(self.copied, versions):
            records[p] = (version, ptr_of[id(p)])
        return records


class _NativeFacts:
    """StepPlan's per-step checks as native passes (plan_checks.TorchFacts) over rows read
    when the plan was built: the same facts as the Python passes, compared the same way.

    Differences in bookkeeping only: every gradient's pointer is read and written each step
    (the Python passes skip unchanged gradient objects), and the batch's items do not keep the
    gradients alive between steps (the descriptor column is refreshed before every run).
    """

    def __init__(self, lib: plan_checks.TorchFacts, plan: StepPlan, param_rows, grad_rows):
        self.lib = lib
        self.param_rows, self.grad_rows = param_rows, grad_rows
        self.state_refs = plan_checks.object_addresses(plan.state_refs)
        self.state_ptrs = torch.tensor(plan.state_ptrs, dtype=torch.int64)
        self.scale_refs = plan_checks.object_addresses(plan.scale_refs)
        self.scale_ptrs = torch.tensor(plan.scale_ptrs, dtype=torch.int64)
        # (the plan holds every one of these objects, so no address is reused meanwhile)
        self.flat = plan_checks.object_addresses(plan.flat)
        self.state_keys = plan_checks.object_addresses(plan.state_keys)
        self.state_values = plan_checks.object_addresses(plan.state_values)
        # The parameters of the plan's groups that had no gradient: they must still have none.
        planned = set(map(id, plan.params))
        self.gradless = [p for p in plan.flat if id(p) not in planned]
        desc = plan.batch._desc
        self.column = desc.data_ptr() + 8 * plan.batch._loader._I64_GRAD
        self.stride = desc.stride(0) * desc.element_size()
        for item in plan.batch.items:  # the column is refreshed from p.grad before every run
            item.grad = None
        plan.grads = plan.grads_all = plan.grad_ptrs = None
        if plan.copied:
            plan.versions = lib.versions(plan.copied)

    @classmethod
    def make(cls, plan: StepPlan, lib: plan_checks.TorchFacts) -> Optional["_NativeFacts"]:
        """The native checks of plan, or None (a tensor the library cannot read)."""
        param_rows = lib.read_rows(plan.params)
        grad_rows = lib.read_rows(plan.grads)  # the batch's gradients: p.grad, plain (eligible)
        if param_rows is None or grad_rows is None:
            return None
        return cls(lib, plan, param_rows, grad_rows)

    def fits(self, plan: StepPlan, opt: OptimizerDoor) -> bool:
        """StepPlan.fits after its group checks: the groups' parameter lists, the parameters,
        the states, then the gradients, whose pointers are written into the batch when all of
        them fit."""
        lib = self.lib
        if not (lib.same_items([group["params"] for group in plan.groups], self.flat)
                and lib.same_rows(plan.params, self.param_rows)
                and (not plan.copied or torch.equal(lib.versions(plan.copied), plan.versions))
                and opt.state is plan.state
                and lib.same_dict(opt.state, self.state_keys, self.state_values)
                and lib.same_states(plan.states, _STATE_KEYS, self.state_refs, self.state_ptrs,
                                    len(_STATE_KEYS))
                and (not plan.fp8 or lib.same_states(plan.fp8, _SCALES, self.scale_refs,
                                                     self.scale_ptrs, 2))):
            return False
        if not all(map(is_, map(_grad_of, self.gradless), repeat(None))):
            return False  # a parameter outside the plan has a gradient now
        return lib.take_grads(plan.params, self.grad_rows, self.column, self.stride)

    def after_write(self, plan: StepPlan) -> None:
        """The autograd versions after the kernel wrote the parameters (as mark_written does)."""
        self.lib.bump_versions(plan.params)
        if plan.copied:
            plan.versions = self.lib.versions(plan.copied)
