"""Host cost of a DDP iteration: the CPU time the training loop itself spends (Python, hooks,
collective calls), with compute made near zero so that it shows.

    python benchmarks/bench_host_cost.py                        # worlds 1 and 2, 148/500/1500 tensors
    python benchmarks/bench_host_cost.py --quick                # world 2, 148 tensors, 1 round
    python benchmarks/bench_host_cost.py --tensors 148 --worlds 2 --rounds 5

On a GPU the host is the bottleneck of a well-fed iteration: the kernels are queued faster
than Python issues them only while Python stays ahead. There, every microsecond a comm hook
spends per bucket (or per segment, or per param) shows in the iteration's time. On a CPU the
same work shows as process CPU time (wall time on 2 shared cores is at the mercy of other
jobs): this benchmark gives a model GPT-2 small's param layout at a tiny width, so compute
is near zero and the host work dominates.

The model: GPT-2 small's 148 tensors (token and position embeddings, per block two
LayerNorms, qkv, proj, fc and fc2 with biases, a final LayerNorm; the LM head tied to the
token embedding) at width 64, its vocabulary and context scaled by the same factor as the
width so that every tensor keeps its share of the bytes; DDP's ``bucket_cap_mb`` and
zero_ext's hook segment bytes are scaled by the model's bytes, so that DDP cuts it into as
many buckets as the real model gets (19 at 25 MB). ``--tensors 500`` and ``1500`` give each
block 8 or 29 experts (fc and fc2 with biases each: MoE-like, many small tensors).

Modes, each run in the same processes, interleaved in rounds (fresh model, optimizer and
DDP per mode and round; 3 warm-up iterations, then ``--iters`` timed):

  ddp               DDP + torch.optim.AdamW (DDP's C++ all-reduce, one per bucket)
  ddp+py_hook       DDP + torch's Python ``allreduce_hook`` (the floor of any Python hook)
  zero_ext          zero_ext even sharding, DDP's own all-reduce
  zero_ext+hook     + reduce_scatter_hook
  zero_ext+hook+ov  + overlap_param_gather=True

``--gpt2-cuda`` runs the real GPT-2 small instead (width 768, flash attention, bf16
autocast, 8 x 1024 tokens, DDP's default 25 MB buckets) on GPUs over NCCL, world 1 by
default (then no byte moves: every millisecond above DDP is host or kernel work of ours),
and times synchronised wall milliseconds per iteration (median of --iters).

It prints, per (world, tensors, mode): process CPU ms per iteration (median over rounds,
mean over ranks), the ratio to ``ddp`` and to ``ddp+py_hook`` measured in the same run, the
hook's collectives per iteration, and the max abs difference of the params from ``ddp``
after the timed iterations (parity: every mode trains the same model on the same batches).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repository root on sys.path)
from common import print_table, spawned_rank

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("ddp", "ddp+py_hook", "zero_ext", "zero_ext+hook", "zero_ext+hook+ov")
WIDTH = 64
REAL_WIDTH, REAL_VOCAB, REAL_CONTEXT, LAYERS = 768, 50257, 1024, 12
EXPERTS = {148: 1, 500: 8, 1500: 29}  # per block: 12 blocks x (8 + 4 E) + 4 tensors


class Block(torch.nn.Module):
    def __init__(self, d: int, experts: int, sdpa: bool = False):
        super().__init__()
        self.sdpa = sdpa
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc = torch.nn.ModuleList(torch.nn.Linear(d, 4 * d) for _ in range(experts))
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(4 * d, d) for _ in range(experts))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        if self.sdpa:  # (the real model on a GPU: causal flash attention, heads of 64)
            b, t, d = q.shape
            q, k, v = (z.view(b, t, d // 64, 64).transpose(1, 2) for z in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, d)
        else:
            # (sigmoid, not softmax: softmax is blind to the key bias, whose grad is then
            # pure rounding noise that Adam turns into lr-sized steps, hiding differences)
            y = torch.sigmoid(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5) @ v
        x = x + self.c_proj(y)
        h = self.ln_2(x)
        return x + sum(f2(torch.nn.functional.gelu(f(h))) for f, f2 in zip(self.fc, self.fc2))


class TinyGPT(torch.nn.Module):
    """GPT-2 small's param layout at width `d` (vocabulary and context scaled alike)."""

    def __init__(self, d: int = WIDTH, experts: int = 1, sdpa: bool = False):
        super().__init__()
        vocab = REAL_VOCAB * d // REAL_WIDTH
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(REAL_CONTEXT * d // REAL_WIDTH, d)
        self.h = torch.nn.ModuleList(Block(d, experts, sdpa) for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())


def _batch(rank: int, it: int, vocab: int, shape=(1, 8), device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randint(0, vocab, shape, generator=g).to(device)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


HP = dict(lr=1e-3, betas=(0.9, 0.95))


def _build(mode: str, experts: int, cap_mb: float, real: bool = False,
           device: torch.device = torch.device("cpu")):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = (TinyGPT(REAL_WIDTH, experts, sdpa=True) if real else TinyGPT(experts=experts))
    model = model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    if mode.startswith("ddp"):
        ddp = DDP(model, bucket_cap_mb=cap_mb, device_ids=ids)
        opt = torch.optim.AdamW(_groups(model), fused=device.type == "cuda", **HP)
        if mode == "ddp+py_hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, allreduce_hook)
        return model, ddp, opt
    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    opt = ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, sharding="even",
                                  overlap_param_gather=mode.endswith("+ov"), **HP)
    ddp = DDP(model, bucket_cap_mb=cap_mb, device_ids=ids)
    if "+hook" in mode:
        ddp.register_comm_hook(opt, reduce_scatter_hook)
    return model, ddp, opt


def _iteration(rank: int, it: int, model, ddp, opt, vocab: int, real: bool = False) -> None:
    if real:  # GPT-2 small as trained on a GPU: 8 x 1024 tokens, bf16 autocast
        with torch.autocast("cuda", torch.bfloat16):
            loss = ddp(_batch(rank, it, vocab, (8, REAL_CONTEXT), "cuda"))
    else:
        loss = ddp(_batch(rank, it, vocab))
    loss.backward()
    if isinstance(opt, torch.optim.AdamW):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


class _Counter:
    """Counts the collectives issued while it is on (wrapping torch.distributed's)."""

    NAMES = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "reduce_scatter_single",
             "broadcast", "all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.count, self.saved = 0, {}

    def __enter__(self):
        from zero_ext import sync
        from zero_ext.reduce_scatter import transport

        for mod in (dist, sync, transport):
            for name in self.NAMES:
                fn = getattr(mod, name, None)
                if fn is not None and (mod, name) not in self.saved:
                    self.saved[(mod, name)] = fn
                    setattr(mod, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for (mod, name), fn in self.saved.items():
            setattr(mod, name, fn)


def worker(rank: int, world: int, opts: dict) -> None:
    real = opts["real"]
    device = torch.device(f"cuda:{rank}") if real else torch.device("cpu")
    if real:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if real else "gloo", init_method=opts["init"], rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    from zero_ext.reduce_scatter import plan

    results = []
    segment_bytes = plan.SEGMENT_BYTES  # (the real model's: scaled below)
    for tensors in opts["tensors"]:
        experts = EXPERTS[tensors]
        # (the matrices' share of the bytes: they make GPT-2 small's buckets)
        scale = 1.0 if real else (WIDTH / REAL_WIDTH) ** 2
        vocab = REAL_VOCAB if real else TinyGPT(experts=1).wte.num_embeddings
        cap_mb = 25 * scale
        plan.SEGMENT_BYTES = max(1024, int(segment_bytes * scale))
        ref_params = None
        for rnd in range(opts["rounds"]):
            for mode in opts["modes"]:
                model, ddp, opt = _build(mode, experts, cap_mb, real, device)
                for it in range(3):
                    _iteration(rank, it, model, ddp, opt, vocab, real)
                if real:
                    with torch.autocast("cuda", torch.bfloat16):
                        loss = ddp(_batch(rank, 3, vocab, (8, REAL_CONTEXT), device))
                else:
                    loss = ddp(_batch(rank, 3, vocab))
                # one backward counted, not timed (not the forward: with the overlap the
                # last step's exchange runs during it, on the worker thread)
                with _Counter() as counter:
                    loss.backward()
                    collectives = counter.count
                opt.zero_grad(set_to_none=True)  # (dropped alike in every mode)
                dist.barrier()
                walls, c0 = [], time.process_time()
                for it in range(4, 4 + opts["iters"]):
                    w0 = time.perf_counter()
                    _iteration(rank, it, model, ddp, opt, vocab, real)
                    if real:
                        torch.cuda.synchronize()
                    walls.append(time.perf_counter() - w0)
                if hasattr(opt, "wait_for_params"):
                    opt.wait_for_params()
                cpu = (time.process_time() - c0) / opts["iters"]
                params = [p.detach().float().cpu() for p in model.parameters()]
                if mode == "ddp":
                    ref_params = params
                diff = (max((a - b).abs().max().item() for a, b in zip(params, ref_params))
                        if ref_params is not None else float("nan"))
                buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
                results.append(dict(tensors=tensors, mode=mode, round=rnd, cpu=cpu,
                                    wall=statistics.median(walls), diff=diff,
                                    collectives=collectives, buckets=buckets,
                                    n=sum(1 for _ in model.parameters())))
                del model, ddp, opt, params
                dist.barrier()
    out = [None] * world
    dist.all_gather_object(out, results)
    if rank == 0:
        _report(world, out, opts)


def _report(world: int, per_rank: list, opts: dict) -> None:
    """Per mode: the median over rounds of the mean over ranks of what is timed (process
    CPU on the CPU; synchronised wall time per iteration on a GPU), and its ratios."""
    what = "wall" if opts["real"] else "cpu"
    rows = []
    for tensors in opts["tensors"]:
        t = {}
        for mode in opts["modes"]:
            rounds = []
            for rnd in range(opts["rounds"]):
                entries = [r for res in per_rank for r in res
                           if r["tensors"] == tensors and r["mode"] == mode and r["round"] == rnd]
                rounds.append(statistics.mean(e[what] for e in entries))
            t[mode] = statistics.median(rounds)
        for mode in opts["modes"]:
            entries = [r for res in per_rank for r in res
                       if r["tensors"] == tensors and r["mode"] == mode]
            first = entries[0]
            rows.append([world, first["n"], mode, first["buckets"], first["collectives"],
                         f"{t[mode] * 1e3:.2f}",
                         f"{t[mode] / t['ddp']:.2f}" if "ddp" in t else "-",
                         f"{t[mode] / t['ddp+py_hook']:.2f}" if "ddp+py_hook" in t else "-",
                         f"{max(e['diff'] for e in entries):.1e}"])
    title = (f"GPT-2 small on {torch.cuda.get_device_name()} (NCCL, bf16 autocast, 8 x 1024 "
             f"tokens), world {world}: ms per iteration (synchronised), median of "
             f"{opts['rounds']} rounds of the median of {opts['iters']} iterations"
             if opts["real"] else
             f"Host cost, world {world} (gloo, 1 thread per rank): process CPU ms per "
             f"iteration, median of {opts['rounds']} rounds of {opts['iters']} iterations")
    print_table(title, ["world", "tensors", "mode", "DDP buckets", "collectives / backward",
                        f"{'ms' if opts['real'] else 'CPU ms'} / it", "x ddp",
                        "x ddp+py_hook", "max abs diff vs ddp"], rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--tensors", default="148,500,1500")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="world 2, 148 tensors, 1 round")
    ap.add_argument("--gpt2-cuda", action="store_true",
                    help="the real GPT-2 small on GPUs (NCCL, world 1 unless --worlds)")
    args = ap.parse_args(argv)
    if args.quick:
        args.worlds, args.tensors, args.rounds, args.iters = "2", "148", 1, 5
    if args.gpt2_cuda:
        if not torch.cuda.is_available():
            ap.error("--gpt2-cuda needs a GPU")
        if "--worlds" not in (argv or sys.argv):
            args.worlds = "1"
        args.tensors = "148"
    tensors = [int(t) for t in args.tensors.split(",")]
    for t in tensors:
        if t not in EXPERTS:
            ap.error(f"--tensors takes {sorted(EXPERTS)}, got {t}")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {MODES}")
    for world in [int(w) for w in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            opts = dict(init=f"file://{os.path.join(tmp, 'store')}", tensors=tensors,
                        modes=modes, rounds=args.rounds, iters=args.iters,
                        real=args.gpt2_cuda)
            mp.spawn(spawned_rank, args=(worker, world, opts), nprocs=world, join=True)


if __name__ == "__main__":
    sys.exit(main())
