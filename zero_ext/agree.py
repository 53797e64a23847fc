"""Turn one rank's local failure into a clear error on every rank, instead of a hang.

Every collective operation of the optimizer (construction, load_state_dict, checkpoint
load, the step) first does its local work inside a try block, then calls `agree` with the
exception (or None). `agree` is one small collective: if any rank failed, every rank
raises (the failing rank its own exception, the others a RuntimeError, or a ValueError when
the failure was a ValueError, naming the rank), and nothing irreversible has happened yet.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import time

import torch
import torch.distributed as dist

from .groups import digest, first_difference
from .sync import backend_device, small_all_reduce

logger = logging.getLogger("zero_ext")


def agree(group, world_size: int, error: BaseException | None, what: str,
          flags: tuple[int, ...] = (), peer_value_error: bool = False) -> list[int]:
    """Collective over `group`: raise on every rank if any rank's `error` is set.

    A failing rank raises its own exception; the others raise a RuntimeError naming it
    (a ValueError when `peer_value_error` and the failure was one). `flags` are ints that
    ride along in the same collective; their maximum over the ranks is returned (e.g.
    "some rank stepped a frozen param").
    """
    if world_size == 1 or group is None and not dist.is_initialized():
        if error is not None:
            raise error
        return list(flags)
    group = group if group is not None else dist.group.WORLD
    vals = torch.tensor([0 if error is None else 1, *flags], dtype=torch.int64,
                        device=backend_device(group))
    small_all_reduce(vals, dist.ReduceOp.MAX, group)
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
                cls = ValueError if peer_value_error and e[0] == "ValueError" \
                    else RuntimeError
                raise cls(f"{what}: rank {r} failed ({e[0]}: {e[1]}); every rank stops here")
    return vals[1:]


def call_and_agree(fn, group, world_size: int, what: str, with_grad: bool = False):
    """fn() on every rank (in grad mode when `with_grad`: a step's closure runs forward and
    backward), then one agreement on its failure: a failure on any rank raises on every
    rank (as `agree`), before the caller goes on; else fn's result."""
    error, out = None, None
    try:
        with torch.set_grad_enabled(True) if with_grad else contextlib.nullcontext():
            out = fn()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    agree(group, world_size, error, what)
    return out


def agree_on_inputs(group, world_size: int, error: BaseException | None, lines: list[str],
                    what: str) -> None:
    """Construction / add_param_group: `agree` on local validation, and check that every
    rank describes the same params, groups and hyperparameters (`lines`, one per item)."""
    d = int(digest(lines)[:15], 16)  # 60 bits of the description's hash
    if world_size == 1:
        agree(group, world_size, error, what)
        return
    top, bottom = agree(group, world_size, error, what, (d, -d))
    if top == -bottom:
        return
    # Rank 0's description goes to every rank, each compares its own and only the one-line
    # differences are gathered (every description on every rank would be O(world x params)
    # lines per rank: 60 MB at 1024 ranks x 723 params).
    group = group if group is not None else dist.group.WORLD
    ref = [lines if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(ref, src=dist.get_global_rank(group, 0), group=group,
                               device=backend_device(group))
    mine = None if lines == ref[0] else first_difference(ref[0], lines)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    diffs = [f"rank {r}: {d}" for r, d in enumerate(everyone) if d is not None]
    raise RuntimeError(f"{what}: ranks were given different parameters, groups or "
                       "hyperparameters (compared with rank 0): " + "; ".join(diffs))


# rendezvous: how long a rank waits for the others before an error, and between warnings
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("ZERO_EXT_RENDEZVOUS_TIMEOUT_S", "1800"))
RENDEZVOUS_WARN_S = float(os.environ.get("ZERO_EXT_RENDEZVOUS_WARN_S", "60"))
_rendezvous_calls: dict = {}


def rendezvous(group, world_size: int, rank: int, what: str, hint: str) -> None:
    """Wait until every rank of `group` has reached this point (the n-th `what` on this
    group), through the default store rather than a collective: before a collective that
    scripts may call on one rank only (state_dict() without consolidate_state_dict()), so
    that a missing rank gives a warning naming it, with `hint`, every RENDEZVOUS_WARN_S
    seconds and a RuntimeError after RENDEZVOUS_TIMEOUT_S, instead of a silent hang."""
    if world_size == 1 or not dist.is_initialized():
        return
    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) == "fake":
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to meet in: the collective itself waits
        return
    # the group's name is the same on every rank (groups are created in the same order)
    name = dist.distributed_c10d._get_process_group_name(group)
    n = _rendezvous_calls[(name, what)] = _rendezvous_calls.get((name, what), 0) + 1
    tag = hashlib.sha256(name.encode()).hexdigest()[:16]
    base = f"zero_ext/rendezvous/{what}/{tag}/{n}"
    keys = [f"{base}/{r}" for r in range(world_size)]  # who is here, for the warning
    count, done = f"{base}/count", f"{base}/done"
    store.set(keys[rank], "1")
    # One counter decides: the rank whose arrival makes it world_size completes the
    # rendezvous, and a rank that gives up takes its arrival back with the same atomic add,
    # so a late rank and a timed-out one cannot both think they won the race.
    if store.add(count, 1) == world_size:
        store.set(done, "1")
        return
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        step = max(0.1, min(RENDEZVOUS_WARN_S, RENDEZVOUS_TIMEOUT_S - waited))
        try:
            store.wait([done], datetime.timedelta(seconds=step))
            return
        except RuntimeError:  # the store's timeout
            pass
        waited = time.monotonic() - start
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        msg = (f"{what}: rank {rank} has waited {waited:.0f} s for ranks {missing} of its "
               f"process group to call it too; {hint}")
        if waited >= RENDEZVOUS_TIMEOUT_S:
            if store.add(count, -1) == world_size - 1:
                return  # every rank had arrived before this one gave up: complete
            # withdrawn: the next call of every rank pairs with the right one (a rank that
            # arrives later waits for this rank's next call, as for a first call)
            _rendezvous_calls[(name, what)] -= 1
            try:
                store.delete_key(keys[rank])
            except Exception:  # noqa: BLE001 - a store without delete: only the warning reads it
                pass
            raise RuntimeError(msg + " (ZERO_EXT_RENDEZVOUS_TIMEOUT_S)")
        logger.warning("zero_ext: %s", msg)
