"""Checkpoints: the saved form of the state (each value once, torch's keys where torch can take them) and its checked, streaming restore.

A saved parameter entry holds ``step``, ``master`` (fp32, the parameter's shape), ``ab_step``
and the moments as they are stored: fp32 and bf16 ones as torch's ``exp_avg`` /
``exp_avg_sq`` (the parameter's shape), fp8 codes and scales as ``ab_exp_avg``,
``ab_exp_avg_sq``, ``ab_exp_avg_scale``, ``ab_exp_avg_sq_scale``. Each param group carries
``seed``, ``precision`` and ``numerics`` (where torch.distributed.checkpoint keeps them).
See docs/checkpoints.md.

- saved.py: the saved form (``saved_entry``) and the group settings saved with it.
- checks.py: every value of a loaded checkpoint checked before anything changes.
- restore.py: ``restore`` (checked, nothing built) and ``Restored.states()``, which builds
  one parameter's state at a time, adopting loaded tensors where nothing else holds them.
- in_place.py: a checkpoint loaded in place into the last state_dict() (``HandedOut``).
- torch_adamw.py: ``to_torch_adamw``, what torch.optim.AdamW needs to load fp8 moments.
- stream_file.py: ``save``, torch.save's file written one tensor at a time (the NVMe tier's
  entries, read from its files, are never all in RAM at once).

Checkpoints written before the moments were saved once (torch's decoded form beside our
stored ``ab_`` moments, in every precision) load as they did: the stored moments are taken
where they decode to exactly the torch form beside them.
"""
from .checks import MAX_STEP, same_bits, step_of  # noqa: F401
from .in_place import NOT_OURS_STEP, REFUSED_AFTER_IN_PLACE, HandedOut  # noqa: F401
from .restore import Restored, restore, written_entry  # noqa: F401
from .saved import (GROUP_META, HYPERPARAMETERS, NATIVE_KEYS, OURS, group_meta,  # noqa: F401
                    saved_entry, torch_group_flags, torch_takes)
from .stream_file import save  # noqa: F401
from .torch_adamw import to_torch_adamw  # noqa: F401
