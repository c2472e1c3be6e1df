"""What every adapter needs: finding the AdamBridge inside a framework's optimizer wrapper."""
from __future__ import annotations

from typing import Any

from ..optimizer import AdamBridge


def innermost(optimizer: Any) -> Any:
    """The optimizer under framework wrappers (accelerate, Lightning): an AdamBridge or not."""
    inner, seen = optimizer, set()
    # AcceleratedOptimizer and LightningOptimizer both expose the wrapped one as .optimizer.
    while not isinstance(inner, AdamBridge) and hasattr(inner, "optimizer") and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.optimizer
    return inner


def unwrap_optimizer(optimizer: Any, who: str) -> AdamBridge:
    """The AdamBridge under framework wrappers (accelerate, Lightning), or a one-line error."""
    inner = innermost(optimizer)
    if not isinstance(inner, AdamBridge):
        raise TypeError(f"{who}: the optimizer is {type(inner).__name__}, not AdamBridge; "
                        f"build it with adambridge.AdamBridge")
    return inner


def gathers(optimizer: Any) -> bool:
    """Whether the AdamBridge under ``optimizer`` has shard_state, whose state_dict() is a
    collective that gathers every rank's ranges (saved with ``save_gathered`` instead)."""
    inner = innermost(optimizer)
    return isinstance(inner, AdamBridge) and inner.shard_group is not None


class Gathered:
    """A shard_state optimizer's place in a framework's checkpoint until the adapter's save,
    run on every rank, writes it with the gathered save; ``refusal`` is the one line a
    pickling of it by anything else raises."""

    def __init__(self, opt: AdamBridge, refusal: str) -> None:
        self.opt, self.refusal = opt, refusal

    def __reduce__(self) -> Any:
        raise TypeError(self.refusal)
