"""zero_ext.ddp_zero_hook.reduce_scatter_hook: grads reduce-scattered to their owners in
DDP's backward, against DDP's own all-reduce + a plain torch.optim.AdamW.

Every scenario runs two copies of one model on every rank, fed the same per-rank batches
through a REAL DDP backward: the reference (DDP's default all-reduce, torch's AdamW, torch's
clip_grad_norm_, GradScaler) and the candidate (DDP + reduce_scatter_hook + zero_ext, its
clip_grad_norm_). After every step the params must agree (atol/rtol 1e-6; Adam amplifies
rounding in near-zero grads, hence not bitwise) and be bitwise equal on every rank; the
returned grad norms agree to fp32 rounding. Covered: both sharding modes, bucket views,
gradient_as_bucket_view, several small DDP buckets (DDP rebuilds them after iteration 1),
grad accumulation under no_sync, find_unused_parameters with an unused branch and a frozen
param, the hook state None (the optimizer found from the bucket's params), GradScaler,
bf16 params with master weights, a hybrid layout (2 replicas x 2 shards), state dicts
across modes, and the errors: torch's clip (or any in-place change / replacement of the
grads) after the hook, and Join.
"""
from __future__ import annotations

import pytest
import torch

from _dist import gloo_available, run_world
from zero_ext.sync import REDUCE_SCATTER

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

TOL = dict(atol=1e-6, rtol=1e-6)
HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))


class _Net(torch.nn.Module):
    def __init__(self, unused_branch=False, frozen=False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(12, 24)
        self.mid = torch.nn.Linear(24, 40)
        self.norm = torch.nn.LayerNorm(40)
        self.head = torch.nn.Linear(40, 5)
        self.unused = torch.nn.Linear(40, 3) if unused_branch else None
        if frozen:
            self.mid.bias.requires_grad_(False)
        self.to(dtype)

    def forward(self, x, use_branch=False):
        h = torch.relu(self.emb(x))
        h = self.norm(torch.relu(self.mid(h)))
        out = self.head(h)
        if use_branch and self.unused is not None:
            out = out + self.unused(h).sum()
        return out


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _batch(rank, it, micro=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * it + 10 * rank + micro)
    return torch.randn(6 + rank, 12, generator=g).to(dtype)  # uneven per-rank batches


def _pair(rank, cfg, group=None):
    """(reference DDP + AdamW, candidate DDP + hook + zero_ext) on one model's copies."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook
    from zero_ext.reduce_scatter import plan, transport

    if cfg.get("segment_bytes"):  # (a fresh process per world: no other test sees it)
        plan.SEGMENT_BYTES = cfg["segment_bytes"]
    if cfg.get("transport"):  # NCCL's form (reduce_scatter_tensor), here on gloo
        transport.TRANSPORT = cfg["transport"]
    if "local_world" in cfg:  # torchrun's ranks per node (sharding="auto" reads it)
        import os
        os.environ["LOCAL_WORLD_SIZE"] = str(cfg["local_world"])
    dtype = cfg.get("dtype", torch.float32)
    kw = dict(bucket_cap_mb=0.002,  # several buckets even for this small model
              find_unused_parameters=cfg.get("find_unused", False),
              gradient_as_bucket_view=cfg.get("grad_view", False))
    net_kw = dict(unused_branch=cfg.get("find_unused", False), frozen=cfg.get("frozen", False),
                  dtype=dtype)
    m_ref, m_zero = _Net(**net_kw), _Net(**net_kw)
    if dtype != torch.float32:  # the reference steps float32 masters, as master_weights do
        m_ref = m_ref.float()
    ref = DDP(m_ref, **kw)
    zero = DDP(m_zero, **kw)
    o_ref = torch.optim.AdamW(_groups(m_ref), **HP)
    o_zero = ZeroRedundancyOptimizer(_groups(m_zero), torch.optim.AdamW, process_group=group,
                                     sharding=cfg.get("sharding", "param"),
                                     parameters_as_bucket_view=cfg.get("bucket_view", False),
                                     master_weights=dtype != torch.float32, **HP)
    zero.register_comm_hook(None if cfg.get("state_none") else o_zero, reduce_scatter_hook)
    return (ref, o_ref), (zero, o_zero)


def _iteration(rank, it, ddp, opt, cfg, is_ref, scaler=None):
    dtype = cfg.get("dtype", torch.float32)
    micro = cfg.get("accumulate", 1)
    use_branch = cfg.get("find_unused", False) and it % 2 == 1
    for k in range(micro):
        x = _batch(rank, it, k, torch.float32 if is_ref else dtype)
        ctx = ddp.no_sync() if k < micro - 1 else torch.enable_grad()
        with ctx:
            loss = ddp(x, use_branch).float().square().mean() / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
    norm = None
    if cfg.get("clip"):
        if scaler is not None:
            scaler.unscale_(opt)
        norm = (torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05) if is_ref
                else opt.clip_grad_norm_(0.05))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()
    return norm


def _parity(rank, world, cfg):
    (ref, o_ref), (zero, o_zero) = _pair(rank, cfg)
    scalers = ((torch.amp.GradScaler("cpu", init_scale=2.0 ** 8),
                torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)) if cfg.get("scaler")
               else (None, None))
    norms = []
    for it in range(cfg.get("iters", 5)):
        n_ref = _iteration(rank, it, ref, o_ref, cfg, True, scalers[0])
        n_zero = _iteration(rank, it, zero, o_zero, cfg, False, scalers[1])
        if n_ref is not None:
            norms.append((float(n_ref), float(n_zero)))
        for (name, a), b in zip(ref.module.named_parameters(), zero.module.parameters()):
            torch.testing.assert_close(b.detach().float(), a.detach(), **cfg.get("tol", TOL),
                                       msg=lambda m, it=it, name=name: f"iter {it} {name}: {m}")
    for a, b in norms:
        assert abs(a - b) <= cfg.get("norm_rtol", 1e-5) * max(1.0, abs(a)), (a, b)
    if "resolves_to" in cfg:  # (sharding="auto": what the hook's first call made of it)
        assert (o_zero.sharding == "even") == (cfg["resolves_to"] == "even"), o_zero.sharding
    return [p.detach().clone() for p in zero.module.parameters()]


def _same_everywhere(per_rank):
    for r in range(1, len(per_rank)):
        for a, b in zip(per_rank[0], per_rank[r]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


CASES = {
    "param": dict(sharding="param", clip=True),
    "flat": dict(sharding="flat", clip=True),
    "even": dict(sharding="even", clip=True),
    "even-accumulate-grad-scaler": dict(sharding="even", accumulate=2, scaler=True, clip=True,
                                        grad_view=True),
    # DDP buckets cut into several all_to_alls (each a share of every rank's runs)
    "param-segments": dict(sharding="param", clip=True, segment_bytes=256),
    "flat-segments-grad-view": dict(sharding="flat", clip=True, segment_bytes=256,
                                    grad_view=True),
    "even-segments": dict(sharding="even", clip=True, segment_bytes=256),
    # the segments by reduce_scatter_tensor, as on NCCL (W equal blocks, padded)
    "even-reduce-scatter": dict(sharding="even", clip=True, transport="reduce_scatter"),
    "param-reduce-scatter-segments": dict(sharding="param", clip=True, segment_bytes=256,
                                          transport="reduce_scatter"),
    "flat-reduce-scatter-scaler-accumulate": dict(
        sharding="flat", clip=True, scaler=True, accumulate=2, grad_view=True,
        transport="reduce_scatter"),
    "param-bucket-view": dict(sharding="param", bucket_view=True, clip=True),
    "flat-bucket-view-grad-view": dict(sharding="flat", bucket_view=True, grad_view=True,
                                       clip=True),
    "accumulate-no-sync": dict(sharding="flat", accumulate=3, clip=True),
    "unused-and-frozen": dict(sharding="param", find_unused=True, frozen=True, clip=True),
    "state-none": dict(sharding="flat", state_none=True),
    "grad-scaler": dict(sharding="flat", scaler=True, clip=True, grad_view=True),
    # sharding="auto" turns even at the hook's first call (nothing stepped yet) when the
    # ranks span nodes (one rank per node here) ...
    "auto": dict(sharding="auto", clip=True, local_world=1, resolves_to="even"),
    "auto-state-none-grad-scaler": dict(sharding="auto", state_none=True, scaler=True,
                                        local_world=1, resolves_to="even"),
    # ... but not with bucket views (even has none), nor on one node
    "auto-bucket-view": dict(sharding="auto", bucket_view=True, clip=True, local_world=1,
                             resolves_to="not even"),
    "auto-one-node": dict(sharding="auto", clip=True, local_world=3, resolves_to="not even"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_ddp_allreduce_and_adamw(world, case):
    if world == 3 and case not in ("param", "flat", "even", "accumulate-no-sync",
                                   "grad-scaler", "even-segments", "even-reduce-scatter", "auto"):
        pytest.skip("world 3 runs the main cases only (2 cores)")
    _same_everywhere(run_world(_parity, world, CASES[case]))


def _own_share_calls(rank, world, cfg):
    """_parity with every hook all_to_all recorded: (this rank's input and output split,
    the other ranks' output split: this rank's share, whether the rank is a middle one)."""
    import torch.distributed as dist

    real, seen = dist.all_to_all_single, []

    def spy(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        if input_split_sizes is not None:  # (the agreements' all_to_all gives none)
            middle = 0 < rank < world - 1
            seen.append((input_split_sizes[rank], output_split_sizes[rank],
                         max(output_split_sizes), middle))
        return real(out, inp, output_split_sizes=output_split_sizes,
                    input_split_sizes=input_split_sizes, **kw)

    dist.all_to_all_single = spy
    try:
        params = _parity(rank, world, cfg)
    finally:
        dist.all_to_all_single = real
    return params, seen


@pytest.mark.parametrize("world", [2, 3])
def test_own_share_stays_home(world):
    """A rank's own share of a segment is summed where it lies in the bucket, not sent to
    itself (the scratch holds only the other ranks' copies): every hook all_to_all sends
    this rank nothing of its own, but where the send is a slice of the bucket with the own
    share in the middle (world 3, rank 1: then exactly its share, to itself); the params
    still match DDP + AdamW. Param mode at world 3 has both kinds of segment on rank 1.
    bf16 (its own share summed in float32 scratch) at world 2 only: at world 3 this test's
    float32 reference's grad norm drifts 8% from bf16's, the same before the own share
    stayed home."""
    bf16 = dict(dtype=torch.bfloat16, tol=dict(atol=2e-2, rtol=2e-2), norm_rtol=5e-2)
    cfgs = [dict(sharding="even", clip=True, segment_bytes=256),
            dict(sharding="flat", clip=True, segment_bytes=256, **(bf16 if world == 2 else {}))]
    if world == 3:
        cfgs.append(dict(sharding="param", clip=True))
    for cfg in cfgs:
        results = run_world(_own_share_calls, world, cfg)
        _same_everywhere([params for params, _ in results])
        for rank, (_, seen) in enumerate(results):
            owning = [c for c in seen if c[2] > 0]  # (a share of the segment is this rank's)
            kept = [c for c in owning if c[0] == 0 and c[1] == 0]
            assert kept, f"rank {rank} sent its own share in every all_to_all: {owning[:4]}"
            travelled = [c for c in owning if c not in kept]
            # only a middle rank's in-place send carries its share, and exactly that
            assert all(c[3] and c[0] == c[1] == c[2] for c in travelled), (rank, travelled)
            if cfg["sharding"] == "param" and 0 < rank < world - 1:
                assert travelled, f"rank {rank}: the in-place middle send was not exercised"


def test_bf16_own_share_at_world_3():
    """bf16 at world 3, in segments: each owner sums its own share (packed into the float32
    scratch first) and the two others'; against the same bf16 model under DDP's all-reduce
    (test_nccl_paths' same-precision reference), on every rank."""
    from test_nccl_paths import _parity as same_precision_parity
    from test_nccl_paths import _same_everywhere as same_on_every_rank

    same_on_every_rank(run_world(same_precision_parity, 3, dict(
        sharding="flat", dtype="bf16", hook=True, transport="all_to_all",
        bucket_mb=0.00005)))


def test_bf16_master_weights():
    """bf16 params + master weights: the owner sums the bf16 grads in float32; the params
    follow an fp32 AdamW on the averaged grads to bf16 rounding."""
    cfg = dict(sharding="flat", dtype=torch.bfloat16, clip=True, tol=dict(atol=2e-2, rtol=2e-2),
               norm_rtol=5e-2)  # (the reference's forward runs in float32)
    _same_everywhere(run_world(_parity, 2, cfg))


# ------------------------------------------------------------------ hybrid layout

def _hybrid(rank, world, sharding, segment_bytes=None, transport=None):
    from zero_ext import hybrid_groups

    shard, _replica = hybrid_groups(shard_size=2)
    (ref, o_ref), (zero, o_zero) = _pair(rank, dict(sharding=sharding, transport=transport,
                                                    segment_bytes=segment_bytes), group=shard)
    for it in range(4):
        _iteration(rank, it, ref, o_ref, {"clip": True}, True)
        _iteration(rank, it, zero, o_zero, {"clip": True}, False)
        for a, b in zip(ref.module.parameters(), zero.module.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return [p.detach().clone() for p in zero.module.parameters()]


@pytest.mark.parametrize("sharding", ["param", "flat", "even"])
def test_hybrid_layout_two_replicas_of_two_shards(sharding):
    _same_everywhere(run_world(_hybrid, 4, sharding))


def test_hybrid_layout_with_segmented_buckets():
    """Each segment's owned sum is all-reduced across the replicas in segment order."""
    _same_everywhere(run_world(_hybrid, 4, "even", 256))


def test_hybrid_layout_by_reduce_scatter():
    _same_everywhere(run_world(_hybrid, 4, "even", 256, "reduce_scatter"))


def _transport_calls(rank, world, transport, dtype):
    """The hook's collectives in one iteration after DDP's rebuild: (name, input numel,
    output numel) per call."""
    import torch.distributed as dist

    calls, real = [], {n: getattr(dist, n) for n in ("all_to_all_single", REDUCE_SCATTER)}

    def spy(name):
        def call(out, inp, *args, **kw):
            if inp.dtype not in (torch.int64, torch.float64):  # (not an agreement's)
                calls.append((name, inp.numel(), out.numel()))
            return real[name](out, inp, *args, **kw)
        return call

    cfg = dict(sharding="even", transport=transport, dtype=dtype, clip=True,
               tol=dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else TOL)
    (ref, o_ref), (zero, opt) = _pair(rank, cfg)
    for it in range(3):
        if it == 2:
            for n in real:
                setattr(dist, n, spy(n))
        try:
            _iteration(rank, it, ref, o_ref, cfg, True)
            _iteration(rank, it, zero, opt, cfg, False)
        finally:
            for n, f in real.items():
                setattr(dist, n, f)
        for a, b in zip(ref.module.parameters(), zero.module.parameters()):
            torch.testing.assert_close(b.detach().float(), a.detach(), **cfg["tol"])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_transport_is_what_runs(world, dtype):
    """Forced (as NCCL picks it), every segment is one reduce_scatter_tensor of W equal
    blocks, and no all_to_all runs; by default on gloo it is all_to_all. Both train to
    parity with DDP + AdamW (bf16: its sums in bf16 on the wire, as DDP's own all-reduce)."""
    for calls in run_world(_transport_calls, world, "reduce_scatter", dtype):
        names = {n for n, _, _ in calls}
        assert names == {REDUCE_SCATTER}, calls
        assert all(i == world * o for _, i, o in calls), calls
    for calls in run_world(_transport_calls, world, "auto", dtype):
        assert {n for n, _, _ in calls} == {"all_to_all_single"}, calls


def test_unknown_transport_is_a_value_error(monkeypatch):
    from zero_ext.reduce_scatter import transport

    monkeypatch.setattr(transport, "TRANSPORT", "ring")
    with pytest.raises(ValueError, match="ZERO_EXT_HOOK_TRANSPORT"):
        transport.reduces_by_scatter(torch.zeros(1), "gloo", [1])


def test_auto_takes_reduce_scatter_on_nccl_only_for_near_equal_shares(monkeypatch):
    """reduce_scatter_tensor moves W equal blocks: a segment one rank owns (param mode)
    would cost W-1 times its size per rank, so "auto" keeps all_to_all there."""
    from types import SimpleNamespace

    from zero_ext.reduce_scatter import transport as grad_reduce

    cuda = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(grad_reduce, "TRANSPORT", "auto")
    by_scatter = grad_reduce.reduces_by_scatter
    assert by_scatter(cuda, "nccl", [100, 100, 100, 100])
    assert by_scatter(cuda, "nccl", [100, 100, 100, 90])  # chunk rounding
    assert not by_scatter(cuda, "nccl", [400, 0, 0, 0])
    assert not by_scatter(cuda, "nccl", [150, 100, 100, 50])
    assert not by_scatter(SimpleNamespace(is_cuda=False), "nccl", [100, 100, 100, 100])
    assert not by_scatter(cuda, "gloo", [100, 100, 100, 100])


def _fp16_large_grads(rank, world, transport):
    """Identical batches on every rank, the loss scaled so that the largest local grad is
    4e4: the sum of W copies overflows float16 (65504) unless divided first, as DDP does.
    Returns the largest error of this rank's averaged owned grads against DDP's (fp32), over
    the largest grad."""
    import torch.distributed as dist

    cfg = dict(sharding="even", dtype=torch.float16, transport=transport)
    (ref, _), (zero, opt) = _pair(rank, cfg)
    x = _batch(0, 0)  # the same on every rank
    ref(x).square().mean().backward()  # (DDP's first iteration: all-reduced by the hook)
    g_max = torch.tensor([max(p.grad.abs().max().item() for p in ref.parameters()
                              if p.grad is not None and p.grad.numel())])
    dist.all_reduce(g_max, op=dist.ReduceOp.MAX)
    scale = 4e4 / g_max.item()
    for p in list(ref.parameters()) + list(zero.parameters()):
        p.grad = None
    zero(x.half()).float().square().mean().backward()
    for p in zero.parameters():
        p.grad = None
    (ref(x).square().mean() * scale).backward()
    (zero(x.half()).float().square().mean() * scale).backward()
    worst = 0.0
    runs = opt.hook_seam.ownership().runs
    ref_of = {id(b): a for a, b in zip(ref.parameters(), zero.parameters())}
    for pid, b in enumerate(opt.hook_seam.params):  # (the optimizer's order: its groups)
        a = ref_of[id(b)]
        for r, start, length in runs.get(pid, ()):
            if r == rank and length:
                mine = b.grad.reshape(-1)[start:start + length].float()
                want = a.grad.reshape(-1)[start:start + length]
                assert torch.isfinite(mine).all(), f"param {pid}: inf/nan in owned grads"
                worst = max(worst, (mine - want).abs().max().item())
    return worst / 4e4  # (relative to the largest grad: fp16's forward rounds too)


@pytest.mark.parametrize("transport", ["reduce_scatter", "all_to_all"])
def test_fp16_grads_near_the_top_of_the_range_are_averaged_not_overflowed(transport):
    for worst in run_world(_fp16_large_grads, 2, transport):
        assert worst <= 1e-2, worst


# ------------------------------------------------------------------ checkpoints across modes

def _across_modes(rank, world):
    """3 steps with the hook, state_dict() on every rank; a new optimizer without the hook
    loads it and trains on: equal to 6 plain steps of the reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer

    cfg = dict(sharding="flat", clip=True)
    (ref, o_ref), (zero, o_zero) = _pair(rank, cfg)
    for it in range(3):
        _iteration(rank, it, ref, o_ref, cfg, True)
        _iteration(rank, it, zero, o_zero, cfg, False)
    sd = o_zero.state_dict()
    plain = DDP(zero.module, bucket_cap_mb=0.002)  # DDP's own all-reduce from here on
    o2 = ZeroRedundancyOptimizer(_groups(zero.module), torch.optim.AdamW, sharding="param", **HP)
    o2.load_state_dict(sd if rank == 0 else None)
    for it in range(3, 6):
        _iteration(rank, it, ref, o_ref, cfg, True)
        _iteration(rank, it, plain, o2, cfg, False)
    for a, b in zip(ref.module.parameters(), zero.module.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return [p.detach().clone() for p in zero.module.parameters()]


def test_state_dict_from_the_hook_mode_loads_without_it():
    _same_everywhere(run_world(_across_modes, 2))


# ------------------------------------------------------------------ what must raise

def _misuse(rank, world, how):
    cfg = dict(sharding="param", grad_view=how == "torch-clip-bucket-view")
    _, (zero, opt) = _pair(rank, cfg)
    _iteration(rank, 0, zero, opt, {}, False)  # one good step
    if how == "closure-torch-clip":  # backward inside step(closure), as Lightning does
        def closure():
            opt.zero_grad()
            loss = zero(_batch(rank, 1)).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3)
            return loss
        before = [p.detach().clone() for p in zero.parameters()]
        try:
            opt.step(closure)
        except RuntimeError as exc:
            assert all(torch.equal(a, b) for a, b in zip(before, zero.parameters()))
            return str(exc)
        return None
    zero(_batch(rank, 1)).square().mean().backward()
    if how.startswith("torch-clip"):
        torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3)
    elif how == "scale-one-grad":
        next(zero.parameters()).grad.mul_(0.5)
    elif how == "replace-grad":
        p = next(zero.parameters())
        p.grad = p.grad.clone()
    elif how == "torch-clip-in-a-step-pre-hook":  # the step reads the grads after its hooks
        opt.register_step_pre_hook(
            lambda o, args, kwargs: torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3))
    elif how == "scaler-then-torch-clip":
        scaler = torch.amp.GradScaler("cpu")
        opt.zero_grad()
        scaler.scale(zero(_batch(rank, 2)).square().mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3)
        try:
            scaler.step(opt)
        except RuntimeError as exc:
            return str(exc)
        return None
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how", ["torch-clip", "torch-clip-bucket-view", "scale-one-grad",
                                 "replace-grad", "scaler-then-torch-clip",
                                 "closure-torch-clip", "torch-clip-in-a-step-pre-hook"])
def test_grads_changed_after_the_hook_raise_on_every_rank(how):
    msgs = run_world(_misuse, 2, how)
    for m in msgs:
        assert m is not None and "clip_grad_norm_" in m, m


def _step_that_never_started(rank, world):
    """Grads changed after the hook, then a step that fails in a pre-hook before it starts;
    zero_grad and a clean backward: that step is a normal one (nothing of the first one's
    verdict is left behind), equal to DDP + AdamW's."""
    (ref, o_ref), (zero, opt) = _pair(rank, dict(sharding="even"))
    for ddp, o in ((ref, o_ref), (zero, opt)):
        _iteration(rank, 0, ddp, o, {}, ddp is ref)
    zero(_batch(rank, 1)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(zero.parameters(), 1e-3)

    def refuse(o, args, kwargs):
        raise ValueError("not now")

    handle = opt.register_step_pre_hook(refuse)
    try:
        opt.step()
    except ValueError as exc:
        first = str(exc)
    handle.remove()
    opt.zero_grad()
    for ddp, o in ((ref, o_ref), (zero, opt)):
        _iteration(rank, 1, ddp, o, {}, ddp is ref)
    for a, b in zip(ref.module.parameters(), zero.module.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return first


def test_a_step_that_never_started_leaves_no_verdict_behind():
    assert run_world(_step_that_never_started, 2) == ["not now"] * 2


def _join(rank, world):
    from torch.distributed.algorithms.join import Join

    _, (zero, opt) = _pair(rank, dict(sharding="param"))
    try:
        with Join([zero, opt]):
            zero(_batch(rank, 0)).square().mean().backward()
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_join_is_a_clear_error():
    for m in run_world(_join, 2):
        assert m is not None and "Join" in m, m


def _bytes(rank, world, sharding):
    """Elements this rank sends in the hook's all_to_all per iteration vs the model."""
    import torch.distributed as dist

    sent = []
    real = dist.all_to_all_single

    def counting(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        if inp.dtype not in (torch.int64, torch.float64):  # (not an agreement's)
            sent.append(sum(n for r, n in enumerate(input_split_sizes) if r != rank))
        return real(out, inp, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = counting
    try:
        _, (zero, opt) = _pair(rank, dict(sharding=sharding))
        for it in range(2):
            sent.clear()
            _iteration(rank, it, zero, opt, {}, False)
    finally:
        dist.all_to_all_single = real
    return sum(sent), sum(p.numel() for p in zero.module.parameters())


@pytest.mark.parametrize("sharding", ["param", "flat", "even"])
def test_each_rank_sends_only_what_others_own(sharding):
    """Over the ranks, the hook sends (W-1)/W of the model's grads per rank on average
    (each element once to its owner from every other rank): half of DDP's all-reduce."""
    out = run_world(_bytes, 2, sharding)
    total = out[0][1]
    assert sum(s for s, _ in out) == total  # W=2: every element leaves one rank once


def _shares(rank, world, sharding):
    """After DDP's rebuild: per DDP bucket, the elements each rank receives in the hook's
    all_to_all (from the bucket plans the hook sends by) and the padding that would make
    every param of it a multiple of the world; per exchange message of the step, the
    elements each owner contributes."""
    from zero_ext import sync
    from zero_ext.reduce_scatter import hook

    _, (zero, opt) = _pair(rank, dict(sharding=sharding))
    for it in range(3):
        _iteration(rank, it, zero, opt, {}, False)
    params = opt._all_params
    buckets = []
    for bp in hook.reducer_of(opt).buckets.values():
        pad = sum(-(-params[i].numel() // world) * world - params[i].numel()
                  for i in bp.param_ids)
        buckets.append((list(bp.splits), pad))
    exchanged = [0] * world
    for messages in opt._replicas._messages.values():
        for m in messages:
            if isinstance(m, sync.Gather):
                for _, ranges, _ in m.params:
                    for r, (lo, hi) in enumerate(ranges):
                        exchanged[r] += hi - lo
            else:
                exchanged[m.owner] += m.numel
    total_pad = sum(-(-p.numel() // world) * world - p.numel() for p in params)
    return buckets, exchanged, total_pad


@pytest.mark.parametrize("world", [3, 4])
def test_even_mode_splits_every_bucket_and_the_exchange_evenly(world):
    """sharding="even": in every DDP bucket each rank's share differs from another's by at
    most the bucket's padding, and so do the owners' parts of the params' exchange; flat
    mode (whole ranges of one flat buffer) gives a DDP bucket to one or two ranks."""
    buckets, exchanged, pad = run_world(_shares, world, "even")[0]
    assert len(buckets) >= 2
    for splits, bucket_pad in buckets:
        assert max(splits) - min(splits) <= bucket_pad, (splits, bucket_pad)
    assert max(exchanged) - min(exchanged) <= pad, (exchanged, pad)
    flat, _, _ = run_world(_shares, world, "flat")[0]  # the check can fail
    assert any(max(s) - min(s) > p for s, p in flat), flat


def _accumulate(rank, world, how):
    """Two backwards before one step: without no_sync the second reduction would mix
    averaged and local grads: an error on every rank; zeroed in between: fine. Also through
    a second DDP wrap of the model while the first one lives on, and through
    ``ddp.forward`` called directly (no module hook of the DDP model runs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    cap = 25 if how.startswith("one-bucket") else 0.002
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=cap, gradient_as_bucket_view=how.endswith("grad-view"))
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, sharding="flat", **HP)
    ddp.register_comm_hook(None, reduce_scatter_hook)
    ref = DDP(_Net(), bucket_cap_mb=cap)
    o_ref = torch.optim.AdamW(ref.module.parameters(), **HP)
    if "rewrap" in how:  # trained through the first wrap, then a second over the same model
        for it in range(2):
            ddp(_batch(rank, it)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        first, ddp = ddp, DDP(net, bucket_cap_mb=cap)  # (the first one kept alive)
        ddp.register_comm_hook(None, reduce_scatter_hook)
    run = ddp.forward if "forward-direct" in how else ddp
    for it in range(2):
        run(_batch(rank, it)).square().mean().backward()
        if "zeroed" in how and "after-forward" not in how:
            ddp.zero_grad(set_to_none=False)  # the first micro-batch discarded, in place
        loss = run(_batch(rank, it, 1)).square().mean()
        if "after-forward" in how:  # (zeroed between the forward and its backward)
            ddp.zero_grad(set_to_none=False)
        loss.backward()
        try:
            opt.step()
        except RuntimeError as exc:
            return str(exc)
        opt.zero_grad()
        ref(_batch(rank, it, 1)).square().mean().backward()
        o_ref.step()
        o_ref.zero_grad()
    for a, b in zip(ref.module.parameters(), net.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return None


@pytest.mark.parametrize("how", ["one-bucket", "buckets", "one-bucket-grad-view",
                                 "one-bucket-zeroed", "buckets-zeroed-grad-view",
                                 "buckets-zeroed-after-forward", "buckets-rewrap",
                                 "buckets-forward-direct"])
def test_two_backwards_without_no_sync(how):
    msgs = run_world(_accumulate, 2, how)
    for m in msgs:
        if "zeroed" in how:
            assert m is None, m
        else:
            assert m is not None and "no_sync" in m, m


def _newest(rank, world):
    """state None: the hook uses the most recently built optimizer over the params, on
    every rank, although an older one over the same params is still alive."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook
    from zero_ext.reduce_scatter.hook import _REDUCERS

    (ref, o_ref), (zero, old) = _pair(rank, dict(sharding="param"))
    new = ZeroRedundancyOptimizer(_groups(zero.module), torch.optim.AdamW, sharding="flat",
                                  **HP)
    fresh = DDP(zero.module, bucket_cap_mb=0.002)
    fresh.register_comm_hook(None, reduce_scatter_hook)
    for it in range(3):
        _iteration(rank, it, ref, o_ref, {"clip": True}, True)
        _iteration(rank, it, fresh, new, {"clip": True}, False)
    for a, b in zip(ref.module.parameters(), zero.module.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL)
    return new in _REDUCERS, old in _REDUCERS


def test_hook_without_state_takes_the_newest_optimizer():
    for used_new, used_old in run_world(_newest, 2):
        assert used_new and not used_old


def _zero_grad_then_step(rank, world):
    """backward, zero_grad (grads None), step: nothing to step, no error (as torch)."""
    _, (zero, opt) = _pair(rank, dict(sharding="flat"))
    zero(_batch(rank, 0)).square().mean().backward()
    before = [p.detach().clone() for p in zero.parameters()]
    opt.zero_grad()
    opt.step()
    return all(torch.equal(a, b) for a, b in zip(before, zero.parameters()))


def test_zero_grad_then_step_is_not_an_error():
    assert all(run_world(_zero_grad_then_step, 2))


def _dropped_before_its_step(rank, world):
    """An optimizer dropped after a backward through the hook, before any step (a
    replacement built instead), three times over: the watch it left for a second backward
    (a global module forward pre-hook) goes with it. Left behind, every forward of the
    process would run it, and torch.compile would compile nothing while it is there."""
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    torch.manual_seed(0)
    ddp = DDP(_Net(), bucket_cap_mb=0.002)
    ddp.register_comm_hook(None, reduce_scatter_hook)
    counts = []
    for phase in range(3):
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **HP)
        for it in range(2):
            ddp(_batch(rank, it)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        ddp(_batch(rank, 9)).square().mean().backward()  # reduced, never stepped
        during = len(hooks)
        gone = weakref.ref(opt)
        del opt
        gc.collect()
        ddp.zero_grad()
        counts.append((during - before, gone() is None, len(hooks) - before))
    return counts


def test_an_optimizer_dropped_before_its_step_takes_its_forward_watch_along():
    for counts in run_world(_dropped_before_its_step, 2):
        # (one watch while the record waited; none once its optimizer was freed)
        assert counts == [(1, True, 0)] * 3, counts


def _pickled(rank, world):
    """A DDP model trained through the hook pickles and deep-copies (torch.save(ddp),
    copy.deepcopy): the hook leaves nothing unpicklable on it (its watch for a second
    backward is a global forward pre-hook, and only between a backward and its step); the
    copy trains on as a plain model."""
    import copy
    import io

    _, (zero, opt) = _pair(rank, dict(sharding="flat"))
    for it in range(3):
        _iteration(rank, it, zero, opt, {}, False)
    buf = io.BytesIO()
    torch.save(zero, buf)
    twin = copy.deepcopy(zero)
    twin.module(_batch(rank, 0)).sum().backward()
    return buf.tell() > 0


def test_ddp_with_the_hook_pickles_and_deepcopies():
    assert all(run_world(_pickled, 2))


def _no_optimizer(rank, world):
    """The hook (state None) on a model no zero_ext optimizer holds: DDP's all-reduce, the
    same grads as DDP's own, and one log line saying so."""
    import logging

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("zero_ext").addHandler(handler)
    hooked, plain = DDP(_Net(), bucket_cap_mb=0.002), DDP(_Net(), bucket_cap_mb=0.002)
    hooked.register_comm_hook(None, reduce_scatter_hook)
    for it in range(3):
        for d in (hooked, plain):
            d.zero_grad()
            d(_batch(rank, it)).square().mean().backward()
        for a, b in zip(plain.parameters(), hooked.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **TOL)
    return [m for m in said if "no zero_ext ZeroRedundancyOptimizer" in m]


def test_hook_over_a_model_no_optimizer_holds_says_so_once():
    for said in run_world(_no_optimizer, 2):
        assert len(said) == 1, said
