"""The one door into the optimizer (adambridge/door.py): AdamBridge has all it names, and no
module of the package outside optimizer.py and params.py reaches into the optimizer's
private attributes or takes it untyped."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from adambridge import AdamBridge
from adambridge.door import OptimizerDoor

PACKAGE = Path(__file__).resolve().parents[2] / "adambridge"
OWNERS = {"optimizer.py", "params.py"}  # the optimizer and its ParamOwner base
# the callers' names for the optimizer, followed by a private attribute
PRIVATE = re.compile(r"\b(?:opt|optimizer|self\.opt)\._(?!_)\w+")
UNTYPED = re.compile(r"\bopt: Any\b")
ABOVE_THE_OPTIMIZER = ("integrations", "lab", "plan")  # they hold the whole AdamBridge


def _inner_modules() -> list:
    return [p for p in PACKAGE.rglob("*.py")
            if p.name not in OWNERS or p.parent != PACKAGE]


def test_adambridge_has_everything_its_door_names():
    opt = AdamBridge([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    names = set(OptimizerDoor.__annotations__) | {
        n for n in vars(OptimizerDoor) if not n.startswith("_")}
    assert sorted(n for n in names if not hasattr(opt, n)) == []


def test_no_module_outside_the_optimizer_reads_or_writes_its_private_attributes():
    found = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
             for p in _inner_modules()
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if PRIVATE.search(line)]
    assert found == []


def test_the_layers_below_the_optimizer_take_it_through_its_door():
    found = [f"{p.relative_to(PACKAGE)}:{i}"
             for p in _inner_modules() if p.relative_to(PACKAGE).parts[0] not in ABOVE_THE_OPTIMIZER
             and p.name not in ("cli.py", "diagnostics.py")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if UNTYPED.search(line)]
    assert found == []


def test_the_private_attribute_check_can_fail():
    assert PRIVATE.search("    buffer = opt._writeback.get(p)")
    assert PRIVATE.search("if updater.opt._pipeline is updater:")
    assert not PRIVATE.search("self._opt_ref = weakref.ref(opt)")
