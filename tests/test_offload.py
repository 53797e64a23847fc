"""offload_optimizer (issue 46): the share's state, masters and step on the host, against
DDP's own all-reduce + a plain torch.optim.AdamW (or the torch optimizer of the same class)
on every rank.

Every scenario runs two copies of one model on every rank, fed the same per-rank batches
through a REAL DDP backward: the reference (DDP's default all-reduce, torch's optimizer,
torch's clip_grad_norm_, GradScaler) and the candidate (DDP, optionally reduce_scatter_hook,
zero_ext with offload_optimizer). After every step the params must agree (float32:
atol = rtol = 1e-6, as tests/test_grad_reduce.py; bf16/fp16 with master weights: 2e-2, the
reference stepping float32 copies, which bf16 grads averaged in bf16 drift from; so these
runs also step a twin without the option, which the candidate must equal bitwise: offloading
changes where the step runs, not its arithmetic) and be bitwise equal on every rank. Each
scenario also
checks what only the feature does: the host part of the share is what the fraction asks,
its keys and state are memory of their own (no view of a param), grads went to the host (by
the hook's buckets where the hook runs), and, where the fraction leaves a device part, that
part's state stays under the params' own memory.

On this machine the params are on the CPU: the host keys are real copies and every copy,
staging step and packing runs (GPU-only parts: benchmarks/gpu_check.sh, section offload).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from _dist import gloo_available, run_specs, run_world

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

TOL = dict(atol=1e-6, rtol=1e-6)
# bf16/fp16 against the float32 reference: DDP averages the grads in the param dtype, and an
# Adam step moves an element by up to lr (1e-2) whatever its grad, so a near-zero grad whose
# rounding flips its sign drifts by up to 2 lr per step (seen: 2.3e-2 after 5 steps); the
# twin without offload (bitwise) is the exact check
LOW_TOL = dict(atol=4e-2, rtol=2e-2)
HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))


class _Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32, extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(12, 24)
        self.mid = torch.nn.Linear(24, 40)
        self.norm = torch.nn.LayerNorm(40)
        self.head = torch.nn.Linear(40, 5)
        self.extra = torch.nn.Linear(5, 5) if extra else None
        self.to(dtype)

    def forward(self, x):
        h = torch.relu(self.emb(x))
        h = self.norm(torch.relu(self.mid(h)))
        out = self.head(h)
        if self.extra is not None:
            out = out + self.extra(out)
        return out


def _groups(model, skip=()):
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith(skip)]
    decay = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _batch(rank, it, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * it + 10 * rank)
    return torch.randn(6 + rank, 12, generator=g).to(dtype)  # uneven per-rank batches


def _loss(ddp, x, inf_term=None):
    loss = ddp(x).float().square().mean()
    if inf_term is not None:  # (an inf in the grad of one param, on one rank)
        loss = loss + inf_term * ddp.module.head.bias.float().sum()
    return loss


def _models(cfg, pg, twin=False):
    """DDP over the reference model (float32) and the candidate's (cfg's dtype); `twin`:
    a third, the candidate's twin without offload_optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dtype = cfg.get("dtype", torch.float32)
    extra = cfg.get("add_group", False)
    kw = dict(process_group=pg, bucket_cap_mb=0.002,
              gradient_as_bucket_view=cfg.get("grad_view", False))
    out = [DDP(_Net(extra=extra), **kw), DDP(_Net(dtype, extra=extra), **kw)]
    if twin:
        out.append(DDP(_Net(dtype, extra=extra), **kw))
    return out


def _zero(params, cfg, pg, offload=None):
    from zero_ext import ZeroRedundancyOptimizer

    cls = cfg.get("cls", torch.optim.AdamW)
    hp = cfg.get("hp", HP)
    return ZeroRedundancyOptimizer(
        params, cls, process_group=pg, sharding=cfg.get("sharding", "param"),
        parameters_as_bucket_view=cfg.get("bucket_view", False),
        overlap_param_gather=cfg.get("overlap", False),
        master_weights=cfg.get("dtype", torch.float32) != torch.float32,
        offload_optimizer=cfg.get("offload", True) if offload is None else offload, **hp)


def check_host_part(opt, fraction) -> dict:
    """What offload_optimizer promises of the share's layout: the host part is the fraction
    asked (whole pieces), its keys and every state tensor under them are memory of their own
    (no view of any param's storage), and the device part's state lives under the params'
    own memory. Returns a few numbers for the caller's checks."""
    params = opt._all_params
    storages = {p.untyped_storage().data_ptr() for p in params}
    host = [lp for lp in opt.plan.local if lp.host]
    device = [lp for lp in opt.plan.local if not lp.host]
    total = sum(lp.length for lp in opt.plan.local)
    assert opt.offload_numel == sum(lp.length for lp in host)
    if fraction >= 1.0:
        assert not device and opt.offload_numel == opt.local_numel, "the whole share on host"
    elif len(opt.plan.local) >= 2:
        assert host and device, f"fraction {fraction}: host and device parts expected"
    for lp in host:
        assert lp.key.untyped_storage().data_ptr() not in storages, "a host key views a param"
        for name, v in opt.optim.state.get(lp.key, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.untyped_storage().data_ptr() not in storages, name
    for lp in device:
        assert lp.key.untyped_storage().data_ptr() in storages, "a device key is a copy"
    return {"host": opt.offload_numel, "total": total,
            "early": opt._offload.pulled_early, "at_step": opt._offload.pulled_at_step}


def _iteration(rank, it, ddp, opt, cfg, is_ref, scaler=None):
    dtype = torch.float32 if is_ref else cfg.get("dtype", torch.float32)
    inf = cfg.get("inf_at")
    inf_term = float("inf") if inf is not None and (it, rank) == tuple(inf) else None
    loss = _loss(ddp, _batch(rank, it, dtype), inf_term)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    norm = None
    if cfg.get("gather_torch_clip") and not is_ref:
        # the hook's grads made whole on every rank, then changed in place by torch's clip
        # (allowed after gather_grads): the copies the hook sent to the host are stale
        from zero_ext.ddp_zero_hook import gather_grads
        gather_grads(opt)
    if cfg.get("gather_torch_clip"):
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
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


def _compare(ref, zero, tol, it, twin=None):
    for (name, a), b in zip(ref.module.named_parameters(), zero.module.parameters()):
        torch.testing.assert_close(b.detach().float(), a.detach(), **tol,
                                   msg=lambda m, name=name: f"iter {it} {name}: {m}")
    if twin is not None:
        for (name, a), b in zip(twin.module.named_parameters(), zero.module.parameters()):
            assert torch.equal(a, b), f"iter {it} {name}: differs from the twin without offload"


def parity(cfg, ctx):
    """The scenario: reference and candidate side by side for cfg["iters"] iterations."""
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    rank, pg = ctx.rank, ctx.pg
    low = cfg.get("dtype", torch.float32) != torch.float32
    ref, zero, *twin = _models(cfg, pg, twin=low)
    cls = cfg.get("cls", torch.optim.AdamW)
    o_ref = cls(_groups(ref.module, ("extra",)), **cfg.get("hp", HP))
    o_zero = _zero(_groups(zero.module, ("extra",)), cfg, pg)
    o_twin = [_zero(_groups(t.module, ("extra",)), cfg, pg, offload=False) for t in twin]
    if cfg.get("hook"):
        for m, o in zip([zero] + twin, [o_zero] + o_twin):
            m.register_comm_hook(o, reduce_scatter_hook)
    scheds = None
    if cfg.get("scheduler"):
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=10)
                  for o in (o_ref, o_zero)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if cfg.get("scaler")
               else None for _ in range(2 + len(twin))]
    tol = LOW_TOL if low else TOL
    norms, scales = [], []
    for it in range(cfg.get("iters", 5)):
        if cfg.get("add_group") and it == 2:  # (state exists: the new pieces are placed)
            for o, m in ((o_ref, ref.module), (o_zero, zero.module)):
                o.add_param_group({"params": list(m.extra.parameters()), "lr": 5e-3})
        n_ref = _iteration(rank, it, ref, o_ref, cfg, True, scalers[0])
        n_zero = _iteration(rank, it, zero, o_zero, cfg, False, scalers[1])
        for t, o in zip(twin, o_twin):
            _iteration(rank, it, t, o, cfg, False, scalers[2])
            o.wait_for_params()
        if scheds:
            for s in scheds:
                s.step()
        if n_ref is not None:
            norms.append((float(n_ref), float(n_zero)))
        if scalers[0] is not None:
            scales.append((scalers[0].get_scale(), scalers[1].get_scale()))
        o_zero.wait_for_params()
        _compare(ref, zero, tol, it, twin[0] if twin else None)
    for a, b in norms:
        if math.isfinite(a):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)) or cfg.get("dtype"), (a, b)
    for a, b in scales:
        assert a == b, f"GradScaler scales differ from the reference's: {scales}"
    info = check_host_part(o_zero, 1.0 if cfg.get("offload", True) is True
                           else cfg["offload"])
    if not info["host"]:
        pass  # (whole pieces: a rank whose one piece is above twice its target keeps it)
    elif cfg.get("hook") and not (cfg.get("scaler") and cfg.get("clip")) \
            and not cfg.get("gather_torch_clip"):
        # grads after DDP's first iteration went to the host per bucket
        assert info["early"] > 0, info
    else:  # (no hook; or GradScaler's unscale_ rescaled them after the hook sent them)
        assert info["early"] == 0 and info["at_step"] > 0, info
    return {"params": [p.detach().clone() for p in zero.module.parameters()],
            "info": info, "scales": scales}


F32 = {}
for _mode in ("param", "flat", "even"):
    for _frac in (True, 0.5):
        F32[f"{_mode}-{_frac}"] = dict(sharding=_mode, offload=_frac, clip=True)
        F32[f"{_mode}-{_frac}-hook"] = dict(sharding=_mode, offload=_frac, clip=True, hook=True)
CASES = {
    **F32,
    "flat-hook-grad-view": dict(sharding="flat", hook=True, grad_view=True, clip=True),
    "even-hook-overlap": dict(sharding="even", hook=True, overlap=True, clip=True),
    "param-0.5-overlap": dict(sharding="param", offload=0.5, overlap=True),
    "param-bucket-view": dict(sharding="param", bucket_view=True, clip=True),
    "flat-0.5-bucket-view": dict(sharding="flat", offload=0.5, bucket_view=True),
    "flat-bf16-masters-hook": dict(sharding="flat", dtype=torch.bfloat16, hook=True, clip=True),
    "param-fp16-masters-0.5": dict(sharding="param", dtype=torch.float16, offload=0.5,
                                   clip=True),
    "even-bf16-masters-overlap": dict(sharding="even", dtype=torch.bfloat16, overlap=True),
    # GradScaler: an inf in one param's grad on rank 1 at iteration 2 skips every rank's
    # step (with the hook only that param's owner sees it); unscale_ before the clip
    # rescales grads in place after the hook sent them to the host
    "flat-scaler-inf-hook": dict(sharding="flat", hook=True, scaler=True, inf_at=(2, 1)),
    "even-scaler-unscale-clip-hook": dict(sharding="even", hook=True, scaler=True,
                                          clip=True, inf_at=(3, 0)),
    "param-0.5-scaler-unscale-clip": dict(sharding="param", offload=0.5, scaler=True,
                                          clip=True, inf_at=(1, 1)),
    "flat-add-param-group": dict(sharding="flat", add_group=True, iters=5),
    "param-0.5-add-param-group": dict(sharding="param", offload=0.5, add_group=True),
    "flat-scheduler-hook": dict(sharding="flat", scheduler=True, hook=True, clip=True),
    "even-hook-gather-grads-torch-clip": dict(sharding="even", hook=True,
                                              gather_torch_clip=True),
    # optimizers other than AdamW: torch's own CPU step of the class on the host keys
    "param-sgd-momentum": dict(sharding="param", cls=torch.optim.SGD,
                               hp=dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "flat-0.5-adagrad-hook": dict(sharding="flat", offload=0.5, hook=True,
                                  cls=torch.optim.Adagrad, hp=dict(lr=0.05)),
    "even-adam-l2-bf16": dict(sharding="even", cls=torch.optim.Adam, dtype=torch.bfloat16,
                              hp=dict(lr=1e-2, weight_decay=0.01)),
}
WORLD3 = ("param-True", "flat-True-hook", "even-0.5-hook", "flat-scaler-inf-hook",
          "even-hook-overlap")
_NAMES = sorted(CASES)


@pytest.fixture(scope="module")
def world2():
    return run_specs(2, parity, [CASES[n] for n in _NAMES], prefix="offload")


@pytest.fixture(scope="module")
def world3():
    return run_specs(3, parity, [CASES[n] for n in WORLD3], prefix="offload")


def _same_everywhere(vals):
    for r in range(1, len(vals)):
        for a, b in zip(vals[0]["params"], vals[r]["params"]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("case", _NAMES)
def test_matches_ddp_and_torch_optimizer_world2(world2, case):
    vals = world2.values(f"offload{_NAMES.index(case)}")
    _same_everywhere(vals)
    if CASES[case].get("inf_at"):  # the step with the inf was skipped: the scale backed off
        assert any(a < b for (a, _), (b, _) in zip(vals[0]["scales"][1:],
                                                   vals[0]["scales"])), vals[0]["scales"]


@pytest.mark.parametrize("case", WORLD3)
def test_matches_ddp_and_torch_optimizer_world3(world3, case):
    _same_everywhere(world3.values(f"offload{WORLD3.index(case)}"))


# --------------------------------------------------------------------------- hybrid


def _hybrid(rank, world, sharding, hook):
    """World 4 = 2 replicas x 2 shards (DDP over the job, the optimizer over a shard group
    of hybrid_groups(), the owned sums all-reduced across the replicas by the hook)."""
    from zero_ext import hybrid_groups
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    shard, _replica = hybrid_groups(shard_size=2)
    cfg = dict(sharding=sharding, hook=hook, clip=True, offload=0.5 if hook else True)
    ref, zero = _models(cfg, None)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    o_zero = _zero(_groups(zero.module), cfg, shard)
    if hook:
        zero.register_comm_hook(o_zero, reduce_scatter_hook)
    for it in range(4):
        _iteration(rank, it, ref, o_ref, cfg, True)
        _iteration(rank, it, zero, o_zero, cfg, False)
        _compare(ref, zero, TOL, it)
    info = check_host_part(o_zero, 0.5 if hook else 1.0)
    assert (info["early"] > 0) == hook, info
    return [p.detach().clone() for p in zero.module.parameters()]


@pytest.mark.parametrize("sharding,hook", [("flat", True), ("param", False)])
def test_hybrid_layout_two_replicas_of_two_shards(sharding, hook):
    vals = run_world(_hybrid, 4, sharding, hook)
    for r in range(1, 4):
        for a, b in zip(vals[0], vals[r]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


# --------------------------------------------------------------------------- state dicts


def _trained(rank, cfg, iters):
    """DDP + torch.optim.AdamW and DDP + the offloaded optimizer (cfg) on the world's
    group, both `iters` iterations in: (ref, zero, their optimizers)."""
    ref, zero = _models(cfg, None)
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    o_zero = _zero(_groups(zero.module), cfg, None)
    for it in range(iters):
        _iteration(rank, it, ref, o_ref, cfg, True)
        _iteration(rank, it, zero, o_zero, cfg, False)
    return ref, zero, o_ref, o_zero


def _state_dict_flows(rank, world, sharding, offload):
    """A torch-format state_dict of the offloaded optimizer equals torch's AdamW's after the
    same steps and loads into a plain AdamW; torch's AdamW's dict loads into a fresh
    offloaded optimizer (its state on the host), which then goes on like the reference."""
    import torch.distributed as dist

    cfg = dict(sharding=sharding, offload=offload, clip=True)
    ref, zero, o_ref, o_zero = _trained(rank, cfg, 3)
    o_zero.consolidate_state_dict(0)
    sd = o_zero.state_dict()
    ref_sd = o_ref.state_dict()
    if rank == 0:
        assert set(sd["state"]) == set(ref_sd["state"])
        for i, st in ref_sd["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(sd["state"][i][k].float(), v.float(), **TOL,
                                           msg=lambda m, i=i, k=k: f"state {i} {k}: {m}")
        plain = torch.optim.AdamW(_groups(_Net()), **HP)
        plain.load_state_dict(sd)  # (the torch format: loads into the plain optimizer)
    # torch's AdamW dict -> a fresh offloaded optimizer over the candidate's params
    o_new = _zero(_groups(zero.module), cfg, None)
    o_new.load_state_dict(ref_sd if rank == 0 else None)
    check_host_part(o_new, 1.0 if offload is True else offload)
    for st in o_new.optim.state.values():  # (loaded onto the host keys' memory)
        for v in st.values():
            if isinstance(v, torch.Tensor):
                assert v.device.type == "cpu"
    for it in range(3, 6):
        _iteration(rank, it, ref, o_ref, cfg, True)
        _iteration(rank, it, zero, o_new, cfg, False)
        _compare(ref, zero, TOL, it)
    dist.barrier()
    return [p.detach().clone() for p in zero.module.parameters()]


@pytest.mark.parametrize("sharding,offload", [("flat", True), ("param", 0.5)])
def test_torch_format_state_dict_round_trips(sharding, offload):
    vals = run_world(_state_dict_flows, 2, sharding, offload)
    for a, b in zip(vals[0], vals[1]):
        assert torch.equal(a, b)


def _save_phase(rank, world, path, sharding, offload, dtype):
    """Train 3 iterations (reference and candidate), save both: the candidate with
    zero_ext.checkpoint, the reference's model, AdamW state and the candidate's params."""
    import torch.distributed as dist

    from zero_ext import checkpoint

    cfg = dict(sharding=sharding, offload=offload, clip=True, dtype=dtype)
    ref, zero, o_ref, o_zero = _trained(rank, cfg, 3)
    checkpoint.save(o_zero, os.path.join(path, "optim"))
    if rank == 0:
        torch.save({"ref_model": ref.module.state_dict(), "ref_opt": o_ref.state_dict(),
                    "zero_model": zero.module.state_dict()}, os.path.join(path, "rest.pt"))
    dist.barrier()
    return True


def _resume_phase(rank, world, path, sharding, offload, dtype):
    """Resume at this world size with these options; continue 3 iterations against the
    resumed reference."""
    from zero_ext import checkpoint

    cfg = dict(sharding=sharding, offload=offload, clip=True, dtype=dtype)
    # (bf16: a twin resumed without offload, which the candidate must equal bitwise)
    ref, zero, *twin = _models(cfg, None, twin=dtype != torch.float32)
    rest = torch.load(os.path.join(path, "rest.pt"))
    ref.module.load_state_dict(rest["ref_model"])
    o_ref = torch.optim.AdamW(_groups(ref.module), **HP)
    o_ref.load_state_dict(rest["ref_opt"])
    pairs = []
    for m, off in zip([zero] + twin, [offload, False]):
        m.module.load_state_dict(rest["zero_model"])
        o = _zero(_groups(m.module), cfg, None, offload=off)
        checkpoint.load(o, os.path.join(path, "optim"))
        pairs.append((m, o))
    o_zero = pairs[0][1]
    tol = TOL if dtype == torch.float32 else LOW_TOL
    for it in range(3, 6):
        _iteration(rank, it, ref, o_ref, cfg, True)
        for m, o in pairs:
            _iteration(rank, it, m, o, cfg, False)
        _compare(ref, zero, tol, it, twin[0] if twin else None)
    if offload:
        check_host_part(o_zero, 1.0 if offload is True else offload)
    return [p.detach().clone() for p in zero.module.parameters()]


RESUMES = {  # (save: world, sharding, offload), (resume: world, sharding, offload), dtype
    "offload-on-to-off": ((2, "flat", True), (2, "flat", False), torch.float32),
    "offload-off-to-0.5": ((2, "param", False), (2, "param", 0.5), torch.float32),
    "world2-on-to-world3-0.5": ((2, "even", True), (3, "flat", 0.5), torch.float32),
    "world3-0.5-to-world2-on-bf16": ((3, "flat", 0.5), (2, "param", True), torch.bfloat16),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_sharded_checkpoint_resumes_across_offload_and_world_sizes(case, tmp_path):
    (w1, s1, o1), (w2, s2, o2), dtype = RESUMES[case]
    run_world(_save_phase, w1, str(tmp_path), s1, o1, dtype)
    vals = run_world(_resume_phase, w2, str(tmp_path), s2, o2, dtype)
    for r in range(1, w2):
        for a, b in zip(vals[0], vals[r]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"


# --------------------------------------------------------------------------- bad input


BAD = {
    "not-a-fraction": ("yes", {}, TypeError, "offload_optimizer must be"),
    "above-one": (1.5, {}, ValueError, "fraction in [0, 1]"),
    "nan": (float("nan"), {}, ValueError, "fraction in [0, 1]"),
    "negative": (-0.25, {}, ValueError, "fraction in [0, 1]"),
    "lbfgs": (True, dict(cls=torch.optim.LBFGS), ValueError, "LBFGS"),
    "overlap-with-ddp": (True, dict(overlap_with_ddp=True), ValueError, "overlap_with_ddp"),
    "aliased": (True, dict(aliased=True), ValueError, "share memory"),
}


def _bad(rank, world, offload, extra):
    """Every rank gets the bad option (or one rank only: `only_rank`): every rank raises a
    clear error at construction, nothing hangs, and the process group still works."""
    import torch.distributed as dist

    from zero_ext import ZeroRedundancyOptimizer

    net = _Net()
    params = list(net.parameters())
    if extra.get("aliased"):
        extra_p = torch.nn.Parameter(torch.empty(0))
        extra_p.data = params[0].data
        params.append(extra_p)
    only = extra.get("only_rank")
    mine = offload if only is None or rank == only else True
    out = None
    try:
        ZeroRedundancyOptimizer(params, extra.get("cls", torch.optim.AdamW),
                                overlap_with_ddp=extra.get("overlap_with_ddp", False),
                                sharding="param", offload_optimizer=mine, lr=0.1)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        out = (type(exc).__name__, str(exc))
    t = torch.ones(1)
    dist.all_reduce(t)  # (the group is usable afterwards: no rank is left in a collective)
    return out, float(t)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_clear_error_on_every_rank(case):
    offload, extra, exc, words = BAD[case]
    for r, (out, total) in enumerate(run_world(_bad, 2, offload, extra)):
        assert total == 2.0
        assert out is not None, f"rank {r} raised nothing"
        assert out[0] == exc.__name__ and words.lower() in out[1].lower(), (r, out)


def test_one_rank_with_a_bad_fraction_raises_on_every_rank():
    outs = run_world(_bad, 2, 2.0, dict(only_rank=1))
    assert outs[1][0][0] == "ValueError", outs
    assert outs[0][0] is not None and "rank 1" in outs[0][0][1], outs
