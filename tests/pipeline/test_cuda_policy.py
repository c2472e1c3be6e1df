"""attach_hooks' device decisions (pipeline/cuda_policy.py) and the whole pipeline on a fake CUDA."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.pipeline import cuda_policy
from adambridge.host import topology
from adambridge.host.topology import NumaNode
from adambridge.pipeline.transport import CudaTransport
from fake_cuda import FakeCuda
from _attach import attach_with
from _tiny import tiny_mlp


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def _model() -> nn.Module:
    return tiny_mlp((64, 64, 8), between="layernorm")


def _attached(model, **opt_args):
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=100, **opt_args)
    attach_with(opt, model, make_transport=CudaTransport)
    return opt


def _steps(model, opt, hooks: bool, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
        opt.step()
        if not hooks:
            opt.zero_grad()


def test_policy_fake_cuda_pipeline_equals_step_and_pins_only_at_attach(cuda):
    sync_model, async_model = _model(), _model()
    sync_opt = AdamBridge(sync_model.parameters(), backend="torch", small_param_threshold=100)
    _steps(sync_model, sync_opt, hooks=False)
    opt = _attached(async_model)
    at_attach = list(cuda.register_threads)
    assert at_attach and all(name.startswith("adambridge-") for name in at_attach)  # worker
    _steps(async_model, opt, hooks=True)
    assert cuda.register_threads == at_attach  # nothing pinned inside backward
    for p, q in zip(async_model.parameters(), sync_model.parameters()):
        assert torch.equal(p, q)
    assert opt.last_step_stats.d2h_bytes == sum(p.numel() * 4 for p in async_model.parameters())


def test_policy_failed_registration_raises_at_step_with_nothing_changed(cuda):
    cuda.fail_register = True
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = _attached(model)
    model(torch.randn(4, 64)).sum().backward()  # backward itself raises nothing
    with pytest.raises(RuntimeError, match=r"cudaHostRegister .* failed.*no parameter or "
                                           r"optimizer state was changed"):
        opt.step_sync()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state or all(not s for s in opt.state.values())


def test_policy_graph_capture_is_refused_in_the_hook(cuda, monkeypatch):
    model = _model()
    opt = _attached(model)
    monkeypatch.setattr(cuda_policy, "_capturing", lambda p: True)
    with pytest.raises(RuntimeError, match="^adambridge: attach_hooks\\(\\) does not work under "
                                           "CUDA graph capture"):
        model(torch.randn(4, 64)).sum().backward()
    opt.detach_hooks()


def test_policy_compiled_backward_warns_once(cuda, monkeypatch, caplog):
    monkeypatch.setattr(cuda_policy, "_warned", set())
    monkeypatch.setattr(cuda_policy, "_compiled_backward", lambda: True)
    model = _model()
    opt = _attached(model)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        _steps(model, opt, hooks=True, steps=2)
    assert [r.message.count("compiled autograd") for r in caplog.records] == [1]


def test_policy_compiled_module_warns_at_attach(monkeypatch, caplog):
    monkeypatch.setattr(cuda_policy, "_warned", set())
    compiled = torch.compile(_model())  # wrapping only; nothing compiles until it is called
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        cuda_policy.check_model(compiled)
        cuda_policy.check_model(_model())
    assert len(caplog.records) == 1 and "torch.compile'd" in caplog.records[0].message


@pytest.mark.parametrize("how", ["torch.compile(model) beside it", "model.compile()"])
def test_policy_plain_module_run_through_compile_warns_at_the_first_step(monkeypatch, caplog,
                                                                         how):
    # attach_hooks() is given the plain module; the forward runs through torch.compile.
    monkeypatch.setattr(cuda_policy, "_warned", set())
    model = _model()
    if how == "model.compile()":
        model.compile(backend="eager")
    else:
        compiled = torch.compile(model, backend="eager")  # noqa: F841 - kept beside the model
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        for _ in range(2):
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
    opt.detach_hooks()
    notes = [r.message for r in caplog.records if "runs through torch.compile" in r.message]
    assert len(notes) == 1


def test_policy_plain_module_without_compile_gives_no_compile_note(monkeypatch, caplog):
    monkeypatch.setattr(cuda_policy, "_warned", set())
    torch.compile(_model(), backend="eager")  # another model's wrapper: not this one's
    model = _model()
    opt = AdamBridge(model.parameters(), lr=1e-3, small_param_threshold=0)
    opt.attach_hooks(model)
    with caplog.at_level(logging.WARNING, logger="adambridge"):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    opt.detach_hooks()
    assert not [r for r in caplog.records if "torch.compile" in r.message]


@pytest.mark.parametrize("case", [
    dict(desc="one node, CUDA: unpinned, one thread short", nodes=1, device="cuda",
         expect=((), 7)),
    dict(desc="two nodes, CUDA: pinned to the GPU's node", nodes=2, device="cuda",
         expect=(tuple(range(8)), None)),
    dict(desc="one node, CPU parameters: unchanged", nodes=1, device="cpu",
         expect=(tuple(range(8)), None)),
], ids=lambda c: c["desc"])
def test_policy_pool_is_not_pinned_against_autograd_on_one_node(monkeypatch, case):
    nodes = tuple(NumaNode(index=i, cpus=tuple(range(8 * i, 8 * i + 8)))
                  for i in range(case["nodes"]))
    monkeypatch.setattr(topology, "numa_nodes", lambda root="/": nodes)
    assert cuda_policy.pool_plan(tuple(range(8)), [torch.device(case["device"], 0)
                                                  if case["device"] == "cuda"
                                                  else torch.device("cpu")]) == case["expect"]


def test_policy_host_memory_includes_the_pinned_staging(cuda):
    model = _model()
    opt = _attached(model)
    _steps(model, opt, hooks=True, steps=1)
    memory = opt.host_memory_bytes()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert memory["pinned_staging"] == 2 * param_bytes  # a grad and an out buffer each
    assert memory["state"] == opt.host_state_bytes() > 0
    assert memory["total"] == memory["state"] + memory["pinned_staging"] + memory["writeback"]


def test_policy_compiled_autograd_region_is_detected(monkeypatch):
    from torch._dynamo import compiled_autograd
    monkeypatch.setattr(compiled_autograd, "in_compiled_autograd_region", True)
    assert cuda_policy._compiled_backward()
    monkeypatch.setattr(compiled_autograd, "in_compiled_autograd_region", False)
    assert not cuda_policy._compiled_backward()


def test_policy_frozen_parameters_get_no_pinned_slot(cuda):
    model = _model()
    model[2].weight.requires_grad_(False)  # owned by the optimizer, never a gradient
    opt = _attached(model)
    slots = opt.pipeline.lanes[torch.device("cpu")].transport._slots
    assert model[2].weight not in slots and model[2].bias in slots
    _steps(model, opt, hooks=True, steps=2)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert frozen and opt.host_memory_bytes()["pinned_staging"] == 2 * trainable
