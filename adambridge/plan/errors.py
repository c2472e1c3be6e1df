"""PlanError: bad input to a plan, in one line that names the argument and what it takes."""
from __future__ import annotations


class PlanError(ValueError):
    """An input the plan cannot use: the message names the argument, its value and the fix."""


def invalid(name: str, value: object, expected: str) -> PlanError:
    """``Invalid tokens_per_step (--tokens-per-step): 0 (expected ...)``."""
    return PlanError(f"Invalid {name} (--{name.replace('_', '-')}): {value!r} ({expected})")
