"""Resident memory per param per rank (RSS) next to the bytes counted from the tensors.

    python benchmarks/bench_resident_memory.py                    # GPT-2 small, worlds 2 and 4
    python benchmarks/bench_resident_memory.py --width-div 16     # smoke run (~2.8M params)
    python benchmarks/bench_resident_memory.py --worlds 4 --configs ours-bf16-master-bv
    python benchmarks/bench_resident_memory.py --worlds 4 \
        --configs ours-bf16-master,ours-bf16-master-offload,ours-bf16-master-offload-half

What is measured (issue 15, "Memory accounting"): what each rank's resident set grows by
for the optimizer setup, in bytes per param of the model (all its params, as
bench_mixed_precision.py --run memory counts them), against what the tensors account for:

  counted   weights + grads + every tensor in the local optimizer's state (masters too),
            from the tensors' nbytes: 4 + 12/d for zero_ext bf16 + master_weights=True,
            8 + 8/d (mean over ranks) for torch's fp32 ZeRO with AdamW
  resident  VmRSS after the steps, gc.collect() and malloc_trim(0) (freed temporaries
            given back to the OS), minus VmRSS of the same process right after `import
            torch` and the gloo init (also after gc + malloc_trim): what a bare process
            that imports torch and joins the world already has (about 0.5 GB here)

Every config runs in fresh processes (one spawn of `world` ranks per config and world, gloo
on localhost, torch.multiprocessing), so one config's imports and allocator history cannot
leak into another's figure. Each rank reads VmRSS, RssAnon (heap, mmapped memory) and
RssFile (pages of shared libraries) from /proc/self/status, and Pss from
/proc/self/smaps_rollup, at these stages:

  init       import torch (+ torch.distributed, torch.multiprocessing) and the gloo init,
             then gc + malloc_trim: the baseline
  dynamo     one throw-away torch.optim.AdamW: the first torch Optimizer of a process
             imports torch._dynamo (torch wraps Optimizer methods in torch._disable_dynamo,
             which imports it at the first call), and with it triton, sympy, numpy. Every
             torch optimizer pays it: torch's ZeRO, zero_ext's (a torch Optimizer, whose
             local optimizer is torch.optim.AdamW) and a plain AdamW alike. gc + trim
  imports    the optimizer's own package: torch.distributed.optim for torch's ZeRO; zero_ext
             and its native library for ours (zero_ext does not import
             torch.distributed.optim). gc + trim
  params     the model's params (GPT-2 shapes from model_shapes.py, constants; the usual
             two groups: 2-D weights with weight decay, the rest without)
  grads      one grad per param
  optimizer  the optimizer constructed
  step1 ..   after each step (VmRSS as the allocator leaves it: freed memory may be kept)
  trimmed    gc.collect() + malloc_trim(0): what stays resident

then walks gc.get_objects() for torch.Tensor instances and sums untyped_storage().nbytes()
over DISTINCT storages (by data_ptr), classified as params, grads, optimizer state (by entry
name) or "other live tensors", the biggest of which are listed with what holds them. Tensors
held only by C++ (autograd graph, process groups) are not seen by the walk: they end up in
"rest". The breakdown (mean over ranks; MB = 1e6 bytes):

  torch._dynamo import   dynamo - init, anonymous (Python modules) and file pages (mostly
                         triton's libtriton.so; shared between the ranks by the page
                         cache, which PSS shows: PSS splits shared pages between processes)
  own imports            imports - dynamo
  counted tensors        weights, grads, masters, optimizer state
  other live tensors     live storages that are none of the above
  rest                   trimmed - imports - all live storages: allocator fragmentation
                         that malloc_trim cannot return, C++ buffers (gloo), Python objects
                         (anonymous), code pages first touched by the steps (file)
  freed, kept            last step - trimmed: freed temporaries kept until malloc_trim
  constructor            optimizer - grads

Device bytes (offload_optimizer, issue 46): the table "device bytes per param per rank"
splits the counted tensors by where they would live on a GPU: on the device the weights,
the grads, the state and masters of the device part of the share (keyed by the params' own
memory) and the offload's staging; on the host the host part's keys (the share's param
copies), their grads and their state and masters. Here everything is in RAM (CPU ranks), so
the split is read from what holds each storage (the optimizer's offload.HostShard), not from
tensor.device. Configs ours-bf16-master-offload (the whole share on the host) and
ours-bf16-master-offload-half (offload_optimizer=0.5).

--mmap-threshold N sets MALLOC_MMAP_THRESHOLD_ in the ranks (glibc: blocks of N bytes and
more get their own mapping and go back to the OS when freed); default unset (glibc's
dynamic threshold, as in a user's process). Nothing is asserted: all figures are measured
in this run, compare the configs measured together. Runtime on 2 cores: 10-30 s per
(config, world) for GPT-2 small, about 1-1.5 minutes for the default run; memory per rank
at world 4: about 1 GB (bf16) to 1.5 GB (fp32) including the 0.5 GB baseline.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import model_shapes  # noqa: E402  (no torch import of its own)

BF16, FP32 = torch.bfloat16, torch.float32
LR, BETAS, EPS, WD = 6e-4, (0.9, 0.95), 1e-8, 0.1  # as benchmarks/_zero_worker.py
# name -> (implementation, param dtype, master_weights, parameters_as_bucket_view)
CONFIGS = {
    "ours-bf16-master": ("ours", BF16, True, False),
    "torch-fp32": ("torch", FP32, False, False),
    # extra rows, for context
    "ours-bf16-master-bv": ("ours", BF16, True, True),
    "ours-fp32": ("ours", FP32, False, False),
    "torch-bf16": ("torch", BF16, False, False),
    "bare": (None, FP32, False, False),  # init only: checks the baseline of the others
    # offload_optimizer (the value in OFFLOAD)
    "ours-bf16-master-offload": ("ours", BF16, True, False),
    "ours-bf16-master-offload-half": ("ours", BF16, True, False),
}
OFFLOAD = {"ours-bf16-master-offload": True, "ours-bf16-master-offload-half": 0.5}
DEFAULT_CONFIGS = "ours-bf16-master,torch-fp32"
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


# ----------------------------------------------------------------------------- rank side
def _status() -> dict:
    """VmRSS, RssAnon, RssFile, RssShmem (/proc/self/status) and Pss (smaps_rollup, where
    the kernel has it) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":", 1)[0]
            if k in FIELDS:
                out[k] = int(line.split()[1]) * 1024
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    out["Pss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


_LIBC = None


def _trim() -> None:
    """gc.collect() then malloc_trim(0): free what Python holds, give the heap back."""
    global _LIBC
    gc.collect()
    if _LIBC is None:
        _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim(0)


def _build(cfg: str, groups):
    impl, _, master, bucket_view = CONFIGS[cfg]
    kw = dict(lr=LR, betas=BETAS, eps=EPS)
    if impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        return TorchZero(groups, torch.optim.AdamW, parameters_as_bucket_view=bucket_view, **kw)
    from zero_ext import ZeroRedundancyOptimizer as OurZero

    return OurZero(groups, torch.optim.AdamW, parameters_as_bucket_view=bucket_view,
                   master_weights=master, sharding=_build.sharding,
                   offload_optimizer=OFFLOAD.get(cfg, False), **kw)


_build.sharding = "auto"


def _import_dynamo() -> None:
    """The first torch Optimizer of a process imports torch._dynamo (Optimizer methods are
    wrapped in torch._disable_dynamo): every optimizer pays it, either ZeRO or a plain one."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def _import_package(cfg: str) -> dict:
    """What the optimizer itself imports or loads before it touches a param: torch's ZeRO
    lives in torch.distributed.optim (FSDP, DTensor come with it); zero_ext is its package
    and its native library (zero_ext does not import torch.distributed.optim)."""
    out = {}
    if CONFIGS[cfg][0] == "torch":
        import torch.distributed.optim  # noqa: F401
    else:
        import zero_ext
        from zero_ext.kernels import ensure_loaded

        zero_ext.ZeroRedundancyOptimizer  # noqa: B018
        out["native"] = bool(ensure_loaded())
    return out


def _attr_of(owner, value) -> str | None:
    """The attribute (or __slots__ entry) of `owner` that is `value`, if any."""
    names = list(getattr(owner, "__dict__", {}) or {})
    for cls in type(owner).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
    for n in names:
        try:
            if getattr(owner, n) is value:
                return n
        except Exception:  # noqa: BLE001 - properties, unset slots
            continue
    return None


def _owner_desc(obj, skip: set, depth: int = 5) -> str:
    """A short path of who holds `obj` ("dict[0] <- Replicas.buffers" ...), found with
    gc.get_referrers, at most `depth` hops; `skip`: ids of our own containers. Objects are
    preferred over dicts over lists and tuples at every hop."""
    parts = []
    cur = obj
    skip = set(skip)
    for _ in range(depth):
        found = gc.get_referrers(cur)
        skip.add(id(found))
        refs = [r for r in found if id(r) not in skip
                and type(r).__name__ not in ("frame", "cell", "function", "module")]
        del found
        if not refs:
            break
        refs.sort(key=lambda r: 2 if isinstance(r, (list, tuple)) else
                  1 if isinstance(r, dict) else 0)
        r = refs[0]
        skip.add(id(refs))
        skip.add(id(r))
        del refs
        if isinstance(r, dict):
            key = next((repr(k) for k, v in r.items() if v is cur), None)
            parts.append(f"dict[{key}]")
        elif isinstance(r, (list, tuple)):
            parts.append(f"{type(r).__name__}[{len(r)}]")
        else:
            attr = _attr_of(r, cur)
            parts.append(f"{type(r).__qualname__}" + (f".{attr}" if attr else ""))
        cur = r
    return " <- ".join(parts) if parts else "(no Python referrer seen)"


def walk_storages(params, opt, top: int, min_bytes: int) -> dict:
    """Distinct live tensor storages, classified; the biggest unclassified ones described."""
    kind: dict = {}

    def mark(t, what):
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            kind.setdefault(t.untyped_storage().data_ptr(), what)

    for p in params:
        mark(p, "weights")
        mark(p.grad, "grads")
    inner = getattr(opt, "optim", opt)
    host = getattr(opt, "_offload", None)
    host_keys = set()
    if host is not None:  # offload_optimizer: what is host memory on a GPU machine
        for b in host.buffers:
            mark(b.params, "host:keys")
            mark(b.grads, "host:grads")
            for t in (b.stage, b.hook_stage):
                mark(t, "staging")
        host_keys = {id(s.key) for s in host.slots}
    for key, st in inner.state.items():
        for name, v in st.items():
            mark(v, f"host:state:{name}" if id(key) in host_keys else f"state:{name}")
    gc.collect()
    objs = gc.get_objects()
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in objs if isinstance(o, torch.Tensor)]
    del objs
    size: dict = {}   # storage data_ptr -> bytes
    where: dict = {}  # storage data_ptr -> index of one tensor over it in `tensors`
    for i, t in enumerate(tensors):
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - meta / sparse / wrapper subclasses
            continue
        n = st.nbytes()
        if n == 0 or st.device.type != "cpu":
            continue
        ptr = st.data_ptr()
        if n > size.get(ptr, -1):
            size[ptr], where[ptr] = n, i
    sums: dict = {}
    others = []  # data_ptrs of the unclassified storages
    for ptr, n in size.items():
        k = kind.get(ptr, "other")
        sums[k] = sums.get(k, 0) + n
        if k == "other":
            others.append(ptr)
    others.sort(key=lambda ptr: -size[ptr])
    listed, small = [], 0
    for ptr in others:
        if len(listed) >= top or size[ptr] < min_bytes:
            small += 1
            continue
        t = tensors[where[ptr]]
        listed.append({"bytes": size[ptr], "dtype": str(t.dtype).replace("torch.", ""),
                       "shape": list(t.shape),
                       "held_by": _owner_desc(t, {id(tensors), id(others)})})
        del t
    return {"by_kind": sums, "n_storages": len(size), "n_other": len(others),
            "other_top": listed, "other_not_listed": small}


def worker(rank: int, world: int, opts: dict, out_path: str) -> None:
    cfg = opts["config"]
    torch.set_num_threads(opts["threads"])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(opts["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["timeout"]))
    stages: dict = {}

    def stage(name: str, trim: bool = False) -> None:
        dist.barrier()
        if trim:
            _trim()
        stages[name] = _status()

    try:
        stage("init", trim=True)
        impl, dtype, _, _ = CONFIGS[cfg]
        mine: dict = {"rank": rank, "stages": stages}
        if impl is not None:
            _build.sharding = opts["sharding"]
            _import_dynamo()
            stage("dynamo", trim=True)
            mine.update(_import_package(cfg))
            stage("imports", trim=True)
            shapes = model_shapes.gpt2_shapes(opts["model"], width_div=opts["width_div"])
            # values do not matter here: constants are quick to make
            params = [torch.full(s, 0.02, dtype=dtype).requires_grad_() for _, s in shapes]
            stage("params")
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            stage("grads")
            decay = [p for (_, s), p in zip(shapes, params) if len(s) >= 2]
            rest = [p for (_, s), p in zip(shapes, params) if len(s) < 2]
            opt = _build(cfg, [{"params": decay, "weight_decay": WD},
                               {"params": rest, "weight_decay": 0.0}])
            stage("optimizer")
            for i in range(opts["steps"]):
                opt.step()
                stage(f"step{i + 1}")
            mine["last_step"] = f"step{opts['steps']}"
            stage("trimmed", trim=True)
            walk = walk_storages(params, opt, opts["top"], opts["min_list_bytes"])
            stages["after_walk"] = _status()
            mine["walk"] = walk
            mine["sharding_used"] = str(getattr(opt, "sharding", "param (torch)"))
            mine["modules"] = len(sys.modules)
            mine["torch_zero_imported"] = "torch.distributed.optim" in sys.modules
        else:
            stage("trimmed", trim=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"config": cfg, "world": world, "ranks": gathered}, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- report
def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def _bpp(b: float, n: int) -> str:
    return f"{b / n:.2f}"


def rank_breakdown(rk: dict) -> dict:
    """One rank's figures (bytes) from its stages and storage walk."""
    s = rk["stages"]
    base, end = s["init"], s["trimmed"]
    out = {"resident": end["VmRSS"] - base["VmRSS"], "init": base["VmRSS"],
           "pss": end.get("Pss", 0) - base.get("Pss", 0)}
    if "walk" not in rk:
        return out
    by = rk["walk"]["by_kind"]
    state = {k.split(":", 1)[1]: v for k, v in by.items() if k.startswith("state:")}
    hstate = {k.split(":", 2)[2]: v for k, v in by.items() if k.startswith("host:state:")}
    live = sum(by.values())
    dyn, imp = s["dynamo"], s["imports"]
    out.update({
        "dynamo_anon": dyn["RssAnon"] - base["RssAnon"],
        "dynamo_file": dyn["RssFile"] - base["RssFile"] + dyn["RssShmem"] - base["RssShmem"],
        "own_imports": imp["VmRSS"] - dyn["VmRSS"],
        "weights": by.get("weights", 0), "grads": by.get("grads", 0),
        "masters": state.get("master", 0),
        "state": sum(v for k, v in state.items() if k != "master"),
        "host_masters": hstate.get("master", 0),
        "host_state": sum(v for k, v in hstate.items() if k != "master"),
        "host_copies": by.get("host:keys", 0) + by.get("host:grads", 0),
        "staging": by.get("staging", 0),
        "other_tensors": by.get("other", 0),
        "rest_anon": (end["RssAnon"] - imp["RssAnon"]) - live,
        "rest_file": end["RssFile"] - imp["RssFile"] + end["RssShmem"] - imp["RssShmem"],
        "freed_kept": s[rk["last_step"]]["VmRSS"] - end["VmRSS"],
        "ctor": s["optimizer"]["VmRSS"] - s["grads"]["VmRSS"],
    })
    out["dynamo"] = out["dynamo_anon"] + out["dynamo_file"]
    out["counted"] = (out["weights"] + out["grads"] + out["masters"] + out["state"]
                      + out["host_masters"] + out["host_state"] + out["host_copies"]
                      + out["staging"])
    out["device"] = (out["weights"] + out["grads"] + out["masters"] + out["state"]
                     + out["staging"])
    out["remainder"] = out["resident"] - out["counted"] - out["dynamo"] - out["own_imports"]
    return out


PARTS = (("dynamo_anon", "torch._dynamo import, anonymous (Python modules)"),
         ("dynamo_file", "torch._dynamo import, file pages (libtriton.so, shared)"),
         ("own_imports", "the optimizer's own imports (package, native library)"),
         ("weights", "weights"), ("grads", "grads"), ("masters", "masters"),
         ("state", "optimizer state (exp_avg, exp_avg_sq, step)"),
         ("host_masters", "offload: masters of the host part"),
         ("host_state", "offload: optimizer state of the host part"),
         ("host_copies", "offload: the host part's param and grad copies"),
         ("staging", "offload: device staging of the copies"),
         ("other_tensors", "other live tensors"),
         ("rest_anon", "rest, anonymous (allocator, C++ buffers, Python objects)"),
         ("rest_file", "rest, file pages first touched after the imports"),
         ("resident", "= resident after the steps and malloc_trim"),
         ("freed_kept", "(freed by the steps, kept until malloc_trim)"),
         ("ctor", "(constructor: optimizer - grads)"))


def summarize(results: list, numel: int) -> tuple[list, list, list, list]:
    """Rows of the summary, the breakdown, the other-tensor listing; baseline notes."""
    summary, parts, listing, notes = [], [], [], []
    summarize.device = []
    for data in results:
        cfg, world = data["config"], data["world"]
        ranks = data["ranks"]
        br = [rank_breakdown(rk) for rk in ranks]
        mean = {k: statistics.fmean(b[k] for b in br) for k in br[0]}
        mx = {k: max(b[k] for b in br) for k in br[0]}
        notes.append(f"world {world}, {cfg}: {mean['init'] / 1e6:.1f} MB")
        if cfg == "bare":
            continue
        summary.append([
            world, cfg, ranks[0].get("sharding_used", "-"), f"{_formula(cfg, world):g}",
            f"{_bpp(mean['counted'], numel)} / {_bpp(mx['counted'], numel)}",
            f"{_bpp(mean['resident'], numel)} / {_bpp(mx['resident'], numel)}",
            _bpp(mean["resident"] - mean["counted"], numel), _bpp(mean["dynamo"], numel),
            _bpp(mean["own_imports"], numel), _bpp(mean["remainder"], numel),
            _bpp(mean["resident"] - mean["dynamo"], numel), _bpp(mean["pss"], numel)])
        for k, label in PARTS:
            parts.append([world, cfg, label, _mb(mean[k]), _bpp(mean[k], numel), _mb(mx[k])])
        summarize.device.append([
            world, cfg, str(OFFLOAD.get(cfg, False)), _bpp(mean["weights"], numel),
            _bpp(mean["grads"], numel),
            f"{_bpp(mean['masters'] + mean['state'], numel)} / "
            f"{_bpp(mx['masters'] + mx['state'], numel)}",
            _bpp(mean["staging"], numel),
            f"{_bpp(mean['device'], numel)} / {_bpp(mx['device'], numel)}",
            _bpp(mean["host_masters"] + mean["host_state"], numel),
            _bpp(mean["host_copies"], numel)])
        for rk in ranks:
            walk = rk.get("walk", {})
            for o in walk.get("other_top", []):
                listing.append([world, cfg, rk["rank"], f"{o['bytes'] / 1e6:.3f}", o["dtype"],
                                "x".join(map(str, o["shape"])) or "()", o["held_by"]])
            if walk.get("other_not_listed"):
                small = walk["by_kind"].get("other", 0) - sum(o["bytes"] for o in
                                                              walk.get("other_top", []))
                listing.append([world, cfg, rk["rank"], f"{small / 1e6:.3f}", "-",
                                f"{walk['other_not_listed']} smaller storages", "-"])
    return summary, parts, listing, notes


def _formula(cfg: str, world: int):
    _, dtype, master, _ = CONFIGS[cfg]
    if dtype == BF16 and master:
        return 4 + 12 / world
    if dtype == BF16:
        return 4 + 4 / world
    return 8 + 8 / world


def _spawn(world: int, opts: dict) -> dict:
    from bench_zero_step import _free_port

    fd, out = tempfile.mkstemp(prefix="resident_memory_", suffix=".json")
    os.close(fd)
    try:
        from common import spawned_rank
        mp.spawn(spawned_rank, args=(worker, world, dict(opts, port=_free_port()), out),
                 nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=type("F", (argparse.RawDescriptionHelpFormatter,
                                                            argparse.ArgumentDefaultsHelpFormatter),
                                                      {}))
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (gloo ranks)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--model", default="small", choices=sorted(model_shapes.GPT2),
                    help="GPT-2 shape set from model_shapes.py")
    ap.add_argument("--width-div", type=int, default=1,
                    help="divide the model width by this (16: a quick smoke run)")
    ap.add_argument("--sharding", default="auto", choices=["auto", "param", "flat"],
                    help="zero_ext's sharding mode")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps before the trim")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="MALLOC_MMAP_THRESHOLD_ in the ranks, bytes (0: unset)")
    ap.add_argument("--top", type=int, default=5,
                    help="list this many of the biggest other live tensors per rank")
    ap.add_argument("--min-list-bytes", type=int, default=1 << 16,
                    help="list other live tensors of at least this many bytes only")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores // world, at least 1)")
    ap.add_argument("--timeout", type=int, default=900, help="gloo timeout, seconds")
    ap.add_argument("--json", default="", help="also write the raw per-rank results here")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown --configs {bad}; choose from {','.join(CONFIGS)}")
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if any(CONFIGS[c][0] == "ours" for c in configs):
        from bench_zero_step import _ours_importable, _prebuild

        why = _ours_importable()
        if why is not None:
            print(f"zero_ext is not usable: {why}", file=sys.stderr)
            return 1
        note = _prebuild()
    else:
        note = "zero_ext not used"
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    shapes = model_shapes.gpt2_shapes(args.model, width_div=args.width_div)
    numel = sum(model_shapes.numel(s) for _, s in shapes)
    name = f"GPT-2 {args.model}" + (f" / {args.width_div} width" if args.width_div > 1 else "")
    cores = os.cpu_count() or 1
    print(f"# Resident memory per param per rank, {name}: {numel:,} params in {len(shapes)} "
          f"tensors; worlds {worlds} on gloo; zero_ext sharding {args.sharding!r}; "
          f"{args.steps} steps; MALLOC_MMAP_THRESHOLD_="
          f"{args.mmap_threshold or 'unset'}; torch {torch.__version__}, {cores} cores; "
          f"{note}", flush=True)
    results, t00 = [], time.perf_counter()
    for world in worlds:
        threads = args.threads or max(1, cores // world)
        for cfg in configs:
            t0 = time.perf_counter()
            data = _spawn(world, {"config": cfg, "threads": threads, "timeout": args.timeout,
                                  "model": args.model, "width_div": args.width_div,
                                  "sharding": args.sharding, "steps": max(1, args.steps),
                                  "top": args.top, "min_list_bytes": args.min_list_bytes})
            results.append(data)
            print(f"# world {world}, {cfg}: {time.perf_counter() - t0:.0f} s", flush=True)

    from common import print_table  # (imported here: the ranks do not need it)

    summary, parts, listing, notes = summarize(results, numel)
    print_table("Bytes per param per rank (all the model's params; mean / max over ranks). "
                "counted: weights + grads + optimizer state, from the tensors; resident: "
                "VmRSS after the steps + malloc_trim minus the same process after import "
                "torch + gloo init; resident - counted = torch._dynamo import + the "
                "optimizer's own imports + remainder; PSS: resident with shared pages split "
                "between the processes that map them:",
                ["world", "config", "sharding", "formula", "counted", "resident",
                 "resident - counted", "torch._dynamo import", "own imports", "remainder",
                 "resident ex. dynamo", "resident PSS"], summary)
    print_table("Device bytes per param per rank, counted from the tensors by where they "
                "would live on a GPU (all the model's params; mean / max over ranks): "
                "state + masters on the device, the offload's staging, the device total; "
                "host: state + masters, and the host part's param and grad copies:",
                ["world", "config", "offload", "weights", "grads", "state + masters (device)",
                 "staging", "device total", "host state + masters", "host copies"],
                summarize.device)
    print_table("Where each rank's resident memory goes (mean over ranks; the max rank's MB):",
                ["world", "config", "part", "MB", "bytes/param", "MB (max rank)"], parts)
    if listing:
        print_table("Other live tensors (not params, grads or optimizer state), per rank:",
                    ["world", "config", "rank", "MB", "dtype", "shape", "held by"], listing)
    print("\n# baseline (VmRSS after import torch + gloo init, gc + malloc_trim; mean over "
          "ranks): " + "; ".join(notes))
    print(f"\n# all done in {time.perf_counter() - t00:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": numel, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
