"""SourcedTensor (host/sourced.py): the tensor whose operations reach its source, as p.grad in
async mode and the NVMe tier's state_dict() entries are. Views keep the device they view."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from adambridge.host.sourced import KeptSource, SourcedTensor


def test_views_writes_and_pickling_reach_the_source():
    values = torch.arange(12.0)
    view = SourcedTensor(values, KeptSource(values))
    rows = view.view(3, 4)
    assert type(rows) is SourcedTensor and rows.device == values.device
    rows[1].fill_(-1.0)  # through two views, into the values
    assert values[4:8].eq(-1.0).all()
    assert torch.equal(pickle.loads(pickle.dumps(rows)), values.view(3, 4))
    with pytest.raises(RuntimeError, match=r"\.t_\(\) changes a tensor's shape in place"):
        rows.t_()


def test_a_gradient_view_of_p_grad_is_on_the_gradient_device():
    # Before host/sourced.py, p.grad.view(-1), p.grad[0] and p.grad.detach() in async mode
    # reported the meta device (their shapes were worked out there).
    model = nn.Linear(300, 300)
    opt = AdamBridge(model.parameters(), small_param_threshold=0)
    opt.attach_hooks(model)
    model(torch.randn(2, 300)).sum().backward()
    grad = model.weight.grad
    for view in (grad.view(-1), grad[0], grad.detach(), grad.data, grad.split(100)[1]):
        assert view.device == grad.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"p\.grad\.t_\(\) changes the gradient tensor's "
                                           r"shape in place.*p\.grad = p\.grad\.t\(") as info:
        grad.t_()
    assert "\n" not in str(info.value)
    opt.step()
    opt.detach_hooks()
