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

Forgetting the callback is an error at the optimizer's first step, on every rank
(:func:`check_trainer_saves_state`), before any checkpoint folder is written.
"""
from __future__ import annotations

import sys

from transformers import TrainerCallback

from . import unwrap

__all__ = ["ZeroCheckpointCallback", "check_trainer_saves_state"]


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


def _trainer_driving_the_step():
    """The transformers Trainer whose code is on the call stack (its training loop calls
    the step), or None."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, trainer_cls):
            return obj
        frame = frame.f_back
    return None


def check_trainer_saves_state(opt) -> None:
    """Raise when a Trainer drives `opt`'s steps and will save checkpoints with the
    optimizer's state but has no :class:`ZeroCheckpointCallback`: its main process would
    call ``state_dict()`` alone, wait for ranks that never come, and leave a half-written
    ``checkpoint-N`` behind. Every rank sees the same Trainer configuration, so every rank
    raises the same error (called by zero_ext at the first step of a sharded optimizer)."""
    trainer = _trainer_driving_the_step()
    if trainer is None:
        return
    args = trainer.args
    if _value(args.save_strategy) == "no" or getattr(args, "save_only_model", False):
        return  # no optimizer state is ever saved
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    if any(isinstance(cb, ZeroCheckpointCallback) for cb in callbacks):
        return
    raise RuntimeError(
        "zero_ext.ZeroRedundancyOptimizer is driven by a transformers Trainer that saves "
        f"checkpoints (save_strategy={_value(args.save_strategy)!r}) without "
        "zero_ext.integrations.transformers.ZeroCheckpointCallback among its callbacks. "
        "The Trainer saves optimizer.state_dict() from the main process only, and the "
        "sharded state needs every rank there: add callbacks=[ZeroCheckpointCallback()] "
        "to Trainer(...) (or trainer.add_callback(ZeroCheckpointCallback())), or pass "
        "save_only_model=True or save_strategy='no' to TrainingArguments")
