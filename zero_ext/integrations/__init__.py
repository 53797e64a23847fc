"""zero_ext with training frameworks.

- accelerate: nothing to add. ``accelerator.prepare(model, opt, ...)`` round-trips the state
  dict on every rank (before any step the state is empty everywhere; with state, rank 0's
  dict and the other ranks' placeholders load back exactly), ``save_state()`` calls
  ``state_dict()`` on every rank (which then gathers the state on rank 0 by itself), and
  ``load_state()`` loads the saved dict on every rank.
- PyTorch Lightning: nothing to add. Its DDP strategy calls ``consolidate_state_dict()`` on
  every rank before a checkpoint and ``state_dict()`` on global rank 0.
- Hugging Face Trainer: it saves ``optimizer.state_dict()`` from the main process only, so
  the state must be consolidated on every rank just before: add
  ``zero_ext.integrations.transformers.ZeroCheckpointCallback()`` to the Trainer's callbacks.
"""
from __future__ import annotations

__all__ = ["unwrap"]


def unwrap(optimizer):
    """The zero_ext.ZeroRedundancyOptimizer inside framework wrappers (accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer keep it as ``.optimizer`` or
    ``._optimizer``), or None when there is none."""
    from ..zero import ZeroRedundancyOptimizer

    for _ in range(8):
        if optimizer is None or isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        optimizer = (getattr(optimizer, "optimizer", None)
                     or getattr(optimizer, "_optimizer", None))
    return None
