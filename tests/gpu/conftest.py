"""GPU tests: a per-test time limit that dumps every thread's stack and exits on a hang.

NOTE: a hung CUDA wait blocks in C with the GIL released, where no Python-level timeout
can interrupt it; faulthandler's watchdog thread still can, and scripts/gpu_check.sh runs
each test file in its own process, so one hang costs only the rest of that file.
"""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

_LIMIT_S = float(os.environ.get("ADAMBRIDGE_GPU_TEST_TIMEOUT", "90"))


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    print(f"\n[gpu test start] {request.node.nodeid}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
