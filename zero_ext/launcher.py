"""What the optimizer learns from how its process was launched.

- `process_group_of`: the group it shards over, its size and this rank's index in it; a
  plain single process (no launcher) when torch.distributed is not initialized, and an
  error when a launcher (torchrun) says there are more ranks than the one process the
  optimizer would otherwise quietly become.
- `FirstStepCheck`: at the first step, a framework driving the optimizer in a way that
  cannot work with sharded state (the HF Trainer saving checkpoints without
  ZeroCheckpointCallback) is an error on every rank, before any checkpoint is written.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist


def launcher_world_size() -> int:
    """The world size a launcher announced (torchrun's WORLD_SIZE), 1 without one."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1  # not a launcher's value: nothing to hold the script to


def process_group_of(process_group: Any) -> tuple[Any, int, int]:
    """(group, world_size, rank) for the constructor's `process_group`; (None, 1, 0) for a
    plain single process."""
    if process_group is None and not dist.is_initialized():
        world = launcher_world_size()
        if world > 1:
            # torch's ZeRO raises here too; quietly building an unsharded optimizer on
            # every rank would hold the whole state everywhere and never say so.
            raise ValueError(
                "ZeroRedundancyOptimizer: torch.distributed has no process group yet, but "
                f"this process was launched as one of WORLD_SIZE={world} ranks (torchrun); "
                "built now, every rank would hold the whole optimizer state, unsharded. "
                "Call torch.distributed.init_process_group() before building the "
                "optimizer. With the Hugging Face Trainer, TrainingArguments(...) creates "
                "the group: build the optimizer after it, or pass optimizer_cls_and_kwargs="
                "(ZeroRedundancyOptimizer, {...}) to Trainer and let it build the optimizer")
        return None, 1, 0
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


class FirstStepCheck:
    """A step pre-hook (``register_step_pre_hook``) that inspects, once, what drives the
    optimizer's steps. Each rank checks on its own, from what every rank shares (the
    framework's configuration), so every rank raises the same error before its first step
    has touched anything or issued a collective; nothing is paid after the first step."""

    def __init__(self):
        self.done = False

    def __call__(self, opt, args, kwargs) -> None:
        if self.done:
            return
        # (only when the Trainer's module is loaded already: nothing to look for otherwise)
        if opt.world_size > 1 and "transformers.trainer" in sys.modules:
            from .integrations.transformers import check_trainer_saves_state

            check_trainer_saves_state(opt)
        self.done = True  # after the check: a caught error repeats at the next step
