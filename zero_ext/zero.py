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
from .local_step import FusedShardStep, chunk_bounds
from .sync import Exchanger, wait_all

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
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0

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
            if sharding == "flat":
                for g in groups:
                    if any(not p.is_contiguous() for p in g["params"]):
                        raise ValueError("sharding='flat' needs contiguous parameters")
            lines = groups_mod.describe(groups, {
                "optimizer_class": optimizer_class.__qualname__, "sharding": sharding,
                "parameters_as_bucket_view": bool(parameters_as_bucket_view),
                "defaults": sorted(defaults.items())})
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks know
            error = exc
        self._agree_across_ranks(error, lines)

        self._optimizer_class = optimizer_class
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._overlap_with_ddp = False
        super().__init__(groups, defaults)  # fills defaults into the groups
        Joinable.__init__(self)
        self._all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[int] = [gi for gi, g in enumerate(self.param_groups)
                                     for _ in g["params"]]
        self._default_device = self._all_params[0].device
        self._exchanger = Exchanger(self.process_group, self.rank, self.world_size)

        self.sharding = self._resolve_sharding(sharding)
        self._owner: list[int] = []          # param mode: rank of every param
        self._generations: list[list[int]] = []  # param ids added by each constructor/add call
        self._buckets: list[layout.Bucket] = []
        self._buffers: dict[int, torch.Tensor] = {}   # bucket index -> flat buffer (views on)
        self._shards: list[dict] = []        # flat mode: per bucket {storage, grad, runs}
        self._consolidated: dict | None = None
        # seconds of the last step: local update, time waiting for the exchange, total
        self.last_step_timings: dict[str, float] = {}
        self._is_trainable_mask = self._trainable_mask()

        self._add_generation(list(range(len(self._all_params))), initial=True)
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._stepper: FusedShardStep | None = None  # built at the first fused step
        self._fused_kernel_usable: bool | None = None
        self._regions: list | None = None  # the exchange's regions per chunk (overlapped sync)
        self._initialized = True

    # ------------------------------------------------------------------ construction

    def _agree_across_ranks(self, error: BaseException | None, lines: list[str]) -> None:
        """One small collective so that bad or mismatched input stops every rank."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        mine = (None if error is None else f"{type(error).__name__}: {error}",
                groups_mod.digest(lines))
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        if error is not None:
            raise error
        failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
        if failed:
            r, e = failed[0]
            raise RuntimeError(
                f"ZeroRedundancyOptimizer: rank {r} rejected its arguments ({e}); every rank "
                "stops here instead of hanging in a later collective")
        digests = [d for _, d in gathered]
        if len(set(digests)) > 1:
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, lines, group=self.process_group)
            diffs = [f"rank {r}: {groups_mod.first_difference(everyone[0], everyone[r])}"
                     for r in range(1, self.world_size) if digests[r] != digests[0]]
            raise RuntimeError(
                "ZeroRedundancyOptimizer: ranks were given different parameters, groups or "
                "hyperparameters (compared with rank 0): " + "; ".join(diffs))

    def _resolve_sharding(self, sharding: str) -> str:
        if sharding != "auto":
            return sharding
        if self.world_size == 1 or not is_elementwise(self._optimizer_class) or any(
                not p.is_contiguous() for p in self._all_params):
            return layout.PARAM
        numels = [p.numel() for p in self._all_params]
        owners = layout.assign_owners(numels, self._group_of, self.world_size)
        ratio = kernels.partition.max_over_mean(
            kernels.partition.rank_loads(numels, owners, self.world_size))
        choice = layout.FLAT if ratio > AUTO_FLAT_THRESHOLD else layout.PARAM
        logger.info("zero_ext: sharding='auto' chose %r (whole-param max/mean load %.3f, "
                    "threshold %.2f)", choice, ratio, AUTO_FLAT_THRESHOLD)
        return choice

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _add_generation(self, ids: list[int], initial: bool) -> None:
        """Place params `ids` (all new): owners, buckets, flat shards."""
        numels = [self._all_params[i].numel() for i in ids]
        if self.sharding == layout.PARAM:
            if initial:
                owners = layout.assign_owners(numels, [self._group_of[i] for i in ids],
                                              self.world_size)
            else:
                owners = layout.extend_owners(self._rank_loads(), numels)
            self._owner.extend(owners)
        self._generations.append(ids)
        self._build_generation_buckets(ids)

    def _rank_loads(self) -> list[int]:
        return kernels.partition.rank_loads([p.numel() for p in self._all_params],
                                            self._owner, self.world_size)

    def _build_generation_buckets(self, ids: list[int]) -> None:
        params = self._all_params
        if self.sharding == layout.PARAM:
            # Frozen params never change, so they stay out of the buckets and the sync.
            live = [i for i in ids if params[i].requires_grad]
            new = layout.param_mode_buckets(params, live, self._owner, self.world_size)
        else:
            new = layout.flat_mode_buckets(params, ids, self.world_size)
        for b in new:
            bi = len(self._buckets)
            self._buckets.append(b)
            if self.parameters_as_bucket_view or self.sharding == layout.FLAT:
                self._attach_buffer(bi)
            if self.sharding == layout.FLAT:
                self._shards.append(self._make_shard(bi))

    def _attach_buffer(self, bi: int) -> None:
        """Flat buffer of bucket `bi`, filled from the params; with bucket views the params
        become views into it (flat mode without views keeps only this rank's range)."""
        b = self._buckets[bi]
        tensors = [self._all_params[i].detach() for i in b.param_ids]
        if self.parameters_as_bucket_view:
            buf = torch.empty(b.numel, dtype=b.dtype, device=b.device)
            kernels.flatten_into(tensors, buf, b.offsets)
            ends = [off + n for off, n in zip(b.offsets, b.numels)]
            for gap_lo, gap_hi in zip(ends, b.offsets[1:] + [b.numel]):
                if gap_hi > gap_lo:
                    buf[gap_lo:gap_hi].zero_()  # alignment padding: deterministic bytes
            for pid, off, n in zip(b.param_ids, b.offsets, b.numels):
                p = self._all_params[pid]
                p.data = buf[off:off + n].view_as(p)
            self._buffers[bi] = buf
        else:  # flat mode, no views: a private copy of this rank's range only
            self._buffers[bi] = self._pack_range(b, self.rank, torch.zeros)

    def _my_range_storage(self, bi: int) -> torch.Tensor:
        b = self._buckets[bi]
        lo, hi = b.rank_ranges[self.rank]
        buf = self._buffers[bi]
        return buf[lo:hi] if self.parameters_as_bucket_view else buf

    def _make_shard(self, bi: int) -> dict:
        """Flat mode: this rank's range of bucket `bi` as one "run" per param piece, each a
        1-D view the local optimizer steps. One run per piece (not per group) keeps torch's
        per-param semantics: a param without a grad is skipped, its step not advanced, and
        it gets no state."""
        b = self._buckets[bi]
        lo, _ = b.rank_ranges[self.rank]
        storage = self._my_range_storage(bi)
        runs: list[dict] = []
        for pc in b.pieces(self.rank):
            start = pc.bucket_start - lo
            runs.append({"group": self._group_of[pc.param_id], "start": start,
                         "end": start + pc.length, "pieces": [pc],
                         "param": storage[start:start + pc.length]})
        return {"bucket": bi, "lo": lo, "storage": storage, "runs": runs}

    def _piece_view(self, pc: layout.Piece) -> torch.Tensor:
        p = self._all_params[pc.param_id].detach()
        if pc.start == 0 and pc.length == p.numel():
            return p.view(-1) if p.is_contiguous() else p
        return p.view(-1)[pc.start:pc.start + pc.length]

    def _local_groups(self) -> list[dict]:
        """One local group per global group (possibly empty), hyperparameters included."""
        out = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}
            out.append({**hyper, "params": self._local_params_of_group(gi)})
        return out

    def _local_params_of_group(self, gi: int) -> list[torch.Tensor]:
        if self.sharding == layout.PARAM:
            return [p for p, g, r in zip(self._all_params, self._group_of, self._owner)
                    if g == gi and r == self.rank]
        return [run["param"] for sh in self._shards for run in sh["runs"] if run["group"] == gi]

    def _fused_step_supported(self) -> bool:
        """The chunked fused AdamW replaces optimizer_class's step when it computes the same
        update and a compiled kernel exists for the params' devices."""
        from .fused_adamw import FusedAdamW, fused_path_supported

        cls = self._optimizer_class
        if issubclass(cls, FusedAdamW) or not issubclass(cls, (torch.optim.Adam,
                                                               torch.optim.AdamW)):
            return False  # FusedAdamW's own step is already the fused kernel
        if not all(fused_path_supported(cls, g) for g in self.optim.param_groups):
            return False
        if self._fused_kernel_usable is None:
            # From all params, not this rank's: every rank must take the same path.
            self._fused_kernel_usable = all(p.is_contiguous() for p in self._all_params) and all(
                kernels.native_available("fused_adamw_", d)
                for d in {p.device for p in self._all_params})
        return self._fused_kernel_usable

    def _fused_step(self) -> FusedShardStep:
        if self._stepper is None:
            self._stepper = FusedShardStep(self, self._chunks_per_step())
        return self._stepper

    def _chunks_per_step(self) -> int:
        """Chunks pay off only when the exchange can overlap the compute (_overlapped) and
        each is big enough to hide a collective's fixed cost. Decided from the mean share,
        which every rank computes alike (the broadcast sequence must match)."""
        if not self._overlapped():
            return 1
        mean_share = sum(b.numel for b in self._buckets) // self.world_size
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
        if self.sharding == layout.PARAM:
            return sum(p.numel() for p, r in zip(self._all_params, self._owner) if r == self.rank)
        return sum(pc.length for b in self._buckets for pc in b.pieces(self.rank))

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
            groups_mod.validate_hyperparameters(self._optimizer_class, [group], self.defaults)
            lines = groups_mod.describe([group], {"add_param_group": len(self.param_groups)})
        except Exception as exc:  # noqa: BLE001
            error, lines = exc, []
        self._agree_across_ranks(error, lines)

        super().add_param_group(group)
        gi = len(self.param_groups) - 1
        ids = list(range(len(self._all_params), len(self._all_params) + len(group["params"])))
        self._all_params.extend(group["params"])
        self._group_of.extend([gi] * len(group["params"]))
        self._is_trainable_mask = self._trainable_mask()
        self._add_generation(ids, initial=False)
        self._stepper, self._regions, self._fused_kernel_usable = None, None, None
        hyper = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
        self.optim.add_param_group({**hyper, "params": self._local_params_of_group(gi)})

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Local step on this rank's share, then every rank's update reaches every rank."""
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            logger.warning("zero_ext: the trainable parameters changed; rebuilding buckets")
            self._rebuild_buckets()
            self._is_trainable_mask = mask
        self._copy_hyperparameters(self.param_groups, self.optim.param_groups)
        if not kwargs and self._fused_step_supported():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._fused_step_and_sync()
        else:
            t0 = time.perf_counter()
            loss = self._generic_step(closure, **kwargs)
            t1 = time.perf_counter()
            self._sync_params()
            t2 = time.perf_counter()
            self.last_step_timings = {"local": t1 - t0, "comm": t2 - t1, "total": t2 - t0}
        self._copy_hyperparameters(self.optim.param_groups, self.param_groups)
        return loss

    def _fused_step_and_sync(self) -> None:
        stepper = self._fused_step()
        t0 = time.perf_counter()
        if not self._overlapped():
            stepper.run()
            t1 = time.perf_counter()
            self._sync_params()
            t2 = time.perf_counter()
            self.last_step_timings = {"local": t1 - t0, "comm": t2 - t1, "total": t2 - t0}
            return
        # Chunk k of every rank's range goes out as soon as this rank has computed its own.
        regions = self._chunk_regions()
        pipe = self._exchanger.pipeline()
        comm = [0.0]

        def send(k: int) -> None:
            t = time.perf_counter()
            pipe.send(regions[k])
            comm[0] += time.perf_counter() - t

        stepper.run(after_chunk=send)
        t1 = time.perf_counter()
        pipe.finish()
        t2 = time.perf_counter()
        # "comm" is the time this rank waited for the exchange (the rest overlapped).
        self.last_step_timings = {"local": t1 - t0 - comm[0], "comm": comm[0] + t2 - t1,
                                  "total": t2 - t0}

    def _chunk_regions(self) -> list[list[tuple[torch.Tensor, int]]]:
        """(region, owner) per chunk, for every rank's range of every bucket: the order of
        the overlapped exchange. The generic step sends the same sequence, so ranks agree
        on the collectives whichever step they took."""
        if self._regions is None:
            chunks = self._chunks_per_step()
            out: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(chunks)]
            for bi, b in enumerate(self._buckets):
                align = kernels.flatten.alignment_elems(b.dtype)
                for r, (lo, hi) in enumerate(b.rank_ranges):
                    for k, (a, z) in enumerate(chunk_bounds(lo, hi, chunks, align)):
                        if z > a:
                            out[k].append((self._buffers[bi][a:z], r))
            self._regions = out
        return self._regions

    def _generic_step(self, closure, **kwargs):
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
        for sh in self._shards:
            for run in sh["runs"]:
                pc = run["pieces"][0]
                g = self._all_params[pc.param_id].grad
                run["param"].grad = (None if g is None else
                                     g.detach().reshape(-1)[pc.start:pc.start + pc.length])

    def _detach_shard_grads(self) -> None:
        """Drop the views again so the user's zero_grad(set_to_none) frees the grads."""
        for sh in self._shards:
            for run in sh["runs"]:
                run["param"].grad = None

    @staticmethod
    def _copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    def _rebuild_buckets(self) -> None:
        if self.sharding == layout.FLAT:
            return  # flat buckets hold every param, trainable or not
        self._buckets, self._buffers = [], {}
        for ids in self._generations:
            self._build_generation_buckets(ids)
        self._stepper, self._regions = None, None

    def _sync_params(self) -> None:
        """Send this rank's updated range of every bucket to all ranks."""
        if self._overlapped():
            pipe = self._exchanger.pipeline()
            for regions in self._chunk_regions():
                pipe.send(regions)
            pipe.finish()
            return
        if self.world_size == 1:
            if self.sharding == layout.FLAT and not self.parameters_as_bucket_view:
                self._scatter_own_ranges()
            return
        works, received = [], []
        for bi, b in enumerate(self._buckets):
            if self.parameters_as_bucket_view:
                full = self._buffers[bi]
                regions = [full[lo:hi] for lo, hi in b.rank_ranges]
                works += self._exchanger.exchange(regions, full)
                continue
            regions = []
            for r, (lo, hi) in enumerate(b.rank_ranges):
                if r != self.rank:
                    regions.append(torch.empty(hi - lo, dtype=b.dtype, device=b.device))
                elif self.sharding == layout.FLAT:
                    regions.append(self._buffers[bi])
                else:
                    regions.append(self._pack_range(b, r, torch.empty))
            works += self._exchanger.exchange(regions)
            received.append((b, regions))
        wait_all(works)
        for b, regions in received:
            for r, region in enumerate(regions):
                if r == self.rank and self.sharding == layout.PARAM:
                    continue  # the params themselves were updated
                self._unpack_range(b, r, region)

    def _scatter_own_ranges(self) -> None:
        for bi, b in enumerate(self._buckets):
            self._unpack_range(b, self.rank, self._buffers[bi])

    def _pack_range(self, b: layout.Bucket, r: int, alloc) -> torch.Tensor:
        """Rank r's range of bucket b gathered from the params into a new tensor (`alloc`
        is torch.empty or torch.zeros: whether the padding must be deterministic)."""
        lo, hi = b.rank_ranges[r]
        out = alloc(hi - lo, dtype=b.dtype, device=b.device)
        pieces = b.pieces(r)
        kernels.flatten_into([self._piece_view(pc) for pc in pieces], out,
                             [pc.bucket_start - lo for pc in pieces])
        return out

    def _unpack_range(self, b: layout.Bucket, r: int, region: torch.Tensor) -> None:
        """Copy rank r's range of bucket b (`region`) back into the params' elements."""
        lo = b.rank_ranges[r][0]
        pieces = b.pieces(r)
        kernels.unflatten_from(region, [self._piece_view(pc) for pc in pieces],
                               [pc.bucket_start - lo for pc in pieces])

    # ------------------------------------------------------------------ join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

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
