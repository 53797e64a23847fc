"""``offload_optimizer``: this rank's share of the optimizer state, and of the float32
masters, in host memory; its step on the host (ZeRO-Offload for the drop-in).

The option (``ZeroRedundancyOptimizer(..., offload_optimizer=True | fraction)``) takes a
fraction of each rank's share to the host: the local pieces chosen (`HostShard.place`) get
a host key, a tensor in host memory of their own (pinned where the params are on a GPU),
and the local optimizer steps that key in place of the param's memory, so everything the
local optimizer keeps under it (moments, float32 master, step) is made and kept on the host:
by the fused engine's lazy init, by torch's own ``load_state_dict`` (which puts state on its
key's device) and by a checkpoint's load alike. The rest of the share stays on the device,
as without the option. Every step then:

1. (`pull`) the host pieces' grads go device to host (those that reduce_scatter_hook's
   buckets already sent as they became final, `pull_bucket`, are not sent again), and the
   pieces' current param values too: the params stay the source of truth (a script that
   loads weights or edits them between steps is followed, as without the option);
2. the device pieces' step is launched first (on a GPU it runs while the host computes),
   then the host pieces' step (the fused C++ AdamW over every group at once, or
   ``optimizer_class``'s own CPU step);
3. (`push`) the updated host pieces go host to device, before the params' exchange.

Copies are bounded: a piece of at least `DIRECT_BYTES` travels on its own (one copy between
its memory and its host slot), smaller ones are packed through one device staging buffer of
`STAGE_BYTES` per (device, dtype): one flatten kernel and one copy per window of host-
consecutive pieces, whatever their number. On a GPU the step's copies run on the current
stream (ordered with the step's kernels and the exchange after them), the hook's on a side
stream while the backward goes on; the host waits for their event before it steps.

The host state is kept packed: each state tensor of the host pieces (``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, ``master``) becomes a view into one flat host buffer
per (name, dtype) laid out like the host keys (`pack_state`, at the step after the state
was made or loaded), so the host step streams a few contiguous arrays whatever the number
of tensors.

On a machine without a GPU (the params on the CPU) the same code runs: the host keys are
real copies, every pull, push and staging step happens, so CI covers every path.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import kernels

OPTION = "offload_optimizer"

# A piece of at least this many bytes is copied on its own; smaller ones are packed.
DIRECT_BYTES = 1 << 20
# Device staging per (device, dtype) for packed pieces (and the hook's, a second one).
STAGE_BYTES = 4 << 20

# Local optimizers whose step the host runs: the fused AdamW engine's classes (torch's
# AdamW and Adam, zero_ext's FusedAdamW), and torch's own element-wise optimizers, whose CPU
# implementation steps the host keys (their step reads each param's grad once, so a grad
# copied to the host before the step is the grad the step reads).
HOST_STEPPED = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                "Adadelta", "Rprop", "ASGD")
_STATE_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


def resolve_option(value: Any) -> float:
    """The fraction of each rank's share stepped on the host: False/None -> 0 (off), True
    -> 1, a number in [0, 1] as it is. TypeError / ValueError otherwise."""
    if value is None or value is False:
        return 0.0
    if value is True:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{OPTION} must be a bool or a fraction in [0, 1] (the part of each "
                        f"rank's share stepped on the host), got {value!r}")
    f = float(value)
    if math.isnan(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"{OPTION} must be a fraction in [0, 1] (the part of each rank's "
                         f"share stepped on the host), got {value!r}")
    return f


def check_supported(optimizer_class: type, overlap_with_ddp: bool, params: Sequence[Tensor],
                    aliased: bool) -> None:
    """Construction (raised on every rank by the caller, before any state exists): what
    ``offload_optimizer`` needs."""
    from .fused_adamw import FusedAdamW

    fused = isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedAdamW)
    builtin = (getattr(optimizer_class, "__module__", "").startswith("torch.optim")
               and optimizer_class.__name__ in HOST_STEPPED)
    if not (fused or builtin):
        raise ValueError(
            f"{OPTION} steps the host part of the share with the fused AdamW (torch.optim."
            "AdamW, torch.optim.Adam, zero_ext.FusedAdamW) or with torch's own CPU step of an "
            f"element-wise optimizer ({', '.join(HOST_STEPPED)}); "
            f"{getattr(optimizer_class, '__qualname__', optimizer_class)} is not one of them "
            "(an optimizer that calls its closure again and again, as LBFGS, would read "
            "grads of the device's params, not the host's copies)")
    if overlap_with_ddp:
        raise ValueError(f"{OPTION} is not supported with overlap_with_ddp=True (the step "
                         "inside DDP's backward); use zero_ext.ddp_zero_hook."
                         "reduce_scatter_hook, whose buckets' grads go to the host as they "
                         "become final")
    if aliased:
        raise ValueError(f"{OPTION} cannot step params that share memory (as after "
                         "`b.data = a.data`) on the host: each would get a host copy of its "
                         "own. Tie weights by sharing one Parameter instead")
    bad = sorted({str(p.device) for p in params if p.device.type not in ("cpu", "cuda")})
    if bad:
        raise ValueError(f"{OPTION} needs params on the CPU or on CUDA devices, got {bad}")
    if any(p.is_sparse for p in params):
        raise ValueError(f"{OPTION} does not support sparse params")


# ------------------------------------------------------------------------------ copies


_GRAD = operator.attrgetter("grad")
_NO_STREAM = contextlib.nullcontext()


def _is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda"


def _param_view(p: Tensor, start: int, length: int) -> Tensor:
    """Elements [start, start+length) of param `p`, through ``.data``: a write there does
    not move the param's version counter (nor does the exchange's)."""
    d = p.data
    if start == 0 and length == d.numel():
        return d
    return d.view(-1)[start:start + length]


def _grad_view(g: Tensor, start: int, length: int, shape: torch.Size) -> Tensor:
    if start == 0 and length == g.numel() and g.shape == shape:
        return g
    flat = g.view(-1) if g.is_contiguous() else g.reshape(-1)
    return flat[start:start + length].view(shape)


@dataclass
class _Slot:
    """One host piece: where it sits, on the host and on the device."""

    index: int          # position in HostShard.pieces
    param_id: int
    start: int
    length: int
    buffer: int         # index into HostShard.buffers
    offset: int         # first element in that buffer (aligned)
    key: Tensor         # the host key (a view of the buffer's params), the key's shape
    grad: Tensor        # its grad: a view of the buffer's grads, the key's shape
    pos: int = 0        # position in its buffer's slots


@dataclass
class _Buffers:
    """The host memory of the pieces of one (device, dtype): their params (the host keys
    view it) and their grads, each one flat buffer, plus the device's staging."""

    device: torch.device
    dtype: torch.dtype
    itemsize: int
    numel: int
    params: Tensor
    grads: Tensor
    slots: List[_Slot] = field(default_factory=list)
    # the fused step's grad source for the pieces' grads: a tensor over the params buffer
    # whose .grad is the grads buffer (local_step.share_layout)
    grad_source: Optional[Tensor] = None
    stage: Optional[Tensor] = None        # the step's staging (current stream)
    hook_stage: Optional[Tensor] = None   # the hook's staging (side stream)
    # the fingerprints' scratch (int32, one per 16-bit word of hook_stage; side stream)
    fp_scratch: Optional[Tensor] = None


class _Window:
    """A copy between some device tensors and host elements [lo, hi) of one buffer: one
    tensor copied directly, or several packed through the staging (`rel`: offsets in it)."""

    __slots__ = ("buf", "lo", "hi", "slots", "rel", "direct", "tight")

    def __init__(self, buf: int, slots: List[_Slot], direct: bool):
        self.buf, self.slots, self.direct = buf, slots, direct
        self.lo = slots[0].offset
        self.hi = slots[-1].offset + slots[-1].length
        self.rel = [s.offset - self.lo for s in slots]
        # no alignment gap between its slots (the staging's gaps hold whatever was there)
        self.tight = all(a + s.length == b for a, s, b in zip(self.rel, slots, self.rel[1:]))


def _windows(buffers: List[_Buffers], chosen: Sequence[_Slot]) -> List[_Window]:
    """The copies of the slots `chosen` (in HostShard.pieces order): each window covers only
    chosen, host-consecutive slots (a window's copy writes everything between its first and
    last slot, alignment gaps included), at most STAGE_BYTES; a slot of at least
    DIRECT_BYTES, or bigger than the staging, alone."""
    out: List[_Window] = []
    run: List[_Slot] = []
    prev: Optional[_Slot] = None

    def close():
        if run:
            out.append(_Window(run[0].buffer, list(run), False))
            run.clear()

    for s in chosen:
        b = buffers[s.buffer]
        size = b.itemsize
        stage_elems = STAGE_BYTES // size
        if s.length * size >= DIRECT_BYTES or s.length > stage_elems:
            close()
            out.append(_Window(s.buffer, [s], True))
            prev = s
            continue
        consecutive = (prev is not None and run and prev is run[-1]
                       and s.buffer == prev.buffer and s.index == prev.index + 1)
        if not consecutive or s.offset + s.length - run[0].offset > stage_elems:
            close()
        run.append(s)
        prev = s
    close()
    return out


def _staging(b: _Buffers, hook: bool) -> Tensor:
    name = "hook_stage" if hook else "stage"
    t = getattr(b, name)
    if t is None:
        n = min(b.numel, STAGE_BYTES // b.itemsize)
        t = torch.empty(n, dtype=b.dtype, device=b.device)
        setattr(b, name, t)
    return t


def _to_host(b: _Buffers, host: Tensor, w: _Window, srcs: List[Tensor], hook: bool,
             fp: Optional[Tensor] = None) -> None:
    """Device tensors `srcs` (one per slot of `w`) into host elements [w.lo, w.hi) of `host`
    (b.params or b.grads). `fp` (the hook's copies): the window's fingerprint goes there,
    computed on the device from what is copied (`_fingerprint_window`)."""
    nb = _is_cuda(b.device)
    if fp is not None:  # (packed: flattens into the hook's staging, which is copied below)
        _fingerprint_window(b, w, srcs, fp)
    if w.direct:
        s = w.slots[0]
        host[s.offset:s.offset + s.length].view(srcs[0].shape).copy_(srcs[0], non_blocking=nb)
        return
    stage = _staging(b, hook)
    if fp is None:
        kernels.flatten.flatten_into(srcs, stage, w.rel)
    host[w.lo:w.hi].copy_(stage[:w.hi - w.lo], non_blocking=nb)


# ------------------------------------------------------------------------------ fingerprints
#
# The hook sends a bucket's owned grads to the host as soon as its reduce-scatter is done;
# the step uses those copies only if the grads still hold what was copied. Version counters
# say so for writes through autograd's view of a grad, but not for writes through `.data`
# (`p.grad.data.mul_(s)`, as fairseq's multiply_grads; a clip or a zero_ through `.data`),
# which move no counter. So each window the hook copies gets a fingerprint, computed on the
# device from the very bytes copied; the step computes it again from the current grads, the
# same way, on the device, and copies the windows whose fingerprints differ again.
#
# The fingerprint of n bytes (padded with zeros to a multiple of 8) is two integers: the sum
# of its 64-bit words (modulo 2^64) and the sum of the squares of its 16-bit words (each
# below 2^30; the sum is below 2^63 for fewer than 2^33 words, so it does not wrap). Integer
# sums are exact: the same bytes give the same two numbers whatever order a kernel sums them
# in, whatever the memory layout, thread count or device, so a window nobody changed is
# never copied twice. The first sum sees any change of a single element and almost any
# change of many; the second, nonlinear, sees what keeps the first (a sign flip of as many
# positive as negative elements moves the first by a multiple of 2^64). What keeps both is a
# permutation of the window's elements (two grads' values swapped), or a collision as
# unlikely as a 64-bit hash's: docs/design.md section 12.


def _scratch(b: _Buffers) -> Tensor:
    if b.fp_scratch is None:
        stage = _staging(b, True)
        b.fp_scratch = torch.empty(stage.numel() * b.itemsize // 2, dtype=torch.int32,
                                   device=b.device)
    return b.fp_scratch


def _fingerprint(region: Tensor, scratch: Tensor, out: Tensor, add: bool) -> None:
    """out (int64 [2]) = (sum of `region`'s 64-bit words mod 2^64, sum of the squares of its
    16-bit words); `add`: added to what out holds (a tensor in several chunks). `region`: a
    contiguous 1-D start of a staging buffer, its size a multiple of 8 bytes. Four kernels,
    on the current stream, reading the region twice and the scratch three times."""
    words = region.view(torch.int16)
    sq = scratch[:words.numel()]
    sq.copy_(words)
    sq.mul_(sq)
    if add:
        out[0] += region.view(torch.int64).sum()
        out[1] += sq.sum(dtype=torch.int64)
    else:
        torch.sum(region.view(torch.int64), 0, out=out[0])
        torch.sum(sq, 0, dtype=torch.int64, out=out[1])


def _fingerprint_window(b: _Buffers, w: _Window, srcs: List[Tensor], out: Tensor) -> None:
    """The fingerprint of window `w` of the tensors `srcs` into `out`: a packed window as
    laid out in the hook's staging (flattened there, its gaps and tail zeroed: it stays
    there for the hook's copy), a direct one through the staging in chunks. On the current
    stream (the hook's side stream, at the hook and at the step's check alike)."""
    stage = _staging(b, True)
    scratch = _scratch(b)
    q = max(1, 8 // b.itemsize)  # (elements of 8 bytes)
    if not w.direct:
        n = w.hi - w.lo
        m = -(-n // q) * q  # (within the staging: its size is a multiple of 16 bytes)
        if not w.tight:
            stage[:m].zero_()
        elif m > n:
            stage[n:m].zero_()
        kernels.flatten.flatten_into(srcs, stage, w.rel)
        _fingerprint(stage[:m], scratch, out, False)
        return
    src = srcs[0]
    flat = src.view(-1) if src.is_contiguous() else src.contiguous().view(-1)
    # (read where it lies when it starts on 8 bytes: its words are then those it has in the
    # staging; else, and its last few elements, through the staging)
    aligned = flat.data_ptr() % 8 == 0
    step = stage.numel()
    for k, lo in enumerate(range(0, flat.numel(), step)):
        n = min(step, flat.numel() - lo)
        m = -(-n // q) * q
        if aligned and m == n:
            region = flat[lo:lo + n]
        else:
            stage[:n].copy_(flat[lo:lo + n])
            if m > n:
                stage[n:m].zero_()
            region = stage[:m]
        _fingerprint(region, scratch, out, k > 0)


def _to_device(b: _Buffers, w: _Window, dsts: List[Tensor]) -> None:
    """Host params [w.lo, w.hi) into the device tensors `dsts` (one per slot of `w`)."""
    nb = _is_cuda(b.device)
    if w.direct:
        s = w.slots[0]
        dsts[0].copy_(b.params[s.offset:s.offset + s.length].view(dsts[0].shape),
                      non_blocking=nb)
        return
    stage = _staging(b, False)
    stage[:w.hi - w.lo].copy_(b.params[w.lo:w.hi], non_blocking=nb)
    kernels.flatten.unflatten_from(stage, dsts, w.rel)


# ------------------------------------------------------------------------------ the shard


class HostShard:
    """The host part of one ZeroRedundancyOptimizer's local share (see the module
    docstring). Built once; `place` follows every layout change."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        # (param_id, start, length) -> host key: kept across layout changes, so the state
        # under it stays; and which pieces were placed where (a piece never moves)
        self.keys: Dict[Tuple[int, int, int], Tensor] = {}
        self.on_host: Dict[Tuple[int, int, int], bool] = {}
        self.slots: List[_Slot] = []
        self.buffers: List[_Buffers] = []
        self.plan = None
        self._by_param: Dict[int, List[_Slot]] = {}
        self._views: Optional[List[Tensor]] = None   # device param views, per slot
        self._param_windows: List[_Window] = []
        self._grad_windows: Dict[tuple, List[_Window]] = {}
        self._early: set = set()  # slots whose grads the hook sent in this backward
        self._early_error: Optional[BaseException] = None
        # the windows the hook sent (each with its fingerprint, in the row of its first
        # slot of `_fingerprints`), and the step's check of them until `wait` reads it
        self._hook_windows: List[_Window] = []
        self._fingerprints: Dict[torch.device, Tuple[Tensor, Tensor, Tensor]] = {}
        self._checking: Optional[tuple] = None
        self._events: list = []  # CUDA events the host waits for before it steps
        self._streams: Dict[torch.device, Any] = {}
        # the hook's copies run in the collectives' callbacks, which complete on the
        # backend's threads (gloo: one per lane): one bucket's copies at a time
        self._hook_lock = threading.Lock()
        self._packed: Optional[list] = None  # (dict, name, tensor) as packed last time
        self._state_buffers: Dict[tuple, Tensor] = {}
        self._state_views: Dict[tuple, List[Tensor]] = {}  # per buffer: a view per slot
        # state made or loaded by others than the fused engine (which allocates packed:
        # alloc_state) may be out of the packed buffers: pack_state at the next step
        self.state_unpacked = True
        self._slot_of: Dict[int, _Slot] = {}
        self.copy_seconds = 0.0
        # pieces whose grads went to the host: from the hook's buckets, or at the step
        self.pulled_early = 0
        self.pulled_at_step = 0
        # of pulled_early: pieces sent again at the step, their window changed since the
        # hook's copy (an edit through `.data`: no version counter moved)
        self.sent_again = 0
        # every host piece had its grad at the last pull (the fused step may then read them
        # all from the grads buffers: local_step.share_layout)
        self.all_grads = False
        # the local optimizer's state generation when it was last packed (tracked_state)
        self.packed_generation = -1

    # ------------------------------------------------------------------ placement

    def reset(self) -> None:
        """A fresh partition (no state exists anywhere yet): every piece placed anew."""
        self.keys.clear()
        self.on_host.clear()
        self._state_buffers.clear()
        self._state_views.clear()
        self._packed = None

    @property
    def numel(self) -> int:
        """Elements of this rank's share stepped on the host."""
        return sum(s.length for s in self.slots)

    def place(self, plan) -> None:
        """After `plan.bind_local()`: give the host pieces their host keys (the local
        optimizer's params, under which their state lives). A piece keeps its place from
        one layout change to the next; new pieces go to the host until the host part
        reaches `fraction` of the share (whole pieces, in plan order)."""
        self.plan = plan
        local = plan.local
        total = sum(lp.length for lp in local)
        target = self.fraction * total
        host_now = sum(lp.length for lp in local
                       if self.on_host.get((lp.param_id, lp.start, lp.length)))
        for lp in local:
            k = (lp.param_id, lp.start, lp.length)
            if k not in self.on_host:
                take = self.fraction >= 1.0 or (
                    self.fraction > 0.0 and abs(host_now + lp.length - target)
                    <= abs(host_now - target))
                self.on_host[k] = take
                host_now += lp.length if take else 0
        live = {(lp.param_id, lp.start, lp.length) for lp in local}
        for k in [k for k in self.on_host if k not in live]:
            del self.on_host[k]
            self.keys.pop(k, None)
        # host memory: one flat buffer per (device, dtype), the pieces in plan order
        groups: Dict[tuple, list] = {}
        for lp in local:
            if self.on_host[(lp.param_id, lp.start, lp.length)]:
                p = plan.params[lp.param_id]
                groups.setdefault((p.device, p.dtype), []).append(lp)
        self.buffers, self.slots, self._by_param, self._slot_of = [], [], {}, {}
        for (dev, dtype), lps in groups.items():
            align = kernels.flatten.alignment_elems(dtype)
            offsets, n = kernels.aligned_offsets([lp.length for lp in lps], align)
            pin = _is_cuda(dev)
            b = _Buffers(dev, dtype, torch.empty((), dtype=dtype).element_size(), n,
                         torch.empty(n, dtype=dtype, pin_memory=pin),
                         torch.empty(n, dtype=dtype, pin_memory=pin))
            b.grad_source = b.params.detach()
            b.grad_source.grad = b.grads
            bi = len(self.buffers)
            self.buffers.append(b)
            for lp, off in zip(lps, offsets):
                k = (lp.param_id, lp.start, lp.length)
                p = plan.params[lp.param_id]
                shape = p.shape if lp.length == p.numel() and plan.sharding == "param" \
                    else torch.Size([lp.length])
                view = b.params[off:off + lp.length].view(shape)
                key = self.keys.get(k)
                if key is None or key.shape != shape:
                    key = self.keys[k] = view
                else:
                    key.data = view  # (the same object: its state stays under it)
                key.grad = None
                slot = _Slot(len(self.slots), lp.param_id, lp.start, lp.length, bi, off, key,
                             b.grads[off:off + lp.length].view(shape), len(b.slots))
                self._slot_of[id(key)] = slot
                b.slots.append(slot)
                self.slots.append(slot)
                self._by_param.setdefault(lp.param_id, []).append(slot)
                lp.key, lp.host = key, True
        self._views = None
        self._slot_grads = [s.grad for s in self.slots]  # (what each key's .grad should be)
        self._slot_params = [plan.params[s.param_id] for s in self.slots]
        # how a slot's grad is read: 0 the grad itself, 1 a 1-D view of it, 2 a slice
        self._grad_how = [0 if s.length == p.numel() and s.key.shape == p.shape
                          else 1 if s.length == p.numel() and p.is_contiguous() else 2
                          for s, p in zip(self.slots, self._slot_params)]
        self._early = set()  # (slot indices of the old layout)
        self._hook_windows, self._checking = [], None
        self._fingerprints = {}  # (one row per slot of this layout)
        self._param_windows = _windows(self.buffers, self.slots)
        self._grad_windows = {}
        self._packed = None  # the host keys moved: pack the state again into new buffers
        self._state_buffers.clear()
        self._state_views.clear()
        self.state_unpacked = True

    def slot_of(self, key: Tensor) -> _Slot:
        """The slot of a host key."""
        return self._slot_of[id(key)]

    def grad_source(self, buffer: int) -> Tensor:
        """A tensor whose ``.grad`` is the grads buffer `buffer` (all its pieces' grads)."""
        return self.buffers[buffer].grad_source

    def invalidate_views(self) -> None:
        """The params' memory moved (``p.data = t``, new bucket views): views of it taken
        earlier are stale."""
        self._views = None

    def _param_views(self) -> List[Tensor]:
        if self._views is None:
            params = self.plan.params
            self._views = [_param_view(params[s.param_id], s.start, s.length).view(s.key.shape)
                           for s in self.slots]
        return self._views

    # ------------------------------------------------------------------ copies

    def _stream(self, dev: torch.device):
        st = self._streams.get(dev)
        if st is None:
            st = self._streams[dev] = torch.cuda.Stream(device=dev)
        return st

    def _side(self, dev: torch.device, after_current: bool = True):
        """Where the hook's copies, their check and the re-sends run: on a GPU the side
        stream (made to wait for the current stream's work so far, unless `after_current`
        is False), on the CPU in place. `_record_side_event` marks its end."""
        if not _is_cuda(dev):
            return _NO_STREAM
        side = self._stream(dev)
        if after_current:
            side.wait_stream(torch.cuda.current_stream(dev))
        return torch.cuda.stream(side)

    def _record_side_event(self, dev: torch.device) -> None:
        self._record_event(dev, self._streams.get(dev))

    def _record_event(self, dev: torch.device, stream=None) -> None:
        if _is_cuda(dev):
            ev = torch.cuda.Event()
            ev.record(stream)
            self._events.append(ev)

    def pull(self, early_valid: set) -> None:
        """Device to host: every host piece's param values, and the grads of those that
        have one (from `pull_bucket`'s copies for the params in `early_valid`: the hook
        sent them as they became final and nothing changed them since). Sets each host
        key's ``.grad`` (None where the param has none, so the step skips it). On a GPU
        the copies are queued on the current stream: `wait` before reading them."""
        t0 = time.perf_counter()
        early = {i for i in self._early if self.slots[i].param_id in early_valid} \
            if early_valid else set()
        if self._early_error is not None:
            error, self._early_error = self._early_error, None
            if early_valid:
                raise error
        grads = list(map(_GRAD, self._slot_params))
        if early:  # (queued first: on a GPU it runs on the side stream during the copies)
            early = self._check_early(early, grads)
        views = self._param_views()
        for w in self._param_windows:
            b = self.buffers[w.buf]
            _to_host(b, b.params, w, [views[s.index] for s in w.slots], hook=False)
        # (a key's grad dropped from outside, opt.optim.zero_grad(): attached again)
        attached = all(map(operator.is_, (s.key.grad for s in self.slots), self._slot_grads))
        missing = any(map(operator.is_, grads, itertools.repeat(None)))
        self.all_grads = not missing
        if early or missing or not attached:
            self._attach(grads)
            chosen = [s for s, g in zip(self.slots, grads)
                      if g is not None and s.index not in early]
            key = tuple(s.index for s in chosen)
            self.pulled_early += sum(1 for s, g in zip(self.slots, grads)
                                     if g is not None and s.index in early)
        else:  # (the usual step: every piece has its grad, none came early)
            chosen, key = self.slots, None
        srcs = self._grad_srcs(chosen, grads)
        self.pulled_at_step += len(chosen)
        windows = self._grad_windows.get(key)
        if windows is None:
            if len(self._grad_windows) > 8:
                self._grad_windows.clear()
            windows = self._grad_windows[key] = _windows(self.buffers, chosen)
        try:
            for w in windows:
                b = self.buffers[w.buf]
                _to_host(b, b.grads, w, [srcs[s.index] for s in w.slots], hook=False)
        except RuntimeError:
            if any(g.is_sparse for g in grads if g is not None):
                raise RuntimeError(f"{OPTION}: a param of the host part has a sparse grad "
                                   "(not supported)") from None
            raise
        for dev in {b.device for b in self.buffers}:
            self._record_event(dev)
        self.copy_seconds += time.perf_counter() - t0

    def _grad_srcs(self, slots: Sequence[_Slot], grads: list) -> Dict[int, Tensor]:
        """slot index -> the device elements of its grad, the key's shape."""
        return {s.index: (g if how == 0 else g.reshape(s.key.shape) if how == 1
                          else _grad_view(g, s.start, s.length, s.key.shape))
                for s, g, how in ((s, grads[s.index], self._grad_how[s.index])
                                  for s in slots)}

    def _fingerprint_rows(self, dev: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
        """(the hook's fingerprints, the step's, whether they differ: on the host) of the
        windows on `dev`, one row per slot (a window's: its first slot's)."""
        rows = self._fingerprints.get(dev)
        if rows is None:
            n = len(self.slots)
            rows = self._fingerprints[dev] = (
                torch.zeros(n, 2, dtype=torch.int64, device=dev),
                torch.zeros(n, 2, dtype=torch.int64, device=dev),
                torch.zeros(n, dtype=torch.bool, pin_memory=_is_cuda(dev)))
        return rows

    def _check_early(self, early: set, grads: list) -> set:
        """(pull) Whether the grads the hook sent still hold what it sent: each window it
        sent is fingerprinted again from the current grads, on the device (GPU: on the
        side stream, while the step's copies go on), and compared there with the hook's
        fingerprint; `wait` reads the verdicts and sends the changed windows again. Returns
        `early` less the pieces of windows not all of whose pieces are still early (sent
        again by the pull with the others)."""
        windows, self._hook_windows = self._hook_windows, []
        checked, partial = [], set()
        for w in windows:
            if all(s.index in early for s in w.slots):
                checked.append(w)
            else:
                partial.update(s.index for s in w.slots)
        early = early - partial
        if not checked:
            return early
        srcs = self._grad_srcs([s for w in checked for s in w.slots], grads)
        flags = {}
        for dev in {self.buffers[w.buf].device for w in checked}:
            hook_fp, step_fp, host_flags = self._fingerprint_rows(dev)
            cuda = _is_cuda(dev)
            with self._side(dev):
                for w in checked:
                    b = self.buffers[w.buf]
                    if b.device == dev:
                        _fingerprint_window(b, w, [srcs[s.index] for s in w.slots],
                                            step_fp[w.slots[0].index])
                differ = torch.ne(hook_fp, step_fp).any(1)
                if cuda:
                    host_flags.copy_(differ, non_blocking=True)
                    self._record_side_event(dev)
                flags[dev] = host_flags if cuda else differ
        self._checking = (checked, srcs, flags)
        return early

    def wait(self) -> None:
        """The host waits for the copies queued so far (GPU: their events); after a pull
        that checked the hook's copies, sends the changed ones again and waits for them."""
        events, self._events = self._events, []
        for ev in events:
            ev.synchronize()
        if self._checking is not None:
            self._send_changed()

    def _send_changed(self) -> None:
        """(the first `wait` after a pull that checked the hook's copies) The windows whose
        fingerprints differ are sent again (GPU: on the side stream, through the hook's
        staging), and the host waits for them."""
        t0 = time.perf_counter()
        checked, srcs, flags = self._checking
        self._checking = None
        verdicts = {dev: f.tolist() for dev, f in flags.items()}
        changed = [w for w in checked
                   if verdicts[self.buffers[w.buf].device][w.slots[0].index]]
        if not changed:
            return
        for dev in {self.buffers[w.buf].device for w in changed}:
            with self._side(dev, after_current=False):
                for w in changed:
                    b = self.buffers[w.buf]
                    if b.device == dev:
                        _to_host(b, b.grads, w, [srcs[s.index] for s in w.slots], hook=True)
                self._record_side_event(dev)
        n = sum(len(w.slots) for w in changed)
        self.sent_again += n
        self.pulled_early -= n
        self.pulled_at_step += n
        events, self._events = self._events, []
        for ev in events:
            ev.synchronize()
        self.copy_seconds += time.perf_counter() - t0

    def push(self) -> None:
        """Host to device: the updated host pieces into the params' memory (through .data:
        the params' version counters do not move), before the exchange reads them."""
        t0 = time.perf_counter()
        views = self._param_views()
        for w in self._param_windows:
            _to_device(self.buffers[w.buf], w, [views[s.index] for s in w.slots])
        self.copy_seconds += time.perf_counter() - t0

    def end_step(self) -> None:
        """Whatever the step did (stepped, skipped on an inf, failed): the grads the hook
        sent belong to the backward before it."""
        self._early = set()
        self._early_error = None
        self._hook_windows, self._checking = [], None
        self.all_grads = False  # (the next step's pull finds them again)

    def _attach(self, grads: list) -> None:
        """Each host key's ``.grad``: its slot of the grads buffer where the param has a
        grad, else None (the step skips it)."""
        for s, g in zip(self.slots, grads):
            if g is None:
                if s.key.grad is not None:
                    s.key.grad = None
            elif s.key.grad is not s.grad:
                s.key.grad = s.grad

    def detach_grads(self) -> None:
        """The host keys' grads dropped (the step's pull sets them again)."""
        for s in self.slots:
            s.key.grad = None

    # ------------------------------------------------------------------ the hook's copies

    def pull_bucket(self, param_ids: Sequence[int], grads: Sequence[Tensor],
                    fut: torch.futures.Future) -> torch.futures.Future:
        """reduce_scatter_hook's bucket of `param_ids` (grads: views of DDP's bucket
        buffer, one per param) will hold this rank's final owned grads once `fut`
        completes: the future DDP gets instead completes once the copies of the host
        pieces among them are queued (on a GPU, on a side stream: the backward goes on)."""
        mine = [(s, grads[j]) for j, pid in enumerate(param_ids)
                for s in self._by_param.get(pid, ())
                if grads[j].dtype == self.buffers[s.buffer].dtype
                and grads[j].numel() == self.plan.params[pid].numel()]
        if not mine:
            return fut

        def copy(f):
            value = f.value()  # (raises the collective's error: DDP reports it)
            with self._hook_lock:
                try:
                    self._copy_bucket(mine)
                except Exception as exc:  # noqa: BLE001 - raised on every rank by the step
                    self._early_error = exc
            return value

        return fut.then(copy)

    def _copy_bucket(self, mine: list) -> None:
        mine.sort(key=lambda sg: sg[0].index)
        slots = [s for s, _ in mine]
        srcs = {s.index: _grad_view(g, s.start, s.length, s.key.shape) for s, g in mine}
        dev = self.buffers[slots[0].buffer].device
        hook_fp = self._fingerprint_rows(dev)[0]
        windows = _windows(self.buffers, slots)
        with self._side(dev):
            for w in windows:
                b = self.buffers[w.buf]
                _to_host(b, b.grads, w, [srcs[s.index] for s in w.slots], hook=True,
                         fp=hook_fp[w.slots[0].index])
            self._record_side_event(dev)
        self._hook_windows.extend(windows)
        self._early.update(s.index for s in slots)

    # ------------------------------------------------------------------ packed state

    def alloc_state(self, key: Tensor, name: str, dtype: torch.dtype) -> Optional[Tensor]:
        """(the fused engine's state_alloc) A host key's new state tensor `name`: a zeroed
        view of its slot in the packed buffer of (name, dtype); None for other keys."""
        s = self._slot_of.get(id(key))
        if s is None or s.key is not key:
            return None
        return self._state_view(s, name, dtype, key.shape).zero_()

    def pack_state(self, state: Dict[Tensor, dict]) -> bool:
        """Each host piece's per-element state tensors as views into one flat host buffer
        per (name, dtype), laid out like the host keys: the host step then streams a few
        contiguous arrays. Cheap when nothing changed (one identity check per entry, in C);
        True when something was packed (the step's cached views are then stale)."""
        current = []
        for s in self.slots:
            st = state.get(s.key)
            if not st:
                continue
            for name in _STATE_NAMES:
                t = st.get(name)
                if isinstance(t, Tensor) and t.numel() == s.length and t.device.type == "cpu" \
                        and t.dim() > 0:
                    current.append((st, name, t, s))
        self.state_unpacked = False
        packed = self._packed
        if packed is not None and len(packed) == len(current) and all(
                map(operator.is_, (c[2] for c in current), (p[2] for p in packed))):
            return False
        changed = False
        out = []
        for st, name, t, s in current:
            view = self._state_view(s, name, t.dtype, t.shape)
            if view.data_ptr() != t.data_ptr() or view.stride() != t.stride():
                view.copy_(t)
                st[name] = view
                changed = True
            out.append((st, name, st[name], s))
        self._packed = out
        return changed

    def _state_view(self, s: _Slot, name: str, dtype: torch.dtype, shape) -> Tensor:
        """Slot `s`'s view of the packed buffer of (name, dtype), of `shape`. The views of
        one buffer are made together, by one split: their tensor headers then lie side by
        side in memory, and the fused step's check of every state tensor's storage (at each
        step: the compiled plan's ready()) reads them as a stream (measured at 40000
        headers, caches cold: 0.4 ms, against 0.95 ms for headers made one by one)."""
        k = (s.buffer, name, dtype)
        views = self._state_views.get(k)
        if views is None:
            buf = self._state_buffer(s, name, dtype)
            sizes, parts_of, pos = [], [], 0
            for slot in self.buffers[s.buffer].slots:
                if slot.offset > pos:  # (an alignment gap)
                    sizes.append(slot.offset - pos)
                parts_of.append(len(sizes))
                sizes.append(slot.length)
                pos = slot.offset + slot.length
            if buf.numel() > pos:
                sizes.append(buf.numel() - pos)
            with torch.no_grad():
                parts = buf.split_with_sizes(sizes)
            views = self._state_views[k] = [parts[i] for i in parts_of]
        view = views[s.pos]
        buf = self._state_buffers[k]
        if view.data_ptr() != buf.data_ptr() + s.offset * buf.element_size() \
                or not view.is_contiguous():  # (its memory replaced since: `.data = t`)
            view = views[s.pos] = buf[s.offset:s.offset + s.length]
        if view.shape != shape:
            view = views[s.pos] = view.view(shape)
        return view

    def _state_buffer(self, s: _Slot, name: str, dtype: torch.dtype) -> Tensor:
        k = (s.buffer, name, dtype)
        buf = self._state_buffers.get(k)
        if buf is None:
            buf = self._state_buffers[k] = torch.empty(self.buffers[s.buffer].numel,
                                                       dtype=dtype)
        return buf

    # ------------------------------------------------------------------ accounting

    def device_bytes(self) -> int:
        """Device memory this holds itself: the staging buffers."""
        return sum(t.numel() * t.element_size() for b in self.buffers
                   for t in (b.stage, b.hook_stage, b.fp_scratch)
                   if t is not None and _is_cuda(t.device)) \
            + sum(t.numel() * t.element_size() for rows in self._fingerprints.values()
                  for t in rows[:2] if _is_cuda(t.device))
