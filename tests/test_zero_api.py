"""Construction of zero_ext.ZeroRedundancyOptimizer: accepted inputs, every bad input, rank
consistency, and the attributes code in the wild relies on (.optim, ._all_params,
.param_groups), on gloo worlds of 1, 2 and 3 ranks.

Each world runs every scenario below once (tests/_dist.py); the tests then check the recorded
per-rank outcomes.  Error tests match the exception type and one word of its message.
"""
from __future__ import annotations

import pytest
import torch

from _dist import (WORLD_SIZES, Outcome, Scenarios, _exc_outcome, assert_raised,
                   gloo_available, make_params, make_zero, zero_class, fake_grads, AGAINST_TORCH)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

SC = Scenarios(__name__)
AdamW, Adam, SGD = torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    return SC.run(request.param)


def _p(*shape):
    return torch.randn(*shape, requires_grad=True)


def _construct(*args, **kwargs):
    make_zero(*args, **kwargs)  # only whether it raises matters


def _outcome(rank, fn) -> Outcome:
    try:
        return Outcome(rank=rank, ok=True, value=fn())
    except Exception as exc:
        return _exc_outcome(rank, exc)


# --------------------------------------------------------------------------------------------
# every bad input, given identically to every rank


def _dup_two_groups():
    a, b = _p(3), _p(4)
    return [{"params": [a, b]}, {"params": [a]}]


def _dup_one_group():
    a, b = _p(3), _p(4)
    return [{"params": [a, b, a]}]


def _dup_top_level():
    a = _p(3)
    return [a, _p(2), a]


class WholeTensorOpt(torch.optim.SGD):
    """A user-defined optimizer: not known to be elementwise, so it cannot be split."""


# name -> (params factory, optimizer_class, kwargs, exception type, word in the message)
BAD_INPUTS = {
    "empty_list": (lambda: [], AdamW, {}, ValueError, "empty"),
    "empty_tuple": (lambda: (), AdamW, {}, ValueError, "empty"),
    "empty_generator": (lambda: (p for p in []), AdamW, {}, ValueError, "empty"),
    "bare_tensor": (lambda: _p(4, 3), AdamW, {}, TypeError, "iterable"),
    "non_tensor_item": (lambda: [_p(3), 1.5], AdamW, {}, TypeError, "Tensor"),
    "non_tensor_in_group": (lambda: [{"params": [_p(3), "w"]}], AdamW, {}, TypeError, "Tensor"),
    "dict_after_tensor": (lambda: [_p(3), {"params": [_p(2)]}], AdamW, {}, TypeError, "Tensor"),
    "set_top_level": (lambda: {_p(3), _p(2)}, AdamW, {}, TypeError, "set"),
    "set_in_group": (lambda: [{"params": {_p(3), _p(2)}}], AdamW, {}, TypeError, "set"),
    "dict_without_params": (lambda: [{"lr": 0.1}], AdamW, {}, ValueError, "params"),
    "dup_in_two_groups": (_dup_two_groups, AdamW, {}, ValueError, "more than once"),
    "dup_in_one_group": (_dup_one_group, AdamW, {}, ValueError, "more than once"),
    "dup_top_level": (_dup_top_level, AdamW, {}, ValueError, "more than once"),
    "non_leaf": (lambda: [_p(3) * 2.0], AdamW, {}, ValueError, "leaf"),
    "non_leaf_in_group": (lambda: [{"params": [_p(2), _p(3) + 1.0]}], AdamW, {}, ValueError, "leaf"),
    "neg_lr_default": (lambda: [_p(3)], AdamW, {"lr": -1e-3}, ValueError, "lr"),
    "neg_lr_group": (lambda: [{"params": [_p(3)]}, {"params": [_p(2)], "lr": -0.1}], AdamW, {},
                     ValueError, "lr"),
    "beta1_is_one_group": (lambda: [{"params": [_p(3)], "betas": (1.0, 0.999)}], AdamW, {},
                           ValueError, "betas"),
    "beta2_above_one_group": (lambda: [{"params": [_p(3)], "betas": (0.9, 1.5)}], AdamW, {},
                              ValueError, "betas"),
    "beta_negative_default": (lambda: [_p(3)], AdamW, {"betas": (-0.1, 0.99)}, ValueError,
                              "betas"),
    "neg_eps_group": (lambda: [{"params": [_p(3)], "eps": -1e-8}], AdamW, {}, ValueError, "eps"),
    "neg_weight_decay_group": (lambda: [{"params": [_p(2)]}, {"params": [_p(3)],
                                                             "weight_decay": -0.1}],
                               AdamW, {}, ValueError, "weight_decay"),
    "adam_neg_lr_group": (lambda: [{"params": [_p(3)], "lr": -1.0}], Adam, {}, ValueError, "lr"),
    "adam_bad_betas_group": (lambda: [{"params": [_p(3)], "betas": (0.9, 1.0)}], Adam, {},
                             ValueError, "betas"),
    "sgd_neg_lr_group": (lambda: [{"params": [_p(3)], "lr": -0.1}], SGD, {"lr": 0.1},
                         ValueError, "lr"),
    "sgd_neg_momentum_group": (lambda: [{"params": [_p(3)], "momentum": -0.5}], SGD, {"lr": 0.1},
                               ValueError, "momentum"),
    "sgd_neg_weight_decay_default": (lambda: [_p(3)], SGD, {"lr": 0.1, "weight_decay": -1.0},
                                     ValueError, "weight_decay"),
    "unknown_sharding": (lambda: [_p(3)], AdamW, {"sharding": "bogus"}, ValueError, "sharding"),
    "flat_with_unknown_optimizer": (lambda: [_p(3)], WholeTensorOpt, {"lr": 0.1, "sharding": "flat"},
                                    ValueError, "flat"),
    "overlap_with_ddp_lbfgs": (lambda: [_p(3)], torch.optim.LBFGS, {"overlap_with_ddp": True},
                               ValueError, "LBFGS"),
}


@SC.scenario()
def bad_inputs_all_ranks(ctx):
    out = {}
    for name, (factory, cls, kwargs, _, _) in BAD_INPUTS.items():
        out[name] = _outcome(ctx.rank, lambda: _construct(factory(), cls, ctx.pg, **kwargs))
    return out


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_on_every_rank(world, case):
    _, _, _, exc_type, word = BAD_INPUTS[case]
    for res in world.values("bad_inputs_all_ranks"):
        assert_raised(res[case], exc_type, match=word)


# --------------------------------------------------------------------------------------------
# accepted input forms


def _accepted_cases():
    # name -> (params factory returning (params arg, flat list of the params in order))
    def top_gen():
        ps = [_p(4, 3), _p(3), _p(5)]
        return (p for p in ps), ps

    def tuple_top():
        ps = [_p(4, 3), _p(3)]
        return tuple(ps), ps

    def group_gen():
        a, b, c = _p(6, 2), _p(2), _p(7)
        return [{"params": (p for p in (a, b)), "lr": 1e-2}, {"params": iter([c])}], [a, b, c]

    def group_single_tensor():
        w, b = _p(5, 4), _p(4)
        return [{"params": w, "weight_decay": 0.0}, {"params": [b]}], [w, b]

    def gen_of_dicts():
        a, b = _p(3, 3), _p(3)
        return ({"params": [x]} for x in (a, b)), [a, b]

    def tuple_in_group():
        a, b = _p(3, 3), _p(3)
        return [{"params": (a, b)}], [a, b]

    def mixed_dtypes_one_group():
        a, b = _p(8, 2), _p(5).detach().to(torch.bfloat16).requires_grad_()
        return [{"params": [a, b]}], [a, b]

    def mixed_dtypes_two_groups():
        a, b = _p(8, 2), _p(5).detach().to(torch.bfloat16).requires_grad_()
        return [{"params": [a]}, {"params": [b], "lr": 1e-2}], [a, b]

    def frozen_param():
        a, b = _p(4, 4), _p(4).requires_grad_(False)
        return [a, b], [a, b]

    return {
        "top_level_generator": top_gen,
        "top_level_tuple": tuple_top,
        "group_params_generator": group_gen,
        "group_params_single_tensor": group_single_tensor,
        "generator_of_dicts": gen_of_dicts,
        "group_params_tuple": tuple_in_group,
        "mixed_fp32_bf16_one_group": mixed_dtypes_one_group,
        "mixed_fp32_bf16_two_groups": mixed_dtypes_two_groups,
        "frozen_param": frozen_param,
    }


ACCEPTED = list(_accepted_cases())


@SC.scenario()
def accepted_inputs(ctx):
    out = {}
    for name, factory in _accepted_cases().items():
        def run():
            torch.manual_seed(7)  # same params on every rank
            params, flat = factory()
            opt = make_zero(params, AdamW, ctx.pg, lr=1e-3)
            local = [p for g in opt.optim.param_groups for p in g["params"]]
            for p in flat:
                if p.requires_grad:
                    p.grad = torch.ones_like(p)
            before = [p.detach().clone() for p in flat]
            opt.step()
            return {
                "all_params_is_user_params": [a is b for a, b in zip(opt._all_params, flat)],
                "n_all_params": len(opt._all_params),
                "n_user_params": len(flat),
                "n_groups": len(opt.param_groups),
                "n_local_groups": len(opt.optim.param_groups),
                "local_numel": getattr(opt, "local_numel", None),
                "local_param_numel": sum(p.numel() for p in local),
                "total_numel": sum(p.numel() for p in flat),
                "changed": [not torch.equal(b, p.detach()) for b, p in zip(before, flat)],
                "requires_grad": [p.requires_grad for p in flat],
                "dtypes": [p.dtype for p in flat],
                "params_after": [p.detach().clone() for p in flat],
            }
        out[name] = _outcome(ctx.rank, run)
    return out


@pytest.mark.parametrize("case", ACCEPTED)
def test_accepted_input(world, case):
    per_rank = world.values("accepted_inputs")
    outs = [r[case] for r in per_rank]
    for o in outs:
        assert o.ok, o.describe()
    vals = [o.value for o in outs]
    v0 = vals[0]
    assert v0["n_all_params"] == v0["n_user_params"], (
        f"_all_params has {v0['n_all_params']} entries for {v0['n_user_params']} params "
        "(a generator consumed early, or a single tensor iterated row by row?)")
    assert all(v0["all_params_is_user_params"]), "_all_params must hold the user's tensors in order"
    for r, v in enumerate(vals):
        assert v["n_local_groups"] == v["n_groups"], (
            f"rank {r}: .optim has {v['n_local_groups']} groups, ZeRO {v['n_groups']}")
        # a trainable param is updated by the step; a frozen one is not (grad None)
        for i, (changed, rg) in enumerate(zip(v["changed"], v["requires_grad"])):
            assert changed == rg, f"rank {r} param {i}: changed={changed} requires_grad={rg}"
        assert v["dtypes"] == v0["dtypes"]
        for i, (a, b) in enumerate(zip(v["params_after"], v0["params_after"])):
            assert torch.equal(a, b), f"param {i} differs between rank 0 and rank {r}"
    if not AGAINST_TORCH:
        assert sum(v["local_numel"] for v in vals) == v0["total_numel"]


# --------------------------------------------------------------------------------------------
# one rank with bad input: that rank raises its own error, the others a RuntimeError naming
# the rank; nobody hangs


ONE_RANK_BAD = {
    "empty": (lambda: [], {}, ValueError, "empty"),
    "non_leaf": (lambda: [_p(4, 3) * 1.0, _p(3)], {}, ValueError, "leaf"),
    "set_top_level": (lambda: {_p(4, 3), _p(3)}, {}, TypeError, "set"),
    "non_tensor_item": (lambda: [_p(4, 3), None], {}, TypeError, "Tensor"),
    "neg_lr_group": (lambda: [{"params": [_p(4, 3)], "lr": -1.0}, {"params": [_p(3)]}], {},
                     ValueError, "lr"),
    "unknown_sharding": (lambda: [_p(4, 3), _p(3)], {"sharding": "nope"}, ValueError, "sharding"),
}


def _good_params():
    return [{"params": [_p(4, 3)], "lr": 1e-3}, {"params": [_p(3)]}]


def _one_rank_bad_scenario(case):
    factory, kwargs, _, _ = ONE_RANK_BAD[case]

    def scenario(ctx):
        bad = ctx.rank == ctx.world_size - 1
        params = factory() if bad else _good_params()
        kw = kwargs if bad else {}
        return _outcome(ctx.rank, lambda: _construct(params, AdamW, ctx.pg, **kw))

    scenario.__name__ = scenario.__qualname__ = f"one_rank_bad_{case}"
    globals()[scenario.__name__] = scenario  # picklable by name
    SC.scenario(min_world=2)(scenario)


for _case in ONE_RANK_BAD:
    _one_rank_bad_scenario(_case)


@pytest.mark.parametrize("case", list(ONE_RANK_BAD))
def test_one_rank_bad_input_every_rank_raises(world, case):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    _, _, exc_type, word = ONE_RANK_BAD[case]
    outs = world.values(f"one_rank_bad_{case}")
    for r, o in enumerate(outs):
        if r == world.world_size - 1:
            assert_raised(o, exc_type, match=word)
        else:
            assert_raised(o, RuntimeError, match="rank")


# --------------------------------------------------------------------------------------------
# one rank given different (locally valid) params: every rank raises a RuntimeError naming
# the rank, instead of hanging or silently training different partitions


def _base(shapes=((6, 4), (4,), (3, 3)), dtypes=None, lrs=(1e-3, None), split=(2,)):
    ps = make_params(shapes, seed=3, dtypes=dtypes)
    g0 = {"params": ps[:split[0]]}
    if lrs[0] is not None:
        g0["lr"] = lrs[0]
    g1 = {"params": ps[split[0]:]}
    if lrs[1] is not None:
        g1["lr"] = lrs[1]
    return [g0, g1]


ONE_RANK_DIFFERENT = {
    "shape_same_numel": lambda: (_base(shapes=((4, 6), (4,), (3, 3))), {}),
    "numel": lambda: (_base(shapes=((6, 4), (5,), (3, 3))), {}),
    "dtype": lambda: (_base(dtypes=(torch.float32, torch.bfloat16, torch.float32)), {}),
    "param_count": lambda: (_base(shapes=((6, 4), (4,), (3, 3), (2,))), {}),
    "group_structure": lambda: (_base(split=(1,)), {}),
    "group_hyperparameter": lambda: (_base(lrs=(2e-3, None)), {}),
    "default_hyperparameter": lambda: (_base(), {"weight_decay": 0.5}),
}


def _one_rank_different_scenario(case):
    def scenario(ctx):
        odd = ctx.rank == ctx.world_size - 1
        groups, kw = ONE_RANK_DIFFERENT[case]() if odd else (_base(), {})
        return _outcome(ctx.rank, lambda: _construct(groups, AdamW, ctx.pg, **kw))

    scenario.__name__ = scenario.__qualname__ = f"one_rank_different_{case}"
    globals()[scenario.__name__] = scenario
    SC.scenario(min_world=2)(scenario)


for _case in ONE_RANK_DIFFERENT:
    _one_rank_different_scenario(_case)


@pytest.mark.parametrize("case", list(ONE_RANK_DIFFERENT))
def test_one_rank_different_params_every_rank_raises(world, case):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    for o in world.values(f"one_rank_different_{case}"):
        assert_raised(o, RuntimeError, match="rank")


# --------------------------------------------------------------------------------------------
# attributes that code in the wild relies on


class PlainSGD(torch.optim.Optimizer):
    """A user-defined optimizer: must go through the generic (non-fused) path."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


@SC.scenario()
def optim_attributes(ctx):
    out = {}
    # two tiny params and three groups: at world 3 some rank owns nothing at all
    for cls, kw in ((AdamW, {"lr": 1e-3}), (SGD, {"lr": 0.1, "momentum": 0.9}),
                    (Adam, {"lr": 1e-3}), (PlainSGD, {"lr": 0.1})):
        def run():
            ps = make_params([(3,), (2, 2), (5,)], seed=1)
            groups = [{"params": [ps[0]], "lr": 0.5}, {"params": [ps[1]]}, {"params": [ps[2]]}]
            opt = make_zero(groups, cls, ctx.pg, **kw)
            fake_grads(ps, 0)
            opt.step()  # a rank owning nothing must step too
            opt.zero_grad()
            return {
                "is_optimizer": isinstance(opt, torch.optim.Optimizer),
                "optim_type": type(opt.optim).__name__,
                "optim_isinstance": isinstance(opt.optim, cls),
                "n_groups": len(opt.param_groups),
                "n_local_groups": len(opt.optim.param_groups),
                "local_keys_in_zero": all(set(lg) <= set(zg) for lg, zg in
                                          zip(opt.optim.param_groups, opt.param_groups)),
                "hyper_equal": all(all(zg[k] == lg[k] for k in lg if k != "params")
                                   for lg, zg in zip(opt.optim.param_groups, opt.param_groups)),
                "group0_lr": opt.param_groups[0]["lr"],
                "local_group0_lr": opt.optim.param_groups[0]["lr"],
                "grads_none_after_zero_grad": all(p.grad is None for p in ps),
            }
        out[cls.__name__] = _outcome(ctx.rank, run)
    return out


@pytest.mark.parametrize("cls", ["AdamW", "SGD", "Adam", "PlainSGD"])
def test_optim_is_local_optimizer_with_every_group(world, cls):
    for r, res in enumerate(world.values("optim_attributes")):
        o = res[cls]
        assert o.ok, o.describe()
        v = o.value
        assert v["is_optimizer"], "ZeroRedundancyOptimizer must be a torch.optim.Optimizer"
        assert v["optim_isinstance"], f"rank {r}: .optim is a {v['optim_type']}, not a {cls}"
        assert v["n_groups"] == 3
        assert v["n_local_groups"] == 3, f"rank {r}: .optim has {v['n_local_groups']} groups, want 3"
        assert v["local_keys_in_zero"], f"rank {r}: a key of .optim.param_groups is missing in ZeRO's"
        assert v["hyper_equal"], f"rank {r}: hyperparameters differ between ZeRO and .optim groups"
        assert v["group0_lr"] == 0.5 and v["local_group0_lr"] == 0.5
        assert v["grads_none_after_zero_grad"]


@SC.scenario()
def zero_grad_modes(ctx):
    ps = make_params([(4, 3), (3,), (7,)], seed=2)
    opt = make_zero(ps, AdamW, ctx.pg, lr=1e-3)
    fake_grads(ps, 0)
    opt.zero_grad(set_to_none=False)
    zeros = all(p.grad is not None and not p.grad.any() for p in ps)
    fake_grads(ps, 1)
    opt.zero_grad()
    nones = all(p.grad is None for p in ps)
    return {"zeros": zeros, "nones": nones}


def test_zero_grad(world):
    for r, v in enumerate(world.values("zero_grad_modes")):
        assert v["zeros"], f"rank {r}: zero_grad(set_to_none=False) must zero every grad"
        assert v["nones"], f"rank {r}: zero_grad() must set every grad to None"


@SC.scenario()
def sharding_modes(ctx):
    out = {}
    for mode in ("param", "auto", "flat"):
        def run():
            ps = make_params([(6, 4), (4,), (9,)], seed=4)
            opt = make_zero(ps, AdamW, ctx.pg, sharding=mode, lr=1e-3)
            return {"local_numel": getattr(opt, "local_numel", None), "total": sum(p.numel() for p in ps)}
        out[mode] = _outcome(ctx.rank, run)
    return out


@pytest.mark.parametrize("mode", ["param", "auto", "flat"])
def test_sharding_modes_accepted(world, mode):
    if AGAINST_TORCH:
        pytest.skip("torch has no sharding argument")
    vals = [r[mode] for r in world.values("sharding_modes")]
    for o in vals:
        assert o.ok, o.describe()
    assert sum(o.value["local_numel"] for o in vals) == vals[0].value["total"]


# --------------------------------------------------------------------------------------------
# last: a mismatch on the DEFAULT process group must leave that group usable


@SC.scenario(default_group=True, min_world=2)
def mismatch_then_default_group_usable(ctx):
    import torch.distributed as dist

    odd = ctx.rank == ctx.world_size - 1
    groups = _base(shapes=((4, 6), (4,), (3, 3))) if odd else _base()
    first = _outcome(ctx.rank, lambda: _construct(groups, AdamW, None, lr=1e-3))
    ps = make_params([(6, 4), (4,)], seed=5)
    opt = make_zero(ps, AdamW, None, lr=1e-3)
    fake_grads(ps, 0)
    opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"first": first, "allreduce": t.item(), "params": [p.detach().clone() for p in ps]}


def test_default_group_usable_after_mismatch(world):
    if world.world_size < 2:
        pytest.skip("needs 2+ ranks")
    vals = world.values("mismatch_then_default_group_usable")
    for r, v in enumerate(vals):
        assert_raised(v["first"], RuntimeError, match="rank")
        assert v["allreduce"] == world.world_size
        for a, b in zip(v["params"], vals[0]["params"]):
            assert torch.equal(a, b), f"rank {r} params differ from rank 0 after a step"


# ------------------------------------------------------------------ no process group yet

def test_built_under_torchrun_before_the_process_group_raises(monkeypatch):
    """torchrun announced 2 ranks (WORLD_SIZE) but no group exists yet (e.g. the optimizer
    was built before HF's TrainingArguments, which creates it): ValueError naming the fix,
    as torch's ZeRO raises, instead of an unsharded optimizer on every rank."""
    import torch.distributed as dist

    if AGAINST_TORCH or dist.is_available() and dist.is_initialized():
        pytest.skip("zero_ext's message; needs a process without a group")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2") as info:
        zero_class()([_p(3)], AdamW, lr=0.1)
    for fix in ("init_process_group", "TrainingArguments", "optimizer_cls_and_kwargs"):
        assert fix in str(info.value), fix


@pytest.mark.parametrize("world_size", [None, "1", ""])
def test_plain_single_process_without_a_group_still_trains(monkeypatch, world_size):
    """`python train.py` (no launcher) and torchrun with one rank: a world of one, as
    before; checked against torch's AdamW fed the same grads."""
    import torch.distributed as dist

    if AGAINST_TORCH or dist.is_available() and dist.is_initialized():
        pytest.skip("torch's ZeRO needs a group; needs a process without a group")
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    ps, rs = make_params([(4, 3), (5,)], seed=3), make_params([(4, 3), (5,)], seed=3)
    opt = zero_class()(ps, AdamW, lr=0.1)
    ref = AdamW(rs, lr=0.1)
    assert (opt.world_size, opt.rank, opt.process_group) == (1, 0, None)
    for step in range(3):
        fake_grads(ps, step)
        fake_grads(rs, step)
        opt.step()
        ref.step()
    for p, r in zip(ps, rs):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-6)
