"""bf16 params with fp32 master weights (master_weights=True): convergence, memory, speed.

    python benchmarks/bench_mixed_precision.py                       # all four, a few minutes
    python benchmarks/bench_mixed_precision.py --run convergence --conv-steps 600
    python benchmarks/bench_mixed_precision.py --run step,clip --steps 20 --world 2

Four measurements (--run, default all of them, in this order); each prints a table and writes
a JSON file under --out-dir (default benchmarks/results/, which gets a .gitignore of its own):

1. convergence  The example's GPT (examples/train_gpt.py: same model, data generator, decay /
   no-decay groups and warmup + cosine schedule), trained --conv-steps steps from the same
   initial weights on the same batches, world --conv-world (gloo, spawned ranks), in three
   configs:
     torch-bf16         torch's ZeroRedundancyOptimizer(AdamW) on the bf16 model, no masters
                        (params and AdamW state in bf16)
     ours-bf16-master   zero_ext.ZeroRedundancyOptimizer(AdamW, master_weights=True) on the
                        bf16 model (fp32 masters + fp32 state on the owning rank)
     fp32               torch.optim.AdamW on the fp32 model: the reference
   (optional: ours-bf16, zero_ext without masters, via --conv-configs). Every --conv-every
   steps: the training loss (mean over ranks and the last --conv-every steps) and the loss on
   --conv-eval-batches fixed held-out batches. A small lr (--conv-lr, default 2e-4) is where
   pure bf16 AdamW stalls: most updates are smaller than half a bf16 ulp of the weight they
   change and round away (LayerNorm weights near 1.0 cannot move by less than 2**-8). Written:
   mixed_precision_convergence.json, .csv (the curves) and .png (when matplotlib imports).

2. memory  Bytes per param each rank holds, from the tensors (not RSS), after one step: its
   params' bytes + their grads' + every tensor in its local optimizer's state (masters
   included), divided by the model's param count. GPT-2 small shapes (model_shapes.py),
   worlds --mem-worlds (default 1,2,4; gloo, spawned ranks):
     ours-bf16-master   bf16 params and grads, zero_ext AdamW with master_weights=True:
                        formula 2 + 2 + 12/d = 4 + 12/d (master, exp_avg, exp_avg_sq in fp32)
     torch-fp32         fp32 params and grads, torch's ZeRO with AdamW: 4 + 4 + 8/d = 8 + 8/d
   Per world: the measured max and mean over ranks next to the formula (torch's whole-param
   partition leaves the token embedding's owner above the mean; "flat" sharding does not).

3. step  ms per step, GPT-2 small shapes, world --world (default 2), gloo, fake grads set once
   (identical on every rank, fixed across steps; bf16 grads are the fp32 ones rounded, and the
   fp32 ones are chosen bf16-representable so both see the same numbers):
     torch-fp32               torch's ZeRO at its best: fp32, parameters_as_bucket_view=True,
                              AdamW(fused=True) (foreach=True where fused fails on CPU)
     ours-bf16-master-param   zero_ext, bf16 + master_weights, bucket views, sharding="param"
     ours-bf16-master-flat    the same with sharding="flat"
   (more configs via --configs, see CONFIGS). All configs live in the same processes and are
   stepped in turns (order rotated per round) so machine noise hits all alike. Reported: the
   median over --steps (after --warmup) of the slowest rank's step, and torch/ours.

4. clip  The same shapes and configs, each step preceded by a clip to --max-norm: zero_ext's
   opt.clip_grad_norm_ (norm from the owned elements + one all-reduce, clip applied inside the
   step) against torch.nn.utils.clip_grad_norm_(all params) + torch's ZeRO step. torch's clip
   scales the grads in place, so its grads are restored from a copy before each step (not
   timed). Reported: clip ms, step ms, total and torch/ours, and the norms each returned with
   their relative difference to torch's (target < 1e-6) and to the exact (float64) norm; also
   the largest difference of ours' bf16 params to torch's fp32 params after the run and the
   share of elements where ours differs from torch's rounded to bf16 (the masters track fp32).
   Note: on CPU the float32 norm of one big tensor is itself off the exact value (measured
   here: about 5e-5 relative at 2M elements, 8e-4 for GPT-2 small's grads, 2.6e-3 at 38M); both
   sides use that same per-tensor reduction, so they agree where zero_ext's pieces are whole
   tensors, and may differ by up to that error where flat sharding cuts a tensor in two.

No timing is asserted. On CPU nothing computes natively in bf16, and the master-weights step
moves about as many bytes per element as fp32 AdamW (it reads a bf16 grad, the fp32 master and
moments, and writes them back plus the bf16 param: 2 + 12 + 12 + 2 = 28, or 30 when it also
reads the bf16 param, against fp32 AdamW's 4 + 4 + 8 + 8 + 4 = 28), so the local step is not
cheaper; what bf16 saves is half the bytes of the exchange (gloo broadcasts) and of the
weights and grads in memory.
Machines here are noisy and shared: compare ratios measured in one run.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE, os.path.join(_ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _zero_worker as zw  # noqa: E402
import model_shapes  # noqa: E402
from bench_zero_step import _free_port, _ours_importable, _prebuild  # noqa: E402
from common import print_table, spawned_rank  # noqa: E402

RUNS = ("convergence", "memory", "step", "clip")
BF16, FP32 = torch.bfloat16, torch.float32
# name -> (implementation, param dtype, master_weights, sharding, bucket view, AdamW extras)
CONFIGS = {
    "torch-fp32": ("torch", FP32, False, None, True, {"fused": True}),
    "ours-bf16-master-param": ("ours", BF16, True, "param", True, {}),
    "ours-bf16-master-flat": ("ours", BF16, True, "flat", True, {}),
    # extra rows, for context
    "ours-bf16-master-param-nobv": ("ours", BF16, True, "param", False, {}),
    "ours-bf16-master-flat-nobv": ("ours", BF16, True, "flat", False, {}),
    "ours-fp32-param": ("ours", FP32, False, "param", True, {}),
    "ours-fp32-flat": ("ours", FP32, False, "flat", True, {}),
    "torch-bf16": ("torch", BF16, False, None, True, {"fused": True}),
}
DEFAULT_CONFIGS = "torch-fp32,ours-bf16-master-param,ours-bf16-master-flat"
CONV_CONFIGS = ("torch-bf16", "ours-bf16-master", "fp32", "ours-bf16")
DEFAULT_CONV_CONFIGS = "torch-bf16,ours-bf16-master,fp32"
MEM_CONFIGS = ("ours-bf16-master", "torch-fp32")


# ============================================================================ helpers
def _dtype_name(dt) -> str:
    return {BF16: "bf16", FP32: "fp32"}[dt]


def _torch_fused_ok() -> bool:
    """torch's AdamW(fused=True) steps CPU fp32 and bf16 params here."""
    try:
        for dt in (FP32, BF16):
            p = torch.zeros(4, dtype=dt, requires_grad=True)
            p.grad = torch.ones_like(p)
            torch.optim.AdamW([p], fused=True).step()
        return True
    except Exception:  # noqa: BLE001
        return False


def _build(impl, groups, master, sharding, bucket_view, extra, lr=zw.LR, betas=zw.BETAS):
    kw = dict(lr=lr, betas=betas, eps=zw.EPS, **extra)
    if impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        return TorchZero(groups, torch.optim.AdamW, parameters_as_bucket_view=bucket_view, **kw)
    from zero_ext import ZeroRedundancyOptimizer as OurZero

    if master:
        kw["master_weights"] = True
    return OurZero(groups, torch.optim.AdamW, parameters_as_bucket_view=bucket_view,
                   sharding=sharding or "auto", **kw)


def held_bytes(params, opt) -> dict:
    """Bytes this rank holds in the params, their grads and its local optimizer state
    (fp32 masters counted apart), from the tensors' nbytes."""
    masters = other = 0
    for st in opt.optim.state.values():
        for name, v in st.items():
            if torch.is_tensor(v):
                if name == "master":
                    masters += v.nbytes
                else:
                    other += v.nbytes
    return {"weights": sum(p.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "masters": masters, "state": other}


def _spawn(fn, world: int, opts: dict) -> dict:
    """Run fn(rank, world, opts, out_json) on `world` spawned ranks; rank 0's JSON."""
    fd, out = tempfile.mkstemp(prefix="mixed_precision_", suffix=".json")
    os.close(fd)
    try:
        mp.spawn(spawned_rank, args=(fn, world, dict(opts, port=_free_port()), out),
                 nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _gather_to_file(mine: dict, world: int, rank: int, out_path: str, **extra) -> None:
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(extra, world=world, ranks=gathered), f)


def _bf16_representable(tensors):
    return [t.to(BF16).to(FP32) for t in tensors]


# ============================================================================ 1. convergence
def _conv_build(cfg: str, model, args: dict):
    import train_gpt as ex  # examples/train_gpt.py

    groups = ex.param_groups(model, args["wd"])
    kw = dict(lr=args["lr"], betas=(0.9, 0.95))
    if cfg == "fp32":
        return torch.optim.AdamW(groups, **kw)
    if cfg == "torch-bf16":
        return _build("torch", groups, False, None, False, {}, **kw)
    return _build("ours", groups, cfg == "ours-bf16-master", args["sharding"], False, {}, **kw)


def convergence_worker(rank: int, world: int, opts: dict, out_path: str) -> None:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import train_gpt as ex

    zw.init_rank(rank, world, opts)
    try:
        a = opts["conv"]
        V, T = a["vocab"], a["seq_len"]
        eval_gen = torch.Generator().manual_seed(10_000 + a["seed"])  # same on every rank
        evals = [ex.make_batch(eval_gen, a["batch"], T, V) for _ in range(a["eval_batches"])]
        results, errors = {}, {}
        for cfg in a["configs"]:
            try:
                torch.manual_seed(a["seed"])  # the same initial weights for every config
                model = ex.GPT(V, T, a["d_model"], a["layers"], a["heads"])
                if cfg != "fp32":
                    model.to(BF16)
                net = DDP(model) if world > 1 else model
                opt = _conv_build(cfg, model, a)
                sched = torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda s: ex.lr_at(s, 1.0, a["warmup"], a["steps"]))
                gen = torch.Generator().manual_seed(a["seed"] * 1000 + rank + 1)
                train, curve, t0 = [], [], time.perf_counter()

                def eval_loss(model=model) -> float:
                    with torch.no_grad():
                        return statistics.fmean(
                            F.cross_entropy(model(x).float().view(-1, V), y.view(-1)).item()
                            for x, y in evals)

                curve.append((0, float("nan"), eval_loss()))
                for step in range(a["steps"]):
                    x, y = ex.make_batch(gen, a["batch"], T, V)
                    loss = F.cross_entropy(net(x).float().view(-1, V), y.view(-1))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    train.append(loss.item())
                    if (step + 1) % a["every"] == 0 or step + 1 == a["steps"]:
                        window = train[-a["every"]:]
                        curve.append((step + 1, statistics.fmean(window), eval_loss()))
                # mean of the training losses over ranks (the eval batches are the same)
                t = torch.tensor([c[1] for c in curve], dtype=torch.float64)
                dist.all_reduce(t)
                curve = [(s, v / world, e) for (s, _, e), v in zip(curve, t.tolist())]
                results[cfg] = {"curve": curve, "seconds": time.perf_counter() - t0,
                                "n_params": sum(p.numel() for p in model.parameters())}
                del net, model, opt, sched
            except Exception as exc:  # noqa: BLE001 - one broken config must not hide the rest
                errors[cfg] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            dist.barrier()
        _gather_to_file({"rank": rank, "results": results, "errors": errors}, world, rank,
                        out_path)
    finally:
        dist.destroy_process_group()


def run_convergence(args, out_dir: str) -> dict:
    configs = [c.strip() for c in args.conv_configs.split(",") if c.strip()]
    conv = {"configs": configs, "steps": args.conv_steps, "every": args.conv_every,
            "lr": args.conv_lr, "wd": args.conv_weight_decay, "warmup": args.conv_warmup,
            "seed": args.seed, "batch": args.conv_batch_size, "seq_len": args.conv_seq_len,
            "vocab": args.conv_vocab, "d_model": args.conv_d_model, "layers": args.conv_layers,
            "heads": args.conv_heads, "eval_batches": args.conv_eval_batches,
            "sharding": args.conv_sharding}
    world = args.conv_world
    threads = args.threads or 1  # tiny matrices: one thread per rank beats several
    print(f"\n# 1. Convergence: examples/train_gpt.py's GPT (d_model {args.conv_d_model}, "
          f"{args.conv_layers} layers, vocab {args.conv_vocab}, {args.conv_batch_size}x"
          f"{args.conv_seq_len} tokens per rank and step), world {world} (gloo), "
          f"{args.conv_steps} steps, AdamW lr {args.conv_lr:g} (warmup {args.conv_warmup} + "
          f"cosine to 0.1x), betas (0.9, 0.95), weight decay {args.conv_weight_decay:g}, "
          f"seed {args.seed}, {threads} thread(s) per rank", flush=True)
    t0 = time.perf_counter()
    data = _spawn(convergence_worker, world, {"threads": threads, "timeout": args.timeout,
                                              "conv": conv})
    res = data["ranks"][0]["results"]
    errors = [f"{c}: {e}" for rk in data["ranks"] for c, e in rk["errors"].items()]
    live = [c for c in configs if c in res]
    n_params = next(iter(res.values()))["n_params"] if res else 0
    steps = [s for s, _, _ in res[live[0]]["curve"]] if live else []
    rows = []
    for i, s in enumerate(steps):
        row = [s]
        for c in live:
            _, tr, ev = res[c]["curve"][i]
            row += ["-" if tr != tr else f"{tr:.4f}", f"{ev:.4f}"]
        rows.append(row)
    headers = ["step"] + [f"{c} {k}" for c in live for k in ("train", "eval")]
    print_table(f"Loss (train: mean of the last {args.conv_every} steps over ranks; eval: "
                f"{args.conv_eval_batches} fixed held-out batches); {n_params:,} params:",
                headers, rows)
    summary = []
    ref = res.get("fp32")
    for c in live:
        curve = res[c]["curve"]
        fin_tr, fin_ev = curve[-1][1], curve[-1][2]
        row = [c, f"{fin_tr:.4f}", f"{fin_ev:.4f}"]
        if ref is not None:
            gaps = [abs(e - r[2]) for (_, _, e), r in zip(curve, ref["curve"])]
            row += [f"{fin_ev - ref['curve'][-1][2]:+.4f}", f"{max(gaps):.4f}"]
        else:
            row += ["-", "-"]
        row.append(f"{res[c]['seconds']:.0f}")
        summary.append(row)
    print_table("Final losses (gap = eval loss minus the fp32 reference's):",
                ["config", "final train loss", "final eval loss", "final gap vs fp32",
                 "max |gap| along the curve", "seconds"], summary)
    if errors:
        print("Errors:\n" + "\n".join(f"- {e}" for e in errors))
    print(f"# convergence done in {time.perf_counter() - t0:.0f} s", flush=True)

    out = {"what": "convergence", "settings": conv, "world": world, "threads": threads,
           "n_params": n_params, "results": res, "errors": errors}
    _write_json(out_dir, "convergence", out)
    csv_path = os.path.join(out_dir, "mixed_precision_convergence.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(headers)
        w.writerows(rows)
    print(f"# wrote {csv_path}")
    png = _plot_convergence(res, live, args, os.path.join(out_dir,
                                                          "mixed_precision_convergence.png"))
    print(f"# {'wrote ' + png if png else 'matplotlib not importable: no PNG (see the CSV)'}")
    return out


def _plot_convergence(res, live, args, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in live:
        curve = res[c]["curve"]
        ax.plot([s for s, _, _ in curve], [e for _, _, e in curve], label=f"{c} (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"examples/train_gpt.py GPT, lr {args.conv_lr:g}, world {args.conv_world}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ============================================================================ 2. memory
def memory_worker(rank: int, world: int, opts: dict, out_path: str) -> None:
    zw.init_rank(rank, world, opts)
    try:
        shapes = model_shapes.gpt2_shapes("small", width_div=opts["width_div"])
        results, errors = {}, {}
        for cfg in MEM_CONFIGS:
            dtype = BF16 if cfg == "ours-bf16-master" else FP32
            try:
                # values do not matter here: constants are quick to make
                params = [torch.full(s, 0.02, dtype=dtype).requires_grad_() for _, s in shapes]
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                groups = zw.make_groups(shapes, params)
                if cfg == "ours-bf16-master":
                    opt = _build("ours", groups, True, opts["sharding"], opts["bucket_view"], {})
                else:
                    opt = _build("torch", groups, False, None, False, {})
                opt.step()  # creates the state (and the masters)
                results[cfg] = held_bytes(params, opt)
                results[cfg]["sharding_used"] = str(getattr(opt, "sharding", "param (torch)"))
                del opt, params, groups
            except Exception as exc:  # noqa: BLE001
                errors[cfg] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            dist.barrier()
        total = sum(model_shapes.numel(s) for _, s in shapes)
        _gather_to_file({"rank": rank, "results": results, "errors": errors}, world, rank,
                        out_path, numel=total)
    finally:
        dist.destroy_process_group()


def run_memory(args, out_dir: str) -> dict:
    worlds = [int(w) for w in args.mem_worlds.split(",") if w.strip()]
    shapes = model_shapes.gpt2_shapes("small", width_div=args.mem_width_div)
    total = sum(model_shapes.numel(s) for _, s in shapes)
    name = "GPT-2 small" + (f" / {args.mem_width_div} width" if args.mem_width_div > 1 else "")
    print(f"\n# 2. Memory: bytes per param held per rank (weights + grads + masters + "
          f"optimizer state, from the tensors' nbytes, after one step), {name}: {total:,} "
          f"params in {len(shapes)} tensors; zero_ext sharding {args.mem_sharding!r}, bucket "
          f"view {args.mem_bucket_view}; torch's ZeRO with default flags", flush=True)
    t0 = time.perf_counter()
    rows, raw, errors = [], [], []
    for world in worlds:
        threads = args.threads or max(1, (os.cpu_count() or 1) // world)
        data = _spawn(memory_worker, world, {
            "threads": threads, "timeout": args.timeout, "width_div": args.mem_width_div,
            "sharding": args.mem_sharding, "bucket_view": args.mem_bucket_view})
        raw.append(data)
        errors += [f"world {world}, {c}, rank {rk['rank']}: {e}"
                   for rk in data["ranks"] for c, e in rk["errors"].items()]
        for cfg in MEM_CONFIGS:
            per = [rk["results"].get(cfg) for rk in data["ranks"]]
            if any(r is None for r in per):
                continue
            n = data["numel"]
            tot = [sum(r[k] for k in ("weights", "grads", "masters", "state")) / n for r in per]
            parts = {k: statistics.fmean(r[k] for r in per) / n
                     for k in ("weights", "grads", "masters", "state")}
            if cfg == "ours-bf16-master":
                formula, ftext = 4 + 12 / world, f"4 + 12/{world}"
            else:
                formula, ftext = 8 + 8 / world, f"8 + 8/{world}"
            mean = statistics.fmean(tot)
            rows.append([world, cfg, per[0]["sharding_used"], f"{parts['weights']:.3f}",
                         f"{parts['grads']:.3f}", f"{parts['masters']:.3f}",
                         f"{parts['state']:.3f}", f"{max(tot):.3f}", f"{mean:.3f}",
                         f"{ftext} = {formula:.3f}", f"{mean / formula:.4f}"])
        print(f"# world {world} done ({threads} thread(s) per rank)", flush=True)
    print_table("Bytes per param per rank (weights/grads/masters/state: mean over ranks):",
                ["world", "config", "sharding", "weights", "grads", "masters",
                 "other state", "total max rank", "total mean", "formula", "mean / formula"],
                rows)
    if errors:
        print("Errors:\n" + "\n".join(f"- {e}" for e in errors))
    print(f"# memory done in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {"what": "memory", "model": name, "numel": total, "rows": rows,
           "headers": ["world", "config", "sharding", "weights", "grads", "masters",
                       "other state", "total max rank", "total mean", "formula",
                       "mean / formula"], "raw": raw, "errors": errors}
    _write_json(out_dir, "memory", out)
    return out


# ============================================================================ 3+4. step, clip
class Entry:
    """One config under test: its own params (same values as every other config's, in its
    dtype), grads shared between configs of a dtype (or its own copy when torch clips them),
    the optimizer, and what was measured."""

    def __init__(self, name, shapes, init, grads, clip: bool):
        impl, dtype, master, sharding, bv, extra = CONFIGS[name]
        self.name, self.impl, self.clip = name, impl, clip
        self.params = [t.to(dtype, copy=True).requires_grad_() for t in init]
        self.orig = grads[dtype]
        # torch's clip scales the grads in place: it gets a copy, restored before each step
        self.restore = clip and impl == "torch"
        use = [g.clone() for g in self.orig] if self.restore else self.orig
        for p, g in zip(self.params, use):
            p.grad = g
        self.opt = _build(impl, zw.make_groups(shapes, self.params), master, sharding, bv, extra)
        self.step_s, self.clip_s, self.norms, self.parts = [], [], [], []

    def step(self, timed: bool, max_norm: float) -> None:
        if self.restore:
            with torch.no_grad():
                for p, g in zip(self.params, self.orig):
                    p.grad.copy_(g)
        dist.barrier()
        t0 = time.perf_counter()
        norm = None
        if self.clip:
            if self.impl == "torch":
                norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            else:
                norm = self.opt.clip_grad_norm_(max_norm)
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        if timed:
            self.clip_s.append(t1 - t0)
            self.step_s.append(t2 - t1)
            if norm is not None:
                self.norms.append(float(norm))
            b = zw.breakdown(self.opt)
            if b is not None:
                self.parts.append(b)

    def info(self) -> dict:
        out = {"step_s": self.step_s, "clip_s": self.clip_s, "norms": self.norms,
               "breakdown": ({k: statistics.median(b[k] for b in self.parts)
                              for k in self.parts[0]} if self.parts else None)}
        if self.impl == "ours":
            out["sharding_used"] = str(self.opt.sharding)
        return out


def timing_worker(rank: int, world: int, opts: dict, out_path: str) -> None:
    zw.init_rank(rank, world, opts)
    try:
        zw._preload(["ours"])  # imports + native ops outside the timings
        shapes = model_shapes.gpt2_shapes("small", width_div=opts["width_div"])
        # bf16-representable values, so fp32 and bf16 configs start from the same numbers
        init = _bf16_representable(zw._filled(shapes, 1234, 0.02))
        g32 = _bf16_representable(zw._filled(shapes, 99, opts["grad_scale"]))
        grads = {FP32: g32, BF16: [g.to(BF16) for g in g32]}
        exact = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g32))
        out = {}
        for phase in opts["phases"]:  # "step" and/or "clip", fresh optimizers for each
            clip = phase == "clip"
            entries, errors = [], {}
            for c in opts["configs"]:
                try:
                    entries.append(Entry(c, shapes, init, grads, clip))
                except Exception as exc:  # noqa: BLE001
                    errors[c] = f"build: {type(exc).__name__}: {exc}"
                dist.barrier()
            for i in range(opts["warmup"] + opts["steps"]):
                k = i % max(1, len(entries))
                for e in entries[k:] + entries[:k]:  # order rotated every round
                    if e.name in errors:
                        continue
                    try:
                        e.step(i >= opts["warmup"], opts["max_norm"])
                    except Exception as exc:  # noqa: BLE001
                        errors[e.name] = f"step: {type(exc).__name__}: {exc}"
            res = {e.name: e.info() for e in entries if e.name not in errors}
            # how far ours' bf16 params are from torch's fp32 ones after the same steps
            ref = next((e for e in entries if e.name == "torch-fp32" and e.name in res), None)
            for e in entries:
                if ref is None or e is ref or e.name not in res:
                    continue
                diff, differ, n = 0.0, 0, 0
                with torch.no_grad():
                    for p, q in zip(e.params, ref.params):
                        diff = max(diff, (p.float() - q).abs().max().item())
                        differ += int((p != q.to(p.dtype)).sum())
                        n += p.numel()
                res[e.name]["max_abs_diff_vs_torch"] = diff
                res[e.name]["differ_from_torch_rounded"] = differ / n
            out[phase] = {"results": res, "errors": errors}
            del entries, ref
            gc.collect()
            dist.barrier()
        total = sum(model_shapes.numel(s) for _, s in shapes)
        _gather_to_file({"rank": rank, "phases": out}, world, rank, out_path, numel=total,
                        exact_norm=exact, threads=opts["threads"])
    finally:
        dist.destroy_process_group()


def _slowest_median(per_rank: list[list[float]]) -> float:
    n = min(len(r) for r in per_rank)
    return statistics.median(max(r[i] for r in per_rank) for i in range(n))


def summarize_timing(data: dict, phase: str, configs) -> tuple[list, dict]:
    ranks = [rk["phases"][phase] for rk in data["ranks"]]
    errors = [f"{c}: {e}" for rk in ranks for c, e in rk["errors"].items()]
    summary = {}
    for c in configs:
        per = [rk["results"].get(c) for rk in ranks]
        if any(r is None for r in per):
            continue
        step = _slowest_median([r["step_s"] for r in per])
        clip = _slowest_median([r["clip_s"] for r in per])
        # clip + step of the slowest rank, per step
        tot = _slowest_median([[a + b for a, b in zip(r["clip_s"], r["step_s"])] for r in per])
        summary[c] = {"step_s": step, "clip_s": clip, "total_s": tot,
                      "norm": per[0]["norms"][0] if per[0]["norms"] else None,
                      "norms_all_ranks": [r["norms"][:1] for r in per],
                      "max_abs_diff_vs_torch": max((r.get("max_abs_diff_vs_torch", 0.0)
                                                    for r in per), default=None),
                      "differ_from_torch_rounded": max((r.get("differ_from_torch_rounded", 0.0)
                                                        for r in per), default=None),
                      "sharding_used": per[0].get("sharding_used", "param (torch)"),
                      "breakdown": per[0].get("breakdown")}
    return errors, summary


def run_timing(args, out_dir: str, phases) -> dict:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    fused = _torch_fused_ok()
    if not fused:  # torch's best without a fused CPU kernel: foreach
        for k, v in list(CONFIGS.items()):
            if v[0] == "torch":
                CONFIGS[k] = v[:5] + ({"foreach": True},)
    shapes = model_shapes.gpt2_shapes("small", width_div=args.width_div)
    total = sum(model_shapes.numel(s) for _, s in shapes)
    name = "GPT-2 small" + (f" / {args.width_div} width" if args.width_div > 1 else "")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    print(f"\n# {' and '.join('3. step' if p == 'step' else '4. clip + step' for p in phases)}:"
          f" {name}, {total:,} params in {len(shapes)} tensors, world {args.world} (gloo), "
          f"{threads} thread(s) per rank, {args.warmup} warmup + {args.steps} timed steps per "
          f"config, configs stepped in turns; torch's AdamW: "
          f"{'fused=True' if fused else 'foreach=True (fused failed on CPU)'}", flush=True)
    t0 = time.perf_counter()
    data = _spawn(timing_worker, args.world, {
        "threads": threads, "timeout": args.timeout, "width_div": args.width_div,
        "configs": configs, "phases": list(phases), "warmup": args.warmup,
        "steps": args.steps, "max_norm": args.max_norm, "grad_scale": args.grad_scale})
    print(f"# ranks done in {time.perf_counter() - t0:.0f} s", flush=True)
    outs = {}
    for phase in phases:
        errors, summ = summarize_timing(data, phase, configs)
        base = summ.get("torch-fp32")
        rows = []
        for c in configs:
            if c not in summ:
                continue
            s = summ[c]
            impl, dtype, master, _, bv, _ = CONFIGS[c]
            desc = [c, "torch ZeRO" if impl == "torch" else "zero_ext", _dtype_name(dtype),
                    "yes" if master else "no", s["sharding_used"], "yes" if bv else "no"]
            if phase == "step":
                rows.append(desc + [f"{s['step_s'] * 1e3:.1f}",
                                    f"{base['step_s'] / s['step_s']:.2f}x" if base else "-",
                                    _fmt_diff(c, s)])
            else:
                rows.append(desc + [f"{s['clip_s'] * 1e3:.1f}", f"{s['step_s'] * 1e3:.1f}",
                                    f"{s['total_s'] * 1e3:.1f}",
                                    f"{base['total_s'] / s['total_s']:.2f}x" if base else "-",
                                    _fmt_diff(c, s)])
        common_h = ["config", "optimizer", "params", "masters", "sharding", "bucket view"]
        if phase == "step":
            print_table(f"Step time, world {args.world} (median over timed steps of the "
                        "slowest rank):", common_h + ["step ms", "torch/ours",
                                                      "vs torch fp32 params"], rows)
        else:
            print_table(f"Clip to max_norm {args.max_norm:g} + step, world {args.world} "
                        "(median over timed steps of the slowest rank):",
                        common_h + ["clip ms", "step ms", "clip + step ms", "torch/ours",
                                    "vs torch fp32 params"], rows)
            ref_norm = base["norm"] if base else None
            nrows = []
            for c in configs:
                if c not in summ or summ[c]["norm"] is None:
                    continue
                n = summ[c]["norm"]
                same = len({x[0] for x in summ[c]["norms_all_ranks"] if x}) == 1
                rel = abs(n - ref_norm) / ref_norm if ref_norm else float("nan")
                rel_exact = abs(n - data["exact_norm"]) / data["exact_norm"]
                nrows.append([c, f"{n:.9g}", "yes" if same else "NO",
                              "-" if ref_norm is None else f"{rel:.2e}",
                              "-" if ref_norm is None else ("yes" if rel < 1e-6 else "NO"),
                              f"{rel_exact:.2e}"])
                summ[c]["rel_diff_norm_vs_torch"] = rel
                summ[c]["rel_diff_norm_vs_exact"] = rel_exact
            print_table(f"Total grad norms returned (first timed step; exact float64 norm "
                        f"{data['exact_norm']:.9g}):",
                        ["config", "norm", "same on every rank", "rel diff vs torch",
                         "< 1e-6", "rel diff vs exact"], nrows)
        parts = [[c, ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(summ[c]["breakdown"]
                                                                          .items()))]
                 for c in configs if c in summ and summ[c].get("breakdown")]
        if parts:
            print_table("zero_ext's own step breakdown (rank 0, median ms):",
                        ["config", "parts"], parts)
        if errors:
            print("Errors:\n" + "\n".join(f"- {e}" for e in errors))
        out = {"what": phase, "model": name, "numel": total, "world": args.world,
               "threads": threads, "torch_adamw": "fused" if fused else "foreach",
               "warmup": args.warmup, "steps": args.steps, "summary": summ, "errors": errors,
               "exact_norm": data["exact_norm"], "raw": data}
        if phase == "clip":
            out["max_norm"] = args.max_norm
        _write_json(out_dir, phase, out)
        outs[phase] = out
    return outs


def _fmt_diff(c: str, s) -> str:
    """Ours' (or torch-bf16's) params after the run against torch-fp32's: the largest
    difference and, for bf16 params, the share of elements that differ from torch's fp32
    params rounded to bf16."""
    if c == "torch-fp32" or s.get("max_abs_diff_vs_torch") is None:
        return "-"
    out = f"max |diff| {s['max_abs_diff_vs_torch']:.2e}"
    if CONFIGS[c][1] == BF16:
        out += f", {100 * s['differ_from_torch_rounded']:.4f}% != rounded"
    return out


# ============================================================================ main
def _write_json(out_dir: str, what: str, obj: dict) -> None:
    path = os.path.join(out_dir, f"mixed_precision_{what}.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print(f"# wrote {path}", flush=True)


def _prepare_out_dir(out_dir: str) -> str:
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    inside = os.path.commonpath([out_dir, _ROOT]) == _ROOT
    ignore = os.path.join(out_dir, ".gitignore")
    if inside and not os.path.exists(ignore):  # results are not source: keep them out of git
        with open(ignore, "w") as f:
            f.write("# written by benchmarks/bench_mixed_precision.py: results stay local\n*\n")
    return out_dir


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """--help: the module docstring as written, and every flag with its default."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--run", default=",".join(RUNS),
                    help=f"comma-separated measurements to run, from {','.join(RUNS)}")
    ap.add_argument("--out-dir", default=os.path.join(_HERE, "results"),
                    help="where the JSON / CSV / PNG files go (inside the checkout it gets a "
                         ".gitignore of its own)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: 1 for convergence, whose matrices are "
                         "tiny, else cores // world, at least 1)")
    ap.add_argument("--timeout", type=int, default=900, help="gloo timeout, seconds")
    ap.add_argument("--seed", type=int, default=0, help="convergence: model and data seed")

    g = ap.add_argument_group("1. convergence")
    g.add_argument("--conv-configs", default=DEFAULT_CONV_CONFIGS,
                   help=f"comma-separated subset of {','.join(CONV_CONFIGS)}")
    g.add_argument("--conv-world", type=int, default=1, help="ranks (gloo; 2 uses DDP)")
    g.add_argument("--conv-steps", type=int, default=400, help="training steps per config")
    g.add_argument("--conv-every", type=int, default=25,
                   help="report the losses every N steps")
    g.add_argument("--conv-lr", type=float, default=2e-4, help="peak learning rate")
    g.add_argument("--conv-warmup", type=int, default=30, help="linear warmup steps")
    g.add_argument("--conv-weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of the decay group")
    g.add_argument("--conv-batch-size", type=int, default=16, help="sequences per rank")
    g.add_argument("--conv-seq-len", type=int, default=32, help="tokens per sequence")
    g.add_argument("--conv-vocab", type=int, default=64, help="vocabulary size")
    g.add_argument("--conv-d-model", type=int, default=64, help="model width")
    g.add_argument("--conv-layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--conv-heads", type=int, default=4, help="attention heads")
    g.add_argument("--conv-eval-batches", type=int, default=4,
                   help="fixed held-out batches for the eval loss")
    g.add_argument("--conv-sharding", default="auto", choices=["auto", "param", "flat"],
                   help="zero_ext's sharding mode")

    g = ap.add_argument_group("2. memory")
    g.add_argument("--mem-worlds", default="1,2,4", help="comma-separated world sizes")
    g.add_argument("--mem-width-div", type=int, default=1,
                   help="divide GPT-2 small's width by this (bytes per param barely change)")
    g.add_argument("--mem-sharding", default="auto", choices=["auto", "param", "flat"],
                   help="zero_ext's sharding mode")
    g.add_argument("--mem-bucket-view", action="store_true",
                   help="zero_ext with parameters_as_bucket_view=True")

    g = ap.add_argument_group("3. step and 4. clip + step")
    g.add_argument("--world", type=int, default=2, help="ranks (gloo)")
    g.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated subset of {','.join(CONFIGS)}; torch-fp32 is the "
                        "baseline of the ratios")
    g.add_argument("--steps", type=int, default=10, help="timed steps per config")
    g.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per config first (the first creates the state)")
    g.add_argument("--width-div", type=int, default=1,
                   help="divide GPT-2 small's width by this (16: a smoke run)")
    g.add_argument("--max-norm", type=float, default=1.0, help="clip: max_norm")
    g.add_argument("--grad-scale", type=float, default=1e-3,
                   help="std of the fake grads (GPT-2 small: total norm about 11)")
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.run.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        ap.error(f"unknown --run {bad}; choose from {','.join(RUNS)}")
    bad = [c for c in args.configs.split(",") if c.strip() and c.strip() not in CONFIGS]
    if bad:
        ap.error(f"unknown --configs {bad}; choose from {','.join(CONFIGS)}")
    bad = [c for c in args.conv_configs.split(",") if c.strip()
           and c.strip() not in CONV_CONFIGS]
    if bad:
        ap.error(f"unknown --conv-configs {bad}; choose from {','.join(CONV_CONFIGS)}")
    args.runs = runs
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    why = _ours_importable()
    if why is not None:
        print(f"zero_ext is not usable: {why}", file=sys.stderr)
        return 1
    out_dir = _prepare_out_dir(args.out_dir)
    print(f"# bf16 + master weights; torch {torch.__version__}, {os.cpu_count()} cores; "
          f"{_prebuild()}; results in {out_dir}", flush=True)
    t0 = time.perf_counter()
    failed = False
    if "convergence" in args.runs:
        failed |= bool(run_convergence(args, out_dir)["errors"])
    if "memory" in args.runs:
        failed |= bool(run_memory(args, out_dir)["errors"])
    phases = [p for p in ("step", "clip") if p in args.runs]
    if phases:
        failed |= any(o["errors"] for o in run_timing(args, out_dir, phases).values())
    print(f"\n# all done in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
