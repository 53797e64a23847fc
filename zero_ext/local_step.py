"""The local step of the ZeRO optimizer's fused path: this rank's share, in chunks, stepped
by the one AdamW engine (engine.py) on the local optimizer's torch-format state.

The share (the plan's local pieces) is cut into the plan's chunks (per bucket, at aligned
boundaries) so that the exchange of chunk k can run while chunk k+1 is computed. Segments
read their grads straight from the user params' ``.grad`` (flat mode too: no copy into a
gradient shard). The host pieces of offload_optimizer (offload.py) are whole segments of their
host keys, whose ``.grad`` the pull set: in the first chunk, after the device's segments (the
engine launches the device's call first, so that on a GPU it runs while the host steps).
"""
from __future__ import annotations

import torch

from . import layout
from .engine import AdamWEngine, Segment, StepLayout


def share_layout(plan: layout.ShardPlan) -> StepLayout:
    """The engine's view of this rank's share: one segment per (local piece, chunk)."""
    chunks: list[list[Segment]] = [[] for _ in range(plan.chunks)]
    sources = list(plan.params)
    host: list[Segment] = []
    for lp in plan.local:
        if lp.host:  # its grad is the host key's own (offload.HostShard.pull)
            host.append(Segment(lp.key, 0, lp.length, lp.group, len(sources), 0))
            sources.append(lp.key)
            continue
        if lp.bucket < 0:  # outside the buckets (frozen, bucket views): with the last chunk
            chunks[-1].append(Segment(lp.key, 0, lp.length, lp.group, lp.param_id, lp.start))
            continue
        for k, (clo, chi) in enumerate(plan.chunk_ranges(lp.bucket, plan.rank)):
            a = max(lp.bucket_start, clo)
            z = min(lp.bucket_start + lp.length, chi)
            if z > a:
                o = a - lp.bucket_start
                chunks[k].append(Segment(lp.key, o, z - a, lp.group, lp.param_id,
                                         lp.start + o))
    chunks[0].extend(host)
    return StepLayout(sources, chunks)


class FusedShardStep:
    """Steps this rank's share with the fused kernel, chunk by chunk."""

    def __init__(self, plan: layout.ShardPlan, optim: torch.optim.Optimizer,
                 master_weights: bool = False, state_alloc=None):
        self.optim = optim
        self.layout = share_layout(plan)
        self.engine = AdamWEngine(type(optim), master_weights)
        self.engine.state_alloc = state_alloc  # (offload_optimizer: packed host state)

    def reset(self) -> None:
        """Forget cached views of the state (after it was replaced, e.g. by a load)."""
        self.engine.invalidate()

    def run(self, after_chunk=None, grad_scale=None, before_host=None) -> None:
        """One step; `after_chunk(k)` is called once chunk k's params are final. Local
        params without a grad are skipped and their step is not advanced, as in torch.
        Grads are divided by `grad_scale` (a one-element float32 tensor) when given.
        `before_host()` runs before the first kernel call on the CPU (offload_optimizer:
        the host waits there for its copies, after the device's call was launched)."""
        self.engine.step(self.optim.param_groups, self.optim.state, self.layout,
                         grad_scale=grad_scale, after_chunk=after_chunk,
                         before_host=before_host)
