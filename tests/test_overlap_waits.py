"""overlap_param_gather=True: WHERE the next forward waits for the params' exchange.

The other overlap tests check values; these check the overlap's effect, deterministically
(no timings): which collectives of the exchange each module's forward asks for when it
begins, and how many have finished then.

- Under DDP (optimizer built before or after the wrap, with or without reduce_scatter_hook,
  a stack of layers and a nanoGPT-shaped model with tied embeddings): DDP's own forward and
  the model's root wait for nothing; each layer asks for exactly the collectives carrying
  its own params (through the last of them, in the exchange's order), no more; the first
  layer begins with most of the exchange still in flight.
- The reads that once went stale: a param tied by `inp.weight.data = out.weight.data` whose
  module runs first, and a module outside the model sharing a Parameter (a probe head
  called right after the step): both read the stepped values.

Runs in NCCL's form forced on gloo (every collective issued at the step and finished only
when the main thread waits: what finished is exactly what was waited for) and in gloo's own
form (a worker thread drives the exchange, held back until the forward's first wait).
"""
from __future__ import annotations

import pytest
import torch

from _dist import gloo_available, run_world

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-4)
TOL = dict(atol=1e-5, rtol=1e-5)


class _Stack(torch.nn.Module):
    def __init__(self, width=64, depth=6):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.act = torch.nn.GELU()
        self.proj = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


class _TinyGPT(torch.nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, a final norm and a head tied
    to the token embedding (`lm_head.weight = wte.weight`)."""

    def __init__(self, vocab=96, d=32, ctx=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(ctx, d)
        self.drop = torch.nn.Dropout(0.0)
        self.h = torch.nn.ModuleList(_Block(d) for _ in range(depth))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _input(model_name, rank, it):
    g = torch.Generator().manual_seed(1000 * it + rank)
    if model_name == "gpt":
        return torch.randint(0, 96, (2, 8), generator=g)
    return torch.randn(3, 64, generator=g)


def _build(model_name):
    return _TinyGPT() if model_name == "gpt" else _Stack()


def _items_params(queue) -> list[list[int]]:
    """The param ids each collective of an exchange in flight carries."""
    return [[pc[0] for pc in (m.params if hasattr(m, "params") else m.pieces)]
            for m in queue.items]


class _Trace:
    """What each module's forward asks of the exchange when it begins: (module, items
    finished then, [items waited through]). Also counts every wait (for _hold_the_worker)."""

    def __init__(self, param_gather):
        import threading

        self.entries: list = []
        self.on = False
        self.waits = 0
        self.cond = threading.Condition()
        real_before = param_gather._before_forward
        real_wait = param_gather.ParamGather._wait_through
        trace = self

        def before(module, args):
            if trace.on:
                queue = next((g.queue for g in list(param_gather._ACTIVE)
                              if g.queue is not None), None)
                trace.entries.append([module, None if queue is None else queue.finished, []])
            return real_before(module, args)

        def wait_through(gather, k, by_forward=False):
            if trace.on and trace.entries:
                trace.entries[-1][2].append(k)
            with trace.cond:
                trace.waits += 1
                trace.cond.notify_all()
            return real_wait(gather, k, by_forward)

        param_gather._before_forward = before
        param_gather.ParamGather._wait_through = wait_through


def _hold_the_worker(param_gather, trace):
    """gloo's form: the worker thread drives an exchange only once something waited for it
    after the step that submitted it (the forward's first module, at the latest), so that
    what the forward's first layer finds finished does not depend on timing."""
    real_submit, real_run = param_gather._Worker.submit, param_gather.LaneQueue.run_to_end

    def submit(worker, queue):
        queue.held_until = trace.waits
        return real_submit(worker, queue)

    def run_to_end(queue):
        with trace.cond:
            trace.cond.wait_for(lambda: trace.waits > queue.held_until, timeout=30)
        return real_run(queue)

    param_gather._Worker.submit = submit
    param_gather.LaneQueue.run_to_end = run_to_end


def _where_waits(rank, world, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather, replicas
    from zero_ext.ddp_zero_hook import reduce_scatter_hook

    param_gather.FORM = cfg["form"]
    replicas.DEFERRED_PACK_BYTES = 64  # one collective per param: waits are visible per layer
    trace = _Trace(param_gather)
    if cfg["form"] == "auto":
        _hold_the_worker(param_gather, trace)
    name = cfg["model"]
    ref = DDP(_build(name))
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    model = _build(name)
    kw = dict(sharding=cfg["sharding"], overlap_param_gather=True, **HP)
    if cfg["before_ddp"]:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        ddp = DDP(model)
    else:
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **kw)
    if cfg["hook"]:
        ddp.register_comm_hook(opt, reduce_scatter_hook)
    names = {id(m): n or "(root)" for n, m in model.named_modules()}
    names[id(ddp)] = "DDP"
    checked = 0
    for it in range(6):
        for d, o in ((ref, o_ref), (ddp, opt)):
            loss = d(_input(name, rank, it)).float().square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
        queue = opt._param_gather.queue
        if queue is None:  # (the first steps exchange at once and record the order)
            continue
        items = _items_params(queue)
        pid = {id(p): i for i, p in enumerate(opt._all_params)}
        last = {}  # param id -> last item carrying it
        for k, pids in enumerate(items):
            for i in pids:
                last[i] = k
        trace.entries.clear()
        trace.on = True
        with torch.no_grad():
            out = ddp(_input(name, rank, 50 + it))
            trace.on = False
            want = ref(_input(name, rank, 50 + it))
        torch.testing.assert_close(out, want, **TOL)
        # what each module asked for, against the items carrying its own params
        asked = [(names.get(id(m), type(m).__name__), m, fin, ks)
                 for m, fin, ks in trace.entries]
        assert asked[0][0] == "DDP", [a[0] for a in asked]
        assert asked[0][3] == [], f"DDP's own forward waited through items {asked[0][3]} " \
                                  f"of {len(items)}"
        first_layer = None
        for mod_name, m, fin, ks in asked:
            own = [last[pid[id(p)]] for p in m.parameters(recurse=False) if id(p) in pid]
            if not own:
                assert ks == [], f"{mod_name} holds no params, yet waited through {ks}"
                continue
            need = max(own)
            assert all(k == need for k in ks), \
                f"{mod_name} waited through {ks}; its own params' last item is {need} " \
                f"(of {len(items)})"
            if first_layer is None:
                first_layer = (mod_name, fin, ks, need)
        assert first_layer is not None
        mod_name, fin, ks, need = first_layer
        assert ks == [need], f"the first layer {mod_name} asked for {ks}, not [{need}]"
        # the first layer begins with most of the exchange in flight
        assert fin is not None and fin <= need < len(items) // 2, \
            f"{mod_name} began with {fin} of {len(items)} items finished, needing {need}"
        checked += 1
    assert checked >= 3, checked
    opt.wait_for_params()
    for (n, a), b in zip(ref.module.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return True


@pytest.mark.parametrize("before_ddp", [True, False], ids=["opt-before-ddp", "opt-after-ddp"])
@pytest.mark.parametrize("hook", [False, True], ids=["all-reduce", "reduce_scatter_hook"])
def test_each_layer_waits_for_its_own_collectives_under_ddp(hook, before_ddp):
    run_world(_where_waits, 2, dict(form="nccl", model="stack", sharding="even", hook=hook,
                                    before_ddp=before_ddp))


@pytest.mark.parametrize("form", ["nccl", "auto"])
@pytest.mark.parametrize("sharding,world", [("even", 2), ("flat", 3)])
def test_tied_gpt_under_ddp_waits_layer_by_layer(form, sharding, world):
    run_world(_where_waits, world, dict(form=form, model="gpt", sharding=sharding, hook=False,
                                        before_ddp=True))


def test_gloo_worker_form_waits_layer_by_layer():
    run_world(_where_waits, 2, dict(form="auto", model="stack", sharding="param", hook=True,
                                    before_ddp=False))


# ------------------------------------------------------------------ reads that went stale
class _DataTied(torch.nn.Module):
    """`out` registered first, `inp` called first; `inp.weight.data = out.weight.data` (the
    old tying idiom: two Parameters over one memory)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.out = torch.nn.Linear(16, 16, bias=False)  # (first: the alias is `inp`'s)
        self.mid = torch.nn.Linear(16, 16)
        self.inp = torch.nn.Linear(16, 16, bias=False)
        self.inp.weight.data = self.out.weight.data

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _data_tied(rank, world, cfg):
    """No DDP (grads averaged by hand), as the stale read was found: every module's wait
    does happen there."""
    import torch.distributed as dist

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.05  # (a read that does not wait reads the old values)
    ref, model = _DataTied(), _DataTied()
    # the alias in the optimizer (it travels as `out.weight`), or a Parameter the optimizer
    # does not hold over memory it exchanges (waited for by memory)
    chosen = (lambda m: m.parameters()) if cfg["alias_stepped"] else \
        (lambda m: [p for n, p in m.named_parameters() if n != "inp.weight"])
    o_ref = torch.optim.AdamW(chosen(ref), **HP)
    opt = ZeroRedundancyOptimizer(chosen(model), torch.optim.AdamW, sharding="param",
                                  overlap_param_gather=True, **HP)
    for it in range(6):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(it))
        for m, o in ((ref, o_ref), (model, opt)):
            # every rank the same batch: averaged grads equal the local ones
            out = m(x)
            out.square().mean().backward()
            for p in chosen(m):
                dist.all_reduce(p.grad)
                p.grad /= world
            o.step()
            o.zero_grad()
            m.inp.weight.grad = None
        with torch.no_grad():  # right after the step, the exchange in flight
            xx = torch.randn(4, 16, generator=torch.Generator().manual_seed(99 + it))
            torch.testing.assert_close(model(xx), ref(xx), **TOL,
                                       msg=lambda m, it=it: f"forward after step {it}: {m}")
    opt.wait_for_params()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert model.inp.weight.data_ptr() == model.out.weight.data_ptr()
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("alias_stepped", [True, False], ids=["alias-stepped", "alias-not-held"])
def test_a_data_tied_param_whose_module_runs_first(alias_stepped, form):
    run_world(_data_tied, 2, dict(form=form, alias_stepped=alias_stepped))


def _probe(rank, world, cfg):
    """An eval or sampling head outside the model sharing its Parameter (`probe.weight =
    model.wte.weight`), called right after the step, before the model's own forward, first
    at a step after the forward's order was recorded."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.05
    ref, model = _TinyGPT(), _TinyGPT()
    embeddings = [ref.wte.weight, model.wte.weight]  # (taken before: no wait reading them)
    probes = []
    for m in (ref, model):
        torch.manual_seed(5)
        probe = torch.nn.Linear(32, 96, bias=False)
        if not cfg["tied_later"]:
            probe.weight = m.wte.weight
        probes.append(probe)
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, sharding=cfg["sharding"],
                                  overlap_param_gather=True, **HP)
    if cfg["ddp"]:
        ref, model = DDP(ref), DDP(model)
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
    for it in range(6):
        for m, o in ((ref, o_ref), (model, opt)):
            m(_input("gpt", rank, it)).square().mean().backward()
            if not cfg["ddp"]:  # (grads averaged by hand)
                for p in m.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            o.step()
            o.zero_grad()
        if cfg["tied_later"]:
            # called on its own weight from the start (zero_ext has seen it), then tied to
            # the embedding right after a step, with the exchange in flight
            if it == 3:
                for probe, emb in zip(probes, embeddings):
                    probe.weight = emb
        elif it < 2:  # (first called after the forward's order was recorded)
            continue
        with torch.no_grad():
            torch.testing.assert_close(probes[1](h), probes[0](h), **TOL,
                                       msg=lambda m, it=it: f"probe after step {it}: {m}")
    opt.wait_for_params()
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("sharding", ["param", "even"])
@pytest.mark.parametrize("ddp", [False, True], ids=["no-ddp", "ddp"])
def test_a_module_outside_the_model_sharing_a_param(ddp, sharding, form):
    run_world(_probe, 2, dict(ddp=ddp, sharding=sharding, form=form, tied_later=False))


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("ddp", [False, True], ids=["no-ddp", "ddp"])
def test_a_known_module_tied_to_a_param_while_in_flight(ddp, form):
    run_world(_probe, 2, dict(ddp=ddp, sharding="even", form=form, tied_later=True))


class _WithAux(_TinyGPT):
    """A forward that first reads an auxiliary head's weight when the model has one
    (attached by the script later), without calling the head."""

    def forward(self, idx):
        aux = self._modules.get("aux")
        extra = 0.0
        if aux is not None:  # (before any module of the model runs)
            extra = 0.1 * torch.nn.functional.linear(torch.ones(idx.shape[1], 32), aux.weight)
        return super().forward(idx) + extra


def _attached_later(rank, world, cfg):
    """A head tied to the embedding (through a reference the script took before) attached
    to the model right after a step, with the exchange in flight; the model's forward reads
    its weight as an attribute."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.05
    ref, model = _WithAux(), _WithAux()
    embeddings = [ref.wte.weight, model.wte.weight]
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, sharding="even",
                                  overlap_param_gather=True, **HP)
    inner = (ref, model)
    if cfg["ddp"]:
        ref, model = DDP(ref), DDP(model)
    for it in range(6):
        for m, o in ((ref, o_ref), (model, opt)):
            m(_input("gpt", rank, it)).square().mean().backward()
            if not cfg["ddp"]:
                for p in m.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            o.step()
            o.zero_grad()
        if it == 3:
            for m, emb in zip(inner, embeddings):
                head = torch.nn.Linear(32, 96, bias=False)
                head.weight = emb
                m.aux = head
        if it >= 3:
            with torch.no_grad():
                x = _input("gpt", rank, 70 + it)
                torch.testing.assert_close(model(x), ref(x), **TOL,
                                           msg=lambda m, it=it: f"forward after step {it}: {m}")
    opt.wait_for_params()
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("ddp", [False, True], ids=["no-ddp", "ddp"])
def test_a_head_attached_while_in_flight_read_by_its_parent(ddp, form):
    run_world(_attached_later, 2, dict(ddp=ddp, form=form))


# ------------------------------------------------------------------ found by review
class _KeptNested(torch.nn.Module):
    """Weights and biases kept as a list of pairs (`self._wb = [(l.weight, l.bias) ...]`),
    read by F.linear before any layer's own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self._wb = [(l.weight, l.bias) for l in self.layers]

    def forward(self, x):
        for w, b in self._wb:
            x = torch.tanh(torch.nn.functional.linear(x, w, b))
        return x


class _OneChildBlock(torch.nn.Module):
    """A block holding no param itself and one child, whose params it keeps in a tuple and
    reads (`F.linear(x, *self._pre)`): its list covers its whole tree, yet it is a read."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(64, 64)
        self._pre = (self.pre.weight, self.pre.bias)

    def forward(self, x):
        return torch.tanh(torch.nn.functional.linear(x, *self._pre))


class _OneChildStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_OneChildBlock() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _build_read(name):
    if name == "nested":
        return _KeptNested()
    if name == "one-child":
        return _OneChildStack()
    return _Stack()


def _reads(rank, world, cfg):
    """The model's forward right after each step (exchange in flight, held back 50 ms)
    against DDP + torch.optim.AdamW; `wrap`: torch.jit.script on both, or torch.compile
    on the candidate (then: compiled once, never again)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.05
    ref_m, cand_m = _build_read(cfg["model"]), _build_read(cfg["model"])
    if cfg.get("wrap") == "script":
        ref_m, cand_m = torch.jit.script(ref_m), torch.jit.script(cand_m)
    o_ref = torch.optim.AdamW(ref_m.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(cand_m.parameters(), torch.optim.AdamW, sharding="even",
                                  overlap_param_gather=True, **HP)
    ref, cand = DDP(ref_m), DDP(cand_m)
    if cfg.get("wrap") == "compile":
        import torch._dynamo as dynamo

        dynamo.reset()
        if cfg["how"] == "compile(DDP(m))":
            cand = torch.compile(cand, backend="eager")
        elif cfg["how"] == "DDP(compile(m))":
            cand = DDP(torch.compile(cand_m, backend="eager"))
        else:  # compiled in place
            cand_m.compile(backend="eager")
        counters = dynamo.utils.counters
    compiled_at = []
    for it in range(8):
        losses = []
        for m, o in ((ref, o_ref), (cand, opt)):
            loss = m(_input("stack", rank, it)).square().mean()
            loss.backward()
            losses.append(loss.detach())
            o.step()
            o.zero_grad()
        # (the training forward itself reads the params in flight: compiled, only it runs,
        # so that every compiled forward meets the exchange in flight)
        torch.testing.assert_close(losses[1], losses[0], **TOL,
                                   msg=lambda m, it=it: f"loss at step {it}: {m}")
        if cfg.get("wrap") == "compile":
            compiled_at.append(counters["stats"]["unique_graphs"])
            continue
        with torch.no_grad():
            x = _input("stack", rank, 40 + it)
            torch.testing.assert_close(cand(x), ref(x), **TOL,
                                       msg=lambda m, it=it: f"forward after step {it}: {m}")
    opt.wait_for_params()
    for (n, a), b in zip(ref_m.named_parameters(), cand_m.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), **TOL, msg=lambda m, n=n: f"{n}: {m}")
    if compiled_at:  # (no recompile once the exchange is left in flight at every step)
        assert compiled_at[-1] == compiled_at[1], f"graphs compiled by step: {compiled_at}"
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("model", ["nested", "one-child"])
def test_params_kept_in_nested_lists_and_by_a_one_child_block(model, form):
    run_world(_reads, 2, dict(model=model, form=form))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_scripted_model_waits_for_its_params():
    run_world(_reads, 2, dict(model="stack", form="auto", wrap="script"))


@pytest.mark.parametrize("how", ["compile(DDP(m))", "DDP(compile(m))", "m.compile()"])
def test_a_compiled_model_is_right_and_compiled_once(how):
    run_world(_reads, 2, dict(model="stack", form="auto", wrap="compile", how=how))


def _threads(rank, world, cfg):
    """Two threads run the model's forward right after each step."""
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    ref_m, cand_m = _Stack(), _Stack()
    o_ref = torch.optim.AdamW(ref_m.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(cand_m.parameters(), torch.optim.AdamW, sharding="even",
                                  overlap_param_gather=True, **HP)
    ref, cand = DDP(ref_m), DDP(cand_m)
    for it in range(12):
        for m, o in ((ref, o_ref), (cand, opt)):
            m(_input("stack", rank, it)).square().mean().backward()
            o.step()
            o.zero_grad()
        x = _input("stack", rank, 40 + it)
        outs, errors = [None, None], []

        def run(j):
            try:
                with torch.no_grad():
                    outs[j] = cand_m(x)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        with torch.no_grad():
            want = ref_m(x)
        for out in outs:
            torch.testing.assert_close(out, want, **TOL)
    opt.wait_for_params()
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
def test_forwards_on_two_threads_after_the_step(form):
    run_world(_threads, 2, dict(form=form))


class _ReadOtherwise(torch.nn.Module):
    """A head whose forward never runs, its weight read before any module's forward through
    a reference made at construction that is no attribute read: a functools.partial, a
    namespace, a list four deep, a plain tensor over its memory."""

    def __init__(self, how):
        import functools
        import types

        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 16, bias=False)
        w = self.head.weight
        if how == "partial":
            self.proj = functools.partial(torch.nn.functional.linear, weight=w)
        elif how == "namespace":
            self.ns = types.SimpleNamespace(w=w)
        else:
            self.deep = [[[[w]]]]

    def forward(self, x):
        if self.how == "partial":
            h = self.proj(x)
        else:
            w = self.ns.w if self.how == "namespace" else self.deep[0][0][0][0]
            h = torch.nn.functional.linear(x, w)
        return self.b(torch.tanh(self.a(h)))


def _read_otherwise(rank, world, cfg):
    import torch.distributed as dist

    from zero_ext import ZeroRedundancyOptimizer, param_gather

    param_gather.FORM = cfg["form"]
    param_gather.WORKER_DELAY_S = 0.05
    ref, model = _ReadOtherwise(cfg["how"]), _ReadOtherwise(cfg["how"])
    o_ref = torch.optim.AdamW(ref.parameters(), **HP)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, sharding="param",
                                  overlap_param_gather=True, **HP)
    for it in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(it))
        for m, o in ((ref, o_ref), (model, opt)):
            m(x).square().mean().backward()
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            o.step()
            o.zero_grad()
        with torch.no_grad():  # right after the step, the exchange in flight
            xx = torch.randn(4, 16, generator=torch.Generator().manual_seed(99 + it))
            torch.testing.assert_close(model(xx), ref(xx), **TOL,
                                       msg=lambda m, it=it: f"forward after step {it}: {m}")
    opt.wait_for_params()
    return True


@pytest.mark.parametrize("form", ["auto", "nccl"])
@pytest.mark.parametrize("how", ["partial", "namespace", "deep-list"])
def test_a_param_no_forward_reads_through_its_module(how, form):
    """Params no module's forward read when the order was recorded travel first, and the
    first forward after the step waits for them."""
    run_world(_read_otherwise, 2, dict(how=how, form=form))
