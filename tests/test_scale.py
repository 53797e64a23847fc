"""Scale: plans at large worlds (fake process group, meta params), and the faster planning
code gives exactly the owners the earlier O(world)-per-step code gave."""
from __future__ import annotations

import bisect
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist

from zero_ext import layout, sync
from zero_ext.kernels import partition as P

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


# ------------------------------------------------------------------ the earlier code, verbatim

def _old_extend_owners(loads, numels):
    loads = list(loads)
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(len(loads)), key=lambda r: (loads[r], r))
        out[i] = r
        loads[r] += numels[i]
    return out


def _old_local_search(numels, world_size, owner, loads):
    total = sum(numels)
    bound = max(-(-total // world_size), max(numels, default=0))
    if world_size < 2 or max(loads) <= bound:
        return
    items = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: (numels[i], i)):
        if numels[i] > 0:
            items[owner[i]].append((numels[i], i))
    for _ in range(P.MAX_LOCAL_SEARCH_ITERS):
        h = max(range(world_size), key=lambda r: (loads[r], -r))
        if loads[h] <= bound:
            return
        others = sorted((r for r in range(world_size) if r != h), key=lambda r: (loads[r], r))
        applied = False
        for r in others:
            if loads[h] - loads[r] < 2:
                break
            step = P._best_step(items[h], items[r], loads[h], loads[r])
            if step is None:
                continue
            _, is_swap, p, q, p_numel, q_numel = step
            items[h].remove((p_numel, p))
            bisect.insort(items[r], (p_numel, p))
            owner[p] = r
            delta = p_numel
            if is_swap:
                items[r].remove((q_numel, q))
                bisect.insort(items[h], (q_numel, q))
                owner[q] = h
                delta -= q_numel
            loads[h] -= delta
            loads[r] += delta
            applied = True
            break
        if not applied:
            return


def _old_assign_params(numels, groups, world):
    n = len(numels)
    if n == 0 or world == 1:
        return [0] * n
    owner_a, loads_a = P._greedy(sorted(range(n), key=lambda i: (groups[i], -numels[i], i)),
                                 numels, world)
    owner_b, loads_b = P._greedy(sorted(range(n), key=lambda i: (-numels[i], i)), numels, world)
    owner, loads = (owner_b, loads_b) if max(loads_b) < max(loads_a) else (owner_a, loads_a)
    _old_local_search(numels, world, owner, loads)
    return owner


# ------------------------------------------------------------------ same owners as before

def _mixed_case(seed):
    """Many ranks, some near-empty, ties and empty params (the search mostly stops early)."""
    rng = random.Random(seed)
    world = rng.choice([3, 17, 64, 256, 1024])
    n = rng.randint(1, 6) * world // rng.choice([1, 2, 4]) + rng.randint(0, 40)
    kind = seed % 3
    if kind == 0:
        numels = [int(2 ** rng.uniform(4, 18)) for _ in range(n)]
    elif kind == 1:  # many ties
        numels = [rng.choice([0, 1, 2, 3, 64, 65, 1000]) for _ in range(n)]
    else:  # transformer-like with a few huge ones
        numels = [rng.choice([768, 2304, 589824, 2359296, 38597376]) for _ in range(n)]
    return numels, [rng.randint(0, 2) for _ in range(n)], world


def _search_case(seed):
    """About 20 log-uniform params per rank: the greedy ends above the bound and the local
    search takes hundreds to thousands of steps (seed 7: ~1500 at world 1024)."""
    rng = random.Random(seed)
    world = [5, 64, 256, 1024][seed % 4]
    n = world * (24 if world < 1024 else 20) + rng.randint(0, 30)
    lo, hi = rng.choice([(8, 18), (10, 22), (0, 12)])
    numels = [int(2 ** rng.uniform(lo, hi)) for _ in range(n)]
    if seed % 3 == 0:
        numels = [x // 16 * 16 for x in numels]  # many ties, some empty
    return numels, [rng.randint(0, 2) for _ in range(n)], world


@pytest.mark.parametrize("case", [_mixed_case, _search_case])
@pytest.mark.parametrize("seed", range(12))
def test_partition_same_owners_as_before(case, seed):
    numels, groups, world = case(seed)
    old = _old_assign_params(numels, groups, world)
    assert P.assign_params_reference(numels, groups, world) == old
    assert P.assign_params(numels, groups, world) == old  # the native kernel when built


@pytest.mark.parametrize("seed", range(12))
def test_extend_owners_same_as_before(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 5, 64, 1024])
    loads = [rng.choice([0, 0, 7, rng.randint(0, 1 << 20)]) for _ in range(world)]
    numels = [rng.choice([0, 1, 7, rng.randint(0, 1 << 20)]) for _ in range(rng.randint(0, 300))]
    assert layout.extend_owners(loads, numels) == _old_extend_owners(loads, numels)


# ------------------------------------------------------------------ fake world of 1024 ranks

@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    def init(world, rank=0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_meta_params_are_not_aliases():
    a = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    b = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    c = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    assert layout.find_aliases([a, b, c]) == {}
    c.data = a.data  # the old tying idiom: the same meta storage
    assert layout.find_aliases([a, b, c]) == {2: 0}


def _gpt2_meta(width_div=4):
    sys.path.insert(0, _BENCH)
    import model_shapes

    params = [torch.nn.Parameter(torch.empty(s, device="meta"))
              for _, s in model_shapes.gpt2_shapes("small", width_div)]
    return params, [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("sharding", ["param", "flat"])
def test_world_1024_plan_on_meta(fake_world, sharding):
    import zero_ext

    world = 1024
    numels_seen = None
    for rank in (0, 777):
        fake_world(world, rank)
        params, groups = _gpt2_meta()
        opt = zero_ext.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, sharding=sharding,
                                               lr=1e-3)
        plan = opt.plan
        numels = [p.numel() for p in plan.params]
        assert numels_seen in (None, numels)
        numels_seen = numels
        # every element of every param is owned exactly once over all ranks
        covered = [0] * len(numels)
        per_rank = [0] * world
        for b in plan.buckets:
            assert len(b.rank_ranges) == world
            for r in range(world):
                for pc in b.pieces(r):
                    covered[pc.param_id] += pc.length
                    per_rank[r] += pc.length
        assert covered == numels
        assert per_rank[rank] == opt.local_numel
        if sharding == "param":
            assert plan.owner == P.assign_params(numels, plan.group_of, world)
        else:
            assert max(per_rank) - min(per_rank) <= max(
                b.numel for b in plan.buckets) // world
        # a step on fake grads issues the agreement and one broadcast per planned message
        for p in params:
            p.grad = torch.empty_like(p)
        calls = []
        real = dist.broadcast

        def counting(*a, **k):
            calls.append(a[0].numel())
            return real(*a, **k)

        opt.step()
        dist.broadcast = counting
        try:
            opt.step()
        finally:
            dist.broadcast = real
        messages = sync.plan_messages(plan.buckets, world, plan.trainable)
        assert len(calls) == len(messages)
        assert sum(calls) == sum(numels)  # the whole model goes round once per step


def test_bench_scale_quick_runs(fake_world, capsys):
    sys.path.insert(0, _BENCH)
    import bench_scale

    assert bench_scale.main(["--quick", "--models", "gpt2-small", "--worlds", "8", "64",
                             "--no-torch"]) == 0
    out = capsys.readouterr().out
    assert "| gpt2-small |    64 |     flat |" in out
