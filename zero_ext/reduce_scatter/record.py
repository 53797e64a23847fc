"""What reduce_scatter_hook reduced since the last step, read back once DDP has written
the grads: the record the step's checks compare the grads with.

Each DDP model's backward (itself possibly nested backwards: reentrant activation
checkpointing runs one per block) reduces some of the optimizer's grads; at its last bucket
a record of them is queued to run after DDP's write-back. Records of several backwards
(several DDP models under one optimizer) are kept until the step, so that a grad changed
after its own model's backward is seen whatever ran after it.
"""
from __future__ import annotations

import functools
import weakref

import torch


class Record:
    """One optimizer's grads reduced since its last step, and how they were seen.

    Its costs are per bucket (what the hook reduced) and per step or record (one pass over
    the recorded grads); nothing runs per param in a normal training loop's backward: the
    grads of a backward that adds onto reduced grads are watched only when such grads
    exist as the next forward begins (`arm`)."""

    def __init__(self, seam):
        self.seam = seam
        self.accumulated = False  # a backward ran onto reduced grads
        # param ids of each bucket reduced since the last record; the same -> the seam's
        # Ownership it was cut by, since the last step
        self.pending: list[tuple] = []
        self.reduced_under: dict[tuple, object] = {}
        self._record_queued = False  # a record of `pending` runs after DDP's write-back
        # param_id -> (weakref to its grad, the grad's version) once DDP wrote it (weak: a
        # grad dropped by zero_grad is freed); params whose buckets were all-reduced have
        # none (their grads are whole: anything may read or change them)
        self.seen: dict[int, tuple] | None = None
        self.cuts: list[_Cut] = []  # the tags of the grads recorded since the last step
        # what changed grads had undergone when gather_grads made them whole (changes()):
        # a clip of partial grads before the gather is still an error at the step
        self.gathered_changes: dict = {}
        self._armed: list = []  # hooks on the incoming grads of untouched reduced grads
        self._next_forward = None  # a global forward pre-hook that arms, while one waits

    def reduced(self, param_ids: tuple, ownership) -> None:
        """The hook reduce-scatters these params' grads (one bucket's) under `ownership`."""
        self.pending.append(param_ids)
        self.reduced_under[param_ids] = ownership

    def after_bucket(self, bucket) -> None:
        """After the hook ran for `bucket` (here, on the autograd thread): at DDP's last
        bucket queue the record of the grads reduced since the last record, to run once
        DDP has written them back. DDP queues its write-back (finalize) right after the last
        bucket's hook, into the graph task running now (the innermost backward, under
        reentrant activation checkpointing); a callback queued from a callback that runs
        before it comes after it."""
        if not bucket.is_last() or not self.pending or self._record_queued:
            return
        engine = torch.autograd.Variable._execution_engine
        try:
            engine.queue_callback(lambda: engine.queue_callback(self._record))
            self._record_queued = True
        except RuntimeError:  # not inside a backward (DDP's join hook runs buckets itself)
            pass

    # ---------------------------------------------------------------- accumulation
    def arm(self) -> None:
        """(the first module forward after a record that no step consumed) A backward that
        adds onto a grad this hook reduced, untouched since (no step, no zero_grad between),
        would mix averaged and local grads in the next reduction: the elements a rank does
        not own hold its local grad. Such grads exist here only when a script runs another
        forward and backward without a step (in a normal loop the step consumes the record
        first, and this never runs): their incoming grads are watched until the step,
        which then raises."""
        self.disarm()
        if not self.seen:
            return
        params = self.seam.params
        me = weakref.ref(self)
        for i, (ref, version) in self.seen.items():
            g = params[i].grad
            if g is not None and g is ref() and g._version == version:
                self._armed.append(params[i].register_hook(
                    functools.partial(_incoming_grad, me, i)))

    def disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed = []
        self._drop_next_forward()

    def _drop_next_forward(self) -> None:
        if self._next_forward is not None:
            handle, gone = self._next_forward
            gone.detach()
            handle.remove()
            self._next_forward = None

    def _arm_on_next_forward(self) -> None:
        """(a record no step consumed yet) The next module forward, of any module (through
        a DDP model or not, a new DDP wrap, ``ddp.forward`` called directly), arms: a global
        forward pre-hook, removed by the step or once it fired. In a normal loop it is
        registered at the end of backward and removed by the step, never called. A record
        freed first (its optimizer dropped after a backward, a replacement built instead)
        takes the hook with it: left behind, a global hook would run on every forward of
        the process and keep torch.compile from compiling any module."""
        if self._next_forward is None:
            handle = torch.nn.modules.module.register_module_forward_pre_hook(
                functools.partial(_arm_on_forward, weakref.ref(self)))
            self._next_forward = (handle, weakref.finalize(self, handle.remove))

    # ---------------------------------------------------------------- the record
    @torch._disable_dynamo
    def _record(self) -> None:
        """Each grad reduced since the last record, as DDP wrote it: its identity, its
        version, and the tag naming this optimizer's plan. Kept with the records of the
        other backward passes before the step (several DDP models): a grad changed after
        its own model's backward is caught even when another backward came after."""
        self._record_queued = False
        if self.seam.optimizer is None:
            return
        params = self.seam.params
        pending, self.pending = self.pending, []
        if self.seen is None:
            self.seen = {}
        seen = self.seen
        cut = _Cut(self)
        self.cuts.append(cut)
        for ids in pending:
            for i in ids:
                g = params[i].grad
                if g is not None:
                    seen[i] = (weakref.ref(g), g._version)
                    g._zero_ext_cut = cut
        if seen:
            self._arm_on_next_forward()

    def start_step(self) -> None:
        """The step reads the grads: what the backward passes left is consumed."""
        self.seen, self.cuts, self.reduced_under, self.gathered_changes = None, [], {}, {}
        self.disarm()

    def forget(self, ids) -> None:
        """(gather_grads) These params' grads are whole again: nothing to check of them."""
        ids = set(ids)
        for i in ids:
            self.seen.pop(i, None)
        self.reduced_under = {tuple(i for i in pids if i not in ids): own
                              for pids, own in self.reduced_under.items()}

    def moved_ownership(self) -> list[int]:
        """Indices of reduced params whose owners changed since the reduction (a new
        partition between backward and step): their owners now hold unreduced grads."""
        if not self.reduced_under:
            return []
        now = self.seam.ownership()
        moved = set()
        for ids, then in self.reduced_under.items():
            if then.token is not now.token:  # (one test per bucket while nothing changed)
                moved.update(i for i in ids if sorted(then.runs.get(i, ()))
                             != sorted(now.runs.get(i, ())))
        return sorted(moved)

    def changes(self, ids=None) -> dict:
        """param_id -> "replaced", or (its version bumps since the hook, its grad's counter
        key, or None when it has none), for every recorded grad still held (of `ids`, when
        given)."""
        out = {}
        params = self.seam.params
        for i, s in (self.seen or {}).items():
            g = params[i].grad
            if g is None or (ids is not None and i not in ids):
                continue  # dropped (not stepped)
            if g is not s[0]():
                out[i] = "replaced"
            else:
                bumps = g._version - s[1]
                out[i] = (bumps, _counter_key(g) if bumps else None)
        return out

    def unchanged_grads(self, scaler: bool) -> set:
        """Indices of params whose grad is the one the hook reduced, with its values as the
        hook left them: the same tensor, its version unmoved, or moved only by GradScaler's
        one pass over every grad when `scaler` (its inf check leaves the values; whether it
        unscaled them in place is the step's to tell). Grads that gather_grads made whole
        are not among them (anything may have changed them since). offload_optimizer uses
        the copies the hook sent to the host of these only."""
        if self.seen is None:
            return set()
        allowed: dict = {}
        if scaler:
            for p in self.seam.params:
                if p.grad is not None and _scaler_bumps_versions(p.grad.device):
                    k = _counter_key(p.grad)
                    allowed[k] = allowed.get(k, 0) + 1
        return {i for i, c in self.changes().items()
                if c != "replaced" and (not c[0] or c[0] == allowed.get(c[1]))}

    def changed_grads(self, scaler: bool) -> list[int]:
        """Indices of params whose grad was replaced or written in place since the hook
        (GradScaler's one in-place pass over every grad allowed when `scaler`), also those
        changed before gather_grads made them whole."""
        if self.seen is None:
            return []
        for cut in self.cuts:
            cut.consume()
        # A grad's version counter is shared by every grad viewing one buffer (DDP's
        # gradient_as_bucket_view); GradScaler's pass (its inf check in step(), or
        # unscale_) bumps it once per such grad, where its kernel bumps versions at all.
        allowed: dict = {}
        if scaler:
            for p in self.seam.params:
                if p.grad is not None and _scaler_bumps_versions(p.grad.device):
                    k = _counter_key(p.grad)
                    allowed[k] = allowed.get(k, 0) + 1
        return [i for i, c in sorted({**self.gathered_changes, **self.changes()}.items())
                if c == "replaced" or (c[0] and c[0] != allowed.get(c[1]))]


class _Cut:
    """One backward's reduce-scatter, tagged onto every grad it wrote (`._zero_ext_cut`):
    whose plan decided which rank holds which averaged elements, and whether that
    optimizer's step has read them. On the grads, not in a registry, so that every rank
    sees the same tags whether or not the old optimizer is still alive."""

    __slots__ = ("record", "consumed", "__weakref__")
    # those not consumed yet, of any optimizer: a step looks at its grads' tags only when
    # one of another optimizer is among them (one test per step in a normal loop)
    unconsumed: "weakref.WeakSet" = weakref.WeakSet()

    def __init__(self, record):
        self.record = weakref.ref(record)
        self.consumed = False
        _Cut.unconsumed.add(self)

    def consume(self) -> None:
        self.consumed = True
        _Cut.unconsumed.discard(self)


@torch._disable_dynamo
def _arm_on_forward(record_ref, module, args) -> None:
    """The global forward pre-hook of Record._arm_on_next_forward: fires once."""
    r = record_ref()
    if r is None:
        return
    r._drop_next_forward()
    if r.seen:
        r.arm()


_SCALER_BUMPS: dict = {}


def _scaler_bumps_versions(device: torch.device) -> bool:
    """Whether GradScaler's in-place unscale kernel advances the version counters of the
    grads on `device` (it does not on CPU in torch 2.14): asked once per device type."""
    if device.type not in _SCALER_BUMPS:
        t = torch.zeros(1, device=device)
        v = t._version
        torch._amp_foreach_non_finite_check_and_unscale_(
            [t], torch.zeros(1, device=device), torch.ones(1, device=device))
        _SCALER_BUMPS[device.type] = t._version != v
    return _SCALER_BUMPS[device.type]


@torch._disable_dynamo
def _incoming_grad(record_ref, i: int, grad):
    """Tensor hook of param i (see Record.arm): runs before autograd adds `grad` to the
    param's .grad."""
    r = record_ref()
    s = None if r is None or r.seen is None else r.seen.get(i)
    if s is not None:
        g = None if r.seam.optimizer is None else r.seam.params[i].grad
        if g is not None and g is s[0]() and g._version == s[1]:
            r.accumulated = True
    return None


def _counter_key(g: torch.Tensor) -> tuple:
    base = g._base if g._base is not None else g
    return (base.device, base.untyped_storage().data_ptr())
