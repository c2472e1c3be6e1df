"""Adapters that plug AdamBridge into training frameworks, one module per framework.

- ``adambridge.integrations.transformers``: Hugging Face ``Trainer``
  (``optimizer_cls_and_kwargs`` and ``AdamBridgeCallback``).
- ``adambridge.integrations.lightning``: Lightning ``Trainer`` (``AdamBridgeCallback``).
- ``adambridge.integrations.accelerate``: ``attach_hooks(accelerator, model, optimizer)``.

Each module imports its framework itself, so importing this package (or ``adambridge``)
imports none of them. The adapters only translate a framework's settings (accumulation,
clipping, resume order) into the optimizer's public API and refuse, in one line, what
they cannot honour.
"""
