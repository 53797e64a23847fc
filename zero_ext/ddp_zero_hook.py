"""DDP comm hooks that run the ZeRO step inside DDP's backward: the names, signatures and
behaviour of ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``, for
``zero_ext.ZeroRedundancyOptimizer(..., overlap_with_ddp=True)``, on every backend (gloo
included), at any world size, with param-group dicts. A script written for torch's changes
two imports::

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import hook_with_zero_step

    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True,
                                  lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, opt))
    for batch in data:            # no opt.step(): backward steps
        ddp(batch).sum().backward()
        opt.zero_grad()

As with torch's hooks, the first two iterations (three with ``static_graph``) do not update
the params: DDP finalises its buckets first. The machinery is in ``zero_ext.overlap``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import overlap
from .reduce_scatter import gather_grads  # DDP's averaged grads on every rank, when asked
from .reduce_scatter import reduce_scatter_hook  # grads to their owners only (with clipping)

__all__ = [
    "gather_grads",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "reduce_scatter_hook",
]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def hook_with_zero_step(hook: Hook, ddp, zero, shard_buckets: bool = False) -> Hook:
    """``hook`` (e.g. ``allreduce_hook``), followed by the ZeRO step: once the last bucket's
    grads are computed, every all-reduce is waited for and each rank steps the elements it
    owns, then every owner's update reaches every rank, all before ``backward()`` returns.

    ``shard_buckets`` is accepted for torch's signature; zero_ext's partition is balanced
    over every param whatever its value, and the result does not depend on it.
    Raises (on every rank) TypeError/ValueError for a wrong pairing: ``zero`` not built with
    ``overlap_with_ddp=True``, params of ``zero`` that ``ddp`` does not hold, DDP with
    ``find_unused_parameters=True`` without ``static_graph`` (it never finalises its buckets).
    """
    return overlap.build_hook(hook, ddp, zero, shard_buckets, interleaved=False,
                              what="hook_with_zero_step")


def hook_with_zero_step_interleaved(hook: Hook, ddp, zero, shard_buckets: bool = False) -> Hook:
    """As :func:`hook_with_zero_step`, but each bucket's share is stepped as soon as its
    all-reduce has completed (checked at every later bucket), while backward goes on; the
    exchange of the updates still follows the last bucket, after every all-reduce."""
    return overlap.build_hook(hook, ddp, zero, shard_buckets, interleaved=True,
                              what="hook_with_zero_step_interleaved")
