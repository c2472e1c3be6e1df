"""Adapters that plug AdamBridge into training frameworks, one module per framework.

- ``adambridge.integrations.transformers``: Hugging Face ``Trainer``
  (``optimizer_cls_and_kwargs``, ``AdamBridgeCallback`` and ``stream_saves``).
- ``adambridge.integrations.lightning``: Lightning ``Trainer`` (``AdamBridgeCallback``,
  ``AdamBridgeCheckpointIO``).
- ``adambridge.integrations.accelerate``: ``attach_hooks(accelerator, model, optimizer)``,
  ``stream_saves(accelerator)``.

Each writes the optimizer's checkpoint with ``adambridge.checkpoint.save`` (one tensor at a
time) where the framework would ``torch.save`` it whole.

Each module imports its framework itself, so importing this package (or ``adambridge``)
imports none of them. The adapters only translate a framework's settings (accumulation,
clipping, resume order) into the optimizer's public API and refuse, in one line, what
they cannot honour.
"""
