"""A checkpoint kept in the repository whose next step's bits are pinned.

tests/data/checkpoint_fixture.pt holds a parameter, its gradient and one AdamBridge
checkpoint per precision, written by numerics version 3 (checkpoint_fixture_v2.pt: the same
written by version 2, which version 3 loads, codecs.LOADABLE_NUMERICS). Loading it and taking
one step must give exactly the pinned sha256 of the parameter and the stored state, on the
torch backend and the native kernel alike. A change of arithmetic therefore fails here until
it is made on purpose: bump codecs.NUMERICS_VERSION (old checkpoints are then refused with a
message naming both versions, unless their state means the same: LOADABLE_NUMERICS),
regenerate with ``python tests/checkpoint/test_checkpoint_fixture.py``, and update the digests below in
the same commit.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from adambridge import AdamBridge
from adambridge.update import codecs

FIXTURE = Path(__file__).parents[1] / "data" / "checkpoint_fixture.pt"
FIXTURE_V2 = Path(__file__).parents[1] / "data" / "checkpoint_fixture_v2.pt"
PRECISIONS = ("fp32", "bf16", "fp8")
PINNED = {  # sha256 of (parameter, master, moments, scales) after one step from the fixture
    "fp32": "64c1b08b76d0d1b02dcd99ce0bce68969e2123876e4b9cdb36a1508d49312da0",
    "bf16": "d1fda99c4d8e9fd6cf7e585711ac7b25e19e54762065bc2515f4f13e3fff34f0",
    "fp8": "df9daa8bc9645b0e6d4b6e86842cf59752e8c8d9145df67d45029705fe3310e1",
}


def _digest(param: torch.Tensor, state: dict) -> str:
    h = hashlib.sha256()
    tensors = [param] + [state[k] for k in ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale",
                                            "exp_avg_sq_scale") if k in state]
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _step_from_fixture(precision: str, backend: str, fixture: Path = FIXTURE) -> str:
    data = torch.load(fixture, weights_only=True)
    param = torch.nn.Parameter(data["params"][precision].clone())
    opt = AdamBridge([param], lr=3e-3, weight_decay=0.1, precision=precision, backend=backend,
                     seed=7)
    opt.load_state_dict(data["checkpoints"][precision])
    param.grad = data["grad"].clone()
    opt.step()
    return _digest(param, opt.state[param])


def test_fixture_was_written_by_this_numerics_version():
    data = torch.load(FIXTURE, weights_only=True)
    assert data["numerics"] == codecs.NUMERICS_VERSION, (
        "the arithmetic changed version: regenerate the fixture and its digests on purpose")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fixture_next_step_bits_are_pinned(precision, backend):
    assert _step_from_fixture(precision, backend) == PINNED[precision]


def test_version_2_fixture_loads_and_steps_to_the_same_bits(backend):
    # Version 3 changed only how new fp8 codes round (subnormal range, blocks of m < 1e-36);
    # the stored state means the same, so a version-2 checkpoint resumes (here no element
    # meets the difference).
    assert torch.load(FIXTURE_V2, weights_only=True)["numerics"] == 2
    for precision in PRECISIONS:
        assert _step_from_fixture(precision, backend, FIXTURE_V2) == PINNED[precision]


def test_version_1_checkpoint_is_refused_in_one_line():
    data = torch.load(FIXTURE_V2, weights_only=True)
    checkpoint = data["checkpoints"]["fp8"]
    for group in checkpoint["param_groups"]:
        group["numerics"] = 1
    opt = AdamBridge([torch.nn.Parameter(data["params"]["fp8"].clone())], precision="fp8")
    with pytest.raises(ValueError, match=r"is 1, this adambridge computes numerics 3; resume"):
        opt.load_state_dict(checkpoint)


def _regenerate() -> None:
    gen = torch.Generator().manual_seed(11)
    param0 = torch.randn(700, generator=gen) * 0.1   # 700: five full fp8 blocks and a tail
    checkpoints, params = {}, {}
    for precision in PRECISIONS:
        param = torch.nn.Parameter(param0.clone())
        opt = AdamBridge([param], lr=3e-3, weight_decay=0.1, precision=precision,
                         backend="torch", seed=7)
        steps = torch.Generator().manual_seed(12)
        for _ in range(3):
            param.grad = torch.randn(700, generator=steps) * 0.01
            opt.step()
        checkpoints[precision] = opt.state_dict()
        params[precision] = param.detach().clone()
    grad = torch.randn(700, generator=torch.Generator().manual_seed(13)) * 0.01
    FIXTURE.parent.mkdir(exist_ok=True)
    torch.save(dict(numerics=codecs.NUMERICS_VERSION, params=params, grad=grad,
                    checkpoints=checkpoints), FIXTURE)
    for precision in PRECISIONS:
        print(f'    "{precision}": "{_step_from_fixture(precision, "torch")}",')


if __name__ == "__main__":
    _regenerate()
    sys.exit(0)
