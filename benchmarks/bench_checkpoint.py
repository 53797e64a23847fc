"""Checkpoint benchmark: zero_ext's consolidation and sharded save/load vs torch's ZeRO.

World N (default 2) on gloo, spawned processes, GPT-2-small shapes (124M params, decay and
no-decay groups) with AdamW state after one step (2 x 124M fp32 state elements in all).
Both optimizers live in the same processes on the same params; every operation is timed from
a barrier to a barrier (slowest rank; os.sync() before each, untimed, so that one write's
page-cache flush is not charged to the next operation) and measured for memory:

  consolidate   zero_ext consolidate_state_dict(0)  vs torch ZeRO consolidate_state_dict(0)
  + torch.save  the above, then rank 0 torch.save(state_dict()) to a file
  sharded save  zero_ext.checkpoint.save (every rank writes its share) vs consolidate +
                torch.save (torch's only way to checkpoint)
  load          zero_ext.checkpoint.load into a fresh optimizer vs every rank
                torch.load(file) + load_state_dict into a fresh torch ZeRO

Memory: the peak resident set size (VmHWM, reset through /proc/self/clear_refs before each
operation) minus the resident size when the operation starts, on rank 0 (the target of the
consolidation) and the largest over the other ranks. Workers run with
MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors go back to the OS and one operation's
garbage does not hide the next one's allocations. Times are noisy on shared machines: compare
the ratios within one run.

    python benchmarks/bench_checkpoint.py            # GPT-2 small, world 2
    python benchmarks/bench_checkpoint.py --small    # 1/16 width smoke run
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

LR, BETAS, WD = 6e-4, (0.9, 0.95), 0.1


def _shapes(small: bool):
    try:
        from model_shapes import gpt2_shapes

        return gpt2_shapes("small", width_div=16 if small else 1)
    except ImportError:  # pragma: no cover - the helper ships with the repo
        d, vocab, ctx = (48 if small else 768), 50257, 1024
        out = [("wte", (vocab, d)), ("wpe", (ctx, d))]
        for i in range(12):
            out += [(f"{i}.ln1w", (d,)), (f"{i}.ln1b", (d,)), (f"{i}.attn", (d, 3 * d)),
                    (f"{i}.attnb", (3 * d,)), (f"{i}.proj", (d, d)), (f"{i}.projb", (d,)),
                    (f"{i}.ln2w", (d,)), (f"{i}.ln2b", (d,)), (f"{i}.fc", (d, 4 * d)),
                    (f"{i}.fcb", (4 * d,)), (f"{i}.fc2", (4 * d, d)), (f"{i}.fc2b", (d,))]
        return out + [("lnfw", (d,)), ("lnfb", (d,))]


def _groups(shapes, params):
    decay = [p for (_, s), p in zip(shapes, params) if len(s) >= 2]
    rest = [p for (_, s), p in zip(shapes, params) if len(s) < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- memory


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, args, store: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=3600))
    import torch.distributed.checkpoint  # noqa: F401 - imported once, outside the timings

    from zero_ext import ZeroRedundancyOptimizer, checkpoint, state

    if args.chunk:
        state.CONSOLIDATE_CHUNK = args.chunk
    shapes = _shapes(args.small)
    gen = torch.Generator().manual_seed(1234)
    params = [torch.randn(s, generator=gen).mul_(0.02).requires_grad_() for _, s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3)
    ours = ZeroRedundancyOptimizer(_groups(shapes, params), torch.optim.AdamW, lr=LR,
                                   betas=BETAS, sharding=args.sharding)
    theirs = TorchZeRO(_groups(shapes, params), torch.optim.AdamW, lr=LR, betas=BETAS)
    ours.step()
    theirs.step()
    work = args.dir
    ckpt, plain = os.path.join(work, "sharded"), os.path.join(work, "torch_optim.pt")
    rows: dict[str, dict] = {}
    peak_ok = _reset_peak()

    def measure(name: str, fn) -> None:
        gc.collect()
        if rank == 0:
            os.sync()  # the previous operation's dirty pages are not this one's cost
        dist.barrier()
        _reset_peak()
        rss0 = _kb("VmRSS")
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        dt = time.perf_counter() - t0
        extra = (_kb("VmHWM") - rss0) / 1024.0 if peak_ok else float("nan")
        got: list = [None] * world
        dist.all_gather_object(got, (dt, extra))
        rows[name] = {"time_s": max(t for t, _ in got), "rank0_mb": got[0][1],
                      "others_mb": max((m for _, m in got[1:]), default=0.0)}

    def ours_consolidate():
        ours.consolidate_state_dict(0)

    def ours_torch_save():
        if rank == 0:
            torch.save(ours.state_dict(), plain)
        ours._consolidated = None

    def theirs_consolidate():
        theirs.consolidate_state_dict(0)

    def theirs_torch_save():
        if rank == 0:
            torch.save(theirs.state_dict(), plain)
        theirs._all_state_dicts = []

    for _ in range(args.repeat):
        measure("ours consolidate", ours_consolidate)
        measure("ours torch.save", ours_torch_save)
        measure("torch consolidate", theirs_consolidate)
        measure("torch torch.save", theirs_torch_save)
        measure("ours sharded save", lambda: checkpoint.save(ours, ckpt))
        measure("ours sharded save (no fsync)",
                lambda: checkpoint.save(ours, ckpt, sync_files=False))

    sizes = {"sharded_mb": sum(os.path.getsize(os.path.join(ckpt, f))
                               for f in os.listdir(ckpt)) / 2**20,
             "torch_file_mb": os.path.getsize(plain) / 2**20}

    fresh_ours = ZeroRedundancyOptimizer(_groups(shapes, params), torch.optim.AdamW, lr=LR,
                                         betas=BETAS, sharding=args.sharding)
    measure("ours sharded load", lambda: checkpoint.load(fresh_ours, ckpt))
    del fresh_ours
    fresh_theirs = TorchZeRO(_groups(shapes, params), torch.optim.AdamW, lr=LR, betas=BETAS)
    measure("torch load", lambda: fresh_theirs.load_state_dict(
        torch.load(plain, map_location="cpu", weights_only=True)))
    del fresh_theirs

    if rank == 0:
        numel = sum(p.numel() for p in params)
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "sizes": sizes, "world": world, "numel": numel,
                       "sharding": ours.sharding, "peak_ok": peak_ok,
                       "chunk": state.CONSOLIDATE_CHUNK}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def report(res: dict) -> str:
    r = res["rows"]

    def combo(*names):
        return {"time_s": sum(r[n]["time_s"] for n in names),
                "rank0_mb": max(r[n]["rank0_mb"] for n in names),
                "others_mb": max(r[n]["others_mb"] for n in names)}

    pairs = [
        ("consolidate_state_dict(0)", r["ours consolidate"], r["torch consolidate"]),
        ("consolidate + torch.save", combo("ours consolidate", "ours torch.save"),
         combo("torch consolidate", "torch torch.save")),
        ("checkpoint: sharded save vs consolidate + torch.save", r["ours sharded save"],
         combo("torch consolidate", "torch torch.save")),
        ("checkpoint: sharded save (no fsync) vs consolidate + torch.save",
         r["ours sharded save (no fsync)"], combo("torch consolidate", "torch torch.save")),
        ("load: sharded load vs torch.load + load_state_dict", r["ours sharded load"],
         r["torch load"]),
    ]
    head = (f"GPT-2 small shapes ({res['numel'] / 1e6:.1f}M params, AdamW state "
            f"{2 * res['numel'] * 4 / 2**20:.0f} MiB), world {res['world']} gloo, zero_ext "
            f"sharding={res['sharding']!r}, consolidation chunk {res['chunk']} elements")
    lines = [head, "",
             "| operation | zero_ext s | torch s | speedup | rank 0 extra MiB (zero_ext / "
             "torch) | other ranks extra MiB (zero_ext / torch) |",
             "|---|---|---|---|---|---|"]
    for name, a, b in pairs:
        lines.append(f"| {name} | {a['time_s']:.3f} | {b['time_s']:.3f} | "
                     f"{_ratio(b['time_s'], a['time_s'])} | {a['rank0_mb']:.0f} / "
                     f"{b['rank0_mb']:.0f} | {a['others_mb']:.0f} / {b['others_mb']:.0f} |")
    lines += ["", "| step (zero_ext rows above are sums of these) | s | rank 0 MiB | others MiB |",
              "|---|---|---|---|"]
    for name, v in r.items():
        lines.append(f"| {name} | {v['time_s']:.3f} | {v['rank0_mb']:.0f} | "
                     f"{v['others_mb']:.0f} |")
    s = res["sizes"]
    lines += ["", f"on disk: sharded checkpoint {s['sharded_mb']:.0f} MiB, torch file "
                  f"{s['torch_file_mb']:.0f} MiB"]
    if not res["peak_ok"]:
        lines.append("(peak RSS could not be reset here: memory columns are not meaningful)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="number of ranks (processes, gloo)")
    ap.add_argument("--small", action="store_true", help="1/16 width (smoke run)")
    ap.add_argument("--sharding", default="auto", choices=("auto", "param", "flat"),
                    help="zero_ext's sharding mode")
    ap.add_argument("--chunk", type=int, default=0,
                    help="consolidation message size in elements (0: zero_ext's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="repeat the save-side measurements (the last run is reported)")
    ap.add_argument("--dir", default=None, help="where to write (None: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.world)))
    tmp = tempfile.mkdtemp(prefix="zero_ext_bench_ckpt_")
    args.dir = args.dir or os.path.join(tmp, "work")
    os.makedirs(args.dir, exist_ok=True)
    out = os.path.join(tmp, "result.json")
    try:
        from common import spawned_rank
        mp.spawn(spawned_rank, args=(worker, args.world, args, os.path.join(tmp, "store"), out),
                 nprocs=args.world, join=True)
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
