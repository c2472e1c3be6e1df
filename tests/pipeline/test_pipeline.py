"""Asynchronous mode (pipeline/hooks.py) on the CPU: equal to step() bit for bit, the schedule, faults."""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
from torch import nn

from _attach import attach_with
from adambridge import AdamBridge, StepStats
from adambridge.pipeline import hooks as pipeline, work_items, worker
from adambridge.pipeline.transport import HostTransport

RTOL, ATOL = 1e-6, 1e-7  # docs/numerics.md


class Net(nn.Module):
    """Sizes chosen to exercise every path at chunk_size=256, small_param_threshold=64:
    w1 (960) and scale (300) are chunked, the last chunk short and not a multiple of 128;
    wt is a non-contiguous (transposed) leaf; biases and the norm are grouped."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(24, 40)
        self.norm = nn.LayerNorm(40)
        self.wt = nn.Parameter(torch.randn(17, 40).t() * 0.2)
        self.w2 = nn.Linear(17, 5)
        self.scale = nn.Parameter(torch.randn(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.nn.functional.gelu(self.w1(x)))
        return self.w2(h @ self.wt.to(h.dtype)), (self.scale.float() ** 2).sum() * 1e-3


def _loss(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out, reg = model(x.to(model.w1.weight.dtype))
    return ((out.float() - y) ** 2).mean() + reg


def _batches(steps: int, micro: int):
    gen = torch.Generator().manual_seed(3)
    return [[(torch.randn(8, 24, generator=gen), torch.randn(8, 5, generator=gen))
             for _ in range(micro)] for _ in range(steps)]


def _train(config: dict, backend: str, hooks: bool):
    torch.manual_seed(0)
    model = Net().to(config.get("param_dtype", torch.float32))
    opt = AdamBridge(model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend,
                     **config["opt"])
    if hooks:
        opt.attach_hooks(model)
    for micro_batches in _batches(config.get("steps", 4), config.get("micro", 1)):
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with (opt.accumulate() if hooks and not last else _nothing()):
                _loss(model, x, y).backward()
        if hooks:
            stats = opt.step_sync()
            assert stats is opt.last_step_stats
        else:
            opt.step()
        opt.zero_grad()
    return model, opt


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


EQUIVALENCE = [
    dict(desc="fp32 moments, chunks of 256, small params grouped",
         opt=dict(precision="fp32", chunk_size=256, small_param_threshold=64)),
    dict(desc="bf16 moments, chunks of 256", opt=dict(precision="bf16", chunk_size=256,
                                                      small_param_threshold=64)),
    dict(desc="fp8 moments, chunks of 256 (scales sliced per block)",
         opt=dict(precision="fp8", chunk_size=256, small_param_threshold=64)),
    dict(desc="fp8 moments, no chunks, no grouping", opt=dict(precision="fp8",
                                                              small_param_threshold=0)),
    dict(desc="bf16 moments, 3 accumulated micro-batches, grads kept", micro=3,
         opt=dict(precision="bf16", chunk_size=256, small_param_threshold=64,
                  release_grads=False)),
    dict(desc="bf16 params, write-back at step_sync", param_dtype=torch.bfloat16,
         opt=dict(precision="fp32", chunk_size=256, small_param_threshold=64,
                  overlap_writeback=False)),
]


def _assert_same_state(opt_a, opt_b, params_a, params_b):
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key].float(), sb[key].float()), key


@pytest.mark.parametrize("config", EQUIVALENCE, ids=lambda c: c["desc"])
def test_hooks_equal_step_bit_for_bit(config, backend):
    sync_model, sync_opt = _train(config, backend, hooks=False)
    async_model, async_opt = _train(config, backend, hooks=True)
    _assert_same_state(async_opt, sync_opt, list(async_model.parameters()),
                       list(sync_model.parameters()))


def test_hooks_fp32_match_torch_adamw_per_element(backend):
    # The loss is linear in each parameter, so gradients do not depend on the weights and
    # both optimizers see identical inputs (the comparison measures only the arithmetic).
    shapes = [(4097,), (33, 31), (15,), (1,)]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in shapes]
    # Gradients below 0.5, so moments stay where 1 ulp < atol (as in test_optimizer.py).
    grads = [[torch.randn(s, generator=gen) * 10.0 ** -k for s, k in zip(shapes, (1, 2, 4, 1))]
             for _ in range(30)]
    ref = [nn.Parameter(t.clone()) for t in init]
    ours = [nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    opt = AdamBridge(ours, lr=1e-2, weight_decay=0.05, backend=backend, chunk_size=1024,
                     small_param_threshold=16)
    holder = nn.ParameterList(ours)
    opt.attach_hooks(holder)
    for g in grads:
        sum((p * gp).sum() for p, gp in zip(ours, g)).backward()
        opt.step_sync()
        for p, gp in zip(ref, g):
            p.grad = gp.clone()
        ref_opt.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[q][key].view(q.shape), ref_opt.state[p][key],
                                       rtol=RTOL, atol=ATOL)


def test_detach_hooks_returns_to_step_and_stats_are_filled():
    torch.manual_seed(0)
    model = Net()
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=64)
    opt.attach_hooks(model)
    x, y = torch.randn(8, 24), torch.randn(8, 5)
    _loss(model, x, y).backward()
    stats = opt.step_sync()
    assert isinstance(stats, StepStats) and stats.num_params == 8
    assert stats.wall_s >= stats.sync_wait_s >= 0 and stats.host_update_s > 0
    opt.step()  # with hooks attached step() finishes a step: no new backward, no update
    assert opt.last_step_stats.num_params == 0
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    opt.detach_hooks()
    with pytest.raises(RuntimeError, match=r"step_sync\(\) needs hooks: call opt.attach_hooks"):
        opt.step_sync()
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    opt.attach_hooks(model)
    # Refused before anything changes (not by the next step, after it updated the others).
    groups = len(opt.param_groups)
    with pytest.raises(RuntimeError, match=r"^add_param_group\(\) while hooks are attached: "
                                           r"call opt\.detach_hooks\(\), add the group"):
        opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3))]))
    assert len(opt.param_groups) == groups
    _loss(model, x, y).backward()
    opt.step()
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())


# --------------------------------------------------------------------------- the schedule


class ManualTransport(HostTransport):
    """Copies land only when the test says so (``land(n)``: the first n copies ever made).

    No test of the schedule depends on timing: copies land when told, and ``events``
    records the order of landings, updates and copies back."""

    gather_numel = 0  # its copies land later, as a GPU's do: each piece is queued at once

    def __init__(self, device, events: list) -> None:
        super().__init__(device)
        self.made, self.landed, self.events = 0, 0, events
        self.cond = threading.Condition()

    def land(self, n: int) -> None:
        with self.cond:
            self.landed = n
            self.events.append(("land", n))
            self.cond.notify_all()

    def grad_to_host(self, p, grad, ranges, with_values):
        flat, _ = super().grad_to_host(p, grad, ranges, with_values)
        tickets = []
        for _ in ranges:
            tickets.append(ManualTicket(self, self.made))
            self.made += 1
        return flat, tickets

    def to_device(self, p, start, end):
        self.events.append(("h2d", id(p), start))
        super().to_device(p, start, end)


class ManualTicket:
    def __init__(self, transport: ManualTransport, number: int) -> None:
        self.transport, self.number = transport, number

    def ready(self) -> bool:
        return self.number < self.transport.landed

    def wait(self) -> None:
        with self.transport.cond:
            assert self.transport.cond.wait_for(self.ready, timeout=10)


def _scheduled(monkeypatch, model, **opt_args):
    """An optimizer on a ManualTransport whose kernel calls are recorded as ("batch", ...)."""
    events: list = []
    batch_done = threading.Semaphore(0)
    real = worker.adamw_update

    def recording_update(items, backend):
        real(items, backend)
        events.append(("batch", [(id(i.master.untyped_storage()), i.offset) for i in items]))

    real_run = worker.Lane.run

    def counted_run(self, batch, speculative=False):  # released even by a failing batch
        try:
            real_run(self, batch, speculative)
        finally:
            batch_done.release()

    monkeypatch.setattr(worker, "adamw_update", recording_update)
    monkeypatch.setattr(worker.Lane, "run", counted_run)
    opt = AdamBridge(model.parameters(), backend="torch", **opt_args)
    transports: list = []
    attach_with(opt, model, make_transport=lambda d: transports.append(
        ManualTransport(d, events)) or transports[-1])
    return opt, events, transports[0], batch_done


def _drain(opt) -> None:
    for lane in opt.pipeline.lanes.values():  # the worker has handled all that was queued
        lane.wait(lane.call(lambda: None))


class DrainBackward(torch.autograd.Function):
    """Identity; its backward first lets the worker handle every gradient that has landed,
    so "updated during backward" is a fact of the order of events, not of timing."""

    opt = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _drain(DrainBackward.opt())
        DrainBackward.events.append(("drained",))
        return grad


def _layered(monkeypatch):
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
    opt, events, transport, _ = _scheduled(monkeypatch, layers, small_param_threshold=0)
    transport.land(10**9)  # every copy lands at once: the order is the backward's
    DrainBackward.opt, DrainBackward.events = weakref.ref(opt), events
    x = torch.randn(4, 16)

    def backward():
        h = x
        for layer in layers:
            h = DrainBackward.apply(torch.tanh(layer(h)))
        h.sum().backward()
    return opt, events, backward


def test_schedule_updates_run_while_backward_runs(monkeypatch):
    opt, events, backward = _layered(monkeypatch)
    backward()
    opt.step_sync()  # the first step is held until step_sync; watch the second
    events.clear()
    backward()
    last_drain = max(i for i, e in enumerate(events) if e[0] == "drained")
    opt.step_sync()
    during = [e for e in events[:last_drain] if e[0] == "batch"]
    assert len(during) >= 5, events  # every layer but the first updated inside backward


def test_schedule_first_step_after_attach_updates_nothing_before_the_step(monkeypatch):
    # The worker is given every chance (drained inside backward): a held step still waits.
    opt, events, backward = _layered(monkeypatch)
    backward()
    assert not [e for e in events if e[0] == "batch"], events
    assert not any(opt.state[p] for p in opt.pipeline.owned)
    opt.step_sync()
    assert [e for e in events if e[0] == "batch"]
    assert all(int(opt.state[p]["step"]) == 1 for p in opt.pipeline.owned)


def test_schedule_batches_grow_under_load(monkeypatch):
    # While the kernel is busy with the first landed gradient, the other 23 land: the
    # worker then takes all of them in one call.
    layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(12)))
    opt = AdamBridge(layers.parameters(), backend="torch", small_param_threshold=0)
    transports = []
    attach_with(opt, layers, make_transport=lambda d: transports.append(ManualTransport(d, []))
                    or transports[-1])
    transport, x = transports[0], torch.randn(2, 8)
    transport.land(10**9)
    layers(x).sum().backward()
    opt.step_sync()  # the first step is held; watch the second
    real, sizes = worker.adamw_update, []
    in_kernel, gate = threading.Event(), threading.Event()

    def gated_update(items, backend):
        sizes.append(len(items))
        in_kernel.set()
        assert gate.wait(timeout=10)
        real(items, backend)

    monkeypatch.setattr(worker, "adamw_update", gated_update)
    first = transport.made
    transport.land(first)
    layers(x).sum().backward()
    transport.land(first + 1)     # one copy lands; the worker starts updating it
    assert in_kernel.wait(timeout=10)
    transport.land(first + 24)    # the rest land while the kernel is busy
    gate.set()
    stats = opt.step_sync()
    assert sizes == [1, 23] and stats.num_batches == 2 and stats.num_params == 24


def test_schedule_chunks_overlap_copies_and_updates(monkeypatch):
    holder = nn.ParameterList([nn.Parameter(torch.randn(4096))])
    opt, events, transport, batch_done = _scheduled(monkeypatch, holder, chunk_size=512,
                                                    small_param_threshold=0)
    transport.land(10**9)
    (holder[0] ** 2).sum().backward()
    opt.step_sync()  # the first step is held; watch the second
    events.clear()
    while batch_done.acquire(blocking=False):  # forget the first step's batches
        pass
    first = transport.made
    transport.land(first)          # from now on nothing lands unless the test says so
    (holder[0] ** 2).sum().backward()
    transport.land(first + 1)      # only chunk 0 has landed
    assert batch_done.acquire(timeout=10)
    assert ("h2d", id(holder[0]), 0) in events  # updated and sent back ...
    transport.land(first + 8)      # ... before the other seven chunks landed
    opt.step_sync()
    offsets = sorted(o for e in events if e[0] == "batch" for _, o in e[1])
    assert offsets == list(range(0, 4096, 512))
    assert len([e for e in events if e[0] == "h2d"]) == 8


# --------------------------------------------------------------------------- faults


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            [{k: v.clone() for k, v in opt.state.get(p, {}).items()} for p in params])


def _assert_unchanged(opt, params, snapshot):
    values, states = snapshot
    for p, value, st in zip(params, values, states):
        assert torch.equal(p, value)
        assert opt.state.get(p, {}).keys() == st.keys()  # no state made, none changed
        for key in st:
            assert torch.equal(opt.state[p][key].float(), st[key].float())


def test_fault_sparse_gradient_on_first_step_changes_nothing():
    emb = nn.Embedding(50, 8, sparse=True)
    dense = nn.Linear(8, 8)
    model = nn.ModuleDict(dict(emb=emb, dense=dense))
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    params = list(model.parameters())
    before = _snapshot(opt, params)
    dense(emb(torch.tensor([1, 2, 3]))).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients are not supported.*no parameter "
                                           r"or optimizer state was changed"):
        opt.step_sync()
    _assert_unchanged(opt, params, before)


def test_fault_replaced_parameter_fails_before_any_update():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    x = torch.randn(2, 8)
    model(x).sum().backward()
    opt.step_sync()
    params = list(model.parameters())
    model[0].weight.data = torch.randn(4, 8)  # the same Parameter, a new shape
    before = _snapshot(opt, params)
    model[1](torch.randn(2, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"Parameter 0 changed from \(8, 8\).*no parameter"):
        opt.step_sync()
    _assert_unchanged(opt, params, before)


def test_fault_in_kernel_is_raised_by_step_sync_with_what_was_updated(monkeypatch):
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    opt, _, transport, batch_done = _scheduled(monkeypatch, model, small_param_threshold=0)
    x = torch.randn(2, 8)
    transport.land(10**9)
    model(x).sum().backward()
    opt.step_sync()
    recording, first = worker.adamw_update, model[0].weight

    def failing(items, backend):
        if any(i.master.data_ptr() == first.data_ptr() for i in items):
            raise MemoryError("simulated")
        recording(items, backend)

    monkeypatch.setattr(worker, "adamw_update", failing)
    params = list(model.parameters())
    before = _snapshot(opt, params)
    while batch_done.acquire(blocking=False):  # forget the first step's batches
        pass
    start = transport.made
    transport.land(start)          # from now on nothing lands unless the test says so
    model(x).sum().backward()
    for n in range(1, 7):  # one copy lands per batch: the failure follows other updates
        transport.land(start + n)
        assert batch_done.acquire(timeout=10)
    with pytest.raises(RuntimeError, match=r"update worker for cpu failed \(MemoryError: "
                                           r"simulated\); this step had already updated "
                                           r"parameters \[(\d, )*\d\]"):
        opt.step_sync()
    stepped = [int(opt.state[p]["step"]) for p in params]
    assert stepped[0] == 1 and stepped[2:] == [2, 2, 2, 2]  # each took the step, or not
    untouched = [i for i, step in enumerate(stepped) if step == 1]
    _assert_unchanged(opt, [params[i] for i in untouched],
                      ([before[0][i] for i in untouched], [before[1][i] for i in untouched]))
    monkeypatch.setattr(worker, "adamw_update", recording)
    opt.zero_grad()
    model(x).sum().backward()
    transport.land(10**9)
    opt.step_sync()  # the pipeline is usable again after a failed step


def test_fault_second_backward_without_accumulate_is_a_clear_error():
    model = nn.Linear(8, 8)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"second gradient before the optimizer step.*opt.accumulate"):
        model(torch.randn(2, 8)).sum().backward()
    # The refused backward did not finish: the step says so, having changed nothing.
    with pytest.raises(RuntimeError, match=r"backward pass of this step did not finish.*no "
                                           r"parameter or optimizer state was changed"):
        opt.step_sync()
    opt.zero_grad()
    model(torch.randn(2, 8)).sum().backward()
    opt.step_sync()
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())


def test_a_second_step_without_backward_updates_nothing_and_says_so_once(caplog):
    # torch.optim would step again on the p.grad the backward left; the hooks hand each
    # backward's gradients to one step, so the results part from torch: said, once.
    model = nn.Linear(8, 8)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        opt.step()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after))
    said = [r.getMessage() for r in caplog.records if "found no gradient" in r.getMessage()]
    assert len(said) == 1 and "torch.optim would step again on p.grad" in said[0]


def test_a_parameter_without_elements_is_not_hooked_and_steps_as_torch():
    # small_param_threshold=0 (hook everything, as for LoRA) used to hook a 0-element
    # parameter too, and sending its gradient failed the step.
    class WithEmpty(nn.Module):
        def __init__(self):
            super().__init__()
            self.empty, self.linear = nn.Parameter(torch.randn(0, 4)), nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).sum() + self.empty.sum()

    torch.manual_seed(0)
    reference, model = WithEmpty(), WithEmpty()
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    assert not opt.pipeline.hooks(model.empty) and opt.pipeline.hooks(model.linear.weight)
    for _ in range(3):
        x = torch.randn(3, 4)
        for net, optimizer in ((reference, ref_opt), (model, opt)):
            net(x).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert opt.state[model.empty]["exp_avg"].numel() == 0


class _SharedBlock(nn.Module):
    """One Linear applied three times, each use in its own reentrant checkpoint region."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.block, self.use_reentrant = nn.Linear(8, 8), use_reentrant

    def forward(self, x):
        for _ in range(3):
            x = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.block(t)), x,
                                                  use_reentrant=self.use_reentrant)
        return x


def test_fault_shared_parameter_in_reentrant_checkpoints_names_the_cause():
    # Each reentrant region's inner backward fires the parameter's hook once: updating on the
    # first would use a third of the gradient. The error names reentrant checkpointing beside
    # gradient accumulation, and non-reentrant checkpointing steps as torch's AdamW.
    model = _SharedBlock(use_reentrant=True)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"parameter \d received a second gradient .*"
                                           r"use_reentrant=True\) region gets a gradient from "
                                           r"each: pass use_reentrant=False"):
        model(x).sum().backward()
    reference, model = _SharedBlock(use_reentrant=False), _SharedBlock(use_reentrant=False)
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    for _ in range(2):
        for net, optimizer in ((reference, ref_opt), (model, opt)):
            net(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_worker_exits_when_optimizer_is_collected():
    model = nn.Linear(8, 8)
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
    opt.attach_hooks(model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step_sync()
    threads = [lane.thread for lane in opt.pipeline.lanes.values()]
    del opt
    gc.collect()
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    model(torch.randn(2, 8)).sum().backward()  # the hooks are gone or inert


def test_ctrl_c_during_backward_does_not_hang(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent("""
        import torch
        from adambridge import AdamBridge

        class Interrupt(torch.autograd.Function):
            forward = staticmethod(lambda ctx, x: x.view_as(x))
            @staticmethod
            def backward(ctx, grad):
                # What Ctrl-C becomes inside backward, raised here rather than signalled:
                # a signal is acted on whenever the main thread next runs bytecode, which
                # under load may be after backward (the test then saw nothing happen).
                raise KeyboardInterrupt

        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
        opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=0)
        opt.attach_hooks(model)
        h = model[1](Interrupt.apply(model[0](torch.randn(2, 64))))
        model[3](model[2](h)).sum().backward()
        opt.step_sync()
    """))
    env = dict(os.environ, ADAMBRIDGE_DISABLE_NATIVE="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


# --------------------------------------------------------------------------- NUMA


def _fake_sysfs(root, nodes: dict, gpu_node: int):
    for index, cpulist in nodes.items():
        node = root / "sys/devices/system/node" / f"node{index}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpulist + "\n")
    device = root / "sys/bus/pci/devices/0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{gpu_node}\n")


def test_numa_worker_cpus_come_from_the_gpus_node(tmp_path, monkeypatch):
    from adambridge.host import topology
    _fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=1)
    monkeypatch.setattr(topology, "cuda_pci_bus_id", lambda index: "0000:3B:00.0")
    monkeypatch.setattr(topology, "allowed_cpus", lambda: tuple(range(8)))
    cuda0 = torch.device("cuda", 0)
    assert worker.worker_cpus(cuda0, True, root=str(tmp_path)) == (4, 5, 6, 7)
    assert worker.worker_cpus(cuda0, False, root=str(tmp_path)) == ()
    assert worker.worker_cpus(torch.device("cpu"), True, root=str(tmp_path)) == ()
    monkeypatch.setattr(topology, "cuda_pci_bus_id", lambda index: None)
    assert worker.worker_cpus(cuda0, True, root=str(tmp_path)) == ()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_numa_worker_thread_pins_itself_and_first_touches_state():
    cpu = min(os.sched_getaffinity(0))
    lane = worker.Lane(HostTransport(torch.device("cpu")), backend="torch",
                         overlap_writeback=True, cpus=(cpu,))
    seen = {}
    lane.wait(lane.call(lambda: seen.update(cpus=os.sched_getaffinity(0),
                                            thread=threading.current_thread())))
    lane.stop()
    assert seen["cpus"] == {cpu} and seen["thread"] is lane.thread
    assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1


def test_numa_native_pool_is_pinned_to_the_workers_node(monkeypatch):
    from adambridge._native import loader
    configured = []
    monkeypatch.setattr(pipeline, "worker_cpus", lambda device, numa_aware: (0,) if numa_aware else ())
    monkeypatch.setattr(loader, "set_num_threads", lambda n, cpus=(): configured.append((n, cpus)))
    model = nn.Linear(4, 4)
    for numa_aware, expected in ((True, [(1, (0,))]), (False, [])):
        configured.clear()
        opt = AdamBridge(model.parameters(), backend="torch", numa_aware=numa_aware)
        monkeypatch.setattr(opt, "resolve_backend", lambda: "native")
        attach_with(opt, model)
        opt.detach_hooks()
        assert configured == expected


# -- no GC-tracked objects per gradient in flight


def _tracked_growth_in_backward(layers: int) -> int:
    """GC-tracked objects alive after a hooked backward, beyond those alive before it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    x = torch.randn(4, 16)
    for _ in range(2):  # past the held first step: updates run during backward
        model(x).square().mean().backward()
        opt.step_sync()
    growths = []
    gc.disable()
    try:
        for _ in range(3):  # the least of three: other tests' threads may allocate meanwhile
            gc.collect()
            before = len(gc.get_objects())
            model(x).square().mean().backward()
            growths.append(len(gc.get_objects()) - before)
            opt.step_sync()
    finally:
        gc.enable()
    opt.detach_hooks()
    return min(growths)


def test_gradients_in_flight_keep_one_tracked_object_alive_each():
    # Each gradient used to keep ~6 (Job, its lists, Piece, WriteBack, partial, flat view)
    # alive until step_sync, so full collections came every few steps. What is left is the
    # GradView that p.grad is until the step (pipeline/grad_views.py): a new one per step,
    # so that a reference kept past the step fails instead of seeing the next gradient.
    few, many = _tracked_growth_in_backward(10), _tracked_growth_in_backward(300)
    assert many - few < 580 + 60, (few, many)  # 580 more gradients: ~3,500 on the old code


def test_reused_jobs_give_the_same_weights_as_the_sync_step():
    torch.manual_seed(1)
    models = [nn.Sequential(nn.Linear(16, 300), nn.Linear(300, 16)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    sync = AdamBridge(models[0].parameters(), lr=1e-2, small_param_threshold=0, chunk_size=1024)
    hooked = AdamBridge(models[1].parameters(), lr=1e-2, small_param_threshold=0,
                        chunk_size=1024)
    hooked.attach_hooks(models[1])
    x = torch.randn(8, 16)
    for step in range(4):
        if step == 2:  # new chunking mid-run: the reused pieces are remade
            sync.chunk_size = hooked.chunk_size = 2048
        for model, opt in zip(models, (sync, hooked)):
            model(x).square().mean().backward()
            if opt is hooked:
                opt.step_sync()
            else:
                opt.step()
                model.zero_grad(set_to_none=True)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    hooked.detach_hooks()


def test_release_grads_changed_after_attach_fails_the_step_with_nothing_changed():
    model = nn.Linear(4, 4)
    opt = AdamBridge(model.parameters(), lr=1e-2, small_param_threshold=0)
    opt.attach_hooks(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.release_grads = False
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="release_grads changed to False after attach_hooks"):
        opt.step_sync()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.detach_hooks()


# -- host pieces are gathered before the worker is woken


def test_lane_gathers_host_pieces_until_gather_numel_and_a_call_flushes_the_rest():
    transport = HostTransport(torch.device("cpu"))
    transport.gather_numel = 100
    lane = worker.Lane(transport, backend="torch", overlap_writeback=True)
    record = work_items.StepRecord(held=True)  # the worker only holds what it takes: no job needed

    def piece(numel):
        return work_items.Piece(None, 0, numel, transport.grad_to_host(
            None, torch.zeros(numel), [(0, numel)], False)[1][0], None, record)

    first = [piece(40), piece(40)]
    for p in first:
        lane.submit(p)
    assert lane._gathered == first and lane.queue.empty()  # 80 < 100: nothing queued yet
    third = piece(40)
    lane.submit(third)  # 120 >= 100: the three go as one unit
    assert lane._gathered == []
    fourth = piece(8)
    lane.submit(fourth)
    lane.wait(lane.call(lambda: None), timeout_s=10)  # the call sends the fourth first
    assert lane._held == first + [third, fourth]
    lane.stop()


def test_host_pieces_of_a_small_model_take_one_native_call_per_step():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(12)))  # 3,264 elements in all
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    x = torch.randn(4, 16)
    for _ in range(3):
        model(x).square().mean().backward()
        stats = opt.step_sync()
    assert stats.num_params == 24 and stats.num_batches == 1, stats
    opt.detach_hooks()


def test_host_pieces_past_gather_numel_wake_the_worker_during_backward(monkeypatch):
    monkeypatch.setattr(HostTransport, "gather_numel", 200)
    sent, real_send = [], worker.Lane._send_gathered_locked

    def recording_send(self):
        sent.append(len(self._gathered))
        real_send(self)

    monkeypatch.setattr(worker.Lane, "_send_gathered_locked", recording_send)
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))  # a 256-element weight each
    opt = AdamBridge(layers.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(layers)
    sent_in_backward = []

    class Watch(torch.autograd.Function):  # its backward runs after every layer's hooks
        @staticmethod
        def forward(ctx, h):
            return h.view_as(h)

        @staticmethod
        def backward(ctx, grad):
            sent_in_backward.append([n for n in sent if n])
            return grad

    x = torch.randn(4, 16, requires_grad=True)  # so that Watch has a backward
    for _ in range(2):  # the first step is held; watch the second
        sent.clear(), sent_in_backward.clear()
        h = Watch.apply(x)
        for layer in layers:
            h = torch.tanh(layer(h))
        h.sum().backward()
        opt.step_sync()
    # every 256-element weight sends what was gathered (a bias waits for the next weight)
    assert len(sent_in_backward[0]) == 6, sent_in_backward
    opt.detach_hooks()


def test_attach_hooks_says_once_how_much_is_hooked(caplog):
    # Item 9 of the async issue: a model whose every tensor is under small_param_threshold
    # (most LoRA adapters) got no hook and overlapped nothing, and nothing said so.
    small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = AdamBridge(small.parameters(), lr=1e-3)
    with caplog.at_level("INFO", logger="adambridge"):
        opt.attach_hooks(small)
        for _ in range(3):
            small(torch.randn(2, 8)).sum().backward()
            opt.step()
    said = [r for r in caplog.records if "attach_hooks() hooked" in r.message]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert "hooked none of the 4 parameters" in said[0].message
    assert "small_param_threshold=65536" in said[0].message
    opt.detach_hooks()
    caplog.clear()
    big = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 2))
    opt = AdamBridge(big.parameters(), lr=1e-3)
    with caplog.at_level("INFO", logger="adambridge"):
        opt.attach_hooks(big)
    said = [r for r in caplog.records if "attach_hooks() hooked" in r.message]
    assert [r.levelname for r in said] == ["INFO"]
    assert "hooked 1 of 4 parameters (99% of the elements); the other 3" in said[0].message
    opt.detach_hooks()
