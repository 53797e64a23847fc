"""The local step of the ZeRO optimizer's fused path: this rank's share, in chunks, stepped
by the one AdamW engine (engine.py) on the local optimizer's torch-format state.

The share (the plan's local pieces) is cut into the plan's chunks (per bucket, at aligned
boundaries) so that the exchange of chunk k can run while chunk k+1 is computed. Segments
read their grads straight from the user params' ``.grad`` (flat mode too: no copy into a
gradient shard). The host pieces of offload_optimizer (offload.py) are whole segments of their
host keys: in the first chunk, after the device's segments (the engine launches the device's
call first, so that on a GPU it runs while the host steps). Their grads are the host's flat
grads buffers at the pieces' offsets when the pull found every one (the compiled plan then
steps each run of pieces contiguous in all host buffers as one segment), else each key's
``.grad`` as the pull set it (None where the param had none: that key is skipped).
"""
from __future__ import annotations

import torch

from . import layout
from .engine import AdamWEngine, Segment, StepLayout


def share_layout(plan: layout.ShardPlan, host=None) -> StepLayout:
    """The engine's view of this rank's share: one segment per (local piece, chunk).

    The host pieces of offload_optimizer read their grads from their host keys' ``.grad``
    (which the pull set: None where the param had none); with `host` (the HostShard, for
    steps where every host piece has its grad) from the host's flat grad buffers instead, at
    the pieces' offsets: one grad source per buffer, so that the compiled plan checks a few
    grads per step and steps each run of pieces that are contiguous in every host buffer as
    one segment, whatever their number."""
    chunks: list[list[Segment]] = [[] for _ in range(plan.chunks)]
    sources = list(plan.params)
    host_segs: list[Segment] = []
    buffer_source: dict[int, int] = {}
    for lp in plan.local:
        if lp.host:
            if host is not None:
                slot = host.slot_of(lp.key)
                src = buffer_source.get(slot.buffer)
                if src is None:
                    src = buffer_source[slot.buffer] = len(sources)
                    sources.append(host.grad_source(slot.buffer))
                host_segs.append(Segment(lp.key, 0, lp.length, lp.group, src, slot.offset,
                                         fixed=True))
                continue
            # its grad is the host key's own (offload.HostShard.pull)
            host_segs.append(Segment(lp.key, 0, lp.length, lp.group, len(sources), 0))
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
    chunks[0].extend(host_segs)
    return StepLayout(sources, chunks)


class FusedShardStep:
    """Steps this rank's share with the fused kernel, chunk by chunk."""

    def __init__(self, plan: layout.ShardPlan, optim: torch.optim.Optimizer,
                 master_weights: bool = False, state_alloc=None, host=None):
        self.optim = optim
        self.layout = share_layout(plan)
        # offload_optimizer: the layout of the steps where every host piece has its grad
        # (HostShard.all_grads, as the pull found them), grads from the host's buffers
        self.host = host if host is not None and host.slots else None
        self.packed_layout = share_layout(plan, self.host) if self.host is not None else None
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
        layout = self.packed_layout if self.host is not None and self.host.all_grads \
            else self.layout
        self.engine.step(self.optim.param_groups, self.optim.state, layout,
                         grad_scale=grad_scale, after_chunk=after_chunk,
                         before_host=before_host)
