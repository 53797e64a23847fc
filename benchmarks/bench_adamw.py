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

--mode masters: the mixed-precision kernel (bf16 params and grads, float32 masters and
moments: 30 bytes per element, reads g 2 + master 4 + param 2 + m 4 + v 4, writes master,
m, v 4 each + param 2), one op call per step through zero_ext.kernels.fused_adamw_, against
a copy moving the same 30 bytes per element, torch.optim.AdamW(fused=True, else foreach) on
float32 params of the same count, and zero_ext FusedAdamW on those float32 params. Sets:
"many" (tensors of 1024 elements) and "few" (4 large tensors); small sizes on the CPU unless
--size says otherwise.

    python benchmarks/bench_adamw.py --mode masters                 # CPU, 2M elements
    python benchmarks/bench_adamw.py --mode masters --device cuda   # 20M and 256M elements
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
from zero_ext.kernels import adamw as K  # noqa: E402

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


# ---- --mode masters ---------------------------------------------------------------------
MASTER_BYTES_PER_ELEM = 30  # see the module docstring
OURS_MW = "zero_ext bf16 + fp32 masters (op)"
COPY_MW = "memory copy, same bytes (30 B/elem)"


def master_sets(device, size, quick):
    """(name, title, shapes). size: total elements (None: 2M on the CPU, 256M on CUDA, 16x
    fewer with --quick)."""
    total = size or ((1 << 21) if device == "cpu" else (1 << 28)) >> (4 if quick else 0)
    n_many = max(1, min(total, 20000 << 10) // 1024)  # at most 20000 tensors
    return [("many", f"{n_many} x 1024", [(1024,)] * n_many),
            ("few", f"4 x {total // 4}", [(total // 4,)] * 4)]


def torch_fp32_adamw(params, device):
    """torch.optim.AdamW(fused=True) where this torch supports it on the device, else foreach."""
    for kw in (dict(fused=True), dict(foreach=True)):
        try:
            opt = torch.optim.AdamW([dict(params=params, **HP3[0])], **kw)
            opt.step()  # unsupported devices raise at construction or at the first step
            return f"torch AdamW {next(iter(kw))}=True (fp32)", opt
        except (RuntimeError, ValueError):
            continue
    raise RuntimeError("torch.optim.AdamW has neither fused nor foreach here")


def bench_masters_set(title, shapes, device, args):
    torch.manual_seed(0)
    S = len(shapes)
    total = sum(numel(s) for s in shapes)
    masters = [torch.empty(s, device=device).uniform_(-1, 1) for s in shapes]
    params = [w.to(torch.bfloat16) for w in masters]
    grads = [torch.empty(s, device=device).normal_(0, 1e-2).to(torch.bfloat16) for s in shapes]
    exp_avgs = [torch.zeros(s, device=device) for s in shapes]
    exp_avg_sqs = [torch.zeros(s, device=device) for s in shapes]
    steps = torch.zeros(S, device=device)
    groups = torch.zeros(S, dtype=torch.long)
    table = K.group_hparams_table(HP3[:1])

    def ours():
        steps.add_(1)
        K.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, groups, table,
                       masters=masters)

    # fp32 params of the same count, each optimizer with its own copies and state
    def fp32_params():
        ps = [torch.nn.Parameter(w.clone()) for w in masters]
        for p, g in zip(ps, grads):
            p.grad = g.float()
        return ps

    torch_name, torch_opt = torch_fp32_adamw(fp32_params(), device)
    ours_fp32 = FusedAdamW([dict(params=fp32_params(), **HP3[0])])
    copy_src = torch.ones(total * MASTER_BYTES_PER_ELEM // 8, dtype=torch.float32,
                          device=device)
    copy_dst = torch.empty_like(copy_src)
    fns = {OURS_MW: ours, COPY_MW: lambda: copy_dst.copy_(copy_src),
           torch_name: torch_opt.step, "zero_ext FusedAdamW (fp32)": ours_fp32.step}
    budget = {k: args.max_seconds for k in fns}
    res = time_interleaved(fns, reps=args.reps, warmup=1, device=device, max_seconds=budget,
                           min_calls=2)
    times = {k: r["median"] for k, r in res.items()}
    rows = speedup_rows(times, OURS_MW)
    for r, k in zip(rows, times):
        moved = MASTER_BYTES_PER_ELEM if k in (OURS_MW, COPY_MW) else BYTES_PER_ELEM
        r[2] = f"{moved * total / times[k] / 1e9:.1f}"
    text = print_table(f"{device.upper()} masters, {title}, {total / 1e6:.1f}M elements "
                       "(GB/s: 30 B/elem for the bf16+master kernel and the copy, 28 for fp32)",
                       SPEEDUP_HEADERS, rows)
    summary = (times[COPY_MW] / times[OURS_MW], times[torch_name] / times[OURS_MW], torch_name,
               times["zero_ext FusedAdamW (fp32)"] / times[OURS_MW])
    del fns, torch_opt, ours_fp32, copy_src, copy_dst, params, grads, masters
    gc.collect()
    return summary, text


def main_masters(args) -> int:
    dev = args.device
    native = native_available("fused_adamw_", dev)
    head = (f"torch {torch.__version__}, device {dev}"
            + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else
               f", {torch.get_num_threads()} threads")
            + f", zero_ext native kernel: {native}, mode masters")
    print(head)
    texts, lines = [head], []
    wanted = None if args.sets is None else set(args.sets.split(","))
    for name, title, shapes in master_sets(dev, args.size, args.quick):
        if wanted is not None and name not in wanted:
            continue
        (vs_copy, vs_torch, torch_name, vs_fp32), text = bench_masters_set(title, shapes,
                                                                            dev, args)
        texts.append(text)
        lines.append(f"  {name:5s} ({title}): {100 * vs_copy:.0f}% of a same-bytes copy's "
                     f"speed; {vs_torch:.2f}x the speed of {torch_name}; {vs_fp32:.2f}x "
                     "the speed of zero_ext fp32")
    print("\nbf16 params + fp32 masters, one op call (ratios of step times):")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(texts + lines) + "\n")
    return 0


def main(argv=None) -> int:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the params and the optimizer state live")
    ap.add_argument("--mode", default="optimizers", choices=["optimizers", "masters"],
                    help="optimizers: FusedAdamW against torch's AdamW variants; masters: the "
                         "bf16 + fp32-master kernel (see above)")
    ap.add_argument("--size", type=int, default=None,
                    help="--mode masters: total elements per set (None: 2M cpu, 256M cuda)")
    ap.add_argument("--sets", default=None,
                    help="comma list of small,mid,gpt,large (None: on cpu small,mid,gpt; on "
                         "cuda small,large); --mode masters: many,few (None: both)")
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
    if args.mode == "masters":
        return main_masters(args)
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
