"""A whole training iteration (forward + DDP backward + clip + step) per ZeRO mode, on gloo,
with the bytes each rank sends counted.

    python benchmarks/bench_iteration.py                         # world 2, MLP and GPT-2
    python benchmarks/bench_iteration.py --world 2,3,4 --model mlp
    python benchmarks/bench_iteration.py --quick --model mlp     # smoke run, tiny sizes

Modes (every one on its own copy of the same seeded model, wrapped in torch's DDP with its
defaults, AdamW lr 6e-4, betas (0.9, 0.95), nanoGPT's two groups: 2-D weights decay 0.1):
  ddp            DDP + torch.optim.AdamW(fused=True), unsharded: the baseline; clip with
                 torch.nn.utils.clip_grad_norm_
  torch_zero     torch's ZeroRedundancyOptimizer at its best: parameters_as_bucket_view=True,
                 AdamW fused=True; clip with torch's clip_grad_norm_ (DDP's grads are full)
  zero_ext       zero_ext today: DDP's all-reduce, then zero_ext's step (bucket views,
                 --sharding, its fused AdamW); clip with opt.clip_grad_norm_
  zero_ext_rs    zero_ext + zero_ext.ddp_zero_hook.reduce_scatter_hook: grads reach their
                 owners only; clip with opt.clip_grad_norm_
  zero_ext_overlap  zero_ext with overlap_with_ddp=True + hook_with_zero_step(allreduce_hook):
                 the step inside backward, no clip (the mode has no place for one), timed
                 after its 2 warm-up iterations without updates (+ --warmup more)
The zero_ext modes run once per --sharding ("flat" by default; "param,flat" for both).

Models: "mlp", 8 x Linear(2048, 2048) with ReLU between (33.6M params), batch 16, loss the
mean square of the output; "gpt2", GPT-2 small's shapes (benchmarks/model_shapes.py: width 768,
12 heads, vocab 50257, tied head, HF's (in, out) weight layout) at --gpt-layers depth (default
4, 67.7M params; 12 is the full 124M, which needs --sequential to fit 24 GB at world 2),
--gpt-batch x --gpt-seq random tokens, cross-entropy.

Timing: all modes alive in the same processes; each round runs one iteration of every mode,
in an order rotated every round, after a barrier, so noise from other work hits all modes
alike (--sequential: one mode after the other, less memory). Per iteration the slowest
rank's time counts; the table gives the median over --iters. "x baseline" is the ratio to
ddp's median in the same run. Where the time goes (median of the slowest rank per phase):
forward, backward (for zero_ext_overlap it holds the step and the exchange), clip + step,
and the exchange of the updated params inside it (torch_zero: its _sync_params;
zero_ext/zero_ext_rs: opt.last_step_timings["comm"], which on gloo with bucket views also
holds the sends overlapped with the local step; zero_ext_overlap: the exchange after the
last bucket).

"max abs diff vs ddp": the largest param difference to ddp's after the same iterations
(torch_zero, zero_ext, zero_ext_rs take the same steps on the same batches), a sanity check,
not a tolerance test (tests/ hold those): zero_ext's fused AdamW rounds differently from
torch's in the last bit of some elements, and Adam turns such differences into visible
ones where grads are below its eps, as in this MLP (grads ~1e-9: torch's fused AdamW
against itself with 1-ulp nudges of 30% of the weights after step 1 differs by 1.6e-5
two steps later).

Bytes: after the timing, one extra untimed iteration per mode runs with torch.distributed's
Python collectives wrapped (common.WireCounter) and every call converted to the bytes this
rank sends in the ring model (all_reduce 2(W-1)/W n, broadcast (W-1)/W n averaged over
ranks, all_gather_into_tensor / reduce_scatter_tensor (W-1)/W of the full tensor,
all_to_all_single exactly the elements sent to other ranks, send n). DDP's built-in
all-reduce runs in C++ and is not seen, so the modes that use it (ddp, torch_zero, zero_ext)
are counted on a fresh copy (same model, same warm-up) with torch's Python allreduce_hook
registered, which issues the same all-reduce of the same buckets through dist.all_reduce.
"MB sent/rank" is the mean over ranks (MB = 1e6 bytes), "x DDP bytes" the ratio to ddp's.

Threads: every rank calls torch.set_num_threads(max(1, cores // world)) (--threads to
override); at world 3 and 4 on 2 cores the ranks oversubscribe the cores: compare ratios
within one run only.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import model_shapes  # noqa: E402
from _zero_worker import BETAS, EPS, LR, WD, init_rank  # noqa: E402
from bench_zero_step import _free_port, _prebuild  # noqa: E402
from common import WireCounter, print_table  # noqa: E402

MODES = ("ddp", "torch_zero", "zero_ext", "zero_ext_rs", "zero_ext_overlap")
ZERO_EXT_MODES = ("zero_ext", "zero_ext_rs", "zero_ext_overlap")
BUILTIN_ALLREDUCE = ("ddp", "torch_zero", "zero_ext")  # DDP's C++ all-reduce when timed
OVERLAP_WARMUP = 2  # torch's: DDP finalises its buckets, no update
MAX_NORM = 1.0
TABLE_HEADERS = ["mode", "ms/iter (median)", "x baseline", "MB sent/rank", "x DDP bytes"]


# ----------------------------------------------------------------------------- models
class Conv1D(torch.nn.Module):
    """HF GPT-2's linear layer: weight stored (in, out), so the shapes are GPT-2's own."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(torch.nn.Module):
    """GPT-2's parameters in HF's order and shapes (tied LM head), at `layers` depth."""

    def __init__(self, d: int, layers: int, vocab: int, context: int):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(context, d)
        torch.nn.init.normal_(self.wte.weight, std=0.02)
        torch.nn.init.normal_(self.wpe.weight, std=0.01)
        self.h = torch.nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, batch):
        idx, targets = batch
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x.square().mean()


def model_spec(name: str, opts: dict) -> dict:
    """What the workers build: sizes of `name` (quick: tiny)."""
    if name == "mlp":
        width, depth, batch = (256, 8, 4) if opts["quick"] else (2048, 8, 16)
        return {"name": name, "width": width, "depth": depth, "batch": batch}
    if name == "gpt2":
        d, _ = model_shapes.GPT2["small"]
        width_div, layers = (16, 2) if opts["quick"] else (1, opts["gpt_layers"])
        return {"name": name, "d": d // width_div, "layers": layers,
                "vocab": model_shapes.VOCAB if not opts["quick"] else 4096,
                "context": model_shapes.CONTEXT, "batch": opts["gpt_batch"],
                "seq": 16 if opts["quick"] else opts["gpt_seq"], "width_div": width_div}
    raise ValueError(f"unknown model {name!r}: mlp or gpt2")


def build_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(0)  # every mode and every rank: the same weights
    if spec["name"] == "mlp":
        return MLP(spec["width"], spec["depth"])
    model = GPT(spec["d"], spec["layers"], spec["vocab"], spec["context"])
    if spec["vocab"] == model_shapes.VOCAB:  # the shapes are GPT-2 small's, layer for layer
        want = model_shapes.gpt2_shapes("small", spec["width_div"])
        want = [s for n, s in want if not n.startswith("h.") or int(n.split(".")[1])
                < spec["layers"]]
        got = [tuple(p.shape) for p in model.parameters()]
        assert got == want, "GPT shapes differ from model_shapes.gpt2_shapes"
    return model


def make_batches(spec: dict, rank: int, n: int = 4) -> list:
    """n batches of this rank (its own data, as in data parallelism), cycled."""
    g = torch.Generator().manual_seed(1000 + rank)
    if spec["name"] == "mlp":
        return [torch.randn(spec["batch"], spec["width"], generator=g) for _ in range(n)]
    shape = (spec["batch"], spec["seq"])
    return [(torch.randint(spec["vocab"], shape, generator=g),
             torch.randint(spec["vocab"], shape, generator=g)) for _ in range(n)]


def param_groups(model) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- modes
class Runner:
    """One mode: its DDP model, optimizer, hooks, and an iteration that records phases."""

    def __init__(self, mode: str, sharding: str, spec: dict, python_allreduce: bool):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
        from torch.nn.parallel import DistributedDataParallel as DDP

        from zero_ext import ZeroRedundancyOptimizer
        from zero_ext.ddp_zero_hook import hook_with_zero_step, reduce_scatter_hook

        self.mode, self.sharding = mode, sharding
        self.ddp = DDP(build_model(spec))
        groups = param_groups(self.ddp.module)
        hp = dict(lr=LR, betas=BETAS, eps=EPS)
        self.exchange_s = 0.0
        if mode == "ddp":
            self.opt = torch.optim.AdamW(groups, fused=True, **hp)
        elif mode == "torch_zero":
            self.opt = TorchZero(groups, torch.optim.AdamW, parameters_as_bucket_view=True,
                                 fused=True, **hp)
            self.opt._sync_params = self._timed(self.opt._sync_params)
        else:
            self.opt = ZeroRedundancyOptimizer(
                groups, torch.optim.AdamW, parameters_as_bucket_view=True, sharding=sharding,
                overlap_with_ddp=mode == "zero_ext_overlap", **hp)
        if mode == "zero_ext_rs":
            self.ddp.register_comm_hook(self.opt, reduce_scatter_hook)
        elif mode == "zero_ext_overlap":
            replicas = self.opt._replicas
            replicas.sync = self._timed(replicas.sync)
            self.ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.ddp,
                                                                  self.opt))
        elif python_allreduce:  # counting: DDP's all-reduce, issued from Python
            self.ddp.register_comm_hook(None, allreduce_hook)

    @property
    def label(self) -> str:
        return self.mode if self.mode not in ZERO_EXT_MODES else f"{self.mode} ({self.sharding})"

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exchange_s += time.perf_counter() - t0
        return timed

    def iteration(self, batch) -> dict:
        self.exchange_s = 0.0
        t0 = time.perf_counter()
        loss = self.ddp(batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.mode != "zero_ext_overlap":  # the overlap mode stepped inside backward
            if self.mode in ("ddp", "torch_zero"):
                torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), MAX_NORM)
            else:
                self.opt.clip_grad_norm_(MAX_NORM)
            self.opt.step()
            if self.mode in ("zero_ext", "zero_ext_rs"):
                self.exchange_s = self.opt.last_step_timings["comm"]
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2,
                "exchange": self.exchange_s}

    def warmup_iterations(self, extra: int) -> int:
        return extra + (OVERLAP_WARMUP if self.mode == "zero_ext_overlap" else 0)

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.ddp.module.parameters()]


# ----------------------------------------------------------------------------- worker
def _cases(opts) -> list[tuple[str, str]]:
    out = []
    for mode in opts["modes"]:
        for sharding in (opts["shardings"] if mode in ZERO_EXT_MODES else ["-"]):
            out.append((mode, sharding))
    return out


def time_modes(cases, spec, batches, opts) -> dict:
    """{label: {"phases": [per-iteration dict], "final": params}} after warm-up + iters."""
    def run_one(r: Runner, k: int, timed: bool, record: dict) -> None:
        dist.barrier()
        ph = r.iteration(batches[k % len(batches)])
        if timed:
            record.setdefault(r.label, {"phases": []})["phases"].append(ph)

    record: dict = {}
    if opts["sequential"]:
        for mode, sharding in cases:
            r = Runner(mode, sharding, spec, python_allreduce=False)
            w = r.warmup_iterations(opts["warmup"])
            for i in range(w + opts["iters"]):
                run_one(r, i, i >= w, record)
            record[r.label]["final"] = [p.clone() for p in r.params()]
            del r
            gc.collect()
        return record
    runners = [Runner(mode, sharding, spec, python_allreduce=False) for mode, sharding in cases]
    steps = {id(r): 0 for r in runners}
    rounds = max(r.warmup_iterations(opts["warmup"]) for r in runners) + opts["iters"]
    for i in range(rounds):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            w = r.warmup_iterations(opts["warmup"])
            # the overlap mode warms up longer: it starts earlier, so that every mode's timed
            # iterations fall in the same rounds
            if i >= rounds - (w + opts["iters"]):
                n = steps[id(r)]
                run_one(r, n, n >= w, record)
                steps[id(r)] = n + 1
    for r in runners:
        record[r.label]["final"] = [p.clone() for p in r.params()]
    record = {r.label: record[r.label] for r in runners}  # in the order of the modes
    del runners
    gc.collect()
    return record


def count_bytes(cases, spec, batches, opts) -> dict:
    """{label: {"bytes": sent, "calls": {name: [calls, bytes]}}}: one counted iteration per
    mode, after the same warm-up as the timed runs, on a fresh copy whose DDP all-reduce
    runs from Python (torch's allreduce_hook) for the modes that use DDP's own."""
    out = {}
    for mode, sharding in cases:
        r = Runner(mode, sharding, spec, python_allreduce=mode in BUILTIN_ALLREDUCE)
        # 2 warm-up iterations: DDP rebuilds its buckets after the first one
        w = r.warmup_iterations(2)
        for i in range(w):
            r.iteration(batches[i % len(batches)])
        dist.barrier()
        with WireCounter() as wc:
            r.iteration(batches[w % len(batches)])
        out[r.label] = {"bytes": wc.total, "calls": wc.by_name()}
        del r
        gc.collect()
    return out


def run(rank: int, world: int, opts: dict, out_path: str) -> None:
    init_rank(rank, world, opts)
    try:
        import torch.distributed.optim  # noqa: F401  (slow first import: not an iteration)

        import zero_ext

        zero_ext.load_native()
        results = {}
        for name in opts["models"]:
            spec = model_spec(name, opts)
            batches = make_batches(spec, rank)
            cases = _cases(opts)
            timed = time_modes(cases, spec, batches, opts)
            ref = timed.get("ddp", {}).get("final")
            for label, rec in timed.items():
                final = rec.pop("final")
                # modes 1-4 took the same steps on the same batches: they must agree
                if ref is not None and not label.startswith("zero_ext_overlap"):
                    rec["max_abs_diff"] = max((a - b).abs().max().item()
                                              for a, b in zip(final, ref))
            del ref
            gc.collect()
            counted = count_bytes(cases, spec, batches, opts)
            model_numel = sum(p.numel() for p in build_model(spec).parameters())
            results[name] = {"spec": spec, "numel": model_numel, "timed": timed,
                             "counted": counted}
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "results": results})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world": world, "threads": opts["threads"], "ranks": gathered}, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- report
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def summarize(data: dict, model: str) -> dict:
    """Per mode: median over iterations of the slowest rank, per phase; counted bytes (mean
    and max over ranks)."""
    world = data["world"]
    per_rank = [rk["results"][model] for rk in data["ranks"]]
    numel = per_rank[0]["numel"]
    rows = {}
    for label in per_rank[0]["timed"]:
        phases = [pr["timed"][label]["phases"] for pr in per_rank]
        n = min(len(p) for p in phases)
        med = {k: statistics.median(max(p[i][k] for p in phases) for i in range(n))
               for k in phases[0][0]}
        sent = [pr["counted"][label]["bytes"] for pr in per_rank]
        diffs = [pr["timed"][label].get("max_abs_diff") for pr in per_rank]
        rows[label] = {"median": med, "iters": n, "sent_mean": sum(sent) / world,
                       "sent_max": max(sent), "calls": per_rank[0]["counted"][label]["calls"],
                       "max_abs_diff": None if diffs[0] is None else max(diffs)}
    return {"world": world, "numel": numel, "rows": rows, "spec": per_rank[0]["spec"]}


def tables(summary: dict, file=None) -> str:
    """The main table and the breakdown, as markdown (printed, and returned)."""
    rows, world, numel = summary["rows"], summary["world"], summary["numel"]
    base = rows.get("ddp")
    ddp_ring = 2 * (world - 1) / world * numel * 4
    main, parts, colls = [], [], []
    for label, r in rows.items():
        t = r["median"]["total"]
        main.append([label, _ms(t),
                     f"{t / base['median']['total']:.2f}x" if base else "-",
                     f"{r['sent_mean'] / 1e6:.2f}",
                     f"{r['sent_mean'] / base['sent_mean']:.3f}x" if base and base["sent_mean"]
                     else "-"])
        m = r["median"]
        overlap = label.startswith("zero_ext_overlap")
        parts.append([label, _ms(m["forward"]), _ms(m["backward"]),
                      "in backward" if overlap else _ms(m["step"]),
                      _ms(m["exchange"]) if not label.startswith("ddp") else "-",
                      "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"])
        colls.append([label, ", ".join(f"{k} x{c} {b / 1e6:.2f} MB"
                                       for k, (c, b) in sorted(r["calls"].items())),
                      f"{r['sent_max'] / 1e6:.2f}"])
    spec = summary["spec"]
    what = (f"MLP {spec['depth']} x Linear({spec['width']}, {spec['width']}), batch "
            f"{spec['batch']}" if spec["name"] == "mlp" else
            f"GPT-2 small shapes, {spec['layers']} layers, width {spec['d']}, vocab "
            f"{spec['vocab']}, batch {spec['batch']} x {spec['seq']} tokens")
    cores = (f" ({world} ranks x {summary['threads']} thread(s) oversubscribe the cores)"
             if summary.get("oversubscribed") else "")
    title = (f"Whole iteration, {what}: {numel:,} fp32 params; world {world}{cores}, gloo; median "
             f"of {min(r['iters'] for r in rows.values())} iterations (slowest rank). Bytes "
             f"counted in one iteration, ring model; DDP's all-reduce counted through torch's "
             f"Python allreduce_hook (ring all-reduce of the model: "
             f"{ddp_ring / 1e6:.2f} MB/rank):")
    text = print_table(title, TABLE_HEADERS, main, file=file)
    text += "\n" + print_table(
        "Where the time goes (ms, median of the slowest rank per phase; step = clip + step + "
        "zero_grad; exchange = the updated params' exchange inside it):",
        ["mode", "forward", "backward", "step", "exchange", "max abs diff vs ddp"], parts,
        file=file)
    text += "\n" + print_table("Collectives counted in one iteration (rank 0; wire bytes):",
                               ["mode", "calls", "max MB sent by a rank"], colls, file=file)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world", default="2", help="comma-separated world sizes")
    ap.add_argument("--model", default="mlp,gpt2", help="comma-separated: mlp, gpt2")
    ap.add_argument("--modes", default=",".join(MODES), help="subset of the modes")
    ap.add_argument("--sharding", default="flat",
                    help="zero_ext's sharding for its modes: flat, param or param,flat")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per mode")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed iterations per mode (the overlap mode: 2 more)")
    ap.add_argument("--gpt-layers", type=int, default=4, help="GPT-2 depth (12: full)")
    ap.add_argument("--gpt-batch", type=int, default=2)
    ap.add_argument("--gpt-seq", type=int, default=64)
    ap.add_argument("--sequential", action="store_true",
                    help="one mode after the other (less memory) instead of interleaved")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: auto)")
    ap.add_argument("--timeout", type=int, default=600, help="gloo timeout, seconds")
    ap.add_argument("--out", default="", help="write the tables (markdown) here")
    ap.add_argument("--json", default="", help="write the summaries (JSON) here")
    args = ap.parse_args(argv)

    worlds = [int(w) for w in args.world.split(",") if w.strip()]
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES] + [m for m in models if m not in ("mlp", "gpt2")]
    if bad:
        ap.error(f"unknown mode(s)/model(s): {bad}")
    if args.quick:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    cores = os.cpu_count() or 1
    print(f"# whole iteration: torch {torch.__version__}, gloo on localhost, {cores} cores; "
          f"{_prebuild()}", flush=True)
    texts, summaries = [], []
    for world in worlds:
        threads = args.threads or max(1, cores // world)
        opts = {"threads": threads, "port": _free_port(), "timeout": args.timeout,
                "models": models, "modes": modes,
                "shardings": [s.strip() for s in args.sharding.split(",") if s.strip()],
                "iters": args.iters, "warmup": args.warmup, "quick": args.quick,
                "sequential": args.sequential, "gpt_layers": args.gpt_layers,
                "gpt_batch": args.gpt_batch, "gpt_seq": args.gpt_seq}
        fd, out = tempfile.mkstemp(prefix=f"iteration_w{world}_", suffix=".json")
        os.close(fd)
        t0 = time.perf_counter()
        mp.spawn(run, args=(world, opts, out), nprocs=world, join=True)
        with open(out) as f:
            data = json.load(f)
        os.unlink(out)
        over = " (ranks oversubscribe the cores)" if world * threads > cores else ""
        print(f"# world {world}: {threads} thread(s) per rank{over}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        for model in models:
            s = summarize(data, model)
            s["threads"], s["oversubscribed"] = threads, bool(over)
            summaries.append(s)
            texts.append(tables(s))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(texts) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
