"""torch.compile around zero_ext's optimizers: their methods opt out of tracing.

torch's compiled-optimizer recipe is ``opt.step = torch.compile(opt.step)``, or a compiled
function that calls ``opt.step()``. zero_ext's step is collective, data-dependent Python
(agreement between ranks, grad version checks, the exchange), so dynamo must not trace it:
a compiled caller breaks its graph there once and the step runs eagerly, with no
recompiles. Traced, it recompiled every iteration, raised a false "different
hyperparameters" error, crashed on the hook's grad check (GuardOnDataDependentSymNode) or
on the process group, or (FusedAdamW) stepped with wrong numbers.

Every distributed scenario runs a reference (plain DDP + torch.optim.AdamW, eager) and the
candidate (DDP + zero_ext, compiled somewhere) on copies of one model, fed the same per-rank
batches through a real DDP backward. After every step the params agree (atol/rtol 1e-6)
and they end bitwise equal on every rank; the graphs dynamo compiled (a recompile is one
more) stop growing after the first iterations.
"""
from __future__ import annotations


import pytest
import torch

from _dist import gloo_available, run_world, sd_diff
from test_grad_reduce import HP, TOL, _batch, _groups, _Net

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

ITERS = 6
MAX_NORM = 0.05
# Graphs a training function may compile in all: forward pieces (DDP's graph split per
# bucket), resume functions after its graph breaks, one recompile as DDP settles after
# iteration 0. A traced step compiles more at every iteration.
GRAPH_BOUND = 12


def _loss(out):
    return out.square().mean()


def _fresh_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # (reset() keeps them)


def _graphs() -> int:
    """Graphs dynamo compiled since _fresh_dynamo (any backend; a recompile is one more)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _lambda(it):
    return 1.0 / (1 + it)


def _pair(cfg):
    """(reference DDP, its AdamW), (candidate DDP, what to call for its forward, zero_ext).
    cfg["model"]: None, "outside" (torch.compile(DDP(m))) or "inside" (DDP(torch.compile(m)),
    as nanoGPT does)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    # several buckets for this small model, except where dynamo sees DDP (a compiled
    # forward): its DDPOptimizer refuses buckets under DDP's first one (1 MB)
    compiled_forward = cfg.get("model") is not None or cfg.get("compile") == "train_step"
    kw = dict(bucket_cap_mb=25 if compiled_forward else 0.002)
    m_ref, m_zero = _Net(), _Net()
    ref = DDP(m_ref, **kw)
    o_ref = torch.optim.AdamW(_groups(m_ref), **HP)
    o_zero = ZeroRedundancyOptimizer(_groups(m_zero), cfg.get("cls", torch.optim.AdamW),
                                     sharding=cfg.get("sharding", "param"), **HP)
    backend = cfg.get("model_backend", "aot_eager")  # (aot: the backward compiled too)
    zero = DDP(torch.compile(m_zero, backend=backend) if cfg.get("model") == "inside"
               else m_zero, **kw)
    if cfg.get("hook"):
        zero.register_comm_hook(o_zero, reduce_scatter_hook)
    call = torch.compile(zero, backend=backend) if cfg.get("model") == "outside" else zero
    return (ref, o_ref), (zero, call, o_zero)


def _reference_iteration(rank, it, ddp, opt, clip, sched=None):
    _loss(ddp(_batch(rank, it))).backward()
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM) if clip else None
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    return norm


def _compiled(rank, world, cfg):
    """ITERS iterations of the reference and the candidate, where cfg["compile"] compiles
    "step" (opt.step = torch.compile(opt.step)), "update" (a function calling
    clip_grad_norm_, step and zero_grad) or "train_step" (the same with forward and
    backward). Returns the candidate's final params and the graphs compiled after each
    iteration."""
    _fresh_dynamo()
    (ref, o_ref), (zero, call, opt) = _pair(cfg)
    clip = cfg.get("clip", False)
    s_ref = s_zero = None
    if cfg.get("sched"):  # it wraps opt.step per instance (patch_track_step_called)
        s_ref = torch.optim.lr_scheduler.LambdaLR(o_ref, _lambda)
        s_zero = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    where = cfg.get("compile")
    backend = cfg.get("backend", "eager")  # "inductor": the recipe as written
    if where == "step":
        opt.step = torch.compile(opt.step, backend=backend)

    def update():
        norm = opt.clip_grad_norm_(MAX_NORM) if clip else None
        opt.step()
        opt.zero_grad()
        return norm

    def train_step(x):
        _loss(call(x)).backward()
        return update()

    if where == "update":
        update = torch.compile(update, backend=backend)
    if where == "train_step":
        train_step = torch.compile(train_step, backend=backend)

    graphs = []
    for it in range(ITERS):
        n_ref = _reference_iteration(rank, it, ref, o_ref, clip, s_ref)
        n_zero = train_step(_batch(rank, it))
        if s_zero is not None:
            s_zero.step()
        graphs.append(_graphs())
        for (name, a), b in zip(ref.module.named_parameters(), zero.module.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), **TOL,
                                       msg=lambda m, it=it, name=name: f"iter {it} {name}: {m}")
        if clip:
            torch.testing.assert_close(n_zero, n_ref, atol=1e-6, rtol=1e-5)
    return [p.detach().clone() for p in zero.module.parameters()], graphs


def _check(results, max_graphs=GRAPH_BOUND):
    per_rank = [r[0] for r in results]
    for r in range(1, len(per_rank)):
        for i, (a, b) in enumerate(zip(per_rank[0], per_rank[r])):
            assert torch.equal(a, b), f"param {i} differs between rank 0 and rank {r}"
    for rank, (_, graphs) in enumerate(results):
        # nothing compiled after the warm-up: every later iteration ran what was cached
        assert graphs[2] == graphs[-1], f"rank {rank}: graphs after each iteration {graphs}"
        assert graphs[-1] <= max_graphs, f"rank {rank}: {graphs[-1]} graphs compiled"
    return results


# ------------------------------------------------------------------ opt.step = compile(opt.step)

@pytest.mark.parametrize("world,sharding", [(2, "param"), (2, "flat"), (3, "flat")])
@pytest.mark.parametrize("hook", [False, True], ids=["allreduce", "reduce-scatter-hook"])
def test_compiled_step_method(world, sharding, hook):
    """The whole step (its pre-hooks too) runs eagerly: dynamo compiles nothing."""
    results = _check(run_world(_compiled, world, dict(compile="step", hook=hook,
                                                      sharding=sharding, clip=hook)))
    for _, graphs in results:
        assert graphs[-1] == 0, graphs


def test_compiled_step_method_default_backend():
    """The recipe as written (inductor): nothing is compiled (so no iteration pays for a
    compilation; counted in graphs, not timed: tests never assert wall-clock time)."""
    results = _check(run_world(_compiled, 2, dict(compile="step", hook=True, sharding="flat",
                                                  backend="inductor")))
    for _, graphs in results:
        assert graphs[-1] == 0, graphs


# ------------------------------------------------------------------ a compiled function

@pytest.mark.parametrize("hook", [False, True], ids=["allreduce", "reduce-scatter-hook"])
def test_compiled_update_function(hook):
    """torch's compiled-optimizer tutorial: a compiled function calls clip_grad_norm_, step
    and zero_grad; an LR scheduler (which wraps opt.step) steps outside it."""
    _check(run_world(_compiled, 2, dict(compile="update", hook=hook, sharding="flat",
                                        clip=True, sched=True)))


@pytest.mark.parametrize("hook", [False, True], ids=["allreduce", "reduce-scatter-hook"])
def test_compiled_train_step_function(hook):
    """A compiled function runs forward, backward, clip_grad_norm_, step and zero_grad (with
    the hook, its own entry points run inside that backward: kept eager too)."""
    _check(run_world(_compiled, 2, dict(compile="train_step", hook=hook, sharding="flat",
                                        clip=True)))


def test_compiled_train_step_fused_adamw_class():
    """zero_ext.FusedAdamW as the sharded optimizer_class, from a compiled train step."""
    from zero_ext import FusedAdamW

    _check(run_world(_compiled, 2, dict(compile="train_step", sharding="param", clip=True,
                                        cls=FusedAdamW)))


# ------------------------------------------------------------------ a compiled model

@pytest.mark.parametrize("model,hook,step", [
    ("outside", False, False),  # torch.compile(DDP(model)), DDP's all-reduce
    ("outside", True, False),   # ... with the reduce-scatter hook
    ("inside", True, True),     # nanoGPT's DDP(torch.compile(model)), + compile(opt.step)
], ids=["compile-ddp", "compile-ddp-hook", "ddp-compiled-model-hook-compiled-step"])
def test_compiled_model_under_ddp(model, hook, step):
    cfg = dict(model=model, hook=hook, sharding="flat", clip=hook)
    if step:
        cfg["compile"] = "step"
    _check(run_world(_compiled, 2, cfg))


# ------------------------------------------------------------------ the state-dict methods

def _state_methods(rank, world):
    """consolidate_state_dict, state_dict and load_state_dict called from compiled code
    give what they give eagerly, and compile nothing."""
    from zero_ext import ZeroRedundancyOptimizer

    _fresh_dynamo()
    _, (zero, _, opt) = _pair(dict(hook=True, sharding="flat"))
    for it in range(2):
        _loss(zero(_batch(rank, it))).backward()
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(0)
    eager = opt.state_dict()

    @torch.compile(backend="eager")
    def save():
        opt.consolidate_state_dict(0)
        return opt.state_dict()

    compiled = save()
    other = ZeroRedundancyOptimizer(_groups(_Net()), torch.optim.AdamW, sharding="param", **HP)
    torch.compile(other.load_state_dict, backend="eager")(compiled if rank == 0 else None)
    other.consolidate_state_dict(0)
    return _graphs(), eager, compiled, other.state_dict()


def test_state_dict_methods_from_compiled_code():
    out = run_world(_state_methods, 2)
    assert [o[0] for o in out] == [0, 0]
    _, eager, compiled, loaded = out[0]
    assert sd_diff(compiled, eager) == []
    assert sd_diff(loaded["state"], eager["state"]) == []


# ------------------------------------------------------------------ FusedAdamW alone

def _fused_alone(compile_what):
    """FusedAdamW compiled (its step, or a train step around it) against an eager twin
    (bitwise: the same eager step runs) and torch.optim.AdamW (FusedAdamW's own suite's
    float32 tolerance: its kernel rounds differently)."""
    from zero_ext import FusedAdamW

    _fresh_dynamo()
    models = [_Net() for _ in range(3)]
    opts = [torch.optim.AdamW(_groups(models[0]), **HP), FusedAdamW(_groups(models[1]), **HP),
            FusedAdamW(_groups(models[2]), **HP)]
    opt, model = opts[2], models[2]

    def train_step(x):
        _loss(model(x)).backward()
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        return norm

    if compile_what == "step":
        opt.step = torch.compile(opt.step, backend="eager")
    else:
        train_step = torch.compile(train_step, backend="eager")
    graphs = []
    for it in range(ITERS):
        norms = []
        for m, o in zip(models[:2], opts[:2]):
            _loss(m(_batch(0, it))).backward()
            norms.append(o.clip_grad_norm_(MAX_NORM) if isinstance(o, FusedAdamW)
                         else torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
            o.step()
            o.zero_grad()
        norms.append(train_step(_batch(0, it)))
        graphs.append(_graphs())
        assert torch.equal(norms[2], norms[1]), (it, norms)
        torch.testing.assert_close(norms[2], norms[0], atol=1e-6, rtol=1e-5)
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(c, b), f"iter {it}: compiled and eager FusedAdamW differ"
            torch.testing.assert_close(c.detach(), a.detach(), atol=1e-6, rtol=1e-5,
                                       msg=lambda m, it=it: f"iter {it}: {m}")
    return graphs


@pytest.mark.parametrize("compile_what", ["step", "train_step"])
def test_fused_adamw_compiled(compile_what):
    graphs = _fused_alone(compile_what)
    assert graphs[2] == graphs[-1] <= GRAPH_BOUND, graphs
    if compile_what == "step":
        assert graphs[-1] == 0, graphs
