"""Per-rank body of bench_zero_step.py (a module of its own so that mp.spawn can pickle it).

Every rank builds the same GPT-2-shaped params (seeded), the same synthetic grads (seeded,
identical on every rank, fixed across steps), runs each optimizer config in turn on a fresh
copy of the params, and reports timings, state sizes and the final params' distance to the
torch baseline. Rank 0 writes one JSON file that the parent turns into tables.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Hyperparameters (GPT-2-like); every config gets the same.
LR, BETAS, EPS, WD = 6e-4, (0.9, 0.95), 1e-8, 0.1
ATTR_CANDIDATES = ("last_step_timings", "step_timings", "timings", "last_timings")


# ----------------------------------------------------------------------------- model
def model_params(small: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of GPT-2 small (tied lm head), or a 1/16-width version with --small."""
    import model_shapes  # benchmarks/model_shapes.py

    return model_shapes.gpt2_shapes("small", width_div=16 if small else 1)


def _filled(shapes, seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(scale) for _, s in shapes]


def make_params(shapes) -> list[torch.Tensor]:
    return [t.requires_grad_() for t in _filled(shapes, 1234, 0.02)]


def make_groups(shapes, params) -> list[dict]:
    decay = [p for (_, s), p in zip(shapes, params) if len(s) >= 2]
    no_decay = [p for (_, s), p in zip(shapes, params) if len(s) < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- configs
def build(config: str, groups):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    if config == "torch":
        return TorchZero(groups, torch.optim.AdamW, parameters_as_bucket_view=True,
                         lr=LR, betas=BETAS, eps=EPS, fused=True)
    from zero_ext import ZeroRedundancyOptimizer as OurZero

    sharding = {"param": "param", "flat": "flat", "auto": "auto"}[config]
    return OurZero(groups, torch.optim.AdamW, parameters_as_bucket_view=True,
                   sharding=sharding, lr=LR, betas=BETAS, eps=EPS)


def state_bytes(opt) -> int | None:
    """Bytes of optimizer-state tensors this rank holds (views of one buffer counted once each)."""
    inner = getattr(opt, "optim", None)
    seen, total = set(), 0
    for st in (getattr(inner, "state", {}) or {}).values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                key = (v.data_ptr(), v.numel(), v.dtype)
                if key not in seen:
                    seen.add(key)
                    total += v.numel() * v.element_size()
    return total if seen else None


def local_numel(opt) -> int:
    n = getattr(opt, "local_numel", None)
    if isinstance(n, int):
        return n
    return sum(p.numel() for g in opt.optim.param_groups for p in g["params"])


def breakdown(opt) -> dict | None:
    for name in ATTR_CANDIDATES:
        d = getattr(opt, name, None)
        if isinstance(d, dict) and d and all(isinstance(v, (int, float)) for v in d.values()):
            return {k: float(v) for k, v in d.items()}
    return None


def run_config(config, shapes, grads, n_warmup, n_steps):
    params = make_params(shapes)
    for p, g in zip(params, grads):
        p.grad = g
    groups = make_groups(shapes, params)
    dist.barrier()
    t0 = time.perf_counter()
    opt = build(config, groups)
    ctor = time.perf_counter() - t0
    times, parts = [], []
    for i in range(n_warmup + n_steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= n_warmup:
            times.append(dt)
            b = breakdown(opt)
            if b is not None:
                parts.append(b)
    final = torch.cat([p.detach().reshape(-1) for p in params])
    sb = state_bytes(opt)
    ln = local_numel(opt)
    info = {"ctor_s": ctor, "step_s": times, "state_bytes": sb, "local_numel": ln,
            "breakdown": ({k: statistics.median(b[k] for b in parts) for k in parts[0]}
                          if parts else None)}
    if config != "torch":
        info["sharding_used"] = str(getattr(opt, "sharding", config))
    del opt, groups, params
    gc.collect()
    return info, final


# ----------------------------------------------------------------------------- limits
def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_limits(total: int, world: int, rank: int, reps: int) -> dict:
    """Bare costs of the two halves of a step on a balanced shard of total/world elements."""
    shard = -(-total // world)
    # Local step: torch's fused AdamW on ONE flat tensor, one group: its best case.
    p = torch.zeros(shard, requires_grad=True)
    p.grad = torch.full((shard,), 1e-3)
    adam = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    local = _median_time(adam.step, reps)
    # Memory bandwidth (copy, counts read + write) with this process's threads, all ranks at once.
    src = torch.ones(shard)
    dst = torch.empty_like(src)
    copy = _median_time(lambda: dst.copy_(src), reps)
    del adam, p, src, dst
    # Communication: every rank broadcasts its shard (torch's bucket-view sync, async then wait).
    buf = torch.zeros(shard * world)
    chunks = list(buf.chunk(world))

    def bcast():
        works = [dist.broadcast(chunks[r], src=r, async_op=True) for r in range(world)]
        for w in works:
            w.wait()

    bc = _median_time(bcast, reps)

    def agather():
        dist.all_gather_into_tensor(buf, chunks[rank])

    ag = _median_time(agather, reps)
    del buf, chunks
    gc.collect()
    return {"shard": shard, "local_fused_s": local, "copy_s": copy,
            "copy_gbps": 2 * 4 * shard / copy / 1e9, "bcast_s": bc, "allgather_s": ag}


# ----------------------------------------------------------------------------- entry
def _preload(configs) -> dict:
    """Import both optimizers and load zero_ext's native ops before anything is timed."""
    out = {}
    t0 = time.perf_counter()
    import torch.distributed.optim  # noqa: F401  (about 4 s the first time: FSDP, DTensor)

    # The first Optimizer() in a process imports torch._dynamo (about 5 s): not ZeRO's cost.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)

    out["import_torch_zero_s"] = time.perf_counter() - t0
    if any(c != "torch" for c in configs):
        t0 = time.perf_counter()
        try:
            import zero_ext
            from zero_ext.kernels import ensure_loaded

            zero_ext.ZeroRedundancyOptimizer  # noqa: B018
            out["native"] = bool(ensure_loaded())
        except Exception as exc:
            out["native_error"] = f"{type(exc).__name__}: {exc}"
        out["load_zero_ext_s"] = time.perf_counter() - t0
    return out


def run(rank: int, world: int, opts: dict, out_path: str) -> None:
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    torch.set_num_threads(opts["threads"])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(opts["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["timeout"]))
    try:
        preload = _preload(opts["configs"])  # imports + native-op load stay out of the timings
        shapes = model_params(opts["small"])
        grads = _filled(shapes, 99, 1e-3)  # identical on every rank
        results, ref, errors = {}, None, {}
        for config in opts["configs"]:
            try:
                info, final = run_config(config, shapes, grads, opts["warmup"], opts["steps"])
            except Exception as exc:  # report and carry on with the next config
                errors[config] = f"{type(exc).__name__}: {exc}"
                dist.barrier()
                continue
            if ref is None and config == "torch":
                ref = final
                info["max_abs_diff"] = 0.0
            elif ref is not None:
                info["max_abs_diff"] = (final - ref).abs().max().item()
            del final
            results[config] = info
        del ref
        del grads
        gc.collect()
        total = sum(int(torch.Size(s).numel()) for _, s in shapes)
        limits = measure_limits(total, world, rank, opts["limit_reps"]) if opts["limits"] else None
        mine = {"rank": rank, "preload": preload, "results": results, "errors": errors, "limits": limits}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            native = preload.get("native", preload.get("native_error"))
            with open(out_path, "w") as f:
                json.dump({"world": world, "threads": opts["threads"], "total": total,
                           "n_params": len(shapes), "native": native, "ranks": gathered}, f)
    finally:
        dist.destroy_process_group()
