"""Partition planning: balance (max/mean rank load) and planning time, ours vs torch's rule.

Balance: whole-param ownership by torch's ZeroRedundancyOptimizer rule and by our
``assign_params``, and element-level ("flat") sharding by ``flat_offsets`` (real elements per
rank, padding excluded). Time: our C++ ``assign_params`` / ``flat_offsets`` (wrapper included,
list -> tensor conversion too) against upstream's own partition code run on meta tensors
(skipped above 100k params: it is O(n * world) Python) and against ``torch_greedy`` (our Python
copy of that rule). Medians of repeats in this run.

    python benchmarks/bench_partition.py [--threads 2] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import model_shapes  # noqa: E402
from zero_ext.kernels import partition as P  # noqa: E402
from zero_ext.kernels._loader import native_available  # noqa: E402

WORLDS = [2, 4, 8, 16, 64]


def median_time(fn, repeats):
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def upstream_partition(numels, groups, world):
    """Ranks from torch's own ZeroRedundancyOptimizer._partition_parameters (meta tensors)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

    params = [torch.empty(n, device="meta") for n in numels]
    ids = sorted(set(groups))
    zero = object.__new__(Zero)
    zero._partition_parameters_cache = []
    zero.world_size = world
    zero.param_groups = [{"params": [p for p, g in zip(params, groups) if g == k]} for k in ids]
    per_rank = Zero._partition_parameters(zero)
    where = {id(p): i for i, p in enumerate(params)}
    owners = [0] * len(params)
    for rank, rank_groups in enumerate(per_rank):
        for group in rank_groups:
            for p in group["params"]:
                owners[where[id(p)]] = rank
    return owners


def flat_loads(numels, world, alignment=4):
    offsets = P.flat_offsets(numels, world, alignment)
    return [sum(piece[2] for piece in P.rank_pieces(offsets, numels, world, r))
            for r in range(world)]


def workloads():
    out = []
    for model in ("small", "medium"):
        numels, groups = model_shapes.decay_groups(model_shapes.gpt2_shapes(model))
        out.append((f"GPT-2 {model}", numels, groups))
    out.append(("100 uneven params", *model_shapes.uneven_model(100, seed=1)))
    n = 1_000_000
    numels = model_shapes.random_numels(n, seed=0)
    out.append(("1M params, 2 groups", numels, [0] * (n // 2) + [1] * (n - n // 2)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed repetitions per case (median reported)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_available("assign_params", "cpu")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, native kernels: "
          f"{native}, median of {args.repeats}")
    if not native:
        print("WARNING: native ops unavailable, timing the pure-Python reference")

    loads = workloads()
    print("\nbalance: max rank load / mean rank load (1.000 is perfect)")
    head = f"{'model':22} {'world':>5} {'torch rule':>10} {'ours':>8} {'flat':>8} {'gain':>7}"
    print(head)
    print("-" * len(head))
    for name, numels, groups in loads:
        for world in WORLDS:
            t = P.max_over_mean(P.rank_loads(numels, P.torch_greedy(numels, groups, world), world))
            o = P.max_over_mean(P.rank_loads(numels, P.assign_params(numels, groups, world), world))
            f = P.max_over_mean(flat_loads(numels, world))
            print(f"{name:22} {world:5d} {t:10.4f} {o:8.4f} {f:8.4f} {t / f:6.2f}x")

    print("\nplanning time (ms; speedup = torch / ours)")
    head = (f"{'model':22} {'world':>5} {'params':>8} {'ours':>8} {'flat':>8} {'upstream':>9} "
            f"{'torch_greedy':>12} {'x upstream':>10} {'x greedy':>8}")
    print(head)
    print("-" * len(head))
    for name, numels, groups in loads:
        for world in (8, 64):
            ours = median_time(lambda: P.assign_params(numels, groups, world), args.repeats)
            flat = median_time(lambda: P.flat_offsets(numels, world, 4), args.repeats)
            greedy = median_time(lambda: P.torch_greedy(numels, groups, world),
                                 max(1, args.repeats // 2))
            if len(numels) <= 100_000:
                upstream = median_time(lambda: upstream_partition(numels, groups, world),
                                       max(1, args.repeats // 2))
                assert upstream_partition(numels, groups, world) == P.torch_greedy(
                    numels, groups, world)
                up, x_up = f"{upstream * 1e3:9.2f}", f"{upstream / ours:9.1f}x"
            else:
                up, x_up = f"{'-':>9}", f"{'-':>10}"
            print(f"{name:22} {world:5d} {len(numels):8d} {ours * 1e3:8.2f} {flat * 1e3:8.2f} "
                  f"{up} {greedy * 1e3:12.2f} {x_up} {greedy / ours:7.1f}x")

    print("\nnative op alone on int64 tensors (ms): the 'well under 100 ms at 1M params' check.")
    print("thread CPU time is the work itself; wall time also counts waiting for a core on a")
    print("loaded machine")
    if native:
        name, numels, groups = loads[-1]
        tn, tg = torch.tensor(numels), torch.tensor(groups)
        for world in WORLDS:
            wall, cpu = [], []
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.thread_time()
                torch.ops.zero_ext.assign_params(tn, tg, world)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - t0)
            print(f"{name:22} world {world:3d}: wall {statistics.median(wall) * 1e3:7.2f} ms, "
                  f"thread CPU {statistics.median(cpu) * 1e3:7.2f} ms")

if __name__ == "__main__":
    main()
