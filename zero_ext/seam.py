"""The optimizer's side of the DDP comm hooks that work with it (`reduce_scatter_hook`, the
hooks of `zero_ext.ddp_zero_hook`): the one seam they reach a ZeroRedundancyOptimizer by.

Every optimizer has one, `opt.hook_seam` (a `HookSeam`). A hook reads through it what it
needs of the optimizer (its params in order, who owns which elements, the exchange's
process groups, whether a Join is active) and asks through it what it needs done (agree on
an error before the next step, refresh moved memory, end a step it ran itself with the
optimizer's own agreement and exchange). The optimizer imports no hook: a hook module
registers its check of the grads at the start of every step here (`register_step_check`),
and keeps its state per optimizer itself (as torch's PowerSGD hook keeps its own).

Also here, the rules of the constructor flag ``overlap_with_ddp`` that the optimizer
applies itself (what construction accepts, what ``step()`` and ``clip_grad_norm_`` do).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import groups as groups_mod
from . import layout
from .agree import agree, call_and_agree

if TYPE_CHECKING:
    from .zero import ZeroRedundancyOptimizer

logger = logging.getLogger("zero_ext")

OVERLAP_FLAG = "overlap_with_ddp=True"

# every ZeroRedundancyOptimizer alive, by construction order (the same on every rank)
_LIVE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_built = itertools.count()

# check(opt, closure, scaler) -> (agree first?, error or None, closure): run by every step
_STEP_CHECKS: list = []


def register_step_check(check) -> None:
    """Run `check` at the start of every ZeroRedundancyOptimizer step, where the step itself
    reads the grads: after the Optimizer step pre-hooks (a pre-hook that clips or rescales
    the grads is seen), before anything is stepped. It returns whether the step must agree
    across ranks before stepping, an error to raise on every rank then, and the closure to
    run in place of the step's (it may wrap it). Not an Optimizer pre-hook: those run first,
    before the user's own, and a verdict they leave survives a step that never starts."""
    if check not in _STEP_CHECKS:
        _STEP_CHECKS.append(check)


def newest_holding(param: torch.Tensor):
    """The most recently built optimizer alive whose params include `param`, or None: an
    optimizer built again over the same params (a new run in one process) replaces one
    still referenced."""
    for _, opt in sorted(_LIVE.items(), key=lambda kv: -kv[0]):
        if id(param) in opt.hook_seam.param_index():
            return opt
    return None


class Ownership(NamedTuple):
    """Who owns which elements of each param, for one state of the partition."""

    token: object  # a fresh object whenever the map changes: compare with `is`
    runs: dict     # param_id -> [(rank, start, length)]


class HookSeam:
    """What a DDP comm hook may read of one ZeroRedundancyOptimizer and ask of it."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self._zero = weakref.ref(zero)  # (the optimizer holds its seam)
        self._index: tuple | None = None
        self._ownership: tuple | None = None
        self._step_warned = False
        # (offload_optimizer) param ids whose grads are as reduce_scatter_hook left them,
        # set by the hook's check at each step (its copies to the host hold for those)
        self.unchanged: set = set()
        _LIVE[next(_built)] = zero

    @property
    def optimizer(self) -> "ZeroRedundancyOptimizer":
        return self._zero()

    # -------------------------------------------------------------- what a hook reads
    @property
    def params(self) -> list[torch.Tensor]:
        """Every param, in group order (param ids index this list); grows with
        add_param_group."""
        return self._zero()._all_params

    def param_index(self) -> dict[int, int]:
        """id(param) -> its index in `params` (kept while no group is added)."""
        params = self.params
        if self._index is None or self._index[0] != len(params):
            self._index = (len(params), {id(p): i for i, p in enumerate(params)})
        return self._index[1]

    def ownership(self) -> Ownership:
        """The partition as element runs per param (any sharding mode); its token changes
        whenever the partition does (a new plan, buckets rebuilt or added)."""
        plan = self._zero().plan
        cached = self._ownership
        if (cached is None or cached[1] is not plan or cached[2] is not plan.buckets
                or cached[3] != len(plan.buckets)):
            runs: dict[int, list] = {}
            for b in plan.buckets:
                for r in range(plan.world_size):
                    for pc in b.pieces(r):
                        runs.setdefault(pc.param_id, []).append((r, pc.start, pc.length))
            if plan.sharding == layout.PARAM:  # params outside the buckets: whole, by owner
                for pid, r in enumerate(plan.owner):
                    if pid not in runs:
                        runs[pid] = [(r, 0, plan.params[pid].numel())]
            cached = self._ownership = (Ownership(object(), runs), plan, plan.buckets,
                                        len(plan.buckets))
        return cached[0]

    @property
    def lanes(self) -> list:
        """The exchange's process groups over the optimizer's ranks: ops on different lanes
        travel at once on gloo (one op at a time per group)."""
        return self._zero()._replicas.ex.lanes

    @property
    def joined(self) -> bool:
        """A Join context (uneven inputs) is active for the optimizer."""
        return self._zero()._join_config.enable

    @property
    def wants_unchanged(self) -> bool:
        """Whether the step needs `unchanged` (offload_optimizer uses the hook's copies)."""
        return self._zero()._offload is not None

    def take_unchanged(self) -> set:
        """`unchanged` as the hook's check left it for this step, then reset."""
        out, self.unchanged = self.unchanged, set()
        return out

    @property
    def overlap_with_ddp(self) -> bool:
        return self._zero()._overlap_with_ddp

    # -------------------------------------------------------------- what a hook asks
    def check_step(self, closure, scaler: bool) -> tuple:
        """(the step's side) Every registered check on this step's grads: (agree first?, the
        first error, the closure to run)."""
        agree_first, error = False, None
        for check in _STEP_CHECKS:
            needed, err, closure = check(self._zero(), closure, scaler)
            agree_first = agree_first or needed
            error = error or err
        return agree_first, error, closure

    def refresh(self) -> bool:
        """Follow params whose memory was replaced (``p.data = t``); True when one was."""
        zero = self._zero()
        moved = zero._replicas.refresh()
        if moved:
            zero._memory_moved()
        return moved

    def fused_step_supported(self) -> bool:
        """Whether the step of this rank's share is the fused AdamW (the same on every rank)."""
        return self._zero()._fused_step_supported()

    def reset_fused_views(self) -> None:
        """State tensors may be new or replaced: the fused step's cached views are stale."""
        stepper = self._zero()._stepper
        if stepper is not None:
            stepper.reset()

    def exchange_grads(self, param_ids: set) -> None:
        """Collective: every owner's elements of the grads of `param_ids` (the same on
        every rank) reach every rank, in place, by the plan of the params' exchange."""
        zero = self._zero()
        params = zero._all_params

        def view_of(pid: int, start: int, length: int) -> torch.Tensor:
            g = params[pid].grad
            if start == 0 and length == g.numel() and not g.is_contiguous():
                return g  # (a strided grad of a whole param: exchanged whole)
            return g.view(-1)[start:start + length]

        zero._replicas.exchange_views(view_of, lambda pid: pid in param_ids)

    def bucket_reduced(self, param_ids: tuple, bucket, fut):
        """reduce_scatter_hook reduces a DDP bucket of these params; `fut` completes once
        this rank's owned sums are in the bucket. Returns the future to hand DDP: with
        offload_optimizer, one that completes once the host pieces' grads among them are
        on their way to the host (offload.HostShard.pull_bucket), else `fut` itself."""
        host = self._zero()._offload
        if host is None or not host.slots:
            return fut
        return host.pull_bucket(param_ids, bucket.gradients(), fut)

    def wait_for_params(self) -> None:
        """The last step's exchange, if left in flight (overlap_param_gather), completed:
        before a hook's collectives and before a step it runs itself."""
        self._zero().wait_for_params()

    def reduce_scatter_begins(self) -> None:
        """reduce_scatter_hook is in use: sharding="auto" may still choose "even" (before
        any state exists; see ZeroRedundancyOptimizer.hook_wants_even)."""
        self._zero().hook_wants_even()

    def state_changed(self) -> None:
        """A step is under way: an earlier consolidation is out of date."""
        self._zero()._state_changed()

    def finish_step(self, error: BaseException | None, what: str, trainable: tuple,
                    frozen_stepped: bool = False, buffers_sent: bool = False) -> None:
        """End a step whose local part ran (by the optimizer or by a hook): one agreement
        on `error` (raised on every rank), the trainable mask and the hyperparameters, then
        every owner's update reaches every rank and the hyperparameters go back to the
        user's groups."""
        zero = self._zero()
        hp = hyperparameter_digest(zero.optim.param_groups)
        mask = hash(trainable) & ((1 << 62) - 1)
        gather = zero._param_gather  # (overlap_param_gather: left in flight for the forward)
        if gather is not None and error is None:  # (unless the step agreed on it earlier)
            error = gather.write_error()
        # (one more lane for the exchange in flight if any rank's forward fell behind it)
        wider = int(gather is not None and gather.wants_more_lanes())
        frozen, top, bottom, hp_top, hp_bottom, wider = agree(
            zero.process_group, zero.world_size, error, what,
            (int(frozen_stepped), mask, -mask, hp, -hp, wider))
        check_same_mask(top, bottom, what)
        check_same_hyperparameters(hp_top, hp_bottom, what, stepped=True)
        if wider:
            gather.add_lane()
        if gather is not None:
            gather.agree_order()
        if gather is not None and gather.ready:
            out = zero._replicas.sync(exchange_frozen=bool(frozen), trainable=trainable,
                                      deferred=gather)
            if out is not None:
                gather.start(*out)
        else:
            zero._replicas.sync(exchange_frozen=bool(frozen), buffers_sent=buffers_sent,
                                trainable=trainable)
            if gather is not None:
                gather.begin_recording()  # the next forward's order of first use
        groups_mod.copy_hyperparameters(zero.optim.param_groups, zero.param_groups)

    # -------------------------------------------------------------- overlap_with_ddp rules
    def user_step(self, closure=None):
        """`step()` with overlap_with_ddp: the hook has stepped already, or steps inside
        the closure's backward (a framework that steps with a closure, as Lightning does,
        runs forward and backward in it: torch's ZeRO would skip it, and train nothing).
        Returns the closure's loss, else None (as torch)."""
        zero = self._zero()
        if getattr(zero, "found_inf", None) is not None or getattr(
                zero, "grad_scale", None) is not None:
            raise RuntimeError(
                f"a GradScaler cannot drive an optimizer built with {OVERLAP_FLAG}: the step "
                "ran inside backward on the still-scaled grads. Use zero_ext.ddp_zero_hook."
                "reduce_scatter_hook with opt.step() instead")
        if closure is not None:  # (the step runs in its backward, on every rank alike)
            return call_and_agree(closure, zero.process_group, zero.world_size,
                                  "ZeroRedundancyOptimizer.step", with_grad=True)
        if not self._step_warned:
            self._step_warned = True
            logger.warning("zero_ext: step() does nothing with %s: the DDP comm hook steps "
                           "inside backward (remove step() from the training loop)",
                           OVERLAP_FLAG)

    def refuse_clip(self) -> None:
        """clip_grad_norm_ with overlap_with_ddp: the step has read the unclipped grads."""
        if self.overlap_with_ddp:
            raise RuntimeError(
                f"clip_grad_norm_ has no place with {OVERLAP_FLAG}: the step runs inside "
                "backward, before any clip. Use zero_ext.ddp_zero_hook.reduce_scatter_hook with "
                "opt.clip_grad_norm_ and opt.step() instead")


def hyperparameter_digest(param_groups: list[dict]) -> int:
    """60 bits of a stable hash of every group's hyperparameters (what a step uses)."""
    text = repr([sorted((k, groups_mod.plain_value(v))
                         for k, v in groups_mod.hyperparameters(g).items())
                 for g in param_groups])
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def check_same_hyperparameters(top: int, bottom: int, what: str, stepped: bool) -> None:
    """`top`/`bottom`: max over ranks of h and of -h, h = hyperparameter_digest. `stepped`:
    the local step has run already (without a GradScaler or a hook, the step's one
    agreement comes after it)."""
    if top != -bottom:
        raise RuntimeError(
            f"{what}: ranks {'stepped' if stepped else 'were to step'} with different "
            "hyperparameters (lr, betas, weight_decay, ...) in some param group; a scheduler "
            "or a manual change must act alike on every rank"
            + (" (each rank has updated its own share with its own values: load the last "
               "checkpoint)" if stepped else "; nothing was stepped"))


def check_same_mask(top: int, bottom: int, what: str) -> None:
    """`top`/`bottom`: max over ranks of h and of -h, h a hash of the trainable mask."""
    if top != -bottom:
        raise RuntimeError(
            f"{what}: ranks disagree on which params require grad; freeze and unfreeze "
            "params alike on every rank")


def overlap_supported(optimizer_class: type) -> bool:
    """The classes torch's overlap supports (those with a functional twin in
    torch.distributed.optim: SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop),
    plus zero_ext's FusedAdamW: each steps a param from that param's grad alone."""
    from torch.distributed.optim.utils import functional_optim_map

    from .fused_adamw import FusedAdamW

    return optimizer_class in functional_optim_map or (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedAdamW))


def check_overlap_options(optimizer_class: type, master_weights: bool,
                          overlap_with_ddp) -> None:
    """Construction (raised on every rank by the caller): what overlap_with_ddp=True needs."""
    if not overlap_with_ddp:
        return
    if not overlap_supported(optimizer_class):
        raise ValueError(
            f"{OVERLAP_FLAG} steps inside DDP's backward without a closure, per bucket; it "
            "supports SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop (as torch "
            "does) and zero_ext.FusedAdamW, not "
            f"{getattr(optimizer_class, '__name__', optimizer_class)}")
    if master_weights:
        raise ValueError(f"master_weights=True is not supported with {OVERLAP_FLAG}")
