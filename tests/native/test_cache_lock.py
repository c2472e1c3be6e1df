"""A build lock that cannot be opened (a `<key>.lock` symlink left in one's own cache): backend="auto"
falls back to torch with one warning, backend="native" refuses in one line naming the file."""
from __future__ import annotations

import warnings

import pytest
import torch

import adambridge
from adambridge._native import build
from test_build import _compiler_or_skip, _fresh_memos, _runtime_warnings  # noqa: F401


@pytest.fixture
def linked_lock(tmp_path, monkeypatch):
    """A fresh cache (ADAMBRIDGE_CACHE_DIR) whose kernel lock is a symlink to a missing file."""
    _compiler_or_skip()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("ADAMBRIDGE_CACHE_DIR", str(cache))
    lock = cache / f"{build.make_plan().key}.lock"
    lock.symlink_to(tmp_path / "elsewhere")
    return lock


def _steps(opt, param, grads):
    for g in grads:
        param.grad = g.clone()
        opt.step()


def test_cache_lock_symlink_auto_falls_back_to_torch_with_one_warning(linked_lock, tmp_path):
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(17, generator=gen) for _ in range(3)]
    param = torch.nn.Parameter(torch.linspace(-1, 1, 17))
    twin = torch.nn.Parameter(torch.linspace(-1, 1, 17))
    opt = adambridge.AdamBridge([param], lr=0.1, backend="auto")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _steps(opt, param, grads)
    assert opt.backend == "torch"
    messages = [str(w.message) for w in _runtime_warnings(record)]
    assert len(messages) == 1, messages
    assert f"cannot open its build lock {linked_lock} (it is a symbolic link)" in messages[0]
    assert f"rm {linked_lock}" in messages[0] and "Falling back to the torch backend" in messages[0]
    _steps(torch.optim.AdamW([twin], lr=0.1), twin, grads)
    torch.testing.assert_close(param.detach(), twin.detach(), rtol=1e-6, atol=1e-7)
    assert linked_lock.is_symlink() and not (tmp_path / "elsewhere").exists()  # never followed


def test_cache_lock_symlink_native_refuses_in_one_line_naming_the_file(linked_lock):
    param = torch.nn.Parameter(torch.linspace(-1, 1, 17))
    before = param.detach().clone()
    param.grad = torch.ones(17)
    with pytest.raises(build.NativeBuildError) as caught:  # at construction or the first step
        opt = adambridge.AdamBridge([param], lr=0.1, backend="native")
        opt.step()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"adambridge cannot open its build lock {linked_lock} (it is a symbolic link); "
                              f"remove it (rm {linked_lock}")
    assert "ADAMBRIDGE_CACHE_DIR" in message
    assert torch.equal(param.detach(), before)
