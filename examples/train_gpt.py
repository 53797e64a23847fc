"""Train a small GPT-style model with zero_ext.ZeroRedundancyOptimizer (ZeRO-1) + DDP.

    torchrun --nproc_per_node 2 examples/train_gpt.py          # 2 ranks, CPU / gloo
    python examples/train_gpt.py                                # 1 process (world of 1)
    torchrun --nproc_per_node 2 examples/train_gpt.py --torch-zero   # torch's ZeRO, to compare
    torchrun --nproc_per_node 2 examples/train_gpt.py --plain-adamw  # DDP + torch AdamW
    torchrun --nproc_per_node 2 examples/train_gpt.py --grad-reduce-scatter --clip-norm 1.0
                                                # grads reduce-scattered to their owners
    torchrun --nproc_per_node 2 examples/train_gpt.py --dtype bf16 --master-weights
                                                # bf16 params, fp32 masters + state per owner
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:PORT \
        examples/train_gpt.py --shard-within-node --ckpt ckpt --save-every 100
                                                # shard within each node, replicate across
    torchrun --nproc_per_node 4 examples/train_gpt.py --shard-within-node \
        --resume-from ckpt/step-100             # resume on another layout (1 node of 4)

The data is generated in-process and has structure a transformer can learn, so the loss
clearly falls: every sequence is either an arithmetic progression modulo the vocabulary
(start and stride random) or a random motif of 2-6 tokens repeated. Each rank draws its own
batches. The optimizer is AdamW with the usual decay / no-decay param-group dicts (no weight
decay on biases, LayerNorm weights and position embeddings), under a warmup + cosine schedule.

--dtype bf16 puts the model's params (and so its grads) in bfloat16 (`model.to(torch.bfloat16)`;
the loss is computed in float32). --master-weights passes master_weights=True: the rank that
owns each element keeps a float32 master copy and float32 AdamW state, and the params receive
the master rounded to nearest even. Without it, AdamW steps the bf16 params directly (state in
bf16 too), and updates smaller than half a bf16 ulp of a weight are lost.

--shard-within-node shards the optimizer state over the ranks of each node only
(zero_ext.hybrid_groups(): the shard group is the node, LOCAL_WORLD_SIZE ranks) while DDP
averages the grads over the whole job, so every node holds a replica of the state and the
parameter exchange after each step stays inside the node. --ckpt DIR --save-every N writes
DIR/step-N/: the model (rank 0), the optimizer (zero_ext.checkpoint: every rank its share,
each shard once across the replicas), the scheduler and step, and every rank's data stream;
--resume-from DIR/step-N continues from there, at any layout (other node count, ranks per
node or sharding mode) as long as the world size is the same (each rank's data stream is
restored by rank).

--grad-reduce-scatter registers zero_ext.ddp_zero_hook.reduce_scatter_hook on DDP: each grad
goes only to the rank that owns its elements in the optimizer (DDP's bytes per iteration
instead of 1.5x); --clip-norm N clips by the global grad norm (zero_ext: opt.clip_grad_norm_,
the only clip that is right with the hook; --plain-adamw and --torch-zero: torch's
clip_grad_norm_). --plain-adamw trains with DDP + an unsharded torch.optim.AdamW, the
reference the other modes match.

Printed: after the first step, per rank, the bytes per param this rank holds (its params, their
grads and every tensor of its optimizer state, masters included, measured from the tensors and
divided by the model's param count); every --log-every steps the loss (the mean over ranks and
over the steps since the last line, so a resumed run's first lines differ from an uninterrupted
run's though its weights are the same) and lr, mean step time and mean optimizer-step time, and
per rank the optimizer-state memory (bytes of the tensors in opt.optim.state) and the number of
parameter elements whose state the rank holds (opt.local_numel).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# runnable from a source checkout without `pip install`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The usual AdamW recipe: decay matrices and embeddings, not biases / norms / pos."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and name != "pos" else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------- data


def make_batch(gen: torch.Generator, batch: int, seq_len: int, vocab: int):
    """(inputs, targets) of shape (batch, seq_len): progressions and repeated motifs."""
    t = torch.arange(seq_len + 1)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 6, (batch, 1), generator=gen)
    progression = (start + stride * t) % vocab
    period = torch.randint(2, 7, (batch, 1), generator=gen)
    motif = torch.randint(0, vocab, (batch, 6), generator=gen)
    repeated = motif.gather(1, t.unsqueeze(0) % period)
    use_prog = torch.rand(batch, 1, generator=gen) < 0.5
    seq = torch.where(use_prog, progression, repeated)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ---------------------------------------------------------------------------- training


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return base_lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def init_distributed(device: torch.device) -> tuple[int, int, str | None]:
    """torchrun sets RANK/WORLD_SIZE; a plain `python` run becomes a world of one."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size(), None
    fd, path = tempfile.mkstemp(prefix="train_gpt_store_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    return 0, 1, path


def state_size(opt) -> tuple[int, int]:
    """(bytes, elements) of the tensors in this rank's local optimizer state."""
    local = getattr(opt, "optim", opt)  # a ZeRO optimizer's local one, or a plain optimizer
    ts = [t for st in local.state.values() for t in st.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in ts), sum(t.numel() for t in ts)


def tensor_bytes(params, opt) -> dict:
    """Bytes this rank holds in the params, their grads and its optimizer state (every tensor
    in opt.optim.state, fp32 masters included), measured from the tensors."""
    params = list(params)
    state = sum(t.nbytes for st in getattr(opt, "optim", opt).state.values()
                for t in st.values() if torch.is_tensor(t))
    return {"weights": sum(p.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "state": state}


def local_numel(opt) -> int:
    if hasattr(opt, "local_numel"):
        return int(opt.local_numel)
    local = getattr(opt, "optim", opt)  # torch's ZeRO, or a plain optimizer
    return sum(p.numel() for g in local.param_groups for p in g["params"])


def report_bytes_per_param(model: nn.Module, opt, n_params: int, rank: int, world: int,
                           masters: bool) -> None:
    """Print, per rank, what it holds per param of the model: weights + grads + optimizer
    state (masters included), measured from the tensors (collective: every rank calls it)."""
    mine = tensor_bytes(model.parameters(), opt)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r, b in enumerate(everyone):
            total = b["weights"] + b["grads"] + b["state"]
            print(f"rank {r}: {total / n_params:.2f} bytes per param held "
                  f"(weights {b['weights'] / n_params:.2f} + grads {b['grads'] / n_params:.2f} "
                  f"+ optimizer state{' incl. fp32 masters' if masters else ''} "
                  f"{b['state'] / n_params:.2f}), "
                  f"{total / 2**20:.3f} MiB", flush=True)


def save(path: str, step: int, model: nn.Module, opt, sched, gen: torch.Generator,
         rank: int) -> None:
    """A training checkpoint (collective): the optimizer through zero_ext.checkpoint (every
    rank writes its share; in a hybrid layout each shard once), the model and the scheduler
    from rank 0, every rank's data stream; "done" last, so a directory without it is
    incomplete."""
    from zero_ext import checkpoint

    os.makedirs(path, exist_ok=True)
    checkpoint.save(opt, os.path.join(path, "optimizer"))
    torch.save({"gen": gen.get_state()}, os.path.join(path, f"data_rank{rank}.pt"))
    if rank == 0:
        torch.save({"model": model.state_dict(), "sched": sched.state_dict(), "step": step},
                   os.path.join(path, "train.pt"))
    dist.barrier()
    if rank == 0:
        open(os.path.join(path, "done"), "w").close()
        print(f"saved {path}", flush=True)


def resume(path: str, model: nn.Module, opt, sched, gen: torch.Generator, rank: int,
           world: int) -> int:
    """Load what `save` wrote (collective); returns the step to continue from."""
    from zero_ext import checkpoint

    if not os.path.exists(os.path.join(path, "done")):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no 'done' file)")
    data = os.path.join(path, f"data_rank{rank}.pt")
    if not os.path.exists(data) or os.path.exists(os.path.join(path, f"data_rank{world}.pt")):
        raise ValueError(f"{path} was saved at another world size: each rank's data stream "
                         "is restored by rank, so resume with the same number of ranks")
    train = torch.load(os.path.join(path, "train.pt"), weights_only=True)
    model.load_state_dict(train["model"])  # every rank, in place: the optimizer follows
    checkpoint.load(opt, os.path.join(path, "optimizer"))
    sched.load_state_dict(train["sched"])
    gen.set_state(torch.load(data, weights_only=True)["gen"])
    return int(train["step"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--sharding", default="auto", choices=["auto", "param", "flat", "even"],
                    help="zero_ext's sharding mode: whole params per rank, flat element "
                         "ranges, every param split over all ranks (even: balanced links, "
                         "for clusters), or chosen by balance")
    ap.add_argument("--bucket-view", action="store_true",
                    help="parameters_as_bucket_view=True (params become views of flat buffers)")
    ap.add_argument("--torch-zero", action="store_true",
                    help="use torch.distributed.optim.ZeroRedundancyOptimizer instead")
    ap.add_argument("--plain-adamw", action="store_true",
                    help="DDP + torch.optim.AdamW, unsharded (the reference)")
    ap.add_argument("--grad-reduce-scatter", action="store_true",
                    help="zero_ext's reduce_scatter_hook on DDP: grads go to their owners only")
    ap.add_argument("--clip-norm", type=float, default=0.0,
                    help="clip grads to this global norm before each step (0: no clipping)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="dtype of the model's params and grads (bf16: model.to(torch.bfloat16))")
    ap.add_argument("--master-weights", action="store_true",
                    help="master_weights=True: fp32 master copy and fp32 AdamW state of the "
                         "elements each rank owns (zero_ext only)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    ap.add_argument("--d-model", type=int, default=64, help="model width")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=4, help="attention heads per block")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW weight decay of the decay group (biases, norms and position "
                         "embeddings get none)")
    ap.add_argument("--warmup", type=int, default=30,
                    help="linear warmup steps before the cosine decay")
    ap.add_argument("--log-every", type=int, default=25,
                    help="print the loss (mean over ranks and over the steps since the "
                         "last line) and lr every N steps")
    ap.add_argument("--seed", type=int, default=0, help="random seed (model and data)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu uses gloo, cuda uses nccl with one GPU per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--shard-within-node", action="store_true",
                    help="shard the optimizer state over the ranks of each node and replicate "
                         "it across nodes (zero_ext.hybrid_groups(); DDP over the whole job)")
    ap.add_argument("--ckpt", default=None,
                    help="directory for checkpoints DIR/step-N (with --save-every)")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save a checkpoint every N steps (0: never)")
    ap.add_argument("--resume-from", default=None,
                    help="a checkpoint directory DIR/step-N to continue from")
    ap.add_argument("--final", default=None,
                    help="write rank 0's final model weights and losses to this file")
    args = ap.parse_args(argv)
    if args.master_weights and args.torch_zero:
        ap.error("--master-weights is a zero_ext option; torch's ZeroRedundancyOptimizer "
                 "has no master weights")
    if args.torch_zero and (args.shard_within_node or args.save_every or args.resume_from):
        ap.error("--shard-within-node, --save-every and --resume-from use zero_ext (its "
                 "hybrid groups and zero_ext.checkpoint)")
    if args.plain_adamw and (args.torch_zero or args.master_weights or args.grad_reduce_scatter
                             or args.shard_within_node or args.save_every or args.resume_from):
        ap.error("--plain-adamw is the unsharded reference: no zero_ext or torch ZeRO options")
    if args.grad_reduce_scatter and args.torch_zero:
        ap.error("--grad-reduce-scatter is a zero_ext hook")
    if args.save_every and not args.ckpt:
        ap.error("--save-every needs --ckpt")

    device = torch.device(args.device)
    rank, world, store_path = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:  # tiny matrices: one thread per rank beats several, most of all on a busy machine
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads).to(device)
    if args.dtype == "bf16":
        model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    masters = args.master_weights and args.dtype != "fp32"  # fp32 params need no master copy
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    groups = param_groups(model, args.weight_decay)
    if args.plain_adamw:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        impl = "torch.optim.AdamW (unsharded)"
    elif args.torch_zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                      parameters_as_bucket_view=args.bucket_view)
        impl = "torch.distributed.optim.ZeroRedundancyOptimizer"
    else:
        from zero_ext import ZeroRedundancyOptimizer

        extra = {"master_weights": True} if args.master_weights else {}
        if args.shard_within_node:
            from zero_ext import hybrid_groups

            extra["process_group"] = hybrid_groups()[0]  # this node's ranks
        opt = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                      parameters_as_bucket_view=args.bucket_view,
                                      sharding=args.sharding, **extra)
        per_node = f", {opt.world_size} ranks per shard group" if args.shard_within_node else ""
        impl = (f"zero_ext.ZeroRedundancyOptimizer(sharding={args.sharding!r}"
                f"{', master_weights=True' if args.master_weights else ''}{per_node})")
        if args.grad_reduce_scatter:
            from zero_ext.ddp_zero_hook import reduce_scatter_hook

            ddp.register_comm_hook(opt, reduce_scatter_hook)
            impl += " + reduce_scatter_hook"
    clip = None
    if args.clip_norm > 0:  # zero_ext: the sharded global norm; else torch's, over all grads
        clip = (opt.clip_grad_norm_ if hasattr(opt, "clip_grad_norm_") else
                lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, 1.0, args.warmup, args.steps))

    if rank == 0:
        print(f"world {world} ({dist.get_backend()}), {impl}, bucket view {args.bucket_view}, "
              f"{n_params:,} {args.dtype} params in {len(list(model.parameters()))} tensors, "
              f"{args.steps} steps of {args.batch_size}x{args.seq_len} tokens per rank",
              flush=True)
        if impl.startswith("zero_ext"):
            # (a first run builds the ops and says so; a cached build loads silently)
            from zero_ext import native_status

            status = native_status()
            if status["state"] != "not built":
                print(f"zero_ext native ops: {status['summary']}", flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own data
    start = 0
    if args.resume_from:
        start = resume(args.resume_from, model, opt, sched, gen, rank, world)
        if rank == 0:
            print(f"resumed from {args.resume_from} at step {start}", flush=True)
    step_times, opt_times, first_loss, window, losses = [], [], None, [], []
    loss_avg = torch.zeros(1, device=device)
    mean_loss = float("nan")
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in make_batch(gen, args.batch_size, args.seq_len, args.vocab))
        t0 = time.perf_counter()
        logits = ddp(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        if clip is not None:
            clip(args.clip_norm)
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        step_times.append(t2 - t0)
        opt_times.append(t2 - t1)
        if step == start:  # the optimizer state exists from the first step on
            report_bytes_per_param(model, opt, n_params, rank, world, masters)

        window.append(loss.detach())
        losses.append(float(loss.detach()))
        if (step + 1) % args.log_every == 0 or step == start or step + 1 == args.steps:
            loss_avg.copy_(torch.stack(window).mean())
            dist.all_reduce(loss_avg)  # mean over ranks (and over the window)
            mean_loss = loss_avg.item() / world
            window.clear()
            if first_loss is None:
                first_loss = mean_loss
            if rank == 0:
                recent = step_times[-args.log_every:]
                print(f"step {step + 1:5d}  loss {mean_loss:7.4f}  "
                      f"lr {opt.param_groups[0]['lr']:.2e}  "
                      f"step {1e3 * sum(recent) / len(recent):7.1f} ms", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            save(os.path.join(args.ckpt, f"step-{step + 1}"), step + 1, model, opt, sched,
                 gen, rank)
    final_loss = mean_loss

    # per-rank optimizer-state memory
    nbytes, nelems = state_size(opt)
    mine = {"rank": rank, "state_bytes": nbytes, "state_elems": nelems,
            "local_numel": local_numel(opt)}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    # the mean leaves out up to 10 warm-up steps, and always times at least the last step
    skip = min(10, len(step_times) - 1)
    timed = step_times[skip:]
    timed_opt = opt_times[skip:]
    if rank == 0:
        print(f"\nloss {first_loss:.4f} -> {final_loss:.4f} "
              f"(uniform guess: {math.log(args.vocab):.4f})")
        which = (f"step {start + skip + 1} only" if len(timed) == 1
                 else f"steps {start + skip + 1}-{start + len(step_times)}")
        if skip == 10:
            which += ", after 10 warm-up steps"
        elif skip:
            which += (f", after {skip} warm-up step{'' if skip == 1 else 's'} instead of 10: "
                      "may still include warm-up costs")
        else:
            which += ": includes the warm-up costs"
        print(f"mean step {1e3 * sum(timed) / len(timed):.1f} ms, of which optimizer step "
              f"{1e3 * sum(timed_opt) / len(timed_opt):.1f} ms (rank 0, {which})")
        print("\nrank  optimizer-state MiB  state elements  local_numel  share of params")
        for m in everyone:
            print(f"{m['rank']:4d}  {m['state_bytes'] / 2**20:19.3f}  "
                  f"{m['state_elems']:14,d}  {m['local_numel']:11,d}  "
                  f"{m['local_numel'] / n_params:15.1%}")
        per_param = 12 if masters else 2 * next(model.parameters()).element_size()
        print(f"(unsharded {'AdamW with fp32 masters' if masters else 'AdamW'} "
              f"would hold {per_param * n_params / 2**20:.3f} MiB on every rank)")

    if args.final and rank == 0:
        torch.save({"model": model.state_dict(), "losses": losses}, args.final)
    dist.destroy_process_group()
    if store_path and os.path.exists(store_path):
        os.unlink(store_path)
    return 0 if final_loss < first_loss else 1


def exit_now(rc: int) -> None:
    """Leave without the interpreter's teardown: with torch 2.14 + gloo it aborts about one
    run in four ("terminate called without an active exception", SIGABRT, even after
    destroy_process_group(): gloo's worker threads meet the finalizing interpreter; plain
    DDP scripts without zero_ext do it too). Everything is written and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_now(main())
