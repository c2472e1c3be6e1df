"""Hooks attached with test options (a transport of the test's own), held by the optimizer as
AdamBridge.attach_hooks holds them."""
from __future__ import annotations

from adambridge.pipeline import hooks


def attach_with(opt, model, **options):
    opt._pipeline = hooks.new(opt, model, **options)
    hooks.start(opt._pipeline)
    return opt._pipeline
