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


def _checksum(tensors) -> tuple:
    return tuple(t.sum(dtype=torch.float64).item() for t in tensors)


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


def warm_up_constructor(config) -> None:
    """Construct and step once on a tiny model: lazy imports and one-time registrations are
    per process, not per optimizer, so they stay out of the constructor time."""
    tiny = [("w", (8, 4)), ("b", (4,))]
    params = make_params(tiny)
    for p in params:
        p.grad = torch.zeros_like(p)
    build(config, make_groups(tiny, params)).step()


class Entry:
    """One optimizer config under test: its params, optimizer and measurements."""

    def __init__(self, config: str, shapes, grads, ctor_reps: int):
        warm_up_constructor(config)
        self.config = config
        self.params = make_params(shapes)
        for p, g in zip(self.params, grads):
            p.grad = g
        self.ctor = float("inf")
        self.opt = None
        for _ in range(max(1, ctor_reps)):  # best of ctor_reps; the last one is kept
            self.opt = None
            gc.collect()
            groups = make_groups(shapes, self.params)
            dist.barrier()
            t0 = time.perf_counter()
            self.opt = build(config, groups)
            self.ctor = min(self.ctor, time.perf_counter() - t0)
        self.times: list[float] = []
        self.parts: list[dict] = []

    def step(self, timed: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.step()
        dt = time.perf_counter() - t0
        if timed:
            self.times.append(dt)
            b = breakdown(self.opt)
            if b is not None:
                self.parts.append(b)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def max_abs_diff(self, other: "Entry") -> float:
        return max((a.detach() - b.detach()).abs().max().item()
                   for a, b in zip(self.params, other.params))

    def info(self) -> dict:
        parts = self.parts
        out = {"ctor_s": self.ctor, "step_s": self.times, "state_bytes": state_bytes(self.opt),
               "local_numel": local_numel(self.opt),
               "breakdown": ({k: statistics.median(b[k] for b in parts) for k in parts[0]}
                             if parts else None)}
        if self.config != "torch":
            out["sharding_used"] = str(getattr(self.opt, "sharding", self.config))
        return out

    def close(self) -> None:
        del self.opt, self.params
        gc.collect()


def _guard(errors: dict, config: str, fn):
    """Run fn(); on an exception record it under config and return None."""
    try:
        return fn()
    except Exception as exc:  # a broken config must not hide the others' numbers
        errors[config] = f"{type(exc).__name__}: {exc}"
        return None


def run_interleaved(configs, shapes, grads, n_warmup, n_steps, errors, ctor_reps) -> dict:
    """All configs alive at once; each round steps every config once, in an order rotated
    every round, so that a noisy neighbour hits all configs alike."""
    entries = []
    for c in configs:
        e = _guard(errors, c, lambda: Entry(c, shapes, grads, ctor_reps))
        if e is not None:
            entries.append(e)
        dist.barrier()
    for i in range(n_warmup + n_steps):
        k = i % max(1, len(entries))
        for e in entries[k:] + entries[:k]:
            if e.config not in errors:  # a config that failed once is left out
                _guard(errors, e.config, lambda: e.step(i >= n_warmup))
    live = [e for e in entries if e.config not in errors]
    ref = next((e for e in live if e.config == "torch"), None)
    results = {}
    for e in live:
        info = e.info()
        if ref is not None:
            info["max_abs_diff"] = 0.0 if e is ref else e.max_abs_diff(ref)
        results[e.config] = info
    for e in entries:
        e.close()
    return results


def run_sequential(configs, shapes, grads, n_warmup, n_steps, errors, ctor_reps) -> dict:
    """One config at a time (less memory); torch's final params kept as the reference."""
    results, ref = {}, None
    for c in configs:
        def one():
            e = Entry(c, shapes, grads, ctor_reps)
            for i in range(n_warmup + n_steps):
                e.step(i >= n_warmup)
            info, final = e.info(), e.flat_params()
            e.close()
            return info, final

        got = _guard(errors, c, one)
        dist.barrier()
        if got is None:
            continue
        info, final = got
        if c == "torch" and ref is None:
            ref, info["max_abs_diff"] = final, 0.0
        elif ref is not None:
            info["max_abs_diff"] = (final - ref).abs().max().item()
        del final
        results[c] = info
    del ref
    gc.collect()
    return results


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


def init_rank(rank: int, world: int, opts: dict) -> None:
    """A benchmark rank's process setup: threads, and the gloo world on localhost."""
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    torch.set_num_threads(opts["threads"])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(opts["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["timeout"]))


def run(rank: int, world: int, opts: dict, out_path: str) -> None:
    init_rank(rank, world, opts)
    try:
        preload = _preload(opts["configs"])  # imports + native-op load stay out of the timings
        shapes = model_params(opts["small"])
        grads = _filled(shapes, 99, 1e-3)  # identical on every rank
        errors: dict = {}
        runner = run_sequential if opts["sequential"] else run_interleaved
        checksum = _checksum(grads)
        results = runner(opts["configs"], shapes, grads, opts["warmup"], opts["steps"], errors,
                         opts["ctor_reps"])
        if _checksum(grads) != checksum:  # the configs share the grads: none may write them
            errors["grads"] = "an optimizer modified the shared grads; results are invalid"
        del grads
        gc.collect()
        total = sum(int(torch.Size(s).numel()) for _, s in shapes)
        limits = measure_limits(total, world, rank, opts["limit_reps"]) if opts["limits"] else None
        mine = {"rank": rank, "preload": preload, "results": results, "errors": errors,
                "limits": limits}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            native = preload.get("native", preload.get("native_error"))
            with open(out_path, "w") as f:
                json.dump({"world": world, "threads": opts["threads"], "total": total,
                           "n_params": len(shapes), "native": native, "ranks": gathered}, f)
    finally:
        dist.destroy_process_group()
