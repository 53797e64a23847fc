"""Hugging Face Trainer: consolidate the ZeRO state on every rank before a checkpoint.

Trainer writes ``optimizer.state_dict()`` from the main process only. A ZeRO optimizer's
state is spread over the ranks, so every rank must take part in gathering it first; the
callback does that, on every rank, right before each save the Trainer is about to make::

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.integrations.transformers import ZeroCheckpointCallback

    trainer = Trainer(
        model=model, args=args, train_dataset=ds,
        optimizer_cls_and_kwargs=(ZeroRedundancyOptimizer,
                                  {"optimizer_class": torch.optim.AdamW, "lr": 3e-4}),
        callbacks=[ZeroCheckpointCallback()])

Resuming (``trainer.train(resume_from_checkpoint=...)``) needs nothing more: the Trainer
loads ``optimizer.pt`` on every rank, and each rank keeps its own share.
"""
from __future__ import annotations

from transformers import TrainerCallback

from . import unwrap

__all__ = ["ZeroCheckpointCallback"]


def _value(v) -> str:
    return str(getattr(v, "value", v))


class ZeroCheckpointCallback(TrainerCallback):
    """Calls ``consolidate_state_dict(0)`` on every rank whenever the Trainer is about to
    save a checkpoint with the optimizer: at the end of a step or an epoch whose save flag
    is set (the Trainer's own flow callback sets it before user callbacks run), and after an
    evaluation under ``save_strategy="best"`` (decided only then). Does nothing for
    optimizers that are not zero_ext's, or with ``save_only_model=True``."""

    def _consolidate(self, args, optimizer) -> None:
        if getattr(args, "save_only_model", False):
            return
        opt = unwrap(optimizer)
        if opt is not None:
            opt.consolidate_state_dict(0)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save:
            self._consolidate(args, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save:
            self._consolidate(args, optimizer)

    def on_evaluate(self, args, state, control, optimizer=None, **kwargs):
        if _value(args.save_strategy) == "best":
            self._consolidate(args, optimizer)
