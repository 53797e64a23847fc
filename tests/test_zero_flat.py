"""Element-level ("flat") sharding and the fused / overlapped step (issue 4), on gloo worlds of
1, 2 and 3 ranks.

In flat mode the params of each (device, dtype) sit in one flat buffer in global order and
every rank owns one equal, aligned, contiguous range of it, so params may straddle ranks.
Every scenario feeds identical seeded grads on every rank and compares with a single-process
``torch.optim`` optimizer trained on clones of the same params, with the same groups.

Covered: AdamW parity (fused path) with param sizes that do not divide by the world size,
params smaller than the alignment (1 and 3 elements), more ranks than params (a rank may own
nothing), frozen params, grads that are None on some steps, amsgrad and maximize, fp32 + bf16
buckets, bucket view on and off, LR schedulers and manual param_groups changes; SGD with
momentum and Adam with L2 weight decay (the generic path: ``opt.optim`` steps this rank's
1-D runs); the overlapped path (bucket view on gloo: chunked step whose broadcasts overlap
the next chunk) against the non-overlapped one and torch; add_param_group mid-training;
the consolidated state dict against torch's, and round trips in every direction between
flat mode (bucket view off / on), param mode and a plain ``torch.optim.AdamW``; local_numel
and balance on a model with one dominant param; the "auto" choice; refusal of flat mode for
optimizers that are not elementwise; flat AdamW on the pure-PyTorch fallback
(ZERO_EXT_REFERENCE=1 set inside one extra world of 2 ranks).

Tolerances. fp32: atol=1e-6, rtol=1e-5 over 10-12 steps; the fused kernel may round
differently from torch's for-loop in the last ulp per step (docs/design.md, "AdamW
arithmetic"), while any real error (a wrong lr or weight decay for a piece of a split param,
a step count off by one, a missed bias correction, a stale or misplaced range after the
sync) is orders of magnitude larger. bf16 params: atol=2e-2, rtol=1.6e-2 after 10 steps of
lr 1e-2 (each step moves a param by about lr, several bf16 ulps at |p|~0.5; torch's
reference rounds every intermediate to bf16), together with a check that the bf16 params
really moved.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _dist import (AGAINST_TORCH, WORLD_SIZES, Scenarios, assert_params_close, assert_raised,
                   assert_same_on_every_rank, clones, detached, fake_grads, gloo_available,
                   make_params, make_zero, sd_diff)

pytestmark = [
    pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(AGAINST_TORCH, reason="torch's ZeroRedundancyOptimizer has no flat mode"),
]

SC = Scenarios(__name__)
AdamW, Adam, SGD = torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD

ATOL, RTOL = 1e-6, 1e-5
BF16_ATOL, BF16_RTOL = 2e-2, 1.6e-2
STEPS = 10
ALIGN_F32 = 4  # 16 bytes of fp32: the flat buffer's alignment (kernels.flatten.alignment_elems)

# Odd sizes (35, 13, 11, 29 divide by neither 2 nor 3), params smaller than the alignment
# (1 and 3 elements), and a few larger ones, so that at world 2 and 3 params straddle ranks.
SHAPES = [(7, 5), (1,), (13,), (3,), (5, 4, 3), (11,), (2, 9), (29,), (6, 6)]
W_IDX, B_IDX, E_IDX = (0, 4, 6, 8), (1, 3, 5), (2, 7)
TOTAL = sum(torch.Size(s).numel() for s in SHAPES)
ADAMW_DEFAULTS = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def three_groups(ps, w_extra=None, b_extra=None, e_extra=None):
    """decay / no-decay / defaults, a different lr per group; the groups interleave the
    params, so the flat buffer's order (group order) differs from the user's list order."""
    groups = [{"params": [ps[i] for i in W_IDX], "lr": 1e-2, "weight_decay": 0.1},
              {"params": [ps[i] for i in B_IDX], "lr": 3e-3, "weight_decay": 0.0},
              {"params": [ps[i] for i in E_IDX]}]
    for g, extra in zip(groups, (w_extra, b_extra, e_extra)):
        g.update(extra or {})
    return groups


def _native_fused() -> bool:
    from zero_ext import kernels

    return kernels.native_available("fused_adamw_", "cpu")


def _layout(opt, params, rank):
    """(user index, start, length) of every piece of a param this rank owns (internals:
    used only to prove that the scenarios really split params between ranks)."""
    index = {id(p): i for i, p in enumerate(params)}
    out = []
    for b in opt.plan.buckets:
        for pc in b.pieces(rank):
            out.append((index[id(opt._all_params[pc.param_id])], pc.start, pc.length))
    return out


def _info(opt, params, ctx):
    stepper = getattr(opt, "_stepper", None)
    return {"sharding": opt.sharding, "local_numel": opt.local_numel,
            "layout": _layout(opt, params, ctx.rank),
            "optim_class": type(opt.optim).__name__,
            "n_local_groups": len(opt.optim.param_groups),
            "local_dims": sorted({p.dim() for g in opt.optim.param_groups for p in g["params"]}),
            "chunks": opt.plan.chunks if stepper is not None else None,
            "native": _native_fused()}


def _parity(ctx, cls, defaults, *, groups=three_groups, shapes=SHAPES, dtypes=None,
            steps=STEPS, skip=None, zero_kwargs=None, sched=None, hook=None, frozen=()):
    """Train flat-mode ZeRO and a plain ``cls`` side by side; return both sets of params."""
    pz = make_params(shapes, seed=11, dtypes=dtypes)
    for i in frozen:
        pz[i].requires_grad_(False)
    init = detached(pz)
    pr = clones(pz)
    opt = make_zero(groups(pz), cls, ctx.pg, sharding="flat", **(zero_kwargs or {}), **defaults)
    ref = cls(groups(pr), **defaults)
    scheds = (sched(opt), sched(ref)) if sched else None
    lrs, asked, used = [], [], []
    for s in range(steps):
        if hook is not None:
            hook(s, opt, ref)
        fake_grads(pz, s, skip=skip)
        fake_grads(pr, s, skip=skip)
        asked.append([g["lr"] for g in opt.param_groups])
        opt.step()
        used.append([g["lr"] for g in opt.optim.param_groups])
        ref.step()
        if scheds:
            scheds[0].step()
            scheds[1].step()
        lrs.append([g["lr"] for g in opt.param_groups])
    out = {"zero": detached(pz), "ref": detached(pr), "init": init, "lrs": lrs,
           "ref_lrs": [g["lr"] for g in ref.param_groups], "asked_lrs": asked,
           "used_lrs": used}
    out.update(_info(opt, pz, ctx))
    return out


def _check(vals, atol=ATOL, rtol=RTOL, total=TOTAL, optim_name="AdamW"):
    for r, v in enumerate(vals):
        assert v["sharding"] == "flat", f"rank {r}: sharding resolved to {v['sharding']!r}"
        assert_params_close(v["zero"], v["ref"], atol, rtol, what=f"rank {r} param")
        assert v["optim_class"] == optim_name, v["optim_class"]
        assert v["local_dims"] in ([], [1]), f"rank {r}: local params are not 1-D runs"
    assert_same_on_every_rank([v["zero"] for v in vals])
    loads = [v["local_numel"] for v in vals]
    assert sum(loads) == total, f"local_numel over ranks {loads} does not sum to {total}"


def _check_layout(vals, shapes, expect_split):
    """Every param's elements are owned exactly once over the ranks; at world > 1 some
    param straddles two ranks (else the scenario would not test flat sharding)."""
    numels = [torch.Size(s).numel() for s in shapes]
    owned = {i: [] for i in range(len(shapes))}
    for r, v in enumerate(vals):
        for i, start, length in v["layout"]:
            owned[i].append((start, length, r))
    split = []
    for i, parts in owned.items():
        parts.sort()
        pos = 0
        for start, length, _ in parts:
            assert start == pos, f"param {i}: pieces {parts} leave a gap or overlap"
            pos += length
        assert pos == numels[i], f"param {i}: pieces {parts} cover {pos} of {numels[i]}"
        if len({r for _, _, r in parts}) > 1:
            split.append(i)
    if expect_split:
        assert split, "no param straddles two ranks: the scenario does not test flat sharding"


# --------------------------------------------------------------------------------------------
# AdamW parity (the fused path when the compiled kernel is there)


@SC.scenario()
def adamw(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS)


@SC.scenario()
def adamw_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, zero_kwargs={"parameters_as_bucket_view": True})


def _amsgrad_maximize(ps):
    return three_groups(ps, w_extra={"amsgrad": True}, b_extra={"maximize": True},
                        e_extra={"amsgrad": True, "maximize": True, "betas": (0.8, 0.9),
                                 "eps": 1e-6})


@SC.scenario()
def adamw_amsgrad_maximize(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, groups=_amsgrad_maximize)


@SC.scenario()
def adamw_amsgrad_maximize_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, groups=_amsgrad_maximize,
                   zero_kwargs={"parameters_as_bucket_view": True})


FROZEN = (1, 4)  # a 1-element param and the largest one, in two different groups


@SC.scenario()
def adamw_frozen(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, frozen=FROZEN)


@SC.scenario()
def adamw_frozen_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, frozen=FROZEN,
                   zero_kwargs={"parameters_as_bucket_view": True})


def _sparse(i, s):
    return (i + s) % 3 == 0  # grad None for this param on this step


@SC.scenario()
def adamw_grads_none_on_some_steps(ctx):
    # torch skips a param whose grad is None: no update, and its step count does not advance
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, skip=_sparse)


@pytest.mark.parametrize("name", ["adamw", "adamw_bucket_view", "adamw_amsgrad_maximize",
                                  "adamw_amsgrad_maximize_bucket_view", "adamw_frozen",
                                  "adamw_frozen_bucket_view", "adamw_grads_none_on_some_steps"])
def test_adamw_parity(world, name):
    vals = world.values(name)
    _check(vals)
    _check_layout(vals, SHAPES, expect_split=world.world_size > 1)
    for r, v in enumerate(vals):
        assert v["n_local_groups"] == 3, f"rank {r}: one local group per global group"
        if v["native"]:
            assert v["chunks"] is not None, f"rank {r}: AdamW did not take the fused path"
    if "frozen" in name:
        for r, v in enumerate(vals):
            for i in FROZEN:
                assert torch.equal(v["zero"][i], v["init"][i]), f"rank {r}: frozen param {i} moved"


# --------------------------------------------------------------------------------------------
# params smaller than the alignment, and more ranks than params


TINY_SHAPES = [(1,), (3,), (2,), (5,), (1,), (7,), (3,)]


@SC.scenario()
def tiny_params(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TINY_SHAPES,
                   groups=lambda ps: [{"params": ps[:4], "lr": 1e-2},
                                      {"params": ps[4:], "weight_decay": 0.0}])


@SC.scenario()
def tiny_params_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TINY_SHAPES,
                   groups=lambda ps: [{"params": ps[:4], "lr": 1e-2},
                                      {"params": ps[4:], "weight_decay": 0.0}],
                   zero_kwargs={"parameters_as_bucket_view": True})


TWO_SHAPES = [(9,), (3,)]          # world 3: the 9-element param straddles ranks 0 and 1
TWO_TINY_SHAPES = [(1,), (2,)]     # world 3: rank 2 owns nothing at all


def _two_groups(ps):
    return [{"params": [ps[0]], "lr": 1e-2}, {"params": [ps[1]], "weight_decay": 0.0}]


@SC.scenario()
def two_params(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TWO_SHAPES, groups=_two_groups)


@SC.scenario()
def two_params_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TWO_SHAPES, groups=_two_groups,
                   zero_kwargs={"parameters_as_bucket_view": True})


@SC.scenario()
def two_tiny_params(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TWO_TINY_SHAPES, groups=_two_groups)


@SC.scenario()
def two_tiny_params_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=TWO_TINY_SHAPES, groups=_two_groups,
                   zero_kwargs={"parameters_as_bucket_view": True})


@pytest.mark.parametrize("name,shapes", [
    ("tiny_params", TINY_SHAPES), ("tiny_params_bucket_view", TINY_SHAPES),
    ("two_params", TWO_SHAPES), ("two_params_bucket_view", TWO_SHAPES),
    ("two_tiny_params", TWO_TINY_SHAPES), ("two_tiny_params_bucket_view", TWO_TINY_SHAPES)])
def test_small_params_and_more_ranks_than_params(world, name, shapes):
    vals = world.values(name)
    total = sum(torch.Size(s).numel() for s in shapes)
    _check(vals, total=total)
    _check_layout(vals, shapes, expect_split=name.startswith("two_params")
                  and world.world_size > 1)
    if name.startswith("two_tiny") and world.world_size == 3:
        assert vals[2]["local_numel"] == 0 and vals[2]["layout"] == [], (
            "rank 2 should own nothing of 3 elements aligned to 4 per param")


# --------------------------------------------------------------------------------------------
# fp32 + bf16 (one flat buffer per dtype)


MIXED_SHAPES = [(9, 5), (13,), (6, 7), (11,), (33,), (3, 3, 3), (1,)]
MIXED_DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
                torch.bfloat16, torch.bfloat16]
F32 = [i for i, d in enumerate(MIXED_DTYPES) if d == torch.float32]
B16 = [i for i, d in enumerate(MIXED_DTYPES) if d == torch.bfloat16]


def _mixed_separate(ps):
    return [{"params": [ps[i] for i in F32], "lr": 5e-3},
            {"params": [ps[i] for i in B16], "lr": 1e-2, "weight_decay": 0.0}]


def _mixed_one_group(ps):
    return [{"params": list(ps), "lr": 1e-2}]


@SC.scenario()
def mixed_fp32_bf16(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=MIXED_SHAPES, dtypes=MIXED_DTYPES,
                   groups=_mixed_separate)


@SC.scenario()
def mixed_fp32_bf16_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=MIXED_SHAPES, dtypes=MIXED_DTYPES,
                   groups=_mixed_separate, zero_kwargs={"parameters_as_bucket_view": True})


@SC.scenario()
def mixed_fp32_bf16_one_group(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, shapes=MIXED_SHAPES, dtypes=MIXED_DTYPES,
                   groups=_mixed_one_group, zero_kwargs={"parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["mixed_fp32_bf16", "mixed_fp32_bf16_bucket_view",
                                  "mixed_fp32_bf16_one_group"])
def test_mixed_fp32_bf16(world, name):
    vals = world.values(name)
    for r, v in enumerate(vals):
        assert v["sharding"] == "flat"
        assert [t.dtype for t in v["zero"]] == MIXED_DTYPES, f"rank {r}: a param changed dtype"
        assert_params_close([v["zero"][i] for i in F32], [v["ref"][i] for i in F32],
                            ATOL, RTOL, what=f"rank {r} fp32 param")
        assert_params_close([v["zero"][i] for i in B16], [v["ref"][i] for i in B16],
                            BF16_ATOL, BF16_RTOL, what=f"rank {r} bf16 param")
    assert_same_on_every_rank([v["zero"] for v in vals])
    total = sum(torch.Size(s).numel() for s in MIXED_SHAPES)
    assert sum(v["local_numel"] for v in vals) == total
    _check_layout(vals, MIXED_SHAPES, expect_split=world.world_size > 1)
    for i in B16:  # the bf16 params really trained: the tolerance is not vacuous
        moved = (vals[0]["zero"][i].float() - vals[0]["init"][i].float()).abs().max().item()
        assert moved > 0.04, f"bf16 param {i} moved only {moved}"


# --------------------------------------------------------------------------------------------
# LR schedulers and manual changes through opt.param_groups


@SC.scenario()
def steplr(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, steps=12,
                   sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5))


def _warmup(step):
    return min(1.0, (step + 1) / 4) * 0.9 ** step


@SC.scenario()
def lambdalr_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, steps=12,
                   zero_kwargs={"parameters_as_bucket_view": True},
                   sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))


def _manual_change(s, opt, ref):
    if s == 4:
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 0.0
            o.param_groups[1]["weight_decay"] = 0.2
            o.param_groups[2]["betas"] = (0.5, 0.9)
    if s == 8:
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 4e-3


@SC.scenario()
def manual_param_group_changes(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, steps=12, hook=_manual_change)


@SC.scenario()
def manual_param_group_changes_bucket_view(ctx):
    return _parity(ctx, AdamW, ADAMW_DEFAULTS, steps=12, hook=_manual_change,
                   zero_kwargs={"parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["steplr", "lambdalr_bucket_view", "manual_param_group_changes",
                                  "manual_param_group_changes_bucket_view"])
def test_schedulers_and_param_group_changes(world, name):
    vals = world.values(name)
    _check(vals)
    for r, v in enumerate(vals):
        assert v["lrs"][-1] == v["ref_lrs"], f"rank {r}: param_groups lr differs from torch's"
        # the lr set on ZeRO's groups before a step is the one opt.optim stepped with
        assert v["used_lrs"] == v["asked_lrs"], f"rank {r}: opt.optim stepped with other lrs"
    if name == "steplr":  # 12 steps, halved every 4: three halvings
        assert [round(x, 12) for x in vals[0]["lrs"][-1]] == [1.25e-3, 3.75e-4, 2.5e-4]


# --------------------------------------------------------------------------------------------
# the generic path: opt.optim (a real optimizer_class) steps this rank's 1-D runs


def _sgd_groups(ps):
    return three_groups(ps, w_extra={"lr": 0.05, "nesterov": True, "weight_decay": 0.01},
                        b_extra={"lr": 0.02, "momentum": 0.5, "dampening": 0.1})


SGD_DEFAULTS = dict(lr=0.03, momentum=0.9)


def _adam_groups(ps):
    # weight_decay with Adam is L2 (added to the grad): not what the fused kernel computes
    return three_groups(ps, w_extra={"amsgrad": True, "weight_decay": 0.01},
                        b_extra={"weight_decay": 0.02, "maximize": True})


ADAM_DEFAULTS = dict(lr=3e-3, betas=(0.8, 0.95))


@SC.scenario()
def sgd_momentum(ctx):
    return _parity(ctx, SGD, SGD_DEFAULTS, groups=_sgd_groups)


@SC.scenario()
def sgd_momentum_bucket_view(ctx):
    return _parity(ctx, SGD, SGD_DEFAULTS, groups=_sgd_groups,
                   zero_kwargs={"parameters_as_bucket_view": True})


@SC.scenario()
def adam_l2(ctx):
    return _parity(ctx, Adam, ADAM_DEFAULTS, groups=_adam_groups)


@SC.scenario()
def adam_l2_bucket_view(ctx):
    return _parity(ctx, Adam, ADAM_DEFAULTS, groups=_adam_groups,
                   zero_kwargs={"parameters_as_bucket_view": True})


@SC.scenario()
def sgd_momentum_grads_none_on_some_steps(ctx):
    # torch skips a param whose grad is None: its momentum does not move it on that step
    return _parity(ctx, SGD, SGD_DEFAULTS, groups=_sgd_groups, skip=_sparse)


@SC.scenario()
def sgd_momentum_frozen(ctx):
    # frozen params sit in the flat buffer beside trainable ones (same group, weight decay on)
    return _parity(ctx, SGD, SGD_DEFAULTS, groups=_sgd_groups, frozen=FROZEN)


@SC.scenario()
def adam_l2_frozen(ctx):
    return _parity(ctx, Adam, ADAM_DEFAULTS, groups=_adam_groups, frozen=FROZEN)


@pytest.mark.parametrize("name,optim_name", [
    ("sgd_momentum", "SGD"), ("sgd_momentum_bucket_view", "SGD"), ("adam_l2", "Adam"),
    ("adam_l2_bucket_view", "Adam"), ("sgd_momentum_grads_none_on_some_steps", "SGD"),
    ("sgd_momentum_frozen", "SGD"),
    ("adam_l2_frozen", "Adam")])
def test_generic_optimizer_parity(world, name, optim_name):
    vals = world.values(name)
    _check(vals, optim_name=optim_name)
    for r, v in enumerate(vals):
        assert v["chunks"] is None, f"rank {r}: {optim_name} must not take the fused AdamW path"
        assert v["n_local_groups"] == 3
    if "frozen" in name:
        for r, v in enumerate(vals):
            for i in FROZEN:
                assert torch.equal(v["zero"][i], v["init"][i]), f"rank {r}: frozen param {i} moved"


# --------------------------------------------------------------------------------------------
# the overlapped path (bucket view on gloo at world > 1: chunked step, broadcasts of chunk k
# overlapping chunk k+1) against the non-overlapped one and torch


OVERLAP_SHAPES = [(40, 12), (37,), (12, 40), (101,), (3,), (9, 9), (1,), (64, 5)]


def _overlap_groups(ps):
    return [{"params": [ps[0], ps[2], ps[5], ps[7]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[1], ps[3], ps[6]], "lr": 3e-3, "weight_decay": 0.0,
             "amsgrad": True},
            {"params": [ps[4]], "maximize": True}]


@SC.scenario()
def overlapped_vs_plain(ctx):
    import zero_ext.zero as zero_mod

    po = make_params(OVERLAP_SHAPES, seed=5)
    pn, pr = clones(po), clones(po)
    # Real models get one chunk per >= 2M elements; let these small tensors be chunked too.
    saved, zero_mod.OVERLAP_MIN_CHUNK_ELEMS = zero_mod.OVERLAP_MIN_CHUNK_ELEMS, 1
    try:
        over = make_zero(_overlap_groups(po), AdamW, ctx.pg, parameters_as_bucket_view=True,
                         sharding="flat", **ADAMW_DEFAULTS)
        # the chunk count is fixed when the first step builds the stepper
        fake_grads(po, 0)
        over.step()
    finally:
        zero_mod.OVERLAP_MIN_CHUNK_ELEMS = saved
    plain = make_zero(_overlap_groups(pn), AdamW, ctx.pg, sharding="flat", **ADAMW_DEFAULTS)
    ref = AdamW(_overlap_groups(pr), **ADAMW_DEFAULTS)
    for s in range(STEPS):
        for ps, o in ((po, over), (pn, plain), (pr, ref)):
            if o is over and s == 0:
                continue  # stepped above
            fake_grads(ps, s)
            o.step()
    return {"over": detached(po), "plain": detached(pn), "ref": detached(pr),
            "over_info": _info(over, po, ctx), "plain_info": _info(plain, pn, ctx)}


def test_overlapped_path_matches_plain_and_torch(world):
    vals = world.values("overlapped_vs_plain")
    for r, v in enumerate(vals):
        assert_params_close(v["over"], v["ref"], ATOL, RTOL, what=f"rank {r} overlapped param")
        assert_params_close(v["plain"], v["ref"], ATOL, RTOL, what=f"rank {r} plain param")
        assert_params_close(v["over"], v["plain"], ATOL, RTOL,
                            what=f"rank {r} overlapped vs plain param")
        oi, pi = v["over_info"], v["plain_info"]
        assert oi["sharding"] == pi["sharding"] == "flat"
        if oi["native"]:
            from zero_ext.zero import OVERLAP_CHUNKS

            want = OVERLAP_CHUNKS if world.world_size > 1 else 1
            assert oi["chunks"] == want, (
                f"rank {r}: overlapped stepper has {oi['chunks']} chunks, expected {want}")
            assert pi["chunks"] == 1, f"rank {r}: no bucket view must not be chunked"
    assert_same_on_every_rank([v["over"] for v in vals])
    assert_same_on_every_rank([v["plain"] for v in vals])
    total = sum(torch.Size(s).numel() for s in OVERLAP_SHAPES)
    assert sum(v["over_info"]["local_numel"] for v in vals) == total


# --------------------------------------------------------------------------------------------
# add_param_group mid-training


def _add_group_run(ctx, zero_kwargs):
    pz = make_params(SHAPES, seed=11)
    pr = clones(pz)
    first, later = [0, 1, 2, 3, 4], [5, 6, 7, 8]
    opt = make_zero([{"params": [pz[i] for i in first], "lr": 1e-2}], AdamW, ctx.pg,
                    sharding="flat", **zero_kwargs, **ADAMW_DEFAULTS)
    ref = AdamW([{"params": [pr[i] for i in first], "lr": 1e-2}], **ADAMW_DEFAULTS)
    numel_before = opt.local_numel
    for s in range(5):
        fake_grads(pz, s, skip=lambda i, _: i in later)
        fake_grads(pr, s, skip=lambda i, _: i in later)
        opt.step()
        ref.step()
    for o, ps in ((opt, pz), (ref, pr)):
        o.add_param_group({"params": [ps[i] for i in later], "lr": 5e-3, "weight_decay": 0.0,
                           "amsgrad": True})
    for s in range(5, 11):
        fake_grads(pz, s)
        fake_grads(pr, s)
        opt.step()
        ref.step()
    out = {"zero": detached(pz), "ref": detached(pr), "n_groups": len(opt.param_groups),
           "numel_before": numel_before,
           "group1": {k: opt.param_groups[1][k] for k in ("lr", "weight_decay", "betas",
                                                          "amsgrad")}}
    out.update(_info(opt, pz, ctx))
    return out


@SC.scenario()
def add_param_group(ctx):
    return _add_group_run(ctx, {})


@SC.scenario()
def add_param_group_bucket_view(ctx):
    return _add_group_run(ctx, {"parameters_as_bucket_view": True})


@pytest.mark.parametrize("name", ["add_param_group", "add_param_group_bucket_view"])
def test_add_param_group_mid_training(world, name):
    vals = world.values(name)
    _check(vals)
    _check_layout(vals, SHAPES, expect_split=world.world_size > 1)
    first_total = sum(torch.Size(SHAPES[i]).numel() for i in range(5))
    assert sum(v["numel_before"] for v in vals) == first_total
    for r, v in enumerate(vals):
        assert v["n_groups"] == 2 and v["n_local_groups"] == 2, f"rank {r}: {v['n_groups']}"
        assert v["group1"] == {"lr": 5e-3, "weight_decay": 0.0,
                               "betas": ADAMW_DEFAULTS["betas"], "amsgrad": True}


# --------------------------------------------------------------------------------------------
# checkpoints: the consolidated dict is torch.optim.AdamW's, and round trips in every
# direction between flat mode, param mode and a plain torch.optim.AdamW

SD_SHAPES = [(7, 5), (1,), (13,), (3,), (5, 4, 3), (11,), (2, 9), (29,)]
K = 5  # steps before the checkpoint, and again after it
NEVER = 5  # requires grad but never gets one: no state in torch's format


def _sd_groups(ps):
    return [{"params": [ps[i] for i in (0, 4, 6)], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[i] for i in (1, 3, 5)], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [ps[i] for i in (2, 7)], "amsgrad": True}]


SD_ORDER = [i for g in _sd_groups(list(range(len(SD_SHAPES)))) for i in g["params"]]


def _sd_skip(i, s):
    return i == NEVER


KINDS = {"flat": {"sharding": "flat"},
         "flat_bv": {"sharding": "flat", "parameters_as_bucket_view": True},
         "param": {"sharding": "param"},
         "plain": None}


def _build(ctx, kind, ps):
    if KINDS[kind] is None:
        return AdamW(_sd_groups(ps), **ADAMW_DEFAULTS)
    return make_zero(_sd_groups(ps), AdamW, ctx.pg, **KINDS[kind], **ADAMW_DEFAULTS)


def _train(opt, ps, steps):
    for s in steps:
        fake_grads(ps, s, skip=_sd_skip)
        opt.step()


def _bcast(ctx, obj, src):
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ctx.pg, src), group=ctx.pg)
    return box[0]


def _save(ctx, kind, opt):
    """The torch-format dict of `opt`, on every rank (consolidated on the last rank)."""
    if KINDS[kind] is None:
        return copy.deepcopy(opt.state_dict())
    to = ctx.world_size - 1
    opt.consolidate_state_dict(to=to)
    return _bcast(ctx, opt.state_dict() if ctx.rank == to else None, to)


def _format(ctx, kind):
    pz = make_params(SD_SHAPES, seed=21)
    pr = clones(pz)
    opt, ref = _build(ctx, kind, pz), _build(ctx, "plain", pr)
    _train(opt, pz, range(K))
    _train(ref, pr, range(K))
    return {"sd": _save(ctx, kind, opt), "ref_sd": copy.deepcopy(ref.state_dict()),
            "layout": _layout(opt, pz, ctx.rank)}


@SC.scenario()
def format_flat(ctx):
    return _format(ctx, "flat")


@SC.scenario()
def format_flat_bucket_view(ctx):
    return _format(ctx, "flat_bv")


FORMATS = ["format_flat", "format_flat_bucket_view"]


@pytest.mark.parametrize("name", FORMATS)
def test_consolidated_state_dict_matches_torch(world, name):
    """Structure, group indices and hyperparameters exactly; the state of every param that
    torch has state for within fp32 tolerance (split params reassembled)."""
    vals = world.values(name)
    _check_layout(vals, SD_SHAPES, expect_split=world.world_size > 1)
    for r, v in enumerate(vals):
        sd, ref_sd = v["sd"], v["ref_sd"]
        assert set(sd) == {"state", "param_groups"}, f"top-level keys {sorted(sd)}"
        missing = sorted(set(ref_sd["state"]) - set(sd["state"]))
        assert not missing, f"rank {r}: no state for params {missing}"
        diffs = sd_diff(sd["param_groups"], ref_sd["param_groups"], "param_groups")
        diffs += sd_diff({k: sd["state"][k] for k in ref_sd["state"]}, ref_sd["state"], "state",
                         atol=ATOL, rtol=RTOL)
        assert not diffs, (f"rank {r}: state_dict differs from torch.optim.AdamW's:\n"
                           + "\n".join(diffs[:20]))


@pytest.mark.parametrize("name", FORMATS)
def test_consolidated_state_dict_has_no_state_for_never_stepped_param(world, name):
    for r, v in enumerate(world.values(name)):
        extra = sorted(set(v["sd"]["state"]) - set(v["ref_sd"]["state"]))
        assert not extra, (
            f"rank {r}: state for params {extra} (user param {NEVER}, index "
            f"{SD_ORDER.index(NEVER)}, never had a grad: torch.optim.AdamW has no state for it)")


def _round_trip(ctx, src, dst):
    """Train `src` K steps, save, load into a fresh `dst` (over copies of the current
    params), train K more; compare with an uninterrupted plain AdamW."""
    ps = make_params(SD_SHAPES, seed=21)
    pr = clones(ps)
    opt, ref = _build(ctx, src, ps), _build(ctx, "plain", pr)
    _train(opt, ps, range(K))
    _train(ref, pr, range(K))
    sd = _save(ctx, src, opt)
    snapshot = copy.deepcopy(sd)
    pd = clones(ps)
    opt2 = _build(ctx, dst, pd)
    opt2.load_state_dict(sd)
    mutated = sd_diff(sd, snapshot)
    again = None
    if KINDS[dst] is not None:  # save right after load: the same dict comes back
        again = _save(ctx, dst, opt2)
    _train(opt2, pd, range(K, 2 * K))
    _train(ref, pr, range(K, 2 * K))
    return {"zero": detached(pd), "ref": detached(pr), "mutated": mutated, "again": again,
            "sd": snapshot}


ROUND_TRIPS = [(s, d) for s in KINDS for d in KINDS if (s, d) != ("plain", "plain")]


def _register_round_trip(src, dst):
    name = f"round_trip_{src}_to_{dst}"

    def scenario(ctx):
        return _round_trip(ctx, src, dst)

    scenario.__name__ = scenario.__qualname__ = name
    globals()[name] = scenario  # pickled by name into the workers
    SC.scenario()(scenario)


for _s, _d in ROUND_TRIPS:
    _register_round_trip(_s, _d)


RT_IDS = [f"{s}-to-{d}" for s, d in ROUND_TRIPS]


@pytest.mark.parametrize("src,dst", ROUND_TRIPS, ids=RT_IDS)
def test_state_dict_round_trip_then_continue(world, src, dst):
    vals = world.values(f"round_trip_{src}_to_{dst}")
    for r, v in enumerate(vals):
        assert_params_close(v["zero"], v["ref"], ATOL, RTOL, what=f"rank {r} param")
        assert not v["mutated"], (f"rank {r}: load_state_dict modified the caller's dict:\n"
                                  + "\n".join(v["mutated"][:10]))
    assert_same_on_every_rank([v["zero"] for v in vals])


ZERO_DST = [(s, d) for s, d in ROUND_TRIPS if KINDS[d] is not None]


@pytest.mark.parametrize("src,dst", ZERO_DST, ids=[f"{s}-to-{d}" for s, d in ZERO_DST])
def test_state_dict_after_load_is_the_loaded_one(world, src, dst):
    """Consolidating right after load_state_dict gives back the dict that was loaded."""
    for r, v in enumerate(world.values(f"round_trip_{src}_to_{dst}")):
        diffs = sd_diff(v["again"]["param_groups"], v["sd"]["param_groups"], "param_groups")
        diffs += sd_diff(v["again"]["state"], v["sd"]["state"], "state", atol=1e-7, rtol=1e-7)
        assert not diffs, (f"rank {r}: load_state_dict then state_dict changed the dict:\n"
                           + "\n".join(diffs[:20]))


# --------------------------------------------------------------------------------------------
# local_numel and balance with one dominant param; the "auto" choice


DOMINANT_SHAPES = [(320, 8), (8, 16), (16,), (16, 8), (8,), (3,), (1,), (17,)]  # 2560 vs 301
BALANCED_SHAPES = [(8, 8)] * 6 + [(16,)] * 6


def _balance(ctx, shapes, sharding):
    ps = make_params(shapes, seed=31)
    groups = [{"params": ps[:4], "weight_decay": 0.1}, {"params": ps[4:], "weight_decay": 0.0}]
    opt = make_zero(groups, AdamW, ctx.pg, sharding=sharding, lr=1e-3)
    fake_grads(ps, 0)
    opt.step()
    state_numel = sum(t.numel() for st in opt.optim.state.values() for k, t in st.items()
                      if k == "exp_avg")
    return {"sharding": opt.sharding, "local_numel": opt.local_numel, "state_numel": state_numel}


@SC.scenario()
def balance_dominant_flat(ctx):
    return _balance(ctx, DOMINANT_SHAPES, "flat")


@SC.scenario()
def balance_dominant_param(ctx):
    return _balance(ctx, DOMINANT_SHAPES, "param")


@SC.scenario()
def balance_dominant_auto(ctx):
    return _balance(ctx, DOMINANT_SHAPES, "auto")


@SC.scenario()
def balance_balanced_auto(ctx):
    return _balance(ctx, BALANCED_SHAPES, "auto")


def test_flat_balance_with_a_dominant_param(world):
    w = world.world_size
    total = sum(torch.Size(s).numel() for s in DOMINANT_SHAPES)
    flat = [v["local_numel"] for v in world.values("balance_dominant_flat")]
    param = [v["local_numel"] for v in world.values("balance_dominant_param")]
    assert all(isinstance(x, int) for x in flat), flat
    assert sum(flat) == total and sum(param) == total, (flat, param)
    mean = total / w
    # equal aligned ranges: off by at most the alignment padding (each param starts aligned,
    # the buffer ends on a multiple of world * alignment)
    slack = ALIGN_F32 * (len(DOMINANT_SHAPES) + 1)
    assert max(flat) <= 1.01 * mean + slack, f"flat loads {flat}, mean {mean:.1f}"
    if w > 1:
        # the model is badly unbalanced for whole params, which is the point of flat mode
        assert max(param) / mean > 1.5, f"param loads {param}: model not unbalanced enough"
    for r, v in enumerate(world.values("balance_dominant_flat")):
        # state lives on this rank's runs only (the runs may include alignment gaps)
        assert v["local_numel"] <= v["state_numel"] <= v["local_numel"] + slack, (r, v)


def test_auto_choice(world):
    w = world.world_size
    dom = world.values("balance_dominant_auto")
    bal = world.values("balance_balanced_auto")
    want_dom = "flat" if w > 1 else "param"
    for r in range(w):
        assert dom[r]["sharding"] == want_dom, (
            f"rank {r}: auto chose {dom[r]['sharding']!r} on the dominant-param model")
        assert bal[r]["sharding"] == "param", (
            f"rank {r}: auto chose {bal[r]['sharding']!r} on the balanced model")
    total = sum(torch.Size(s).numel() for s in DOMINANT_SHAPES)
    assert sum(v["local_numel"] for v in dom) == total


# --------------------------------------------------------------------------------------------
# flat mode refused for optimizers that are not elementwise (on every rank, no hang)


class SignDescent(torch.optim.Optimizer):
    """A user-defined optimizer: not known to be elementwise."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        pass


def _reject(ctx, cls, **defaults):
    ps = make_params([(4, 4), (5,)], seed=3)
    try:
        make_zero(ps, cls, ctx.pg, sharding="flat", **defaults)
    finally:
        if ctx.world_size > 1:  # the group is still usable afterwards: nobody hangs
            t = torch.ones(1)
            dist.all_reduce(t, group=ctx.pg)
    return "constructed"


@SC.scenario()
def reject_lbfgs(ctx):
    return _reject(ctx, torch.optim.LBFGS, lr=0.1)


@SC.scenario()
def reject_custom_optimizer(ctx):
    return _reject(ctx, SignDescent, lr=0.1)


@SC.scenario()
def param_mode_accepts_lbfgs(ctx):
    ps = make_params([(4, 4), (5,)], seed=3)
    opt = make_zero(ps, torch.optim.LBFGS, ctx.pg, sharding="auto", lr=0.1)
    return opt.sharding


@pytest.mark.parametrize("name", ["reject_lbfgs", "reject_custom_optimizer"])
def test_flat_rejects_non_elementwise_optimizer(world, name):
    for outcome in world.outcomes(name):
        assert_raised(outcome, ValueError, match="flat")


def test_auto_keeps_non_elementwise_optimizer_on_whole_params(world):
    assert world.values("param_mode_accepts_lbfgs") == ["param"] * world.world_size


# --------------------------------------------------------------------------------------------
# the pure-PyTorch fallback (ZERO_EXT_REFERENCE=1, set inside this world only): flat AdamW
# then runs torch.optim.AdamW over the runs instead of the fused kernel


def _reference_world(rank, world_size):
    import os

    os.environ["ZERO_EXT_REFERENCE"] = "1"  # before anything loads the native ops here
    from _dist import Ctx

    out = {"native": _native_fused()}
    bucket_view = {"zero_kwargs": {"parameters_as_bucket_view": True}}
    for name, kwargs in (("adamw", {}), ("adamw_bucket_view", bucket_view),
                         ("adamw_frozen", {"frozen": FROZEN})):
        ctx = Ctx(rank=rank, world_size=world_size, pg=None, store=None, scenario=name)
        out[name] = _parity(ctx, AdamW, ADAMW_DEFAULTS, **kwargs)
    return out


@pytest.fixture(scope="module")
def reference_world():
    from _dist import run_world

    return run_world(_reference_world, 2)


@pytest.mark.parametrize("name", ["adamw", "adamw_bucket_view", "adamw_frozen"])
def test_reference_kernels_flat_adamw(reference_world, name):
    assert not any(v["native"] for v in reference_world), "ZERO_EXT_REFERENCE=1 was ignored"
    vals = [v[name] for v in reference_world]
    _check(vals)
    for r, v in enumerate(vals):
        assert v["chunks"] is None, f"rank {r}: the fused path ran without native ops"
        for i in (FROZEN if name == "adamw_frozen" else ()):
            assert torch.equal(v["zero"][i], v["init"][i]), f"rank {r}: frozen param {i} moved"
