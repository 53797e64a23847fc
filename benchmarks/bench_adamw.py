"""FusedAdamW (one fused call for all groups) vs torch.optim.AdamW (fused / foreach / for-loop).

CPU (default, 2 threads): three parameter sets, at 1 and 3 param groups:
  (a) 20000 tensors of 1024 fp32 elements, (b) 5000 x 4096,
  (c) GPT-like: GPT-2-medium layer shapes at half width plus the position embedding
      (~76M fp32 params in 291 tensors; benchmarks/model_shapes.py).
CUDA (--device cuda): 3 groups on many small tensors (20000 x 1024) against torch fused and
  foreach, and GB/s on large tensors (4 x 64M) against the measured copy bandwidth.

Times are optimizer.step() wall times (median of repeats; CUDA synchronised), GB/s counts
28 bytes per element (AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them),
"speedup of ours" = time(variant) / time(FusedAdamW). All variants (and a plain copy that moves
the same bytes, the memory-bound reference) are timed in turns in one process. On CPUs the copy
is not a strict ceiling: its stores pay a read-for-ownership that AdamW's in-place stores do
not. Machines are noisy: only ratios from one run mean anything.

    python benchmarks/bench_adamw.py                 # CPU, all sets, 1 and 3 groups
    python benchmarks/bench_adamw.py --quick         # smaller sets, for a smoke run
    python benchmarks/bench_adamw.py --device cuda --out results.md
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import (SPEEDUP_HEADERS, copy_bandwidth, print_table,  # noqa: E402
                    speedup_rows, time_interleaved)
from model_shapes import gpt2_shapes, numel  # noqa: E402

from zero_ext import FusedAdamW  # noqa: E402
from zero_ext.kernels import native_available  # noqa: E402

BYTES_PER_ELEM = 28  # fp32 AdamW: 4 reads + 3 writes of 4 bytes
OURS = "zero_ext FusedAdamW"
COPY = "memory copy, same bytes"

HP3 = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
       dict(lr=5e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
       dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)]


def param_set(name: str, quick: bool):
    """List of shapes and the group index of each shape (for 3 groups)."""
    if name == "small":
        n = 2000 if quick else 20000
        return f"{n} x 1024", [(1024,)] * n, [i % 3 for i in range(n)]
    if name == "mid":
        n = 500 if quick else 5000
        return f"{n} x 4096", [(4096,)] * n, [i % 3 for i in range(n)]
    if name == "gpt":
        shapes = [(nm, s) for nm, s in gpt2_shapes("medium", width_div=4 if quick else 2)
                  if nm != "wte.weight"]
        # decay matrices, no-decay vectors, attention matrices with their own lr
        groups = [1 if len(s) < 2 else 2 if ".attn." in nm else 0 for nm, s in shapes]
        total = sum(numel(s) for _, s in shapes)
        return (f"GPT-like {total / 1e6:.0f}M in {len(shapes)} tensors",
                [s for _, s in shapes], groups)
    if name == "large":
        n = 16 if quick else 64
        return f"4 x {n}M", [(n << 20,)] * 4, [i % 3 for i in range(4)]
    raise ValueError(name)


def make_params(shapes, device):
    torch.manual_seed(0)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, device=device).uniform_(-1, 1))
        p.grad = torch.empty_like(p).normal_(0, 1e-2)
        ps.append(p)
    return ps


def groups_for(params, group_ids, n_groups):
    if n_groups == 1:
        return [dict(params=list(params), **HP3[0])]
    out = [dict(params=[], **HP3[i]) for i in range(3)]
    for p, gi in zip(params, group_ids):
        out[gi]["params"].append(p)
    return [g for g in out if g["params"]]


def variants(device):
    v = {OURS: lambda gr: FusedAdamW(gr),
         "torch AdamW fused=True": lambda gr: torch.optim.AdamW(gr, fused=True),
         "torch AdamW foreach=True": lambda gr: torch.optim.AdamW(gr, foreach=True)}
    if device == "cpu":
        v["torch AdamW for-loop"] = lambda gr: torch.optim.AdamW(gr, foreach=False, fused=False)
    return v


def bench_set(name, device, n_groups, args):
    title, shapes, gids = param_set(name, args.quick)
    params = make_params(shapes, device)
    total = sum(p.numel() for p in params)
    # every variant steps the same params with its own state; timed in turns, together with
    # a plain copy that moves the same bytes (28 per element): the memory-bound floor
    opts = {vname: make(groups_for(params, gids, n_groups))
            for vname, make in variants(device).items()}
    fns = {k: o.step for k, o in opts.items()}
    copy_src = torch.ones(total * BYTES_PER_ELEM // 8, dtype=torch.float32, device=device)
    copy_dst = torch.empty_like(copy_src)
    fns[COPY] = lambda: copy_dst.copy_(copy_src)
    budget = {k: args.max_seconds * (3 if k.endswith("for-loop") else 1) for k in fns}
    res = time_interleaved(fns, reps=args.reps, warmup=1, device=device, max_seconds=budget,
                           min_calls=2)
    times = {k: r["median"] for k, r in res.items()}
    del opts, fns, copy_src, copy_dst
    gc.collect()
    rows = speedup_rows(times, OURS, BYTES_PER_ELEM * total)
    for r, k in zip(rows, times):
        r.append(f"{100 * times[COPY] / times[k]:.0f}%")
    headers = SPEEDUP_HEADERS + ["vs copy of the same bytes"]
    text = print_table(f"{device.upper()} {title}, {n_groups} group(s), "
                       f"{total / 1e6:.1f}M elements", headers, rows)
    del params
    gc.collect()
    return times, text


def main(argv=None) -> int:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the params and the optimizer state live")
    ap.add_argument("--sets", default=None,
                    help="comma list of small,mid,gpt,large (None: on cpu small,mid,gpt; on "
                         "cuda small,large)")
    ap.add_argument("--groups", default=None,
                    help="comma list of param-group counts to run (None: on cpu 1,3; on cuda 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--reps", type=int, default=10,
                    help="timed repetitions per variant (interleaved, median reported)")
    ap.add_argument("--max-seconds", type=float, default=6.0,
                    help="time budget per variant (for-loop: 3x)")
    ap.add_argument("--quick", action="store_true", help="smaller sets (smoke run)")
    ap.add_argument("--out", default=None, help="also append the tables to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    sets = (args.sets or ("small,mid,gpt" if dev == "cpu" else "small,large")).split(",")
    groups = [int(g) for g in (args.groups or ("1,3" if dev == "cpu" else "3")).split(",")]
    native = native_available("fused_adamw_", dev)
    head = (f"torch {torch.__version__}, device {dev}"
            + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else
               f", {torch.get_num_threads()} threads")
            + f", zero_ext native kernel: {native}")
    print(head)
    copy_gbs = copy_bandwidth(dev, nbytes=(1 << 30) if dev == "cuda" else (256 << 20))
    print(f"measured copy bandwidth (read + write): {copy_gbs:.1f} GB/s")
    texts, summary = [head, f"copy bandwidth: {copy_gbs:.1f} GB/s"], []
    for name in sets:
        for ng in groups:
            if name == "large" and ng != groups[0]:
                continue
            times, text = bench_set(name, dev, ng, args)
            texts.append(text)
            fused = times.get("torch AdamW fused=True")
            if fused:
                summary.append((name, ng, fused / times[OURS], times[COPY] / times[OURS]))
    print("\nSpeedup of FusedAdamW over torch AdamW(fused=True):")
    targets = ({("small", 3): 5.0, ("gpt", 3): 1.1, ("gpt", 1): 1.1} if dev == "cpu"
               else {("small", 3): 1.2})
    for name, ng, s, frac in summary:
        tgt = targets.get((name, ng))
        mark = "" if tgt is None else f"  (target >= {tgt}x: {'met' if s >= tgt else 'NOT met'})"
        bw = f"; {100 * frac:.0f}% of a same-bytes copy's speed"
        if dev == "cuda" and name == "large":
            bw += f" (target >= 85%: {'met' if frac >= 0.85 else 'NOT met'})"
        line = f"  {name:6s} {ng} group(s): {s:.2f}x{mark}{bw}"
        print(line)
        texts.append(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(texts) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
