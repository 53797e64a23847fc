"""Scripts that move the params' memory or the optimizer's state around the optimizer.

Each flow is checked against a plain single-process torch optimizer fed the same grads, on
every rank (fp32: atol/rtol 1e-6), and for bitwise-identical params across ranks:

- `p.data = t` and then `add_param_group` before the next step (the new group must not
  hide the replaced memory);
- `p.data = t` for one param of a multi-param bucket (bucket views): the bucket's other
  params keep training;
- two params swapping memory (`a.data, b.data = b.data, a.data`: the EMA-swap idiom) with
  bucket views, and a tensor the script keeps on a param's old memory staying untouched;
- freezing params with bucket views frees the old buffers (no model copy kept per freeze);
- one rank stepping with another lr raises on every rank;
- FusedAdamW with complex params after `p.data = t`, and after `opt.state[p] = {}`.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import gloo_available, run_world

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

ATOL = RTOL = 1e-6
SHAPES = [(6, 6), (5,), (7, 3), (4,)]
MODES = [("param", False), ("param", True), ("flat", False), ("flat", True)]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=torch.float32) for p in params]


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _step_both(opt, ref, ps, rs, step):
    for p, r, gr in zip(ps, rs, _grads(ps, step)):
        p.grad, r.grad = gr.clone(), gr.clone()
    opt.step()
    ref.step()


def _result(ps, rs):
    err = max((p.detach() - r.detach()).abs().max().item() for p, r in zip(ps, rs))
    flat = torch.cat([p.detach().reshape(-1) for p in ps])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return err, all(torch.equal(every[0], x) for x in every)


def _check(results):
    for r, (err, same) in enumerate(results):
        assert err <= ATOL + RTOL, f"rank {r}: {err:.3g} off torch"
        assert same, f"rank {r}: params differ between ranks"


def _replace_then_add_group(rank, world, sharding, bucket_view):
    from zero_ext import ZeroRedundancyOptimizer

    ps, rs = _params(SHAPES), _params(SHAPES)
    opt = ZeroRedundancyOptimizer(ps[:3], torch.optim.AdamW, sharding=sharding,
                                  parameters_as_bucket_view=bucket_view, lr=0.05)
    ref = torch.optim.AdamW(rs[:3], lr=0.05)
    _step_both(opt, ref, ps[:3], rs[:3], 0)  # state exists: the partition is fixed
    g = torch.Generator().manual_seed(7)
    for p, r in zip(ps, rs):  # weights loaded by replacing the memory
        new = torch.randn(p.shape, generator=g)
        p.data, r.data = new.clone(), new.clone()
    opt.add_param_group({"params": [ps[3]], "lr": 0.01})
    ref.add_param_group({"params": [rs[3]], "lr": 0.01})
    for step in range(1, 4):
        _step_both(opt, ref, ps, rs, step)
    return _result(ps, rs)


@pytest.mark.parametrize("sharding,bucket_view", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("world", [2, 3])
def test_replaced_memory_then_add_param_group(world, sharding, bucket_view):
    _check(run_world(_replace_then_add_group, world, sharding, bucket_view, timeout=120))


def _swap_and_keep_old(rank, world, sharding, bucket_view):
    from zero_ext import ZeroRedundancyOptimizer

    shapes = [(6, 6), (6, 6), (5,)]
    ps, rs = _params(shapes), _params(shapes)
    opt = ZeroRedundancyOptimizer(ps, torch.optim.AdamW, sharding=sharding,
                                  parameters_as_bucket_view=bucket_view, lr=0.05)
    ref = torch.optim.AdamW(rs, lr=0.05)
    _step_both(opt, ref, ps, rs, 0)
    ps[0].data, ps[1].data = ps[1].data, ps[0].data  # EMA-style swap
    rs[0].data, rs[1].data = rs[1].data, rs[0].data
    backup = ps[2].data  # a tensor the script keeps on p2's old memory
    kept = backup.clone()
    ps[2].data = ps[2].data.clone()
    rs[2].data = rs[2].data.clone()
    for step in range(1, 4):
        _step_both(opt, ref, ps, rs, step)
    err, same = _result(ps, rs)
    return err, same and torch.equal(backup, kept)


@pytest.mark.parametrize("sharding,bucket_view", MODES, ids=lambda x: str(x))
def test_swapped_memory_and_kept_old_memory(sharding, bucket_view):
    _check(run_world(_swap_and_keep_old, 2, sharding, bucket_view, timeout=120))


def _replace_one_of_a_bucket(rank, world, sharding):
    """`p.data = t` for ONE param of a multi-param bucket (bucket views): the bucket gets a
    new buffer, and every member's local piece must follow it, not only the moved one's."""
    from zero_ext import ZeroRedundancyOptimizer

    ps, rs = _params(SHAPES), _params(SHAPES)
    opt = ZeroRedundancyOptimizer(ps, torch.optim.AdamW, sharding=sharding,
                                  parameters_as_bucket_view=True, lr=0.05)
    ref = torch.optim.AdamW(rs, lr=0.05)
    members = max(len(b.param_ids) for b in opt.plan.buckets if 1 in b.param_ids)
    _step_both(opt, ref, ps, rs, 0)
    new = torch.randn(SHAPES[1], generator=torch.Generator().manual_seed(11))
    ps[1].data, rs[1].data = new.clone(), new.clone()
    for step in range(1, 4):
        _step_both(opt, ref, ps, rs, step)
    return (*_result(ps, rs), members)


@pytest.mark.parametrize("sharding", ["flat", "param"])
@pytest.mark.parametrize("world", [2, 3])
def test_replacing_one_param_of_a_bucket(world, sharding):
    results = run_world(_replace_one_of_a_bucket, world, sharding, timeout=120)
    _check([(err, same) for err, same, _ in results])
    for r, (_, _, members) in enumerate(results):
        assert members > 1, f"rank {r}: the replaced param is alone in its bucket"


def _freeze_storage(rank, world):
    from zero_ext import ZeroRedundancyOptimizer

    ps = _params([(256, 256), (256, 256), (8,), (8,)])
    model_bytes = sum(p.numel() * p.element_size() for p in ps)
    opt = ZeroRedundancyOptimizer(ps, torch.optim.AdamW, sharding="param",
                                  parameters_as_bucket_view=True, lr=0.01)
    for step in range(4):
        if step in (1, 3):
            ps[step // 2].requires_grad_(False)  # progressive freezing
        for p in ps:
            p.grad = torch.ones_like(p) if p.requires_grad else None
        opt.step()
    live = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ps}
    return sum(live.values()) / model_bytes


def test_freezing_with_bucket_views_frees_old_buffers():
    for r, ratio in enumerate(run_world(_freeze_storage, 2, timeout=120)):
        assert ratio < 1.2, f"rank {r}: params keep {ratio:.2f}x the model bytes alive"


def _lr_on_one_rank(rank, world):
    from zero_ext import ZeroRedundancyOptimizer

    ps = _params(SHAPES)
    opt = ZeroRedundancyOptimizer(ps, torch.optim.AdamW, lr=0.05)
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.1  # e.g. a scheduler stepped on one rank only
    for p, gr in zip(ps, _grads(ps, 0)):
        p.grad = gr
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_different_lr_on_one_rank_raises_everywhere():
    for r, msg in enumerate(run_world(_lr_on_one_rank, 2, timeout=120)):
        assert msg is not None and "hyperparameters" in msg, f"rank {r}: {msg!r}"


def test_fused_adamw_complex_after_replacing_memory_and_resetting_state():
    from zero_ext import FusedAdamW

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.complex64, generator=g)),
          torch.nn.Parameter(torch.randn(4, generator=g))]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = FusedAdamW(ps, lr=0.05), torch.optim.AdamW(rs, lr=0.05)
    for step in range(6):
        if step == 2:
            new = torch.randn(5, 3, dtype=torch.complex64, generator=g)
            ps[0].data, rs[0].data = new.clone(), new.clone()
        if step == 4:
            opt.state[ps[1]] = {}
            ref.state[rs[1]] = {}
        gg = torch.Generator().manual_seed(step)
        for p, r in zip(ps, rs):
            gr = torch.randn(p.shape, dtype=p.dtype, generator=gg)
            p.grad, r.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
    for p, r in zip(ps, rs):
        torch.testing.assert_close(p.detach(), r.detach(), atol=ATOL, rtol=RTOL)


def _sgd_wrong_size_state(rank, world):
    from zero_ext import ZeroRedundancyOptimizer

    ps = _params([(6, 6), (5,)])
    opt = ZeroRedundancyOptimizer(ps, torch.optim.SGD, sharding="param", lr=0.1, momentum=0.9)
    sd = {"state": {0: {"momentum_buffer": torch.zeros(5)}},
          "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                            "params": [0, 1]}]}
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return None


def test_wrong_size_sgd_state_is_refused_at_load_on_every_rank():
    for r, msg in enumerate(run_world(_sgd_wrong_size_state, 2, timeout=120)):
        assert msg is not None and "momentum_buffer" in msg, f"rank {r}: {msg!r}"
