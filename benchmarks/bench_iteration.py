"""A whole training iteration (forward + DDP backward + clip + step) per ZeRO mode, on gloo,
with the bytes each rank sends counted.

    python benchmarks/bench_iteration.py                         # world 2, MLP and GPT-2
    python benchmarks/bench_iteration.py --world 2,3,4 --model mlp
    python benchmarks/bench_iteration.py --quick --model mlp     # smoke run, tiny sizes
    python benchmarks/bench_iteration.py --world 4 --model mlp512 --sharding param,flat,even \
        --modes ddp,torch_zero,zero_ext,zero_ext_rs --iters 3     # issue 24's critical path

On a simulated cluster (netlab.sh W RATE_MBIT CMD: W ranks, each in its own network
namespace behind a link rate-limited both ways; root), every process is one rank, with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (init_method env://,
--launcher env, picked automatically when those are set); rank 0 prints the tables:

    netlab.sh 4 400 python benchmarks/bench_iteration.py --model mlp512 \
        --sharding param,flat,even --modes ddp,torch_zero,zero_ext,zero_ext_rs --out t.md

Modes (every one on its own copy of the same seeded model, wrapped in torch's DDP with its
defaults but bucket_cap_mb, AdamW lr 6e-4, betas (0.9, 0.95), nanoGPT's two groups: 2-D weights decay 0.1):
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
  fsdp2          on request (--modes): torch's FSDP2, no DDP: fully_shard on every Linear
                 (MLP) / block (GPT), then the root, over init_device_mesh("cpu", (W,)),
                 reshard_after_forward=False (ZeRO-2-like: each unit's params all-gathered
                 once, in forward; grads reduce-scattered in backward); AdamW fused=True
                 over the DTensor shards, the same groups; clip with torch's
                 clip_grad_norm_ over the DTensor grads (one scalar all-reduce)
  fsdp2_reshard  fsdp2 with reshard_after_forward=True (ZeRO-3-like: the params gathered
                 again in backward)
  zero_ext_overlap_gather  on request (--modes): zero_ext (DDP's all-reduce) built with
                 overlap_param_gather=True: step() returns with the params' all-gathers in
                 flight and each module's forward waits for its own params
  zero_ext_rs_overlap  on request (--modes): zero_ext_rs (the reduce-scatter hook) with
                 overlap_param_gather=True
                 (both: skipped with a note where this zero_ext has no such option, i.e. its
                 constructor raises TypeError)
  zero_ext_offload, zero_ext_rs_offload, zero_ext_rs_overlap_offload  on request (--modes):
                 zero_ext, zero_ext_rs, zero_ext_rs_overlap built with
                 offload_optimizer=--offload-fraction (default 1: the whole share's state and
                 step on the host; here the "device" is the CPU too, so this times the
                 copies and the host step's placement, not a PCIe link)
--layouts job,hybrid runs every zero_ext mode also with its optimizer over this node's shard
group (zero_ext.hybrid_groups(): LOCAL_WORLD_SIZE ranks, as torchrun or netlab's
NETLAB_NODE_SIZE set it; DDP over the job), labelled "(even@hybrid)".
The zero_ext modes run once per --sharding ("flat,even" by default; any of param, flat,
even; a sharding this zero_ext lacks is left out with a note). "even" has no bucket views
(zero_ext refuses parameters_as_bucket_view=True there): a mode that zero_ext refuses with
bucket views is built without them; a combination it refuses outright (the same error on
every rank) is skipped with a note.

Models: "mlp", 8 x Linear(2048, 2048) with ReLU between (33.6M params), batch 16, loss the
mean square of the output; "mlp512", 8 x Linear(512, 512) (2.1M params), batch 16, with
DDP's bucket_cap_mb 1 so that each Linear is one of 8 DDP buckets (--bucket-cap-mb sets it
for every model; torch's 25 otherwise); "gpt2", GPT-2 small's shapes (benchmarks/model_shapes.py: width 768,
12 heads, vocab 50257, tied head, HF's (in, out) weight layout) at --gpt-layers depth (default
4, 67.7M params; 12 is the full 124M, which needs --sequential to fit 24 GB at world 2),
--gpt-batch x --gpt-seq random tokens, cross-entropy.

Compute stand-in (--compute-ms C, default 0: off): on CPU the layers' own math is tiny next
to a link's time, unlike on a GPU, where backward's compute is what DDP's buckets overlap
with. With C > 0 every layer (mlp, mlp512: every Linear; gpt2: every block) ends in a
parameterless module whose forward sleeps C ms and whose backward sleeps 2C ms (an
autograd.Function passing the tensor / the grad through): time.sleep releases the GIL and
leaves the host free, as GPU kernels do, so gloo's threads and DDP's hooks progress
meanwhile. It is part of the model, so inside DDP (and inside each FSDP2 unit, which is the
Linear / block it ends): every mode pays the same 8C ms forward + 16C ms backward on the
MLPs. The byte counting below runs without it (bytes do not depend on it).

Timing: all modes alive in the same processes; each round runs one iteration of every mode,
in an order rotated every round, after a barrier, so noise from other work hits all modes
alike (--sequential: one mode after the other, less memory). Per iteration the slowest
rank's time counts; the table gives the median over --iters. "x baseline" is the ratio to
ddp's median in the same run. Where the time goes (median of the slowest rank per phase):
forward, backward (for zero_ext_overlap it holds the step and the exchange), clip + step,
the exchange of the updated params inside it (torch_zero: its _sync_params;
zero_ext modes: opt.last_step_timings["comm"], which on gloo with bucket views also
holds the sends overlapped with the local step; zero_ext_overlap: the exchange after the
last bucket), and "param wait": the time the forward spent waiting for the previous step's
params exchange (part of forward): opt.last_step_timings.get("param_wait", 0.0) read after
the forward, for the modes built with overlap_param_gather=True; 0 for every other mode,
whose step finishes its exchange (FSDP2's all-gathers are its forward's own, not a previous
step's: in forward, not here). A per-rank table gives each rank's own medians of these
phases (rank x mode).

Chains (--chain N): a mode whose step leaves the params' gathers in flight can only show
the overlap when its next iteration follows at once, so each mode's turn in a round is N
back-to-back iterations, a barrier before the first only; the first (which starts with
nothing in flight) is untimed when N > 1, the others timed. N is 1 (as above: every
iteration after a barrier) unless an overlap_param_gather mode is requested (then 2, for
every mode alike, so that all take the same steps); --chain sets it. At the end of its turn
(untimed) such a mode waits for its last step's gathers (opt.wait_for_params(); without it,
one forward without grad), so that none is in flight during another mode's turn (they may
run on process groups of their own, which the barrier does not wait for) or when the final
params are read.

"max abs diff vs ddp": the largest param difference to ddp's after the same iterations
(torch_zero, zero_ext, zero_ext_rs take the same steps on the same batches), a sanity check,
not a tolerance test (tests/ hold those): zero_ext's fused AdamW rounds differently from
torch's in the last bit of some elements, and Adam turns such differences into visible
ones where grads are below its eps, as in this MLP (grads ~1e-9: torch's fused AdamW
against itself with 1-ulp nudges of 30% of the weights after step 1 differs by 1.6e-5
two steps later; 2.0e-4 after the --quick run on an AVX2 machine, where zero_ext's kernel
and torch's single-tensor AdamW differ by 9.5e-7 after 3 steps on N(0, 1) params). The
JSON also has "diff_to_zero_ext": the difference to the first zero_ext mode's params,
which every zero_ext mode (hook or not, any sharding) must match: one kernel on the same
averaged grads.

Bytes: after the timing, one extra untimed iteration per mode runs with torch.distributed's
Python collectives wrapped (common.CollectiveTrace), every call converted to the bytes each
rank's link sends and receives under gloo's algorithms (all_reduce ring 2(W-1)/W n each way;
broadcast straight from the root to every rank: the root sends (W-1) n, every other rank
receives n; all_gather_into_tensor ring (W-1) n_in each way; reduce_scatter_tensor ring
(W-1)/W n_in; all_to_all_single what the split sizes send to and receive from other ranks;
point-to-point one way, a batch_isend_irecv one record), with the phase that issued it.
DDP's built-in all-reduce runs in C++ and is not seen, so the modes that use it (ddp,
torch_zero, zero_ext) are counted on a fresh copy (same model, same warm-up) with torch's
Python allreduce_hook registered, which issues the same all-reduce of the same buckets
through dist.all_reduce. "MB sent/rank" is the mean over ranks (MB = 1e6 bytes; the same as
the ring model's mean: a broadcast's (W-1) n from one root is (W-1)/W n per rank), "x DDP
bytes" the ratio to ddp's.

FSDP2 issues its all-gathers and reduce-scatters through dist.all_gather_single /
dist.reduce_scatter_single (counted like all_gather_into_tensor / reduce_scatter_tensor),
and DTensor's clip its all-reduce through the functional collectives (counted as
"funcol.<name>"); the FSDP2 modes' traces are checked against the process group's own count
of collectives run (common.CheckedCollectiveTrace), and where some went unseen their bytes
and critical path read "n/a". The FSDP2 modes' "exchange" is in forward (the all-gathers),
not in the step; fsdp2_reshard's "grads" below also hold backward's re-gather of the params.

Critical path: a collective lasts as long as its busiest rank's link (full duplex), so the
critical path of the counted iteration is the sum over its collectives, in issue order, of
the busiest rank's max(sent, received). The last table gives it, and the mean bytes per rank,
in units of DDP's ring all-reduce of the grads (2(W-1)/W x the fp32 model), for the grads'
exchange (what backward issued: DDP's all-reduce, the hook's exchange; with the overlap mode
also its step) and for grads + params (the whole iteration: with clip's norm, the step's
agreement and the params' exchange). Gloo's reduce_scatter_tensor is counted as a ring
reduce-scatter, whatever gloo runs for it.

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
from common import (CheckedCollectiveTrace, CollectiveTrace, critical_path,  # noqa: E402
                    exit_without_teardown, print_table, spawned_rank)

MODES = ("ddp", "torch_zero", "zero_ext", "zero_ext_rs", "zero_ext_overlap")  # the default
FSDP2_MODES = ("fsdp2", "fsdp2_reshard")  # on request (--modes): torch's fully_shard
# on request (--modes): ZeroRedundancyOptimizer(..., overlap_param_gather=True), where it exists
GATHER_OVERLAP_MODES = ("zero_ext_overlap_gather", "zero_ext_rs_overlap",
                        "zero_ext_rs_overlap_offload")
# on request (--modes): offload_optimizer (--offload-fraction) on zero_ext's modes
OFFLOAD_MODES = ("zero_ext_offload", "zero_ext_rs_offload", "zero_ext_rs_overlap_offload")
ALL_MODES = tuple(dict.fromkeys(MODES + FSDP2_MODES + GATHER_OVERLAP_MODES + OFFLOAD_MODES))
ZERO_EXT_MODES = tuple(dict.fromkeys(("zero_ext", "zero_ext_rs", "zero_ext_overlap")
                                     + GATHER_OVERLAP_MODES + OFFLOAD_MODES))
RS_HOOK_MODES = ("zero_ext_rs", "zero_ext_rs_overlap", "zero_ext_rs_offload",
                 "zero_ext_rs_overlap_offload")  # DDP + reduce_scatter_hook
# DDP's C++ all-reduce when timed
BUILTIN_ALLREDUCE = ("ddp", "torch_zero", "zero_ext", "zero_ext_overlap_gather",
                     "zero_ext_offload")
PHASES = ("forward", "backward", "step", "param_wait", "total")  # the per-rank table's
OVERLAP_WARMUP = 2  # torch's: DDP finalises its buckets, no update
MAX_NORM = 1.0
TABLE_HEADERS = ["mode", "ms/iter (median)", "x baseline", "MB sent/rank", "x DDP bytes"]
CRITICAL_HEADERS = ["mode", "grads: critical path", "grads: mean bytes",
                    "grads+params: critical path", "grads+params: mean bytes",
                    "busiest collectives (grads+params)"]
SHARDINGS = ("param", "flat", "even")
GRADS_PHASES = ("backward",)  # DDP's all-reduce or the hook's exchange, issued in backward
MODEL_NAMES = ("mlp", "mlp512", "gpt2")
DEFAULT_BUCKET_CAP_MB = {"mlp512": 1.0}  # 8 DDP buckets: one Linear(512) each; else torch's 25


def mode_of(label: str) -> str:
    """The mode of a table label ("zero_ext_rs (even)" -> "zero_ext_rs")."""
    return label.split(" (")[0]


def available_shardings() -> tuple:
    """The sharding modes this zero_ext accepts (e.g. no "even" before it exists)."""
    try:
        from zero_ext.zero import SHARDING_MODES
    except Exception:  # pragma: no cover - an unimportable zero_ext fails later, loudly
        return ("param", "flat")
    return tuple(m for m in SHARDING_MODES if m != "auto")


# ----------------------------------------------------------------------------- models
class _ComputeFn(torch.autograd.Function):
    """The identity, with a GPU kernel's wall time: forward sleeps `seconds`, backward
    2 x `seconds` (time.sleep releases the GIL: the host is free meanwhile)."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        time.sleep(seconds)
        # a new tensor, as a kernel's output (a view of the input would make FSDP2 warn)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Compute(torch.nn.Module):
    """A layer's compute stand-in (--compute-ms): no parameters; the identity when ms is 0."""

    def __init__(self, ms: float = 0.0):
        super().__init__()
        self.ms = float(ms)

    def forward(self, x):
        return _ComputeFn.apply(x, self.ms / 1e3) if self.ms > 0 else x

    def extra_repr(self) -> str:
        return f"forward {self.ms:g} ms, backward {2 * self.ms:g} ms"


class Linear(torch.nn.Linear):
    """torch's Linear ending in its Compute stand-in (the same params, names and init; the
    stand-in inside the module, so inside its FSDP2 unit)."""

    def __init__(self, n_in: int, n_out: int, compute_ms: float = 0.0):
        super().__init__(n_in, n_out)
        self.compute = Compute(compute_ms)

    def forward(self, x):
        return self.compute(super().forward(x))


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
    def __init__(self, d: int, heads: int, compute_ms: float = 0.0):
        super().__init__()
        self.heads = heads
        self.compute = Compute(compute_ms)  # the block's compute stand-in (no params)
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
        return self.compute(x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)))))


class GPT(torch.nn.Module):
    """GPT-2's parameters in HF's order and shapes (tied LM head), at `layers` depth."""

    def __init__(self, d: int, layers: int, vocab: int, context: int, compute_ms: float = 0.0):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(context, d)
        torch.nn.init.normal_(self.wte.weight, std=0.02)
        torch.nn.init.normal_(self.wpe.weight, std=0.01)
        self.h = torch.nn.ModuleList(Block(d, max(1, d // 64), compute_ms)
                                     for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, batch):
        idx, targets = batch
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int, compute_ms: float = 0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(Linear(width, width, compute_ms)
                                          for _ in range(depth))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x.square().mean()


def model_spec(name: str, opts: dict) -> dict:
    """What the workers build: sizes of `name` (quick: tiny), and the compute stand-in's
    forward ms per layer (backward: twice that)."""
    compute = {"compute_ms": float(opts.get("compute_ms", 0.0))}
    if name == "mlp":
        width, depth, batch = (256, 8, 4) if opts["quick"] else (2048, 8, 16)
        return {"name": name, "width": width, "depth": depth, "batch": batch, **compute}
    if name == "mlp512":  # issue 24's cluster model: 2.1M params, 8 DDP buckets at 1 MB
        return {"name": name, "width": 512, "depth": 8, "batch": 16, **compute}
    if name == "gpt2":
        d, _ = model_shapes.GPT2["small"]
        width_div, layers = (16, 2) if opts["quick"] else (1, opts["gpt_layers"])
        return {"name": name, "d": d // width_div, "layers": layers,
                "vocab": model_shapes.VOCAB if not opts["quick"] else 4096,
                "context": model_shapes.CONTEXT, "batch": opts["gpt_batch"],
                "seq": 16 if opts["quick"] else opts["gpt_seq"], "width_div": width_div,
                **compute}
    raise ValueError(f"unknown model {name!r}: mlp or gpt2")


def compute_layers(spec: dict) -> int:
    """How many compute stand-ins the model has: its Linears (MLPs) or blocks (GPT)."""
    return spec["depth"] if spec["name"] in ("mlp", "mlp512") else spec["layers"]


def build_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(0)  # every mode and every rank: the same weights
    compute_ms = spec.get("compute_ms", 0.0)
    if spec["name"] in ("mlp", "mlp512"):
        return MLP(spec["width"], spec["depth"], compute_ms)
    model = GPT(spec["d"], spec["layers"], spec["vocab"], spec["context"], compute_ms)
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
    if spec["name"] in ("mlp", "mlp512"):
        return [torch.randn(spec["batch"], spec["width"], generator=g) for _ in range(n)]
    shape = (spec["batch"], spec["seq"])
    return [(torch.randint(spec["vocab"], shape, generator=g),
             torch.randint(spec["vocab"], shape, generator=g)) for _ in range(n)]


def param_groups(model) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- modes
_MESH = {}


def cpu_mesh():
    """FSDP2's 1-D device mesh over the whole (gloo, CPU) world, built once per process."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


def fsdp2_units(model) -> list:
    """The modules that get their own fully_shard (one all-gather / reduce-scatter group
    each) before the root: every Linear of the MLP, every block of the GPT."""
    return list(model.layers) if isinstance(model, MLP) else list(model.h)


class Runner:
    """One mode: its DDP model, optimizer, hooks, and an iteration that records phases."""

    def __init__(self, mode: str, sharding: str, spec: dict, python_allreduce: bool,
                 bucket_cap_mb: float = 25.0):
        if mode in FSDP2_MODES:
            self._init_fsdp2(mode, spec)
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
        from torch.nn.parallel import DistributedDataParallel as DDP

        from zero_ext import ZeroRedundancyOptimizer
        from zero_ext.ddp_zero_hook import hook_with_zero_step, reduce_scatter_hook

        self.mode, self.sharding = mode, sharding
        self.overlap_gather = mode in GATHER_OVERLAP_MODES
        self.ddp = DDP(build_model(spec), bucket_cap_mb=bucket_cap_mb)
        self.bucket_view = mode in ZERO_EXT_MODES
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
            # (a zero_ext without the option: TypeError, and build_runner skips the mode)
            gather = {"overlap_param_gather": True} if self.overlap_gather else {}
            if mode in OFFLOAD_MODES:
                gather["offload_optimizer"] = Runner.offload_fraction
            # "even@hybrid": the optimizer over this node's shard group (hybrid_groups()),
            # DDP over the job
            shard_mode, _, layout = sharding.partition("@")
            group = hybrid_shard_group() if layout == "hybrid" else None

            def build(view: bool):
                return ZeroRedundancyOptimizer(
                    groups, torch.optim.AdamW, parameters_as_bucket_view=view,
                    sharding=shard_mode, overlap_with_ddp=mode == "zero_ext_overlap",
                    process_group=group, **gather, **hp)
            try:
                self.opt = build(True)
            except ValueError as exc:  # a mode without bucket views ("even": in the params)
                if "parameters_as_bucket_view" not in str(exc):
                    raise
                self.bucket_view = False
                self.opt = build(False)
        if mode in RS_HOOK_MODES:
            self.ddp.register_comm_hook(self.opt, reduce_scatter_hook)
        elif mode == "zero_ext_overlap":
            replicas = self.opt._replicas
            replicas.sync = self._timed(replicas.sync)
            self.ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.ddp,
                                                                  self.opt))
        elif python_allreduce:  # counting: DDP's all-reduce, issued from Python
            self.ddp.register_comm_hook(None, allreduce_hook)

    offload_fraction = 1.0  # (--offload-fraction: set in every rank before the runners)

    def _init_fsdp2(self, mode: str, spec: dict) -> None:
        """torch's FSDP2: fully_shard on every unit, then the root, over the CPU mesh;
        reshard_after_forward False (fsdp2: the params stay gathered from forward to
        backward, ZeRO-2-like) or True (fsdp2_reshard: gathered again in backward,
        ZeRO-3-like); AdamW fused=True over the DTensor shards (it runs on CPU DTensors)."""
        from torch.distributed.fsdp import fully_shard

        self.mode, self.sharding = mode, "-"
        self.overlap_gather = False
        self.exchange_s = 0.0
        self.bucket_view = False
        model = build_model(spec)
        kw = dict(mesh=cpu_mesh(), reshard_after_forward=mode == "fsdp2_reshard")
        for unit in fsdp2_units(model):
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        self.ddp = model  # what iteration() calls: the fully sharded model
        self.opt = torch.optim.AdamW(param_groups(model), fused=True, lr=LR, betas=BETAS,
                                     eps=EPS)

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

    def iteration(self, batch, trace: CollectiveTrace | None = None) -> dict:
        def phase(name: str) -> None:
            if trace is not None:
                trace.phase = name

        self.exchange_s = 0.0
        phase("forward")
        t0 = time.perf_counter()
        loss = self.ddp(batch)
        t1 = time.perf_counter()
        # the forward's wait for the previous step's params (in flight only with
        # overlap_param_gather; a missing key: none)
        param_wait = (float(self.opt.last_step_timings.get("param_wait", 0.0))
                      if self.overlap_gather else 0.0)
        phase("backward")
        loss.backward()
        t2 = time.perf_counter()
        if self.mode != "zero_ext_overlap":  # the overlap mode stepped inside backward
            phase("clip")
            if self.mode in ("ddp", "torch_zero") + FSDP2_MODES:  # FSDP2: over DTensors
                torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), MAX_NORM)
            else:
                self.opt.clip_grad_norm_(MAX_NORM)
            phase("step")
            self.opt.step()
            if self.mode in ZERO_EXT_MODES:
                self.exchange_s = self.opt.last_step_timings.get("comm", 0.0)
        phase("step")
        self.opt.zero_grad(set_to_none=True)
        phase("")
        t3 = time.perf_counter()
        return {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2,
                "exchange": self.exchange_s, "param_wait": param_wait}

    def settle(self, batch) -> None:
        """Let the last step's params arrive (untimed): with overlap_param_gather its
        gathers may be in flight, possibly on process groups of their own, which the next
        turn's barrier does not wait for: opt.wait_for_params() (or, in a zero_ext without
        it, one forward without grad: each module's forward waits for its params). Every
        other mode's step finished its exchange."""
        if not self.overlap_gather:
            return
        wait = getattr(self.opt, "wait_for_params", None)
        if callable(wait):
            wait()
            return
        with torch.no_grad():
            self.ddp(batch)

    def warmup_iterations(self, extra: int) -> int:
        return extra + (OVERLAP_WARMUP if self.mode == "zero_ext_overlap" else 0)

    def params(self) -> list[torch.Tensor]:
        if self.mode in FSDP2_MODES:  # the full params (an all-gather each, on every rank)
            return [p.detach().full_tensor() for p in self.ddp.parameters()]
        return [p.detach() for p in self.ddp.module.parameters()]


# ----------------------------------------------------------------------------- worker
_HYBRID: dict = {}


def hybrid_shard_group():
    """This rank's shard group of zero_ext.hybrid_groups() (one per node: torchrun's, or
    netlab's NETLAB_NODE_SIZE, LOCAL_WORLD_SIZE), made once per world (every rank makes it
    at the same point: the first hybrid case, built in the same order everywhere)."""
    from zero_ext import hybrid_groups

    world = dist.get_world_size()
    if world not in _HYBRID:
        _HYBRID[world] = hybrid_groups()[0]
    return _HYBRID[world]


def _cases(opts) -> list[tuple[str, str]]:
    out = []
    for mode in opts["modes"]:
        for sharding in (opts["shardings"] if mode in ZERO_EXT_MODES else ["-"]):
            for layout in (opts.get("layouts") or ["job"]) if mode in ZERO_EXT_MODES \
                    else ["job"]:
                out.append((mode, sharding if layout == "job" else f"{sharding}@{layout}"))
    return out


def build_runner(mode: str, sharding: str, spec: dict, opts: dict,
                 python_allreduce: bool) -> Runner | None:
    """The mode's Runner, or None (said once, by rank 0) where zero_ext refuses the
    combination: its checks agree across ranks, so every rank raises and skips alike."""
    try:
        return Runner(mode, sharding, spec, python_allreduce=python_allreduce,
                      bucket_cap_mb=opts["bucket_cap_mb"][spec["name"]])
    except (ValueError, TypeError, NotImplementedError) as exc:
        if dist.get_rank() == 0:
            why = ("this zero_ext has no overlap_param_gather; "
                   if mode in GATHER_OVERLAP_MODES and isinstance(exc, TypeError)
                   and "overlap_param_gather" in str(exc) else "")
            print(f"# skipped {mode} ({sharding}): {why}{type(exc).__name__}: {exc}",
                  flush=True)
        return None


def chain_length(opts: dict) -> int:
    """Iterations per mode per round (--chain; 0: 2 when an overlap_param_gather mode is
    requested, so that its next forward meets its step's gathers in flight, else 1)."""
    if opts.get("chain"):
        return opts["chain"]
    return 2 if any(m in GATHER_OVERLAP_MODES for m in opts["modes"]) else 1


def time_modes(cases, spec, batches, opts) -> dict:
    """{label: {"phases": [per-iteration dict], "final": params}} after warm-up + iters.

    Each mode's turn in a round is a chain of back-to-back iterations after one barrier
    (chain_length: 1 unless an overlap_param_gather mode is requested); with chains of
    N > 1 the first of each is untimed (nothing in flight at its start), the rest timed."""
    chain = chain_length(opts)
    per_round = max(1, chain - 1)  # timed iterations per chain
    timed_rounds = -(-opts["iters"] // per_round)
    steps: dict = {}

    def warm_rounds(r: Runner) -> int:  # at least the mode's warm-up iterations
        return -(-r.warmup_iterations(opts["warmup"]) // chain)

    def run_chain(r: Runner, timed: bool, record: dict) -> None:
        dist.barrier()
        for j in range(chain):
            n = steps.get(id(r), 0)
            ph = r.iteration(batches[n % len(batches)])
            steps[id(r)] = n + 1
            if timed and (chain == 1 or j > 0):
                phases = record.setdefault(r.label, {"phases": []})["phases"]
                if len(phases) < opts["iters"]:
                    phases.append(ph)
        r.settle(batches[0])  # nothing of this mode in flight during the next one's turn

    record: dict = {}
    if opts["sequential"]:
        for mode, sharding in cases:
            r = build_runner(mode, sharding, spec, opts, python_allreduce=False)
            if r is None:
                continue
            w = warm_rounds(r)
            for i in range(w + timed_rounds):
                run_chain(r, i >= w, record)
            r.settle(batches[0])
            record[r.label]["final"] = [p.clone() for p in r.params()]
            del r
            gc.collect()
        return record
    runners = [build_runner(mode, sharding, spec, opts, python_allreduce=False)
               for mode, sharding in cases]
    runners = [r for r in runners if r is not None]
    if not runners:
        return record
    rounds = max(warm_rounds(r) for r in runners) + timed_rounds
    for i in range(rounds):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            w = warm_rounds(r)
            # the overlap mode warms up longer: it starts earlier, so that every mode's timed
            # iterations fall in the same rounds
            first = rounds - (w + timed_rounds)
            if i >= first:
                run_chain(r, i - first >= w, record)
    for r in runners:
        r.settle(batches[0])
        record[r.label]["final"] = [p.clone() for p in r.params()]
    record = {r.label: record[r.label] for r in runners}  # in the order of the modes
    del runners
    gc.collect()
    return record


def count_bytes(cases, spec, batches, opts) -> dict:
    """{label: {"bytes": sent, "calls": {name: [calls, bytes sent]}, "trace": records}}: one
    traced iteration per mode (common.CollectiveTrace: this rank's link bytes per
    collective, in issue order, with the phase that issued it), after the same warm-up as
    the timed runs, on a fresh copy whose DDP all-reduce runs from Python (torch's
    allreduce_hook) for the modes that use DDP's own."""
    out = {}
    for mode, sharding in cases:
        r = build_runner(mode, sharding, spec, opts,
                         python_allreduce=mode in BUILTIN_ALLREDUCE)
        if r is None:
            continue
        # 2 warm-up iterations: DDP rebuilds its buckets after the first one
        w = r.warmup_iterations(2)
        for i in range(w):
            r.iteration(batches[i % len(batches)])
        r.settle(batches[0])  # the warm-up's gathers: not in the traced iteration
        dist.barrier()
        checked = mode in FSDP2_MODES  # their trace holds tensor collectives only: exact
        with (CheckedCollectiveTrace() if checked else CollectiveTrace()) as tr:
            r.iteration(batches[w % len(batches)], trace=tr)
            # overlap_param_gather: the step's gathers, issued (by a worker thread) while
            # the trace is open, counted as the step's
            tr.phase = "step"
            r.settle(batches[0])
            tr.phase = ""
        calls: dict = {}
        for _key, name, _phase, sent, _recv in tr.records:
            c = calls.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += sent
        out[r.label] = {"bytes": sum(c[1] for c in calls.values()), "calls": calls,
                        "trace": tr.records,
                        # collectives the trace did not see (None: not checked)
                        "missed": sum(tr.missed.values()) if checked else None}
        del r
        gc.collect()
    return out


def init_from_env(opts: dict) -> tuple[int, int]:
    """A rank started by a launcher (netlab.sh, torchrun): RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT (and GLOO_SOCKET_IFNAME) from the environment, init_method env://."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    torch.set_num_threads(opts["threads"])
    Runner.offload_fraction = opts.get("offload_fraction", 1.0)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=opts["timeout"]))
    return dist.get_rank(), dist.get_world_size()


def run(rank: int, world: int, opts: dict, out_path: str) -> None:
    if opts["env"]:
        rank, world = init_from_env(opts)
    else:
        init_rank(rank, world, opts)
    try:
        import torch.distributed.optim  # noqa: F401  (slow first import: not an iteration)

        import zero_ext

        if opts["env"] and rank != 0:
            dist.barrier()  # rank 0 builds / loads the native ops first (one JIT build)
        zero_ext.load_native()
        if opts["env"] and rank == 0:
            dist.barrier()
        results = {}
        for name in opts["models"]:
            spec = model_spec(name, opts)
            batches = make_batches(spec, rank)
            cases = _cases(opts)
            timed = time_modes(cases, spec, batches, opts)
            ref = timed.get("ddp", {}).get("final")
            # (zero_ext's first mode: the others step with the same kernel, so the same)
            # (every zero_ext mode but zero_ext_overlap, whose first 2 iterations do not step)
            same_steps = [label for label in timed if mode_of(label) != "zero_ext_overlap"]
            ours = next((timed[label]["final"] for label in same_steps
                         if mode_of(label) in ZERO_EXT_MODES), None)
            for label, rec in timed.items():
                final = rec.pop("final")
                # these modes took the same steps on the same batches: they must agree
                if ref is not None and label in same_steps:
                    rec["max_abs_diff"] = max((a - b).abs().max().item()
                                              for a, b in zip(final, ref))
                if ours is not None and label in same_steps and \
                        mode_of(label) in ZERO_EXT_MODES:
                    rec["diff_to_zero_ext"] = max((a - b).abs().max().item()
                                                  for a, b in zip(final, ours))
            del ref, ours
            gc.collect()
            # bytes do not depend on the compute stand-in: counted without it
            counted = count_bytes(cases, {**spec, "compute_ms": 0.0}, batches, opts)
            model_numel = sum(p.numel() for p in build_model(spec).parameters())
            results[name] = {"spec": spec, "numel": model_numel, "timed": timed,
                             "counted": counted}
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "results": results})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world": world, "threads": opts["threads"], "ranks": gathered,
                           "bucket_cap_mb": opts["bucket_cap_mb"],
                           "compute_ms": opts.get("compute_ms", 0.0),
                           "chain": chain_length(opts)}, f)
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
        # every rank's own medians (rank order), per phase
        per_rank_med = [dict({k: statistics.median(p[i].get(k, 0.0) for i in range(n))
                              for k in PHASES}, rank=pr_rank)
                        for p, pr_rank in zip(phases, (rk["rank"] for rk in data["ranks"]))]
        counted = [pr["counted"][label] for pr in per_rank]
        sent = [c["bytes"] for c in counted]
        diffs = [pr["timed"][label].get("max_abs_diff") for pr in per_rank]
        ours = [pr["timed"][label].get("diff_to_zero_ext") for pr in per_rank]
        # per collective name: calls (rank 0) and bytes sent per rank (mean over ranks)
        calls = {k: [c, sum(cr["calls"].get(k, [0, 0])[1] for cr in counted) / world]
                 for k, (c, _) in counted[0]["calls"].items()}
        missed = [c.get("missed") for c in counted]
        rows[label] = {"median": med, "iters": n, "sent_mean": sum(sent) / world,
                       "sent_max": max(sent), "calls": calls,
                       "max_abs_diff": None if diffs[0] is None else max(diffs),
                       "diff_to_zero_ext": None if ours[0] is None else max(ours),
                       # collectives the trace missed on some rank (None: not checked);
                       # where any, the bytes and the critical path read "n/a"
                       "missed": None if missed[0] is None else max(missed),
                       "per_rank": sorted(per_rank_med, key=lambda d: d["rank"]),
                       # each timed iteration's slowest rank, per phase (in time order)
                       "slowest": {k: [max(p[i].get(k, 0.0) for p in phases)
                                       for i in range(n)] for k in PHASES}}
        rows[label].update(link_summary([c["trace"] for c in counted], world, numel))
    ddp = per_rank[0]["counted"].get("ddp")
    buckets = None if ddp is None else sum(
        1 for _k, name, ph, _s, _r in ddp["trace"] if name == "all_reduce" and ph == "backward")
    return {"world": world, "numel": numel, "rows": rows, "spec": per_rank[0]["spec"],
            "ddp_buckets": buckets, "bucket_cap_mb": data.get("bucket_cap_mb", {}).get(model),
            "compute_ms": data.get("compute_ms", 0.0), "chain": data.get("chain", 1)}


def compute_note(summary: dict) -> str:
    """The compute stand-in, in words (table titles)."""
    c = summary.get("compute_ms") or 0.0
    if not c:
        return "no compute stand-in (--compute-ms 0)"
    n = compute_layers(summary["spec"])
    return (f"compute stand-in {c:g} ms forward / {2 * c:g} ms backward per layer "
            f"(x{n}: {n * c:g} / {2 * n * c:g} ms per iteration)")


def link_summary(traces: list, world: int, numel: int) -> dict:
    """Critical path and mean bytes per rank of the traced iteration, in units of DDP's
    ring all-reduce of the grads (critical path 2(W-1)/W x the fp32 model): the grads'
    exchange (what backward issued) and the whole iteration (grads + clip + the params'
    exchange); and the collective names that make up the critical path."""
    unit = 2 * (world - 1) / world * numel * 4 or 1.0
    grads = critical_path(traces, GRADS_PHASES)
    total = critical_path(traces)
    by_name: dict = {}
    busiest: dict = {}
    for records in traces:
        for key, name, _ph, s, v in records:
            k = tuple(tuple(x) if isinstance(x, list) else x for x in key)
            if max(s, v) >= busiest.get(k, (-1, ""))[0]:
                busiest[k] = (max(s, v), name)
    for b, name in busiest.values():
        c = by_name.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += b / unit
    return {"crit_grads": grads["critical"] / unit, "mean_grads": grads["mean_sent"] / unit,
            "crit_iter": total["critical"] / unit, "mean_iter": total["mean_sent"] / unit,
            "crit_by_name": by_name}


def tables(summary: dict, file=None) -> str:
    """The main table and the breakdown, as markdown (printed, and returned)."""
    rows, world, numel = summary["rows"], summary["world"], summary["numel"]
    if not rows:  # every mode was skipped
        return print_table("Whole iteration: no mode ran (all skipped)", ["mode"], [],
                           file=file)
    base = rows.get("ddp")
    ddp_ring = 2 * (world - 1) / world * numel * 4
    main, parts, colls = [], [], []
    for label, r in rows.items():
        t = r["median"]["total"]
        na = bool(r.get("missed"))  # the trace missed collectives: no byte counts
        main.append([label, _ms(t),
                     f"{t / base['median']['total']:.2f}x" if base else "-",
                     "n/a" if na else f"{r['sent_mean'] / 1e6:.2f}",
                     "n/a" if na else
                     f"{r['sent_mean'] / base['sent_mean']:.3f}x" if base and base["sent_mean"]
                     else "-"])
        m = r["median"]
        overlap = mode_of(label) == "zero_ext_overlap"
        fsdp2 = label in FSDP2_MODES
        parts.append([label, _ms(m["forward"]), _ms(m["backward"]),
                      "in backward" if overlap else _ms(m["step"]),
                      "in forward" if fsdp2 else
                      _ms(m["exchange"]) if not label.startswith("ddp") else "-",
                      _ms(m.get("param_wait", 0.0)),
                      "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"])
        colls.append([label, (f"n/a ({r['missed']} collective(s) not traced)" if na else
                              ", ".join(f"{k} x{c} {b / 1e6:.2f} MB"
                                        for k, (c, b) in sorted(r["calls"].items()))),
                      "n/a" if na else f"{r['sent_max'] / 1e6:.2f}"])
    spec = summary["spec"]
    what = (f"MLP {spec['depth']} x Linear({spec['width']}, {spec['width']}), batch "
            f"{spec['batch']}" if spec["name"] in ("mlp", "mlp512") else
            f"GPT-2 small shapes, {spec['layers']} layers, width {spec['d']}, vocab "
            f"{spec['vocab']}, batch {spec['batch']} x {spec['seq']} tokens")
    cores = (f" ({world} ranks x {summary['threads']} thread(s) oversubscribe the cores)"
             if summary.get("oversubscribed") else "")
    title = (f"Whole iteration, {what}: {numel:,} fp32 params; world {world}{cores}, gloo; "
             f"{compute_note(summary)}; median "
             f"of {min(r['iters'] for r in rows.values())} iterations (slowest rank"
             + (f"; each mode's turn {summary['chain']} back-to-back iterations, the first "
                f"untimed" if summary.get("chain", 1) > 1 else "") + "). Bytes "
             f"counted in one iteration (mean over ranks), gloo's algorithms; DDP's all-reduce "
             f"counted through torch's "
             f"Python allreduce_hook (ring all-reduce of the model: "
             f"{ddp_ring / 1e6:.2f} MB/rank):")
    text = print_table(title, TABLE_HEADERS, main, file=file)
    text += "\n" + print_table(
        "Where the time goes (ms, median of the slowest rank per phase; step = clip + step + "
        "zero_grad; exchange = the updated params' exchange inside it; param wait = the "
        "forward's wait for the previous step's params, part of forward):",
        ["mode", "forward", "backward", "step", "exchange", "param wait",
         "max abs diff vs ddp"], parts, file=file)
    ranked = [[str(d["rank"]), label] + [_ms(d[k]) for k in PHASES]
              for label, r in rows.items() for d in r.get("per_rank", [])]
    text += "\n" + print_table(
        "Per rank (ms, each rank's own median over the timed iterations; step = clip + step "
        "+ zero_grad; param wait = the forward's wait for the previous step's params "
        "exchange, part of forward: 0 where the step finished it, as in every mode but "
        "those built with overlap_param_gather; FSDP2's all-gathers are its forward's own):",
        ["rank", "mode", "forward", "backward", "step", "param wait", "total"], ranked,
        file=file)
    text += "\n" + print_table("Collectives counted in one iteration (calls on rank 0; "
                               "MB sent per rank, mean over ranks):",
                               ["mode", "calls", "max MB sent by a rank"], colls, file=file)
    crit = []
    for label, r in rows.items():
        if "crit_grads" not in r:
            continue
        parts_ = sorted(r["crit_by_name"].items(), key=lambda kv: -kv[1][1])
        if r.get("missed"):
            crit.append([label] + ["n/a"] * (len(CRITICAL_HEADERS) - 1))
            continue
        crit.append([label, f"{r['crit_grads']:.3f}x", f"{r['mean_grads']:.3f}x",
                     f"{r['crit_iter']:.3f}x", f"{r['mean_iter']:.3f}x",
                     ", ".join(f"{k} x{c} {v:.3f}x" for k, (c, v) in parts_ if v >= 0.0005)])
    buckets = summary.get("ddp_buckets")
    text += "\n" + print_table(
        f"Critical path of the traced iteration (per collective, in issue order, the busiest "
        f"rank's max(sent, received) under gloo's algorithms, summed), and the mean bytes a "
        f"rank sends, both in units of DDP's ring all-reduce of the grads "
        f"({ddp_ring / 1e6:.2f} MB; world {world}"
        + (f", {buckets} DDP buckets" if buckets is not None else "")
        + (f", bucket_cap_mb {summary['bucket_cap_mb']}" if summary.get("bucket_cap_mb")
           else "")
        + "); grads = what backward issued, grads+params = the whole iteration:",
        CRITICAL_HEADERS, crit, file=file)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world", default="2", help="comma-separated world sizes (spawned ranks; "
                    "ignored when the ranks come from the environment)")
    ap.add_argument("--model", default="mlp,gpt2", help="comma-separated: mlp, mlp512, gpt2")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(ALL_MODES)} (FSDP2's only on request)")
    ap.add_argument("--sharding", default="flat,even",
                    help="zero_ext's shardings for its modes, comma-separated, of param, flat, "
                    "even (those this zero_ext lacks are left out, with a note)")
    ap.add_argument("--bucket-cap-mb", type=float, default=0.0,
                    help="DDP's bucket_cap_mb for every mode (0: 1 MB for mlp512, giving 8 "
                    "buckets, torch's 25 otherwise)")
    ap.add_argument("--layouts", default="job",
                    help="for the zero_ext modes, comma-separated: job (the optimizer over "
                         "the whole job), hybrid (over the node's shard group of "
                         "zero_ext.hybrid_groups(), DDP over the job: label 'even@hybrid')")
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="GPU-like compute stand-in: every layer's forward sleeps this many ms "
                    "and its backward twice that (0: off)")
    ap.add_argument("--chain", type=int, default=0,
                    help="back-to-back iterations per mode per round, a barrier before the "
                    "first, which is untimed when > 1 (0: 2 when an overlap_param_gather mode "
                    "is requested, else 1)")
    ap.add_argument("--offload-fraction", type=float, default=1.0,
                    help="offload_optimizer of the *_offload modes (the share's part stepped "
                    "on the host)")
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
    ap.add_argument("--launcher", choices=("auto", "spawn", "env"), default="auto",
                    help="spawn: this process starts --world ranks on localhost; env: this "
                    "process is one rank, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from "
                    "the environment (netlab.sh, torchrun); auto: env when those are set")
    ap.add_argument("--out", default="", help="write the tables (markdown) here")
    ap.add_argument("--json", default="", help="write the summaries (JSON) here")
    args = ap.parse_args(argv)

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    shardings = [x.strip() for x in args.sharding.split(",") if x.strip()]
    bad = ([m for m in modes if m not in ALL_MODES] + [m for m in models if m not in MODEL_NAMES]
           + [x for x in shardings if x not in SHARDINGS])
    if bad:
        ap.error(f"unknown mode(s)/model(s)/sharding(s): {bad}")
    if args.compute_ms < 0 or args.chain < 0:
        ap.error("--compute-ms and --chain must be >= 0")
    have = available_shardings()
    missing = [x for x in shardings if x not in have]
    shardings = [x for x in shardings if x in have]
    if args.quick:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    env_keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    from_env = args.launcher == "env" or (args.launcher == "auto"
                                          and all(k in os.environ for k in env_keys))
    env_rank = int(os.environ.get("RANK", "0")) if from_env else 0
    worlds = ([int(os.environ["WORLD_SIZE"])] if from_env else
              [int(w) for w in args.world.split(",") if w.strip()])
    cores = os.cpu_count() or 1
    say = env_rank == 0
    if say:
        where = (f"ranks from the environment (MASTER_ADDR {os.environ.get('MASTER_ADDR')}, "
                 f"GLOO_SOCKET_IFNAME {os.environ.get('GLOO_SOCKET_IFNAME', '-')})"
                 if from_env else "gloo on localhost")
        print(f"# whole iteration: torch {torch.__version__}, {where}, {cores} cores; "
              f"{_prebuild() if not from_env else 'native ops loaded by rank 0 first'}",
              flush=True)
        chain = chain_length({"chain": args.chain, "modes": modes})
        print("# compute stand-in: "
              + (f"{args.compute_ms:g} ms forward / {2 * args.compute_ms:g} ms backward per "
                 f"layer (mlp, mlp512: per Linear; gpt2: per block)" if args.compute_ms else
                 "off (--compute-ms 0)")
              + f"; {chain} iteration(s) per mode per round"
              + (" (the first untimed)" if chain > 1 else ""), flush=True)
        if missing:
            print(f"# sharding(s) {missing} left out: this zero_ext has {list(have)}",
                  flush=True)
    texts, summaries = [], []
    for world in worlds:
        threads = args.threads or max(1, cores // world)
        opts = {"threads": threads, "port": 0 if from_env else _free_port(),
                "timeout": args.timeout, "models": models, "modes": modes,
                "shardings": shardings, "env": from_env,
                "layouts": [x.strip() for x in args.layouts.split(",") if x.strip()],
                "bucket_cap_mb": {m: args.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB.get(m, 25.0)
                                  for m in models},
                "iters": args.iters, "warmup": args.warmup, "quick": args.quick,
                "compute_ms": args.compute_ms, "chain": args.chain,
                "sequential": args.sequential, "gpt_layers": args.gpt_layers,
                "gpt_batch": args.gpt_batch, "gpt_seq": args.gpt_seq,
                "offload_fraction": args.offload_fraction}
        fd, out = tempfile.mkstemp(prefix=f"iteration_w{world}_", suffix=".json")
        os.close(fd)
        t0 = time.perf_counter()
        if from_env:
            run(env_rank, world, opts, out)
            if env_rank != 0:
                os.unlink(out)
                return 0
        else:
            mp.spawn(spawned_rank, args=(run, world, opts, out), nprocs=world, join=True)
        with open(out) as f:
            data = json.load(f)
        os.unlink(out)
        over = " (ranks oversubscribe the cores)" if world * threads > cores else ""
        print(f"# world {world}: {threads} thread(s) per rank{over}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        for model in models:
            s = summarize(data, model)
            s["threads"], s["oversubscribed"] = threads, bool(over)
            s["launcher"] = "env" if from_env else "spawn"
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
    exit_without_teardown(main())  # (a rank started by a launcher: --launcher env)
