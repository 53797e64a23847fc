"""Turn one rank's local failure into a clear error on every rank, instead of a hang.

Every collective operation of the optimizer (construction, load_state_dict, checkpoint
load, the step) first does its local work inside a try block, then calls `agree` with the
exception (or None). `agree` is one small collective: if any rank failed, every rank
raises (the failing rank its own exception, the others a RuntimeError, or a ValueError when
the failure was a ValueError, naming the rank), and nothing irreversible has happened yet.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _flag_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, world_size: int, error: BaseException | None, what: str,
          flags: tuple[int, ...] = ()) -> list[int]:
    """Collective over `group`: raise on every rank if any rank's `error` is set.

    `flags` are small non-negative ints that ride along in the same collective; their
    maximum over the ranks is returned (e.g. "some rank stepped a frozen param").
    """
    if world_size == 1 or group is None and not dist.is_initialized():
        if error is not None:
            raise error
        return list(flags)
    group = group if group is not None else dist.group.WORLD
    vals = torch.tensor([0 if error is None else 1, *flags], dtype=torch.int64,
                        device=_flag_device(group))
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    vals = vals.tolist()
    if vals[0]:
        # Slow path, failures only: learn who failed and why.
        mine = None if error is None else (type(error).__name__, str(error))
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        if error is not None:
            raise error
        for r, e in enumerate(everyone):
            if e is not None:
                cls = ValueError if e[0] == "ValueError" else RuntimeError
                raise cls(f"{what}: rank {r} failed ({e[0]}: {e[1]}); every rank stops here")
    return vals[1:]
