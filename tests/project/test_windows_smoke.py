"""scripts/windows_smoke.py's async checks, run here on Linux: its async runs put a hook on
the parameters they say and see each hook fire at each step, and a run whose parameters are
all under small_param_threshold (no hook at all) fails that check instead of passing unseen.
(The smoke itself runs under wine64: scripts/windows_check.sh.)"""
from __future__ import annotations

import importlib.util

from _readme import ROOT


def _smoke():
    spec = importlib.util.spec_from_file_location("windows_smoke", ROOT / "scripts" / "windows_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_windows_smoke_async_runs_hook_and_see_every_hook_fire():
    smoke = _smoke()
    want = smoke.run("bf16", "torch")
    for threshold, hooked in ((smoke.HOOK_EVERY_PARAMETER, 4), (smoke.HOOK_THE_WEIGHTS, 2)):
        run, fired, detail = smoke.run_hooked("bf16", threshold)
        assert fired and detail == f"{hooked} hooked of {hooked}, {hooked * smoke.STEPS} hook calls"
        assert smoke.same_run(run, want)


def test_windows_smoke_fails_an_async_run_that_hooks_nothing():
    smoke = _smoke()
    _, fired, detail = smoke.run_hooked("bf16", 65536)  # the default: this model gets no hook
    assert not fired and detail == "0 hooked of 0, 0 hook calls"
