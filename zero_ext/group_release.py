"""Process groups destroyed without the GIL deadlock of torch before 2.8.

Up to torch 2.7 a ProcessGroup's destructor runs with the GIL held (pybind11 frees the
object under it). A gloo group's destructor waits for its queue and joins its worker
threads; a worker that is dropping a finished collective whose tensors' Python objects were
let go first needs the GIL to free them, and waits for it: both wait forever. zero_ext makes
that moment likely: its destroy_process_group waits for the params' exchange in flight and
then destroys at once, while gloo's workers are still dropping the last collectives' works.
torch 2.8 releases the GIL in the destructor ("Release GIL in PG destructor", pytorch PR
154976): a broadcast in flight at destroy, its tensor dropped, as in
tests/test_shutdown_and_amp_internals.py, hung 2.6.0 and 2.7.1 and not 2.8.0.

So on those versions zero_ext's destroy_process_group (param_gather._waiting) first hands
every group that torch's destroy will drop to the native library, which keeps a reference
(`torch.ops.zero_ext.hold_process_group`, csrc/process_groups.cpp); torch's destroy and
zero_ext's own release then drop only Python references, and the last reference goes inside
`release_held_process_groups`, an op, which runs without the GIL: the destructor waits for
the workers there, and they get the GIL they need. Where the native library is not loaded
(no compiler, ZERO_EXT_REFERENCE=1), the groups are kept alive instead, to the end of the
process (never destroyed, so never deadlocked; their threads and sockets stay until exit).
A group that other Python code still references after destroy_process_group (a script's
own variable) is destroyed when that reference goes, as torch does, with the GIL.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Callable, Iterable

import torch.distributed as dist

from .torch_support import torch_version

# torch's ProcessGroup destructor holds the GIL (torch < 2.8). A test forces this to run the
# release path on any torch.
GIL_HELD_BY_GROUP_DESTRUCTOR = torch_version() < (2, 8)

_warned = False


def _native() -> bool:
    from .kernels import _loader

    return _loader.load_if_built() and hasattr(torch_ops(), "hold_process_group")


def torch_ops():
    import torch

    return torch.ops.zero_ext


def groups_destroyed_by(group=None) -> list:
    """The groups torch's destroy_process_group(group) drops: every group it knows for None
    or WORLD (the whole world goes), else `group` alone."""
    c10d = dist.distributed_c10d
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return []
    if group is None or group is c10d.GroupMember.WORLD:
        return list(c10d._world.pg_map)
    try:
        return [group] if group in c10d._world.pg_map else []  # (else torch raises)
    except TypeError:  # (unhashable: not a group)
        return []


def _keep_forever(groups: Iterable) -> None:
    global _warned
    for g in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))  # never freed: never destroyed
    if not _warned:
        _warned = True
        logging.getLogger("zero_ext").info(
            "zero_ext: torch < 2.8 destroys process groups holding the GIL (a possible "
            "deadlock with gloo's threads) and the native library is not loaded: destroyed "
            "process groups are kept alive until the process exits instead")


def hold_for_destroy(group=None) -> Callable[[], None]:
    """Call before torch's destroy_process_group(group); call what it returns afterwards
    (after zero_ext's own references are dropped too). Nothing to do on torch >= 2.8."""
    if not GIL_HELD_BY_GROUP_DESTRUCTOR:
        return lambda: None
    groups = groups_destroyed_by(group)
    if not groups:
        return lambda: None
    if not _native():
        _keep_forever(groups)
        return lambda: None
    ops = torch_ops()
    try:
        for g in groups:
            ops.hold_process_group(g.boxed())
    except Exception as exc:  # noqa: BLE001 - (a group that cannot be boxed) never hang
        logging.getLogger("zero_ext").info("zero_ext: holding a process group failed (%s)",
                                           exc)
        _keep_forever(groups)
    del groups

    def release() -> None:
        ops.release_held_process_groups()  # (an op: runs without the GIL)

    return release


def keep_to_the_end(groups: Iterable) -> None:
    """(the process is ending without destroy_process_group) Groups destroyed at the
    interpreter's teardown would be destroyed with the GIL held, right after the last
    exchange: on torch < 2.8 they are kept alive to the end instead."""
    if not GIL_HELD_BY_GROUP_DESTRUCTOR:
        return
    groups = list(groups)
    if groups and _native():
        ops = torch_ops()
        for g in groups:
            ops.hold_process_group(g.boxed())  # (never released: the process is ending)
    elif groups:
        _keep_forever(groups)
