"""Peak resident memory (RSS) per rank of a DDP training job: what zero_ext's DDP comm hook
``reduce_scatter_hook`` adds over plain zero_ext.

    python benchmarks/bench_hook_memory.py --world 2                  # all configs, ~8 min
    python benchmarks/bench_hook_memory.py --quick                    # smoke run (< 60 s)
    python benchmarks/bench_hook_memory.py --configs zero_ext-even,hook-even --repeats 3

The job: an MLP of 8 x Linear(2048, 2048) with GELU between (33.6M fp32 params, 134 MB),
batch 16 x 2048 random inputs (seeded per rank), loss = output.square().mean(), wrapped in
DDP (gloo, CPU, one thread per rank), ``--iters`` iterations of forward, backward, clipping
to norm 1, step, zero_grad. Configs:

  ddp              torch.optim.AdamW(fused=True), torch.nn.utils.clip_grad_norm_
  zero_ext-<mode>  zero_ext.ZeroRedundancyOptimizer(AdamW, sharding=<mode>), opt.clip_grad_norm_
  hook-<mode>      the same + ddp.register_comm_hook(opt, reduce_scatter_hook)
                   (mode: param, flat, even; only the hook differs)

ru_maxrss is a lifetime peak, so every (config, repeat) runs in fresh processes (spawned
ranks). Each rank reports its baseline (VmRSS from /proc/self/statm right after import torch
and the gloo init) and ru_maxrss after the last iteration. The table gives, per config, the
peak RSS (max over ranks; min..max over repeats), and the peak above baseline (max over ranks)
minus that of the plain zero_ext config of the same mode, and of ddp, paired by repeat (all
configs of a repeat run back to back, so a load change hits them alike). MB = 1e6 bytes.
Nothing is asserted; compare configs measured in one run. Each spawn took 25-35 s on 2
busy cores, mostly importing torch and torch._dynamo (which the first optimizer of a process
pulls in); --quick runs only zero_ext-even and hook-even unless --configs says otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repository root on sys.path)
from common import print_table, spawned_rank

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("param", "flat", "even")
CONFIGS = ("ddp",) + tuple(f"zero_ext-{m}" for m in MODES) + tuple(f"hook-{m}" for m in MODES)
QUICK_CONFIGS = "zero_ext-even,hook-even"
MB = 1e6


def _rss() -> int:
    """Current resident set, bytes (statm's second field is resident pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(rank: int, world: int, opts: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=opts["init"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    baseline = _rss()  # before zero_ext is imported: its import is part of what it costs
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg, width, depth = opts["config"], opts["width"], opts["depth"]
    torch.manual_seed(0)  # the same model on every rank (DDP broadcasts rank 0's anyway)
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(width, width)] + ([torch.nn.GELU()] if i < depth - 1 else [])
    ddp = DDP(torch.nn.Sequential(*layers))
    hooked = cfg.startswith("hook-")
    if cfg == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), lr=6e-4, betas=(0.9, 0.95),
                                weight_decay=0.1, fused=True)
    else:
        from zero_ext import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW,
                                      sharding=cfg.split("-", 1)[1], lr=6e-4,
                                      betas=(0.9, 0.95), weight_decay=0.1)
        if hooked:
            from zero_ext.ddp_zero_hook import reduce_scatter_hook

            ddp.register_comm_hook(opt, reduce_scatter_hook)
    gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    for _ in range(opts["iters"]):
        x = torch.randn(opts["batch"], width, generator=gen)
        ddp(x).square().mean().backward()
        if cfg == "ddp":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        else:  # zero_ext's clip in both, so that only the hook differs (with the hook each
            opt.clip_grad_norm_(1.0)  # rank holds only its own averaged grads: it must)
        opt.step()
        opt.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with open(os.path.join(opts["dir"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "baseline": baseline, "peak": peak}, f)
    dist.barrier()  # nobody tears the group down while another still steps
    dist.destroy_process_group()


def run_once(world: int, opts: dict, timeout: float) -> list:
    """One spawn of `world` fresh ranks; their reports, by rank. Raises on failure/timeout."""
    with tempfile.TemporaryDirectory(prefix="hook_memory_") as d:
        opts = dict(opts, dir=d, init="file://" + os.path.join(d, "store"))
        ctx = mp.start_processes(spawned_rank, args=(worker, world, opts), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=5):  # raises (and ends the others) if a rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{opts['config']} at world {world}: no result "
                                       f"after {timeout:.0f} s")
        finally:
            for p in ctx.processes:  # a hung rank must not outlive the run
                if p.is_alive():
                    p.terminate()
                    p.join(10)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def _span(vals, signed=False) -> str:
    lo, hi = min(vals) / MB, max(vals) / MB
    fmt = "{:+.0f}" if signed else "{:.0f}"
    return fmt.format(lo) if round(lo) == round(hi) else f"{fmt.format(lo)}..{fmt.format(hi)}"


def table(results: dict, worlds, configs) -> str:
    """results[world][config]: one list of rank reports per repeat."""
    headers = ["config", "world", "peak RSS/rank MB", "baseline MB", "above baseline MB",
               "vs zero_ext-<mode> MB", "vs ddp MB"]
    rows = []
    for w in worlds:
        res = results[w]
        above = {c: [max(r["peak"] - r["baseline"] for r in rep) for rep in res[c]]
                 for c in configs}

        def diff(c, ref):
            if ref not in above or ref == c:
                return "-"
            return _span([a - b for a, b in zip(above[c], above[ref])], signed=True)

        for c in configs:
            rows.append([c, w, _span([max(r["peak"] for r in rep) for rep in res[c]]),
                         _span([max(r["baseline"] for r in rep) for rep in res[c]]),
                         _span(above[c]),
                         diff(c, "zero_ext-" + c.split("-", 1)[1]) if "-" in c else "-",
                         diff(c, "ddp")])
    return print_table("Peak RSS per rank (ru_maxrss, max over ranks; min..max over repeats; "
                       "differences of the peaks above baseline, paired by repeat)",
                       headers, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="2", help="world size(s), comma-separated")
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIGS)} "
                    f"(default: all; with --quick: {QUICK_CONFIGS})")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="4 x Linear(256, 256), 3 iterations, 1 repeat: a smoke run")
    ap.add_argument("--timeout", type=float, default=600, help="per spawn, seconds")
    ap.add_argument("--out", help="write the markdown table to this file")
    ap.add_argument("--json", help="write the raw per-rank numbers to this file")
    args = ap.parse_args(argv)
    # a spawn costs ~25 s on 2 cores (import torch, torch._dynamo): 2 keep --quick < 60 s
    chosen = args.configs or (QUICK_CONFIGS if args.quick else ",".join(CONFIGS))
    configs = [c for c in chosen.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown --configs {bad}; choose from {','.join(CONFIGS)}")
    worlds = [int(w) for w in args.world.split(",")]
    opts = dict(width=2048, depth=8, batch=16, iters=args.iters)
    repeats = args.repeats
    if args.quick:
        opts.update(width=256, depth=4, iters=3)
        repeats = 1
    if opts["iters"] < 3:  # DDP rebuilds its buckets after the first iteration
        ap.error("--iters must be at least 3")

    t0 = time.monotonic()
    results = {w: {c: [] for c in configs} for w in worlds}
    for w in worlds:
        for rep in range(repeats):  # all configs of a repeat back to back
            for c in configs:
                ranks = run_once(w, dict(opts, config=c), args.timeout)
                results[w][c].append(ranks)
                print(f"world {w} repeat {rep} {c}: peak "
                      f"{max(r['peak'] for r in ranks) / MB:.0f} MB", flush=True)
    text = table(results, worlds, configs)
    print(f"\n{time.monotonic() - t0:.0f} s for {len(worlds) * repeats * len(configs)} spawns")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.lstrip("\n") + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"opts": opts, "repeats": repeats,
                       "results": {str(w): v for w, v in results.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
