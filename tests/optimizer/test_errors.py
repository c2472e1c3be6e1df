"""Every bad input gets a one-line error naming the argument and its value."""
from __future__ import annotations

import pytest
import torch

from adambridge import AdamBridge, AutoTuneConfig


def _params():
    return [torch.nn.Parameter(torch.randn(4))]


CONSTRUCTOR_ERRORS = [
    dict(desc="negative lr", kwargs=dict(lr=-1.0), exc=ValueError, match=r"^Invalid learning rate: -1\.0$"),
    dict(desc="tensor lr with 2 elements", kwargs=dict(lr=torch.ones(2)), exc=ValueError,
         match=r"Tensor lr must be 1-element, got 2"),
    dict(desc="negative eps", kwargs=dict(eps=-1e-8), exc=ValueError, match=r"^Invalid epsilon value: -1e-08$"),
    dict(desc="beta1 = 1", kwargs=dict(betas=(1.0, 0.999)), exc=ValueError,
         match=r"^Invalid beta parameter at index 0: 1\.0$"),
    dict(desc="tensor beta with 2 elements", kwargs=dict(betas=(torch.ones(2) * 0.9, 0.999)),
         exc=ValueError, match=r"^Tensor betas\[0\] must be 1-element, got 2 elements$"),
    dict(desc="tensor beta = 1", kwargs=dict(betas=(0.9, torch.tensor(1.0))), exc=ValueError,
         match=r"^Invalid beta parameter at index 1: 1\.0$"),
    dict(desc="negative beta2", kwargs=dict(betas=(0.9, -0.1)), exc=ValueError,
         match=r"^Invalid beta parameter at index 1: -0\.1$"),
    dict(desc="negative weight decay", kwargs=dict(weight_decay=-0.1), exc=ValueError,
         match=r"^Invalid weight_decay value: -0\.1$"),
    dict(desc="unknown precision", kwargs=dict(precision="int4"), exc=ValueError,
         match=r"^Invalid precision: 'int4' \(valid: 'fp32', 'bf16', 'fp8'\)$"),
    dict(desc="unknown backend", kwargs=dict(backend="cuda"), exc=ValueError,
         match=r"^Invalid backend: 'cuda' \(valid: 'auto', 'native', 'torch'\)$"),
    dict(desc="num_threads 0", kwargs=dict(num_threads=0), exc=ValueError, match=r"Invalid num_threads: 0"),
    dict(desc="chunk_size not a multiple of 128", kwargs=dict(chunk_size=1000), exc=ValueError,
         match=r"Invalid chunk_size: 1000 \(must be a multiple of 128"),
    dict(desc="negative seed", kwargs=dict(seed=-1), exc=ValueError, match=r"Invalid seed: -1"),
    dict(desc="bad autotune", kwargs=dict(autotune="yes"), exc=TypeError, match=r"Invalid autotune: 'yes'"),
    dict(desc="non-bool flag", kwargs=dict(stochastic_rounding=1), exc=TypeError,
         match=r"Invalid stochastic_rounding: 1"),
    dict(desc="negative small_param_threshold", kwargs=dict(small_param_threshold=-5), exc=ValueError,
         match=r"Invalid small_param_threshold: -5"),
    dict(desc="unknown keyword", kwargs=dict(momentum=0.9), exc=TypeError,
         match=r"unexpected keyword argument 'momentum'"),
] + [
    dict(desc=f"torch flag {flag}", kwargs={flag: True}, exc=ValueError,
         match=rf"^Unsupported torch.optim flag: {flag}=True \(AdamBridge does not implement it")
    for flag in ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")
]


@pytest.mark.parametrize("case", CONSTRUCTOR_ERRORS, ids=lambda c: c["desc"])
def test_constructor_refuses_bad_arguments(case):
    with pytest.raises(case["exc"], match=case["match"]) as info:
        AdamBridge(_params(), **case["kwargs"])
    assert "\n" not in str(info.value)


def test_torch_flags_that_are_off_are_accepted():
    AdamBridge(_params(), amsgrad=False, maximize=False, foreach=None, fused=None)


def test_bad_group_hyperparameters_are_refused():
    with pytest.raises(ValueError, match=r"^Invalid learning rate: -0\.5$"):
        AdamBridge([{"params": _params(), "lr": -0.5}])


def test_bad_autotune_config():
    with pytest.raises(ValueError, match=r"Invalid min_precision: 'fp4'"):
        AutoTuneConfig(min_precision="fp4")


@pytest.mark.parametrize("dtype,match", [
    (torch.complex64, r"Invalid parameter 0: complex dtype torch.complex64 is not supported"),
    (torch.float64, r"Invalid parameter 0: dtype torch.float64 is not supported \(use float32"),
])
def test_unsupported_parameter_dtypes_are_refused(dtype, match):
    with pytest.raises(ValueError, match=match):
        AdamBridge([torch.nn.Parameter(torch.zeros(3, dtype=dtype))])


def test_sparse_gradient_is_refused_and_nothing_changes():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.randn(3))
    opt = AdamBridge([dense, emb.weight], backend="torch")
    before = dense.detach().clone()
    dense.grad = torch.ones(3)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"Invalid gradient of parameter 1: sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), before) and dense not in opt.state


def test_shape_change_between_steps_is_refused():
    p = torch.nn.Parameter(torch.randn(6))
    opt = AdamBridge([p], backend="torch")
    p.grad = torch.ones(6)
    opt.step()
    p.data = torch.randn(2, 3)
    p.grad = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"Parameter 0 changed from \(6,\) torch.float32 to "
                                         r"\(2, 3\) torch.float32 between steps"):
        opt.step()


def test_dtype_change_between_steps_is_refused():
    p = torch.nn.Parameter(torch.randn(6))
    opt = AdamBridge([p], backend="torch")
    p.grad = torch.ones(6)
    opt.step()
    p.data = p.data.bfloat16()
    p.grad = torch.ones(6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"changed from \(6,\) torch.float32 to \(6,\) torch.bfloat16"):
        opt.step()


GROUP_ERRORS = [
    dict(desc="negative weight decay alone", group=dict(weight_decay=-0.1), exc=ValueError,
         match=r"^Invalid weight_decay value: -0\.1$"),
    dict(desc="precision per group", group=dict(precision="bf16"), exc=ValueError,
         match=r"^Invalid param group option 'precision': 'bf16' \(it is optimizer-wide"),
    dict(desc="seed per group", group=dict(seed=3), exc=ValueError,
         match=r"^Invalid param group option 'seed': 3 \(it is optimizer-wide"),
    dict(desc="not a dict", group=None, exc=TypeError, match=r"^param_group must be a dict"),
]


@pytest.mark.parametrize("case", GROUP_ERRORS, ids=lambda c: c["desc"])
def test_add_param_group_refuses_bad_groups(case):
    opt = AdamBridge(_params())
    group = [_params()[0]] if case["group"] is None else dict(case["group"], params=_params())
    with pytest.raises(case["exc"], match=case["match"]) as info:
        opt.add_param_group(group)
    assert "\n" not in str(info.value) and len(opt.param_groups) == 1
