"""ZeroRedundancyOptimizer: ZeRO stage 1 (optimizer-state sharding), drop-in for torch's.

The public class; it composes the parts, in the order data flows through a step:
groups.py (normalise, validate) -> layout.py (the shard plan) -> local_step.py / engine.py
(the fused AdamW step of this rank's share, else optimizer_class's own) -> replicas.py and
sync.py (every owner's update reaches every rank) -> state.py / checkpoint.py (torch-format
state dicts, sharded checkpoints). agree.py turns a failure on one rank into an error on
every rank. docs/design.md describes the whole.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from . import amp, grad_norm
from . import groups as groups_mod
from . import hybrid, kernels, launcher, layout, offload, state, tracked_state
from .agree import agree, agree_on_inputs, call_and_agree, rendezvous
from .fused_adamw import (FusedAdamW, fused_path_supported, group_keys_to_check,
                          keep_step_eager, sharded_step_refusal)
from .local_step import FusedShardStep
from .param_gather import ParamGather, guard_shutdown
from .precision import found_inf_flag, generic_precision, kernel_divisor, scale_factor
from .replicas import Replicas
from .seam import (HookSeam, check_overlap_options, check_same_hyperparameters,
                   check_same_mask, hyperparameter_digest)
from .sync import Exchanger

logger = logging.getLogger("zero_ext")
_STEP = "ZeroRedundancyOptimizer.step"

SHARDING_MODES = ("auto", "param", "flat", "even")
# Optimizers whose update of an element depends only on that element (plus per-param
# scalars such as the step): only these may split a parameter between ranks.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                "Adadelta", "Rprop", "ASGD"}
AUTO_FLAT_THRESHOLD = 1.05  # max/mean whole-param load above which "auto" picks "flat"
OVERLAP_CHUNKS = 4  # local-step chunks whose exchange overlaps the next chunk's compute
OVERLAP_MIN_CHUNK_ELEMS = 1 << 21  # below ~8 MB a chunk's broadcast costs more than it hides


def _spans_nodes(group_size: int) -> bool:
    """Whether a group of this many ranks holds ranks of several nodes: more ranks than
    torchrun's LOCAL_WORLD_SIZE puts on one node (unknown, not under torchrun: no)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return local.isdigit() and 0 < int(local) < group_size


def is_elementwise(optimizer_class: type) -> bool:
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedAdamW):
        return True
    return (getattr(optimizer_class, "__module__", "").startswith("torch.optim")
            and optimizer_class.__name__ in _ELEMENTWISE)


def _push_before_first(host, send):
    """after_chunk with offload_optimizer and overlapped sends: the host's updated part goes
    to the device before chunk 0 is sent (it was stepped in chunk 0)."""
    def after(k: int) -> None:
        if k == 0:
            host.wait()
            host.push()
        send(k)
    return after


class _ZeroJoinHook(JoinHook):
    """A joined rank keeps stepping (on the grads DDP's own hook provides) so that its
    collectives match the ranks still training."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.zero = zero

    def main_hook(self) -> None:
        zero = self.zero
        if not zero._scaler_seen:
            zero.step()
            return
        # The ranks still training step under a GradScaler, whose inf flag joins the step's
        # first agreement: take part in it with "no inf" (the others' flag decides).
        zero.found_inf = torch.zeros(1)
        # its stale grads are still scaled as the last step's were (unscale_ never runs)
        zero.grad_scale = zero._last_grad_scale
        zero._join_stepping = True  # (no GradScaler of its own to tell the verdict)
        try:
            zero.step()
        finally:
            zero._join_stepping = False
            del zero.found_inf
            del zero.grad_scale

    def post_hook(self, is_last_joiner: bool) -> None:
        # (overlap_param_gather) the last step's exchange lands before the Join ends: what
        # follows (DDP's final sync of the last joiner's params) reads them
        self.zero.wait_for_params()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shard the state of ``optimizer_class`` over the ranks of ``process_group``.

    Same signature and behaviour as ``torch.distributed.optim.ZeroRedundancyOptimizer``,
    plus: param-group dicts validated on every rank (with a cross-rank check), mixed dtypes,
    a better-balanced partition, element-level sharding (``sharding="flat"``; ``"even"``
    splits every param over all ranks, so every collective is split evenly), a fused
    multi-group AdamW step, and consolidation that sends state only to the target rank.

    ``master_weights=True``: every bfloat16/float16 param is stepped, by the rank that owns
    each element, through a float32 master copy with float32 optimizer state; the params
    receive the rounded master and the exchange moves param-dtype bytes. The masters are
    the state entry ``"master"`` in state dicts and checkpoints.

    :meth:`clip_grad_norm_` clips by the global grad norm from the owned elements only and
    applies the clip inside the next step; ``torch.amp.GradScaler`` is supported
    (``_step_supports_amp_scaling``): an inf on any rank skips the step on every rank.

    ``offload_optimizer=True`` (ZeRO-Offload, the name of DeepSpeed's option): this rank's
    optimizer state, and its float32 masters with ``master_weights=True``, live in host memory
    (the copies that cross the link pinned, where the params are on a GPU) and its share is
    stepped on the host: the owned
    grads go device to host (per DDP bucket as it becomes final with reduce_scatter_hook, at
    the step otherwise), the fused C++ AdamW (or ``optimizer_class``'s own CPU step) updates
    them, and the updated share goes back to the device before the params' exchange. A
    number in [0, 1] steps that fraction of each rank's share on the host and the rest on the
    device, both at once (Megatron's ``--optimizer-offload-fraction``); ``True`` is 1.
    ``offload_numel`` tells how many elements of the share are stepped on the host.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 *, sharding: str = "auto", master_weights: bool = False,
                 overlap_param_gather: bool = False,
                 offload_optimizer: bool | float = False, **defaults: Any):
        self._initialized = False
        # a single process without a group, an error when torchrun says there are more
        self.process_group, self.world_size, self.rank = launcher.process_group_of(process_group)
        # the ranks that load together: the whole job for a hybrid_groups() shard group
        self.replicated_job = hybrid.replicated_job(self.process_group, self.rank,
                                                    self.world_size)

        # Validate locally, then agree across ranks before anything else is collective.
        error, lines, groups, spans_nodes, fraction = None, [], [], False, 0.0
        try:
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
                raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass, got "
                                f"{optimizer_class!r}")
            if sharding not in SHARDING_MODES:
                raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}")
            if not isinstance(master_weights, bool):
                raise TypeError(f"master_weights must be a bool, got {master_weights!r}")
            if not isinstance(overlap_param_gather, bool):
                raise TypeError(f"overlap_param_gather must be a bool, got "
                                f"{overlap_param_gather!r}")
            if overlap_param_gather and parameters_as_bucket_view:
                raise ValueError(
                    "overlap_param_gather=True leaves the params' exchange in flight after "
                    "the step, into the params' own memory; with parameters_as_bucket_view="
                    "True the buckets are exchanged during the local step instead (gloo): use "
                    "one or the other")
            check_overlap_options(optimizer_class, master_weights, overlap_with_ddp)
            splits = sharding in layout.SPLIT_MODES
            if splits and not is_elementwise(optimizer_class):
                raise ValueError(
                    f"sharding={sharding!r} splits parameters between ranks, which is exact only "
                    f"for elementwise optimizers; {optimizer_class.__name__} is not known to be "
                    "one. Use sharding='param'.")
            if sharding == layout.EVEN and parameters_as_bucket_view:
                raise ValueError(
                    "sharding='even' keeps every param in its own memory (each is split over "
                    "all ranks, exchanged straight into the params): parameters_as_bucket_view"
                    "=True has no buffer to view; use sharding='flat' for bucket views")
            fraction = offload.resolve_option(offload_optimizer)
            groups = groups_mod.normalize_param_groups(params)
            groups_mod.validate_hyperparameters(optimizer_class, groups, defaults)
            flat_params = [p for g in groups for p in g["params"]]
            aliases = layout.find_aliases(flat_params)
            if fraction > 0:
                offload.check_supported(optimizer_class, bool(overlap_with_ddp), flat_params,
                                        bool(aliases))
            if splits:
                if any(not p.is_contiguous() for p in flat_params):
                    raise ValueError(f"sharding={sharding!r} needs contiguous parameters")
                if aliases:
                    raise ValueError(
                        f"sharding={sharding!r} cannot split parameters that share memory (params "
                        f"{sorted(aliases)} alias earlier ones, as after `b.data = a.data`); "
                        "use sharding='param', or tie them as one Parameter")
            # (aliases, contiguity and nodes decide sharding="auto": part of what must agree)
            spans_nodes = sharding == "auto" and _spans_nodes(self.world_size)
            lines = groups_mod.describe(groups, {
                "sharding='auto': the ranks span nodes (torchrun's LOCAL_WORLD_SIZE)":
                    spans_nodes,
                "optimizer_class": optimizer_class.__qualname__, "sharding": sharding,
                "params sharing memory": sorted(aliases.items()),
                "non-contiguous params": [i for i, p in enumerate(flat_params)
                                          if not p.is_contiguous()],
                "parameters_as_bucket_view": bool(parameters_as_bucket_view),
                "overlap_with_ddp": bool(overlap_with_ddp),
                "master_weights": master_weights,
                "overlap_param_gather": overlap_param_gather,
                "offload_optimizer": fraction,
                "defaults": sorted(defaults.items())})
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks know
            error = exc
        agree_on_inputs(self.process_group, self.world_size, error, lines,
                        "ZeroRedundancyOptimizer")

        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self.master_weights = master_weights
        self._clip: grad_norm.PendingClip | None = None  # from clip_grad_norm_, for step
        self._scaler_seen = False  # a GradScaler drove a step (the join hook mimics it)
        self._join_stepping = False  # the join hook runs the step (no GradScaler there)
        self._last_grad_scale: torch.Tensor | None = None
        self._overlap_with_ddp = bool(overlap_with_ddp)
        super().__init__(groups, defaults)  # fills defaults into the groups
        Joinable.__init__(self)
        self.register_step_pre_hook(launcher.FirstStepCheck())  # e.g. HF Trainer's callback
        # Every param in group order (torch's ZeRO has this attribute; code in the wild reads it).
        self._all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self.hook_seam = HookSeam(self)  # what DDP comm hooks read of it and ask of it
        # overlap_param_gather: the exchange after a step left in flight for the forward
        self._param_gather = ParamGather(self) if overlap_param_gather else None
        self._replicas = Replicas(Exchanger(self.process_group, self.rank, self.world_size),
                                  self.parameters_as_bucket_view)
        if self._param_gather is not None:
            self._param_gather.make_lanes(self._replicas.ex)
        if len(self._replicas.ex.lanes) > 1 or (self._param_gather is not None
                                                and self._param_gather.lanes):
            guard_shutdown()  # (extra gloo groups: released when the world is destroyed)
        self._consolidated: dict | None = None  # the full state, on the rank it went to
        # State dicts: _state_epoch counts changes of the state (steps, loads, new groups);
        # _consolidation is (epoch, to) of the last consolidate_state_dict; _had_state tells
        # whether any state can exist (a step or a load happened).
        self._state_epoch, self._had_state = 0, False
        self._consolidation: tuple[int, int] | None = None
        # seconds of the last step: local update, time waiting for the exchange, total
        self.last_step_timings: dict[str, float] = {}
        self._stepper: FusedShardStep | None = None  # built at the first fused step
        self._fused_kernel_usable: bool | None = None
        # offload_optimizer: the part of the share stepped on the host (offload.py)
        self._offload = offload.HostShard(fraction) if fraction > 0 else None
        # (the step's: param ids whose grads the hook sent to the host are still its grads)
        self._early_valid: set = set()

        # sharding="auto" may still become "even" at reduce_scatter_hook's first call
        self._auto_open = sharding == "auto"
        self._spans_nodes = spans_nodes
        self.plan = self._new_plan(self._resolve_sharding(sharding))
        self.sharding = self.plan.sharding
        self._trainable = self._trainable_mask()  # what the bucket views were built for
        local_kwargs = dict(defaults)
        if master_weights and issubclass(optimizer_class, FusedAdamW):
            local_kwargs["master_weights"] = True  # its own engine steps the masters
        self.optim = optimizer_class(self._local_groups(), **local_kwargs)
        # offload_optimizer with the fused AdamW: the local state counts its changes (the
        # fused step's O(1) check; torch's own steps of other classes write their state at
        # every step, where counting would only cost)
        self._tracked_state = self._offload is not None and issubclass(
            optimizer_class, (torch.optim.Adam, torch.optim.AdamW, FusedAdamW))
        if self._tracked_state:
            tracked_state.track(self.optim)
        if isinstance(self.optim, FusedAdamW):
            # step() reads the carried clip factors of the same grads and passes them in
            # its grad_scale: read twice, they would clip twice
            self.optim.reads_carried_clips = False
            if self._offload is not None:  # (its engine makes the host state packed)
                self.optim._engine.state_alloc = self._offload.alloc_state
        self._adopt_optimizer_defaults()
        self._initialized = True

    # ------------------------------------------------------------------ construction

    def _resolve_sharding(self, sharding: str) -> str:
        if sharding != "auto":
            return sharding
        params = self._all_params
        if self._param_gather is not None and self._spans_nodes and self._even_accepted():
            # across nodes the links are the limit: the exchange left in flight is then a
            # ring all-gather of equal chunks, every link alike (performance.md)
            logger.info("zero_ext: sharding='auto' chose 'even' (overlap_param_gather=True, "
                        "ranks on several nodes)")
            return layout.EVEN
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

    def _even_accepted(self) -> bool:
        """Whether sharding="even" takes these params (the same on every rank: what decides
        it was agreed at construction)."""
        params = self._all_params
        return (self.world_size > 1 and is_elementwise(self.optimizer_class)
                and not self.parameters_as_bucket_view and not self._overlap_with_ddp
                and all(p.is_contiguous() for p in params) and not layout.find_aliases(params))

    def hook_wants_even(self) -> None:
        """(HookSeam) reduce_scatter_hook's first call: sharding="auto" becomes "even" when
        the ranks span nodes, where every DDP bucket's reduce-scatter and the params'
        exchange are then split evenly over the ranks' links (on a simulated cluster even +
        hook took 1.1-1.2x DDP's iteration, param or flat + hook 1.8-2.3x; on one host, CPU
        bound, flat + hook was faster: performance.md), if nothing holds state yet (no step,
        no load: the same on every rank, both are collective) and even takes these params.
        Before the first step DDP all-reduces its first iteration's grads, so no grad was
        cut by the old partition."""
        if not self._auto_open:
            return
        self._auto_open = False
        if (self.sharding == layout.EVEN or not self._spans_nodes or self._had_state
                or state.created_at_init(self) or not self._even_accepted()):
            return
        logger.info("zero_ext: sharding='auto' chose 'even' at reduce_scatter_hook's first "
                    "call (was %r)", self.sharding)
        self._repartition(layout.EVEN)

    def _repartition(self, sharding: str) -> None:
        """A fresh partition of every param while nothing holds optimizer state."""
        if self._offload is not None:
            self._offload.reset()  # (no state anywhere: every piece placed anew)
        self.plan = self._new_plan(sharding)
        self.sharding = self.plan.sharding
        self.optim.param_groups.clear()
        self.optim.state.clear()
        for lg in self._local_groups():
            self.optim.add_param_group(lg)

    def _group_ids(self) -> list[int]:
        return [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]

    def _new_plan(self, sharding: str) -> layout.ShardPlan:
        """A fresh plan of every param (construction, or a re-partition before any state)."""
        plan = layout.ShardPlan(sharding, self.world_size, self.rank,
                                self.parameters_as_bucket_view, self._all_params,
                                self._group_ids(), layout.find_aliases(self._all_params))
        plan.add_generation(list(range(len(self._all_params))), initial=True)
        self.plan = plan
        self._layout_changed(fresh_buffers=True)
        return plan

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

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

    def _local_groups(self) -> list[dict]:
        """One local group per global group (possibly empty), hyperparameters included."""
        out = []
        for gi, g in enumerate(self.param_groups):
            out.append({**groups_mod.hyperparameters(g), "params": self.plan.local_keys(gi)})
        return out

    def _fused_step_supported(self) -> bool:
        """The chunked fused AdamW replaces optimizer_class's step when it computes the same
        update and a compiled kernel exists for the params' devices."""
        cls = self.optimizer_class
        if issubclass(cls, FusedAdamW) or not issubclass(cls, (torch.optim.Adam,
                                                               torch.optim.AdamW)):
            return False  # FusedAdamW's own step is already the fused kernel
        if not all(fused_path_supported(cls, g) for g in self.optim.param_groups):
            return False
        if self._fused_kernel_usable is None:
            # From all params, not this rank's: every rank must take the same path.
            # Params over another's memory must be stepped one after the other, as torch's
            # optimizers do, not by one parallel kernel. (offload_optimizer: the host too.)
            devices = {p.device for p in self._all_params}
            if self._offload is not None:
                devices.add(torch.device("cpu"))
            self._fused_kernel_usable = (
                not self.plan.alias_of
                and all(p.is_contiguous() for p in self._all_params)
                and all(kernels.native_available("fused_adamw_", d) for d in devices))
        return self._fused_kernel_usable

    def _fused_step(self) -> FusedShardStep:
        if self._stepper is None:
            self._stepper = FusedShardStep(
                self.plan, self.optim, self.master_weights,
                None if self._offload is None else self._offload.alloc_state, self._offload)
        return self._stepper

    def _chunks_per_step(self, plan: layout.ShardPlan) -> int:
        """Chunks pay off only when the exchange can overlap the compute (gloo with bucket
        views) and each is big enough to hide a collective's fixed cost. Decided from the
        mean share, which every rank computes alike (the broadcast sequence must match)."""
        if not self._replicas.overlapped:
            return 1
        mean_share = sum(b.numel for b in plan.buckets) // self.world_size
        return max(1, min(OVERLAP_CHUNKS, mean_share // OVERLAP_MIN_CHUNK_ELEMS))

    # ------------------------------------------------------------------ public API
    # Every public method is collective or reads grads as data: under torch.compile each
    # one is a graph break that runs eagerly (torch's own zero_grad, state_dict, ... too).

    @property
    def local_numel(self) -> int:
        """Parameter elements whose optimizer state this rank holds."""
        return self.plan.local_numel

    @property
    def offload_numel(self) -> int:
        """Elements of this rank's share stepped on the host, their state in host memory
        (offload_optimizer; 0 without it)."""
        return 0 if self._offload is None else self._offload.numel

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        if not self._initialized:
            return super().add_param_group(param_group)
        self.wait_for_params()
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
            if aliases and (self.sharding in layout.SPLIT_MODES or any(
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
        if self._param_gather is not None:  # new params: the forward's order, recorded again
            self._param_gather.forget_order()
        gi = len(self.param_groups) - 1
        ids = list(range(len(self._all_params), len(self._all_params) + len(group["params"])))
        self._all_params.extend(group["params"])
        self.plan.group_of.extend([gi] * len(group["params"]))
        # The new params are placed as they are now; the others keep the mask their bucket
        # views were built for, so that one frozen or unfrozen since the last step is
        # still re-placed at the next (else, unfrozen after a step that kept it out of the
        # views, its update would never leave its owner).
        now = self._trainable_mask()
        self._trainable = self._trainable[:len(now) - len(ids)] + now[len(now) - len(ids):]
        if not has_state:
            self._trainable = now  # (a fresh plan, from the params as they are now)
            # Nothing has optimizer state yet, so nothing stops a fresh, balanced partition
            # of all params (placing the new ones on top of the old loads can end worse
            # balanced than torch's rule).
            self._repartition(self.sharding)
        else:
            self.plan.add_generation(ids, initial=False)
            self._layout_changed(fresh_buffers=False)
            self.optim.add_param_group({**groups_mod.hyperparameters(self.param_groups[gi]),
                                        "params": self.plan.local_keys(gi)})
        self._adopt_optimizer_defaults()
        self._state_epoch += 1

    def _layout_changed(self, fresh_buffers: bool) -> None:
        """After the plan gained buckets (add_param_group) or rebuilt them (trainable
        params changed, bucket views): buffers, local pieces, chunks, cached step views."""
        self.plan.chunks = self._chunks_per_step(self.plan)
        self._replicas.adopt(self.plan, fresh=fresh_buffers)
        self.plan.bind_local()  # after the bucket views: flat keys view the params' memory
        if self._offload is not None:
            self._offload.place(self.plan)  # the host pieces' keys: host memory of their own
        self._stepper, self._fused_kernel_usable = None, None

    # ------------------------------------------------------------------ the step

    def _patch_step_function(self) -> None:
        super()._patch_step_function()
        keep_step_eager(type(self))  # the step's pre-hooks (FirstStepCheck) eager too

    @torch._disable_dynamo
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Local step on this rank's share, then every rank's update reaches every rank.

        Collective. A failure on any rank (a bad grad, an exception in the local step)
        raises on every rank before the exchange, so no rank is left waiting.
        """
        if self._overlap_with_ddp:  # the DDP comm hook has stepped (torch returns None)
            return self.hook_seam.user_step(closure)
        self.wait_for_params()  # (the last step's exchange, left in flight)
        Join.notify_join_context(self)
        # clipped grads that survived a step of another optimizer still count as clipped
        self._clip = grad_norm.with_carried(self._clip, [p.grad for p in self._all_params])
        # Set around step() by torch.amp.GradScaler (_step_supports_amp_scaling): grads not
        # unscaled yet are divided by grad_scale; found_inf nonzero means skip the step.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # A closure (forward and backward inside step(): Lightning) runs first, and the
        # step agrees on its failure before anything is stepped, unless the local optimizer
        # calls it itself (LBFGS-style: param mode, optimizer_class's own step).
        closure_error, ran_closure, loss = None, False, None
        if closure is not None and not self._local_step_runs_closure(grad_scale, kwargs):
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
                closure_error = exc
            closure, ran_closure = None, True
        self._scaler_seen = self._scaler_seen or found_inf is not None
        self._last_grad_scale = grad_scale  # the join hook's stale grads carry it too
        mask = self._trainable_mask()
        mask_key = tuple(mask)  # (the exchange's plan key too: built once per step)
        mask_hash = hash(mask_key) & ((1 << 62) - 1)
        inf, inf_error = 0, None
        try:
            inf = int(found_inf_flag(found_inf))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            inf_error = exc
        # grads left by reduce_scatter_hook and changed since: an error on every rank (and
        # a closure whose backward may run the hook is checked after it ran)
        hooked, hook_error, closure = self.hook_seam.check_step(closure, found_inf is not None)
        inf_error = closure_error or inf_error or hook_error
        # a group key set since construction that the local step would refuse part-way
        # (capturable=True on the CPU): refused on every rank before any rank steps
        check_keys = group_keys_to_check(self.optimizer_class, self.param_groups)
        if check_keys and inf_error is None:
            inf_error = sharded_step_refusal(
                self.optimizer_class, self.param_groups,
                ((lp.group, lp.key, self.plan.params[lp.param_id]) for lp in self.plan.local),
                self.optim.state)
        if (self._replicas.overlapped or found_inf is not None or hooked or ran_closure
                or check_keys):
            # Buckets sent from inside the local step (overlapped) must be laid out alike
            # before anything is stepped; GradScaler's verdict and a hook's verdict on the
            # grads must be known before anything is stepped: agree first. (A param the
            # script wrote while the last exchange was in flight, overlap_param_gather, is
            # raised here too; with no agreement here, by the one after the local step.)
            if self._param_gather is not None:
                inf_error = inf_error or self._param_gather.write_error()
            verdicts = None if found_inf is None or self._join_stepping else \
                amp.scaler_verdicts(self)
            unreachable = int(found_inf is not None and not self._join_stepping
                              and verdicts is None)
            mine = inf
            hp = hyperparameter_digest(self.param_groups)  # (checked again after the step)
            top, bottom, inf, not_inf, unreachable, hp_top, hp_bottom = agree(
                self.process_group, self.world_size, inf_error, _STEP,
                (mask_hash, -mask_hash, inf, -inf, unreachable, hp, -hp))
            check_same_mask(top, bottom, _STEP)
            check_same_hyperparameters(hp_top, hp_bottom, _STEP, stepped=False)
            if found_inf is not None:  # every scaler's update() must see the same verdict
                amp.share_verdict(verdicts, mine, inf, -not_inf, unreachable, _STEP)
        if mask != self._trainable:
            self._trainable = mask
            if self._replicas.frozen_outside_buckets:
                logger.info("zero_ext: the trainable parameters changed; rebuilding buckets")
                self.plan.rebuild_buckets()
                self._layout_changed(fresh_buffers=True)
        host = self._offload
        if inf:  # an inf/NaN grad on some rank: no rank steps (GradScaler backs off)
            if host is not None:
                host.end_step()
            self._clip_after_step()
            if closure is not None:
                with torch.enable_grad():
                    return closure()
            return loss
        self._state_changed()
        error = None
        t0 = time.perf_counter()
        # Decided from what every rank shares (all params, the groups, kwargs), so every
        # rank issues the same collectives whatever happens locally below.
        groups_mod.copy_hyperparameters(self.param_groups, self.optim.param_groups)
        use_fused = not kwargs and self._fused_step_supported()
        replicas = self._replicas
        # offload_optimizer: grads the hook sent to the host as its buckets finished are
        # the step's where the hook's check found them as the hook left them (not replaced,
        # not written, not made whole by gather_grads), unless GradScaler unscaled them in
        # place since (it then passes no grad_scale; on the CPU that moves no version)
        unchanged = self.hook_seam.take_unchanged()
        self._early_valid = unchanged if hooked and not (
            found_inf is not None and grad_scale is None) else set()
        copy_s = host.copy_seconds if host is not None else 0.0
        try:
            if replicas.refresh():
                self._memory_moved()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = exc
        # after refresh: it may give a bucket a new buffer
        sends = replicas.overlapped_sends() if use_fused and replicas.overlapped else None
        if error is None:
            try:
                if use_fused:
                    if closure is not None:
                        with torch.enable_grad():
                            loss = closure()
                    with self._clip_applied() as clip:  # after the closure: it may clip
                        after = sends.send if sends else None
                        if host is not None:
                            self._host_pull()
                            if sends is not None:  # the host's part lands before chunk 0
                                after = _push_before_first(host, sends.send)
                        self._fused_step().run(after_chunk=after,
                                               grad_scale=kernel_divisor(grad_scale, clip),
                                               before_host=host.wait if host else None)
                        if host is not None:
                            host.wait()
                            if sends is None:
                                host.push()
                else:
                    out = self._generic_step(closure, grad_scale, **kwargs)
                    loss = out if closure is not None else loss
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
                error = exc
            finally:
                if host is not None:
                    host.end_step()
        if sends is not None:
            sends.finish()  # the chunks not sent yet (all of them after an early failure)
        t1 = time.perf_counter()
        self.hook_seam.finish_step(error, _STEP, mask_key, replicas.stepped_a_frozen_param(),
                                   buffers_sent=sends is not None)
        t2 = time.perf_counter()
        local = t1 - t0 - (sends.comm if sends else 0.0)
        self.last_step_timings = {"local": local, "comm": t2 - t0 - local, "total": t2 - t0}
        if host is not None:  # (of "local": issuing the device-host copies, and waits)
            self.last_step_timings["host_copy"] = host.copy_seconds - copy_s
        return loss

    def _memory_moved(self) -> None:
        """Params whose memory was replaced (Replicas.refresh): cached views are stale."""
        if self._stepper is not None:
            self._stepper.reset()
        if self._offload is not None:
            self._offload.invalidate_views()

    def _host_pull(self) -> None:
        """offload_optimizer, before the local step: the local optimizer's state tracked
        (tracked_state: after a load replaced it), the host state packed (after it was made,
        loaded or changed), the host pieces' grads and params copied to the host."""
        host = self._offload
        gen = tracked_state.track(self.optim) if self._tracked_state else None
        if gen is not None and gen.value != host.packed_generation:  # (a change: pack it)
            host.state_unpacked = True
        if host.state_unpacked and host.pack_state(self.optim.state) \
                and self._stepper is not None:
            self._stepper.reset()
        if gen is not None:
            host.packed_generation = gen.value
        host.pull(self._early_valid)

    def _local_step_runs_closure(self, grad_scale, kwargs) -> bool:
        """Whether this step hands its closure to optimizer_class's own step (which may
        call it again and again: LBFGS), as _generic_step does; the same on every rank."""
        if (self.sharding != layout.PARAM or grad_scale is not None
                or self._offload is not None
                or (self.master_weights and not issubclass(self.optimizer_class, FusedAdamW))):
            return False
        groups_mod.copy_hyperparameters(self.param_groups, self.optim.param_groups)
        return bool(kwargs) or not self._fused_step_supported()

    def _generic_step(self, closure, grad_scale, **kwargs):
        """optimizer_class's own step on the local share. The grads it reads are multiplied
        by the step's factor (GradScaler's 1/scale, a pending clip); it steps float32 masters
        in place of low-precision params (precision.generic_precision). FusedAdamW gets the
        factor as its own grad_scale (its kernel applies it in float32)."""
        if self._stepper is not None:
            self._stepper.reset()  # this step may create or replace state tensors
        own_masters = issubclass(self.optimizer_class, FusedAdamW)
        masters = self.master_weights and not own_masters
        if (closure is not None and self.sharding == layout.PARAM and not masters
                and grad_scale is None):
            # As torch does: the local optimizer calls the closure itself (LBFGS calls it
            # again and again, SAM twice), and a clip inside it applies to the grads it made.
            # Every call agrees on its failure before the optimizer steps anything (the
            # ranks' optimizers call it alike: each call runs a DDP backward anyway).
            def local_closure():
                out = call_and_agree(closure, self.process_group, self.world_size, _STEP,
                                     with_grad=True)
                self._apply_clip_in_place()
                return out
            return self.optim.step(local_closure, **kwargs)
        loss = None
        if closure is not None:  # evaluated once, before the grads are read
            with torch.enable_grad():
                loss = closure()
        with self._clip_applied() as clip:
            factor = scale_factor(grad_scale, clip)
            flat = self.sharding in layout.SPLIT_MODES
            host = self._offload
            if host is not None:  # the host keys' grads: copies of the owned grads
                if not own_masters:  # (optimizer_class made or may make state itself)
                    host.state_unpacked = True
                self._host_pull()
                host.wait()
            if flat:
                self._attach_shard_grads()
            try:
                if own_masters and factor is not None:
                    self.optim.grad_scale = factor.reciprocal().reshape(1)
                with generic_precision(self.optim, [lp.key for lp in self.plan.local],
                                       masters, None if own_masters else factor):
                    self.optim.step(**kwargs)
            finally:
                self.optim.__dict__.pop("grad_scale", None)
                if flat:
                    self._detach_shard_grads()
            if host is not None:
                host.push()
        return loss

    def _stepped_ids(self) -> list[int]:
        """Indices (in _all_params) of the params whose grads this rank's step reads."""
        params = self._all_params
        return sorted({lp.param_id for lp in self.plan.local
                       if params[lp.param_id].grad is not None})

    @contextlib.contextmanager
    def _clip_applied(self):
        """Apply the clip factors to this step (grad_norm.applied): yields the factor for
        every grad the step reads, or None when there is none or the clipped grads were
        swapped for scaled copies; raises if clipped grads changed in place. Afterwards the
        factors stay with the grads that survive the step unchanged (PendingClip)."""
        pending = self._clip
        with grad_norm.applied(pending, self._all_params,
                               self._stepped_ids() if pending else ()) as factor:
            yield factor
        self._clip_after_step()

    def _clip_after_step(self) -> None:
        if self._clip:
            self._clip = self._clip.after_step([p.grad for p in self._all_params])

    def _apply_clip_in_place(self) -> None:
        """A clip pending after the closure (the generic path that hands the closure to the
        local optimizer): scale this rank's clipped grads in place, as torch's clip does."""
        pending, self._clip = self._clip, None  # the grads now hold the clipped values
        grad_norm.scale_in_place(pending, self._all_params, self._stepped_ids())

    def _attach_shard_grads(self) -> None:
        """Flat mode, generic path: each run's grad is a view of its piece of p.grad
        (no copy); None when the param has no grad, so the optimizer skips it."""
        for lp in self.plan.local:
            if lp.host:  # (offload_optimizer: its grad is the host copy, set by the pull)
                continue
            g = self._all_params[lp.param_id].grad
            lp.key.grad = (None if g is None else
                           g.detach().reshape(-1)[lp.start:lp.start + lp.length])

    def _detach_shard_grads(self) -> None:
        """Drop the views again so the user's zero_grad(set_to_none) frees the grads."""
        for lp in self.plan.local:
            if not lp.host:
                lp.key.grad = None

    @torch._disable_dynamo
    def wait_for_params(self) -> None:
        """With ``overlap_param_gather=True``: return once every owner's update of the last
        step has reached this rank's params (nothing to do otherwise). Call it, on every
        rank, before the script reads or writes, between ``step()`` and the next forward,
        params it holds itself (a list of params taken earlier); whatever goes through the
        model (its forward, ``model.parameters()``, state_dict, casts, pickling, DDP) and
        zero_ext's own paths wait by themselves."""
        if self._param_gather is not None:
            self._param_gather.wait_all()

    # ------------------------------------------------------------------ clipping

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip = None  # a clip computed from the old grads does not apply to new ones
        if getattr(self, "_offload", None) is not None:
            self._offload.end_step()  # (grads the hook copied to the host: of old grads)
        super().zero_grad(set_to_none)

    @torch._disable_dynamo
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Collective ``torch.nn.utils.clip_grad_norm_`` over all params of the optimizer.

        Returns the total norm of their grads (float32, the same value on every rank, also
        inf or NaN), computed from the grad elements this rank owns plus one small
        all-reduce (two numbers per rank). The clip is applied, per grad, by the step that
        reads it (the ``.grad`` tensors keep their values; see grad_norm.PendingClip for
        what happens when the grads or the layout change in between); :meth:`zero_grad`
        drops it. ``norm_type`` is any non-zero p, ``inf`` or ``-inf`` (or their strings).
        """
        self.hook_seam.refuse_clip()
        self.wait_for_params()
        max_norm, norm_type = grad_norm.validate(max_norm, norm_type)
        if self._join_config.enable:
            raise NotImplementedError(
                "clip_grad_norm_ inside a Join context is not supported: a rank that has "
                "joined cannot take part in its all-reduce. Use "
                "torch.nn.utils.clip_grad_norm_ there (every rank clips all grads)")
        error, term, count, grads, prior = None, 0.0, 0, [], None
        try:
            grads = [p.grad for p in self._all_params]
            self._clip = grad_norm.with_carried(self._clip, grads)
            # A clip still pending for some of these grads counts (clipping twice, as in
            # torch, whose second norm is of the clipped grads): per grad, by param.
            prior = self._clip.factors(grads, for_clip=True) if self._clip else None
            pieces, scales = [], []
            for lp in self.plan.local:
                g = grads[lp.param_id]
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("clip_grad_norm_ does not support sparse gradients")
                pieces.append(g if lp.start == 0 and lp.length == g.numel()
                              else g.reshape(-1)[lp.start:lp.start + lp.length])
                scales.append(None if prior is None else prior[lp.param_id])
            term, count = grad_norm.local_terms(pieces, norm_type, scales)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error, term, count = exc, float("nan"), 0
        norm, failed = grad_norm.total_norm(term, count, norm_type, self.process_group,
                                            self.world_size, self.rank, error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("clip_grad_norm_: another rank failed to compute its part of "
                               "the norm; every rank stops here")
        self._clip = grad_norm.clip(norm, max_norm, norm_type, error_if_nonfinite, grads, prior)
        return torch.tensor(norm, dtype=torch.float32, device=self.join_device)

    # ------------------------------------------------------------------ join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.wait_for_params()  # (a Join context is being entered: DDP's reads params)
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ------------------------------------------------------------------ checkpoints

    @torch._disable_dynamo
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the full optimizer state on rank `to` of the process group (call it on
        every rank); state_dict() on that rank then returns it, as in torch."""
        self.wait_for_params()
        self._consolidated = state.consolidate(self, to)
        self._consolidation = (self._state_epoch, to)

    def _state_changed(self) -> None:
        """A step, a load or a new param group: an earlier consolidation is out of date."""
        self._state_epoch += 1
        self._had_state = True

    def state_loaded(self) -> None:
        """(zero_ext.state's seam) New state installed: the fused step's views are stale."""
        self._state_changed()
        self._stepper = None  # rebuilt at the next fused step, over the new state
        if self._offload is not None:
            self._offload.state_unpacked = True  # (packed into host buffers at the step)

    @torch._disable_dynamo
    def state_dict(self) -> dict:
        """The full state in plain torch format, on the rank it was consolidated on.

        - After ``consolidate_state_dict(to)`` on every rank (and no step since), rank `to`
          gets the consolidated state without any communication (torch's behaviour: what
          Lightning and scripts written for torch's ZeRO do), the other ranks a placeholder
          (a small dict without a "state" key that tells where the state is; torch raises
          there).
        - Before any step or load, unless optimizer_class made state when it was built,
          every rank gets the same plain dict with empty state (accelerate's prepare()).
        - Otherwise state_dict() is collective (accelerate's save_state()): rank 0 gets the
          state consolidated for this call only, the others the placeholder (which
          load_state_dict() accepts). A rank that calls it alone waits for the others,
          warning every minute (HF Trainer: see zero_ext.integrations.transformers).
        """
        self.wait_for_params()
        fresh = self._consolidation is not None and self._consolidation[0] == self._state_epoch
        if fresh and self._consolidated is not None:
            return state.torch_format(self, self._consolidated)
        if fresh:
            return state.placeholder(self, self._consolidation[1])
        if not self._had_state and not state.created_at_init(self):
            return state.torch_format(self, {})
        self._consolidated = self._consolidation = None  # out of date: free it
        rendezvous(
            self.process_group, self.world_size, self.rank, "ZeroRedundancyOptimizer.state_dict",
            "without consolidate_state_dict() on every rank first, state_dict() gathers the "
            "state itself and needs every rank of the process group (as accelerate's "
            "save_state() does). A framework that saves from the main process only needs "
            "consolidate_state_dict() on every rank before its save (HF Trainer: "
            "zero_ext.integrations.transformers.ZeroCheckpointCallback)")
        full = state.consolidate(self, 0)
        return state.torch_format(self, full) if self.rank == 0 else state.placeholder(self, 0)

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict | None) -> None:
        """Load a torch-format state dict (ours, torch's ZeRO's or a plain optimizer's),
        without modifying it. Collective. Ranks given None (or the placeholder) receive
        their share: ``opt.load_state_dict(torch.load(f) if rank == 0 else None)``."""
        self.wait_for_params()
        state.load(self, state_dict)
