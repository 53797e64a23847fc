"""ZeroRedundancyOptimizer: ZeRO stage 1 (optimizer-state sharding), drop-in for torch's.

The path of a step: param_groups (groups.py) -> ownership and buckets (layout.py) ->
local step on this rank's share (optimizer_class, or the fused multi-group AdamW) ->
exchange of every rank's updated range (sync.py). Checkpoints in torch's format live in
state.py.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from . import groups as groups_mod
from . import kernels, layout, state
from .agree import agree, agree_on_inputs
from .local_step import FusedShardStep
from .sync import Exchanger, exchange_pieces, plan_messages

logger = logging.getLogger("zero_ext")

SHARDING_MODES = ("auto", "param", "flat")
# Optimizers whose update of an element depends only on that element (plus per-param
# scalars such as the step): only these may split a parameter between ranks.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                "Adadelta", "Rprop", "ASGD"}
AUTO_FLAT_THRESHOLD = 1.05  # max/mean whole-param load above which "auto" picks "flat"
OVERLAP_CHUNKS = 4  # local-step chunks whose exchange overlaps the next chunk's compute
OVERLAP_MIN_CHUNK_ELEMS = 1 << 21  # below ~8 MB a chunk's broadcast costs more than it hides


def is_elementwise(optimizer_class: type) -> bool:
    from .fused_adamw import FusedAdamW

    if isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedAdamW):
        return True
    return (getattr(optimizer_class, "__module__", "").startswith("torch.optim")
            and optimizer_class.__name__ in _ELEMENTWISE)


class _ZeroJoinHook(JoinHook):
    """A joined rank keeps stepping (on the grads DDP's own hook provides) so that its
    collectives match the ranks still training."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class _OverlappedSends:
    """gloo with bucket views: chunk k of every rank's range goes out as soon as this rank
    has computed its own chunk k, while chunk k+1 computes. `finish` sends whatever was not
    sent (after a local failure too: every rank must issue the same broadcasts)."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.regions = zero._chunk_regions()
        self.pipe = zero._exchanger.pipeline()
        self.sent = 0
        self.comm = 0.0  # seconds spent issuing/waiting for broadcasts

    def send(self, k: int) -> None:
        t = time.perf_counter()
        for j in range(self.sent, k + 1):
            self.pipe.send(self.regions[j])
        self.sent = k + 1
        self.comm += time.perf_counter() - t

    def finish(self) -> None:
        if self.sent < len(self.regions):
            self.send(len(self.regions) - 1)
        t = time.perf_counter()
        self.pipe.finish()
        self.comm += time.perf_counter() - t


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shard the state of ``optimizer_class`` over the ranks of ``process_group``.

    Same signature and behaviour as ``torch.distributed.optim.ZeroRedundancyOptimizer``,
    plus: param-group dicts validated on every rank (with a cross-rank check), mixed dtypes,
    a better-balanced partition, element-level sharding (``sharding="flat"``), a fused
    multi-group AdamW step, and consolidation that sends state only to the target rank.
    """

    def __init__(self, params, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 *, sharding: str = "auto", **defaults: Any):
        self._initialized = False
        if overlap_with_ddp:
            raise NotImplementedError(
                "zero_ext.ZeroRedundancyOptimizer does not implement overlap_with_ddp=True yet; "
                "use overlap_with_ddp=False (the step already overlaps its own communication)")
        if process_group is None and not dist.is_initialized():
            self.process_group, self.world_size, self.rank = None, 1, 0  # plain single process
        else:
            self.process_group = process_group if process_group is not None else dist.group.WORLD
            self.world_size = dist.get_world_size(self.process_group)
            self.rank = dist.get_rank(self.process_group)

        # Validate locally, then agree across ranks before anything else is collective.
        error, lines, groups = None, [], []
        try:
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
                raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass, got "
                                f"{optimizer_class!r}")
            if sharding not in SHARDING_MODES:
                raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}")
            if sharding == "flat" and not is_elementwise(optimizer_class):
                raise ValueError(
                    f"sharding='flat' splits parameters between ranks, which is exact only for "
                    f"elementwise optimizers; {optimizer_class.__name__} is not known to be one. "
                    "Use sharding='param'.")
            groups = groups_mod.normalize_param_groups(params)
            groups_mod.validate_hyperparameters(optimizer_class, groups, defaults)
            flat_params = [p for g in groups for p in g["params"]]
            if any(p.is_complex() for p in flat_params) and parameters_as_bucket_view:
                raise ValueError("parameters_as_bucket_view=True does not support complex "
                                 "parameters (the flat buffers are real)")
            aliases = layout.find_aliases(flat_params)
            if sharding == "flat":
                if any(not p.is_contiguous() for p in flat_params):
                    raise ValueError("sharding='flat' needs contiguous parameters")
                if aliases:
                    raise ValueError(
                        "sharding='flat' cannot split parameters that share memory (params "
                        f"{sorted(aliases)} alias earlier ones, as after `b.data = a.data`); "
                        "use sharding='param', or tie them as one Parameter")
            lines = groups_mod.describe(groups, {
                "optimizer_class": optimizer_class.__qualname__, "sharding": sharding,
                "parameters_as_bucket_view": bool(parameters_as_bucket_view),
                "defaults": sorted(defaults.items())})
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks know
            error = exc
        agree_on_inputs(self.process_group, self.world_size, error, lines,
                        "ZeroRedundancyOptimizer")

        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._overlap_with_ddp = False
        super().__init__(groups, defaults)  # fills defaults into the groups
        Joinable.__init__(self)
        # Every param in group order (torch's ZeRO has this attribute; code in the wild reads it).
        self._all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._exchanger = Exchanger(self.process_group, self.rank, self.world_size)
        self._consolidated: dict | None = None
        # seconds of the last step: local update, time waiting for the exchange, total
        self.last_step_timings: dict[str, float] = {}
        self._buffers: dict[int, torch.Tensor] = {}   # bucket index -> flat buffer (views on)
        self._messages: dict = {}  # piece-exchange plans by active set (no bucket views)
        self._expected_ptrs: list = []  # where every param's memory must be (see _refresh)
        self._stepper: FusedShardStep | None = None  # built at the first fused step
        self._fused_kernel_usable: bool | None = None
        self._regions: list | None = None  # the exchange's regions per chunk (overlapped sync)

        self.plan = self._new_plan(self._resolve_sharding(sharding))
        self.sharding = self.plan.sharding
        self._trainable = self._trainable_mask()  # what the bucket views were built for
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._adopt_optimizer_defaults()
        self._record_param_memory()
        self._initialized = True

    # ------------------------------------------------------------------ construction

    def _resolve_sharding(self, sharding: str) -> str:
        if sharding != "auto":
            return sharding
        params = self._all_params
        if self.world_size == 1 or not is_elementwise(self.optimizer_class) or any(
                not p.is_contiguous() for p in params) or layout.find_aliases(params):
            return layout.PARAM
        numels = [p.numel() for p in params]
        owners = layout.assign_owners(numels, self._group_ids(), self.world_size)
        ratio = kernels.partition.max_over_mean(
            kernels.partition.rank_loads(numels, owners, self.world_size))
        choice = layout.FLAT if ratio > AUTO_FLAT_THRESHOLD else layout.PARAM
        logger.info("zero_ext: sharding='auto' chose %r (whole-param max/mean load %.3f, "
                    "threshold %.2f)", choice, ratio, AUTO_FLAT_THRESHOLD)
        return choice

    def _group_ids(self) -> list[int]:
        return [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]

    def _new_plan(self, sharding: str) -> layout.ShardPlan:
        """A fresh plan of every param (construction, or a re-partition before any state)."""
        plan = layout.ShardPlan(sharding, self.world_size, self.rank,
                                self.parameters_as_bucket_view, self._all_params,
                                self._group_ids(), layout.find_aliases(self._all_params))
        self._buffers = {}
        plan.add_generation(list(range(len(self._all_params))), initial=True)
        self._attach_new_buffers(plan)
        plan.bind_local()
        plan.chunks = self._chunks_per_step(plan)
        self._invalidate_plans()
        return plan

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _frozen_outside_buckets(self) -> bool:
        """Param mode with bucket views keeps frozen params out of the buffers."""
        return self.sharding == layout.PARAM and self.parameters_as_bucket_view

    def _rebuild_bucket_views(self) -> None:
        """Param mode with bucket views, after params were frozen or unfrozen."""
        self.plan.rebuild_buckets()
        self._buffers = {}
        self._attach_new_buffers(self.plan)
        self.plan.bind_local()
        self._invalidate_plans()
        self._record_param_memory()

    def _attach_new_buffers(self, plan: layout.ShardPlan) -> None:
        if self.parameters_as_bucket_view:
            for bi in range(len(self._buffers), len(plan.buckets)):
                self._attach_buffer(plan, bi)

    def _adopt_optimizer_defaults(self) -> None:
        """Every key optimizer_class put into its groups (betas, eps, amsgrad, ...) also in
        ours and in self.defaults, as a plain torch optimizer has them from construction:
        schedulers (OneCycleLR reads betas) and state dicts need them before any step."""
        for k, v in self.optim.defaults.items():
            self.defaults.setdefault(k, v)
        for g, lg in zip(self.param_groups, self.optim.param_groups):
            for k, v in lg.items():
                if k != "params":
                    g.setdefault(k, v)

    def _attach_buffer(self, plan: layout.ShardPlan, bi: int) -> None:
        """Bucket views: the flat buffer of bucket `bi`, filled from the params' current
        values; the params become views into it (params over another's memory follow)."""
        b = plan.buckets[bi]
        tensors = [self._all_params[i].detach() for i in b.param_ids]
        buf = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        kernels.flatten_into(tensors, buf, b.offsets)
        ends = [off + n for off, n in zip(b.offsets, b.numels)]
        for gap_lo, gap_hi in zip(ends, b.offsets[1:] + [b.numel]):
            if gap_hi > gap_lo:
                buf[gap_lo:gap_hi].zero_()  # alignment padding: deterministic bytes
        for pid, off, n in zip(b.param_ids, b.offsets, b.numels):
            p = self._all_params[pid]
            p.data = buf[off:off + n].view_as(p)
        for i, first in plan.alias_of.items():
            if first in b.param_ids:
                self._all_params[i].data = self._all_params[first].data
        self._buffers[bi] = buf

    def _local_groups(self) -> list[dict]:
        """One local group per global group (possibly empty), hyperparameters included."""
        out = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}
            out.append({**hyper, "params": self.plan.local_keys(gi)})
        return out

    def _fused_step_supported(self) -> bool:
        """The chunked fused AdamW replaces optimizer_class's step when it computes the same
        update and a compiled kernel exists for the params' devices."""
        from .fused_adamw import FusedAdamW, fused_path_supported

        cls = self.optimizer_class
        if issubclass(cls, FusedAdamW) or not issubclass(cls, (torch.optim.Adam,
                                                               torch.optim.AdamW)):
            return False  # FusedAdamW's own step is already the fused kernel
        if not all(fused_path_supported(cls, g) for g in self.optim.param_groups):
            return False
        if self._fused_kernel_usable is None:
            # From all params, not this rank's: every rank must take the same path.
            # Params over another's memory must be stepped one after the other, as torch's
            # optimizers do, not by one parallel kernel.
            self._fused_kernel_usable = (
                not self.plan.alias_of
                and all(p.is_contiguous() for p in self._all_params)
                and all(kernels.native_available("fused_adamw_", d)
                        for d in {p.device for p in self._all_params}))
        return self._fused_kernel_usable

    def _fused_step(self) -> FusedShardStep:
        if self._stepper is None:
            self._stepper = FusedShardStep(self.plan, self.optim)
        return self._stepper

    def _chunks_per_step(self, plan: layout.ShardPlan) -> int:
        """Chunks pay off only when the exchange can overlap the compute (_overlapped) and
        each is big enough to hide a collective's fixed cost. Decided from the mean share,
        which every rank computes alike (the broadcast sequence must match)."""
        if not self._overlapped():
            return 1
        mean_share = sum(b.numel for b in plan.buckets) // self.world_size
        return max(1, min(OVERLAP_CHUNKS, mean_share // OVERLAP_MIN_CHUNK_ELEMS))

    def _overlapped(self) -> bool:
        """gloo with bucket views: broadcast chunk k while chunk k+1 is computed. (On NCCL
        one all_gather_into_tensor per bucket after the step is already the fast path.)"""
        return (self.world_size > 1 and self.parameters_as_bucket_view
                and self._exchanger.backend == "gloo")

    # ------------------------------------------------------------------ public API

    @property
    def local_numel(self) -> int:
        """Parameter elements whose optimizer state this rank holds."""
        return self.plan.local_numel

    def add_param_group(self, param_group: dict) -> None:
        if not self._initialized:
            return super().add_param_group(param_group)
        error, group = None, None
        try:
            if not isinstance(param_group, dict):
                raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
            group = groups_mod.normalize_param_groups([param_group])[0]
            known = {id(p) for p in self._all_params}
            if any(id(p) in known for p in group["params"]):
                raise ValueError("a parameter appears more than once: some params of the new "
                                 "group are already in another group")
            groups_mod.validate_hyperparameters(self.optimizer_class, [group], self.defaults)
            aliases = layout.find_aliases(self._all_params + group["params"])
            if aliases and (self.sharding == layout.FLAT or any(
                    i >= len(self._all_params) for i in aliases)):
                raise ValueError("add_param_group: params of the new group share memory with "
                                 "other params (as after `b.data = a.data`); tie weights by "
                                 "sharing one Parameter instead")
            lines = groups_mod.describe([group], {"add_param_group": len(self.param_groups)})
        except Exception as exc:  # noqa: BLE001
            error, lines = exc, []
        agree_on_inputs(self.process_group, self.world_size, error, lines,
                        "ZeroRedundancyOptimizer")
        # Whether any rank holds optimizer state decides if the partition may still change.
        (has_state,) = agree(self.process_group, self.world_size, None, "add_param_group",
                             (int(any(self.optim.state.values())),))

        super().add_param_group(group)
        gi = len(self.param_groups) - 1
        ids = list(range(len(self._all_params), len(self._all_params) + len(group["params"])))
        self._all_params.extend(group["params"])
        self.plan.group_of.extend([gi] * len(group["params"]))
        self._trainable = self._trainable_mask()
        if not has_state:
            # Nothing has optimizer state yet, so nothing stops a fresh, balanced partition
            # of all params (placing the new ones on top of the old loads can end worse
            # balanced than torch's rule).
            self.plan = self._new_plan(self.sharding)
            self.optim.param_groups.clear()
            self.optim.state.clear()
            for lg in self._local_groups():
                self.optim.add_param_group(lg)
        else:
            self.plan.add_generation(ids, initial=False)
            self._attach_new_buffers(self.plan)
            self.plan.bind_local()
            self._invalidate_plans()
            hyper = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
            self.optim.add_param_group({**hyper, "params": self.plan.local_keys(gi)})
        self._adopt_optimizer_defaults()
        self._record_param_memory()

    def _invalidate_plans(self) -> None:
        self._stepper, self._regions, self._fused_kernel_usable = None, None, None
        self._messages = {}

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Local step on this rank's share, then every rank's update reaches every rank.

        Collective. A failure on any rank (a bad grad, an exception in the local step)
        raises on every rank before the exchange, so no rank is left waiting.
        """
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._trainable:
            self._trainable = mask
            if self._frozen_outside_buckets():
                logger.info("zero_ext: the trainable parameters changed; rebuilding buckets")
                self._rebuild_bucket_views()
        error, loss = None, None
        t0 = time.perf_counter()
        # Decided from what every rank shares (all params, the groups, kwargs), so every
        # rank issues the same collectives whatever happens locally below.
        self._copy_hyperparameters(self.param_groups, self.optim.param_groups)
        use_fused = not kwargs and self._fused_step_supported()
        sends = _OverlappedSends(self) if use_fused and self._overlapped() else None
        try:
            self._refresh_params()
            if use_fused:
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                self._fused_step().run(after_chunk=sends.send if sends else None)
            else:
                loss = self._generic_step(closure, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
        if sends is not None:
            sends.finish()  # the chunks not sent yet (all of them after an early failure)
        t1 = time.perf_counter()
        mask_hash = hash(tuple(p.requires_grad for p in self._all_params)) & ((1 << 62) - 1)
        frozen_stepped, top, bottom = agree(
            self.process_group, self.world_size, error, "ZeroRedundancyOptimizer.step",
            (int(self._stepped_a_frozen_param()), mask_hash, -mask_hash))
        if top != -bottom:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.step: ranks disagree on which params require grad; "
                "freeze and unfreeze params alike on every rank")
        if sends is None:
            self._sync_params(exchange_frozen=bool(frozen_stepped))
        if frozen_stepped and self._frozen_outside_buckets() and self.world_size > 1:
            self._exchange_frozen()
        self._copy_hyperparameters(self.optim.param_groups, self.param_groups)
        t2 = time.perf_counter()
        local = t1 - t0 - (sends.comm if sends else 0.0)
        self.last_step_timings = {"local": local, "comm": t2 - t0 - local, "total": t2 - t0}
        return loss

    def _stepped_a_frozen_param(self) -> bool:
        """Whether this rank's local step updated a param that does not require grad (a
        torch optimizer steps any param holding a grad): it must then reach every rank."""
        if self.parameters_as_bucket_view and not self._frozen_outside_buckets():
            return False  # flat bucket views hold frozen params: always exchanged
        return any(not p.requires_grad and p.grad is not None
                   for p in self._all_params)

    def _chunk_regions(self) -> list[list[tuple[torch.Tensor, int]]]:
        """(region, owner) per chunk, for every rank's range of every bucket: the order of
        the overlapped exchange. The generic step sends the same sequence, so ranks agree
        on the collectives whichever step they took."""
        if self._regions is None:
            plan = self.plan
            out: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(plan.chunks)]
            for bi in range(len(plan.buckets)):
                for r in range(self.world_size):
                    for k, (a, z) in enumerate(plan.chunk_ranges(bi, r)):
                        if z > a:
                            out[k].append((self._buffers[bi][a:z], r))
            self._regions = out
        return self._regions

    def _generic_step(self, closure, **kwargs):
        if self._stepper is not None:
            self._stepper.reset()  # this step may create or replace state tensors
        if self.sharding == layout.PARAM:
            return self.optim.step(closure, **kwargs) if closure is not None \
                else self.optim.step(**kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._attach_shard_grads()
        try:
            self.optim.step(**kwargs)
        finally:
            self._detach_shard_grads()
        return loss

    def _attach_shard_grads(self) -> None:
        """Flat mode, generic path: each run's grad is a view of its piece of p.grad
        (no copy); None when the param has no grad, so the optimizer skips it."""
        for lp in self.plan.local:
            g = self._all_params[lp.param_id].grad
            lp.key.grad = (None if g is None else
                           g.detach().reshape(-1)[lp.start:lp.start + lp.length])

    def _detach_shard_grads(self) -> None:
        """Drop the views again so the user's zero_grad(set_to_none) frees the grads."""
        for lp in self.plan.local:
            lp.key.grad = None

    @staticmethod
    def _copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    # ------------------------------------------------------------------ params are the truth

    def _expected_ptr(self, pid: int) -> int | None:
        return self._expected_ptrs[pid] if pid < len(self._expected_ptrs) else None

    def _record_param_memory(self) -> None:
        """Remember where every param's memory is, to notice `p.data = ...` later."""
        self._expected_ptrs = [p.data_ptr() if p.numel() else None for p in self._all_params]
        self._expected_meta = [(p.shape, p.dtype, p.device) for p in self._all_params]

    def _refresh_params(self) -> None:
        """Follow params whose memory the script replaced since the last step
        (`p.data = t`, `load_state_dict(..., assign=True)`): with bucket views their new
        values are copied into the buffer and they view it again; in flat mode the local
        optimizer's views are re-pointed (its state stays). Values written in place need
        nothing: every step reads the params themselves."""
        ptrs = [p.data_ptr() if p.numel() else None for p in self._all_params]
        if ptrs == self._expected_ptrs:
            return
        changed = [i for i, (a, b) in enumerate(zip(ptrs, self._expected_ptrs)) if a != b]
        for i in changed:
            p = self._all_params[i]
            if (p.shape, p.dtype, p.device) != self._expected_meta[i]:
                raise ValueError(
                    f"parameter {i} changed shape, dtype or device after the optimizer was "
                    f"built ({self._expected_meta[i]} -> {(p.shape, p.dtype, p.device)}); "
                    "build the optimizer after moving or casting the model")
        known = {ptr: i for i, ptr in enumerate(ptrs) if ptr is not None and i not in changed}
        for i in changed:
            tied = self.plan.alias_of.get(i)
            if tied is not None and ptrs[i] != ptrs[tied]:
                raise ValueError(
                    f"parameter {i} shared memory with parameter {tied} when the optimizer "
                    "was built and no longer does; build the optimizer after tying weights")
            other = known.get(ptrs[i])
            if tied is None and other is not None and self.plan.alias_of.get(other) != i:
                raise ValueError(
                    f"parameter {i} now shares memory with parameter {other} (tied after the "
                    "optimizer was built); tie weights before building the optimizer")
        if self.parameters_as_bucket_view:
            slot = {pid: (bi, off) for bi, b in enumerate(self.plan.buckets)
                    for pid, off in zip(b.param_ids, b.offsets)}
            for i in changed:
                if i in self.plan.alias_of or i not in slot:
                    continue  # follows its first alias / a frozen param outside the buffers
                p, (bi, off) = self._all_params[i], slot[i]
                view = self._buffers[bi][off:off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
            for i, first in self.plan.alias_of.items():
                self._all_params[i].data = self._all_params[first].data
        else:
            self.plan.rebind(set(changed))
        if self._stepper is not None:
            self._stepper.reset()
        self._record_param_memory()

    # ------------------------------------------------------------------ exchange

    def _sync_params(self, exchange_frozen: bool = True) -> None:
        """Send this rank's updated elements of every bucket to all ranks."""
        if self.world_size == 1:
            return
        if self.parameters_as_bucket_view:
            if self._overlapped():
                pipe = self._exchanger.pipeline()
                for regions in self._chunk_regions():
                    pipe.send(regions)
                pipe.finish()
                return
            self._exchanger.exchange_buffers(
                [(self._buffers[bi], b.rank_ranges) for bi, b in enumerate(self.plan.buckets)])
            return
        # No bucket views: straight into the params, with bounded staging. Frozen params
        # travel only when some rank stepped one (it held a grad).
        key = (exchange_frozen, tuple(p.requires_grad for p in self._all_params))
        if key not in self._messages:
            active = (lambda pid: True) if exchange_frozen else (
                lambda pid: self._all_params[pid].requires_grad)
            self._messages[key] = plan_messages(self.plan.buckets, self.world_size, active)
        exchange_pieces(self._exchanger, self._messages[key], self.plan.element_view)

    def _exchange_frozen(self) -> None:
        """Param mode with bucket views: the frozen params (outside the buffers) after a
        step that updated one of them."""
        frozen = [i for i, p in enumerate(self._all_params)
                  if not p.requires_grad and i not in self.plan.alias_of]
        key = ("frozen", tuple(frozen))
        if key not in self._messages:
            buckets = layout.param_mode_buckets(self._all_params, frozen, self.plan.owner,
                                                self.world_size)
            self._messages[key] = plan_messages(buckets, self.world_size, lambda pid: True)
        exchange_pieces(self._exchanger, self._messages[key], self.plan.element_view)

    # ------------------------------------------------------------------ join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the full optimizer state on rank `to` (call on every rank)."""
        self._consolidated = state.consolidate(self, to)

    def state_dict(self) -> dict:
        """The consolidated state in plain torch format (after consolidate_state_dict)."""
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you "
                "meant to save the global state.")
        return state.torch_format(self, self._consolidated)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a torch-format optimizer state dict (from us, torch's ZeRO, or a plain
        torch optimizer); the caller's dict is not modified."""
        state.load(self, state_dict)
