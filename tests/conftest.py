"""Shared fixtures: the backends this machine can run, and a private kernel cache per session."""
from __future__ import annotations

import os
import signal
import sys
import warnings

import pytest
import torch

# NOTE: the tests live in folders that mirror the package; shared helpers (tests/helpers) and a
# test module another one imports (its twins, its fixtures) are found by name from anywhere,
# as rank workers spawned by torch.multiprocessing find them (they inherit sys.path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from _test_paths import folders  # noqa: E402

for _folder in reversed(folders()):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

# NOTE: tests that assume a POSIX system say which part, so the suite runs on Windows too
# and names what it left out there.
NEEDS_FORK = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX only)")
NEEDS_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"),
                                reason="reads Linux's /proc")
NEEDS_SIGKILL = pytest.mark.skipif(not hasattr(signal, "SIGKILL"),
                                   reason="sends SIGKILL (POSIX signals only)")


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    # One private build cache for the whole run, unless the caller chose one.
    if "ADAMBRIDGE_CACHE_DIR" not in os.environ:
        os.environ["ADAMBRIDGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("adambridge-cache"))
    yield


def native_available() -> bool:
    try:
        from adambridge._native import loader
    except ImportError:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return loader.native_or_none() is not None


def available_backends() -> list:
    backends = ["torch"]
    if os.environ.get("ADAMBRIDGE_DISABLE_NATIVE") != "1":
        backends.append("native")
    return backends


@pytest.fixture(params=available_backends())
def backend(request):
    if request.param == "native" and not native_available():
        pytest.fail("the native kernel did not build on this machine; see "
                    "`python -m adambridge info` (set ADAMBRIDGE_DISABLE_NATIVE=1 to test "
                    "the torch backend alone)")
    return request.param


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _process_settings_kept():
    """A test leaves torch's thread count and default dtype as it found them: both change
    the bits of every later test in this process (CPU matmuls and reductions split their sums
    by thread count), which once failed a bit-for-bit test only in a full run."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    left = (torch.get_num_threads(), torch.get_default_dtype())
    if left != (threads, dtype):
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        pytest.fail(f"the test left torch's thread count and default dtype at {left} (it "
                    f"found {(threads, dtype)}); restore them", pytrace=False)
