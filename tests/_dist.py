"""Multi-rank test harness: run picklable functions on a gloo world of 1..N CPU processes.

Two entry points:

* ``run_world(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank
  after ``init_process_group("gloo")`` and returns the list of per-rank return values, or
  raises one AssertionError holding every rank's exception and traceback.
* ``Scenarios``: a registry of many small scenarios that share ONE spawned world per world
  size (spawning is the slow part).  Each scenario's per-rank outcome (return value or
  exception) is recorded separately, so one broken scenario fails only its own tests.

Robustness rules, so that a buggy optimizer fails tests instead of hanging CI:

* Workers are forked from a forkserver that preloaded torch (about 50 ms per world instead of
  3-5 s with spawn), use one thread each, and rendezvous through a FileStore in a temp dir.
* Every collective has a timeout (60 s on the default group, ``GROUP_TIMEOUT_S`` on the fresh
  per-scenario groups), and the parent kills the whole world after a hard wall-clock timeout,
  reporting which scenario every rank was in.
* A scenario that leaves a collective half-done can only poison its own process group: by
  default each scenario gets a fresh group (``ctx.pg``), and ranks meet at a store-based
  barrier (independent of any process group) between scenarios.
* A rank that dies without reporting (segfault, os._exit) gets the others killed after a short
  grace period; the tail of every rank's stdout/stderr is attached to the failure message.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = float(os.environ.get("ZERO_EXT_TEST_WORLD_TIMEOUT", "300"))
INIT_TIMEOUT_S = 60.0
GROUP_TIMEOUT_S = 30.0
BARRIER_TIMEOUT_S = 120.0
_CRASH_GRACE_S = 3.0
_LOG_TAIL = 4000

_ctx = None


def _mp_context():
    global _ctx
    if _ctx is None:
        method = os.environ.get("ZERO_EXT_TEST_START_METHOD", "forkserver")
        _ctx = mp.get_context(method)
        if method == "forkserver":
            # torch and its slow first imports (the optimizer base imports torch._dynamo);
            # building/loading the native ops stays in the workers.
            _ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                         "torch.distributed.checkpoint"])
    return _ctx


# --------------------------------------------------------------------------------------------
# outcomes


@dataclasses.dataclass
class Outcome:
    """What one rank did in one scenario (or in a whole run_world call)."""

    rank: int
    ok: bool
    value: Any = None
    exc_type: str | None = None  # qualified name of the exception class
    exc_mro: tuple = ()  # names of every class in its MRO, for isinstance-like checks
    message: str = ""
    tb: str = ""

    def is_instance(self, cls: type) -> bool:
        return (not self.ok) and cls.__name__ in self.exc_mro

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: returned {self.value!r:.200}"
        return f"rank {self.rank}: raised {self.exc_type}: {self.message}\n{self.tb}"


def _exc_outcome(rank: int, exc: BaseException) -> Outcome:
    t = type(exc)
    return Outcome(
        rank=rank, ok=False, exc_type=f"{t.__module__}.{t.__qualname__}",
        exc_mro=tuple(c.__name__ for c in t.__mro__), message=str(exc),
        tb="".join(traceback.format_exception(exc)))


def _dump(rank: int, value: Any) -> bytes:
    try:
        return pickle.dumps(Outcome(rank=rank, ok=True, value=value))
    except Exception as exc:  # unpicklable return value: report it, don't crash the world
        return pickle.dumps(_exc_outcome(rank, RuntimeError(
            f"harness: return value not picklable ({type(exc).__name__}: {exc})")))


# --------------------------------------------------------------------------------------------
# worker side


@dataclasses.dataclass
class Ctx:
    """Handed to every scenario: who am I, and which process group to use."""

    rank: int
    world_size: int
    pg: Any  # fresh gloo group (or None = default group, for scenarios that ask for it)
    store: Any
    scenario: str


def _store_barrier(store, key: str, world_size: int, timeout_s: float = BARRIER_TIMEOUT_S):
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"harness: store barrier {key!r} timed out after {timeout_s} s")
        time.sleep(0.002)


def _destroy_holds_the_gil(torch) -> bool:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) < (2, 8)


def _worker(rank: int, world_size: int, store_path: str, log_path: str, q, job):
    # Everything this rank prints (and a crash report) goes to its own log file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import faulthandler

        faulthandler.enable()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    except BaseException as exc:
        q.put(("fatal", rank, pickle.dumps(_exc_outcome(rank, exc))))
        return
    try:
        kind = job[0]
        if kind == "fn":
            _, fn, args = job
            q.put(("progress", rank, fn.__name__))
            try:
                value = fn(rank, world_size, *args)
                q.put(("result", rank, None, _dump(rank, value)))
            except BaseException as exc:
                q.put(("result", rank, None, pickle.dumps(_exc_outcome(rank, exc))))
        else:
            _, scenarios = job
            for i, (name, fn, use_default_group) in enumerate(scenarios):
                _store_barrier(store, f"zero_ext_test/before/{i}", world_size)
                pg = None
                if not use_default_group and world_size > 0:
                    pg = dist.new_group(
                        list(range(world_size)),
                        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
                q.put(("progress", rank, name))
                ctx = Ctx(rank=rank, world_size=world_size, pg=pg, store=store, scenario=name)
                try:
                    torch.manual_seed(1234)
                    value = fn(ctx)
                    payload = _dump(rank, value)
                except BaseException as exc:
                    payload = pickle.dumps(_exc_outcome(rank, exc))
                q.put(("result", rank, name, payload))
        q.put(("progress", rank, "<shutdown>"))
        if _destroy_holds_the_gil(torch):
            # torch < 2.8 destroys a gloo group with the GIL held, while a gloo worker still
            # dropping a finished collective's tensors may need it: both wait forever
            # (torch's own hang, fixed in 2.8; seen on 2.6.0 in a test whose rank built no
            # optimizer). A pause with the GIL free lets the workers finish first. zero_ext's
            # own release without the GIL is tested where scenarios destroy their groups
            # themselves (test_shutdown_and_amp_internals.py), before this point.
            import gc

            gc.collect()
            time.sleep(0.1)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        q.put(("done", rank, None))
    except BaseException as exc:
        q.put(("fatal", rank, pickle.dumps(_exc_outcome(rank, exc))))
    finally:
        sys_stdout_flush()


def sys_stdout_flush():
    import sys

    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------
# parent side


@dataclasses.dataclass
class WorldRun:
    world_size: int
    results: dict  # (scenario name or None, rank) -> Outcome
    fatal: dict  # rank -> Outcome
    progress: dict  # rank -> last scenario announced
    done: set
    timed_out: bool
    exitcodes: dict
    logs: dict  # rank -> tail of its output
    elapsed_s: float

    def problem(self) -> str | None:
        """A description of a world-level failure (crash, hang, fatal error), else None."""
        if not self.fatal and not self.timed_out and len(self.done) == self.world_size:
            return None
        lines = [f"world of {self.world_size} ranks failed after {self.elapsed_s:.1f} s"
                 + (" (hard timeout: killed)" if self.timed_out else "")]
        for r in range(self.world_size):
            state = "finished" if r in self.done else (
                f"was in {self.progress.get(r, '<startup>')!r}, exit code {self.exitcodes.get(r)}")
            lines.append(f"  rank {r}: {state}")
        for r, out in sorted(self.fatal.items()):
            lines.append(f"--- rank {r} fatal error ---\n{out.describe()}")
        for r in range(self.world_size):
            if r not in self.done and self.logs.get(r):
                lines.append(f"--- rank {r} output (tail) ---\n{self.logs[r]}")
        return "\n".join(lines)


def _launch(world_size: int, job, timeout_s: float) -> WorldRun:
    ctx = _mp_context()
    tmp = tempfile.mkdtemp(prefix="zero_ext_world_")
    store_path = os.path.join(tmp, "store")
    q = ctx.Queue()
    procs = []
    t0 = time.monotonic()
    for rank in range(world_size):
        p = ctx.Process(target=_worker, daemon=True, name=f"zero_ext_rank{rank}",
                        args=(rank, world_size, store_path, os.path.join(tmp, f"rank{rank}.log"),
                              q, job))
        p.start()
        procs.append(p)
    results, fatal, progress, done = {}, {}, {}, set()
    timed_out = False
    crash_seen_at = None
    deadline = t0 + timeout_s
    try:
        while len(done) + len(fatal) < world_size:
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            try:
                msg = q.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in done and r not in fatal]
                if dead:
                    # Drain what is left, then give the others a moment before killing.
                    crash_seen_at = crash_seen_at or now
                    if now - crash_seen_at > _CRASH_GRACE_S:
                        break
                continue
            kind, rank = msg[0], msg[1]
            if kind == "progress":
                progress[rank] = msg[2]
            elif kind == "result":
                results[(msg[2], rank)] = pickle.loads(msg[3])
            elif kind == "fatal":
                fatal[rank] = pickle.loads(msg[2])
                crash_seen_at = crash_seen_at or time.monotonic()
            elif kind == "done":
                done.add(rank)
    finally:
        for p in procs:
            p.join(timeout=5 if not (timed_out or crash_seen_at) else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
        logs = {}
        for r in range(world_size):
            try:
                with open(os.path.join(tmp, f"rank{r}.log"), "rb") as f:
                    logs[r] = f.read()[-_LOG_TAIL:].decode("utf-8", "replace")
            except OSError:
                logs[r] = ""
        q.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return WorldRun(world_size, results, fatal, progress, done, timed_out, exitcodes, logs,
                    time.monotonic() - t0)


def run_world(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank values.

    ``fn`` must be a module-level function (it is pickled by name).  Raises AssertionError
    describing every rank's failure if any rank raised, crashed or the world timed out.
    """
    run = _launch(world_size, ("fn", fn, args), timeout)
    outs = [run.results.get((None, r)) for r in range(world_size)]
    bad = [o for o in outs if o is not None and not o.ok]
    problem = run.problem()
    if bad or problem:
        parts = [f"{fn.__name__} failed on world size {world_size}:"]
        parts += [o.describe() for o in bad]
        if problem:
            parts.append(problem)
        raise AssertionError("\n".join(parts))
    return [o.value for o in outs]


class ScenarioResults:
    """Per-scenario, per-rank outcomes of one world."""

    def __init__(self, run: WorldRun, names: list):
        self.run = run
        self.names = names

    @property
    def world_size(self) -> int:
        return self.run.world_size

    def outcomes(self, name: str) -> list:
        """Every rank's Outcome for scenario ``name``; AssertionError if some rank has none."""
        if name not in self.names:
            raise KeyError(f"unknown scenario {name!r}")
        outs = [self.run.results.get((name, r)) for r in range(self.world_size)]
        if any(o is None for o in outs):
            missing = [r for r, o in enumerate(outs) if o is None]
            raise AssertionError(
                f"scenario {name!r}: no outcome from ranks {missing}\n"
                + (self.run.problem() or ""))
        return outs

    def values(self, name: str) -> list:
        """Every rank's return value for ``name``; AssertionError if any rank raised."""
        outs = self.outcomes(name)
        bad = [o for o in outs if not o.ok]
        if bad:
            raise AssertionError(
                f"scenario {name!r} raised on world size {self.world_size}:\n"
                + "\n".join(o.describe() for o in bad))
        return [o.value for o in outs]


class Scenarios:
    """A registry of scenarios that run together in one world per world size.

    Usage, in a test module::

        SC = Scenarios(__name__)

        @SC.scenario()
        def parity_basic(ctx):          # runs on every rank; ctx.pg is a fresh gloo group
            ...
            return something_picklable

        @pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
        def world(request):
            return SC.run(request.param)

        def test_parity_basic(world):
            vals = world.values("parity_basic")

    ``scenario(default_group=True)`` hands ``ctx.pg = None`` (the default process group)
    instead of a fresh one; put such scenarios last, since a desync there can break the
    default group for the rest of the world.  ``min_world``/``max_world`` skip a scenario
    (it returns None on every rank) outside that range.
    """

    def __init__(self, module: str):
        self.module = module
        self._items: list = []
        self._cache: dict = {}

    def scenario(self, *, default_group: bool = False, min_world: int = 1, max_world: int = 99):
        def deco(fn):
            self._items.append((fn.__name__, fn, default_group, min_world, max_world))
            return fn

        return deco

    def names(self, world_size: int) -> list:
        return [n for n, _, _, lo, hi in self._items if lo <= world_size <= hi]

    def run(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> ScenarioResults:
        if world_size not in self._cache:
            job = ("scenarios", [(n, fn, dg) for n, fn, dg, lo, hi in self._items
                                 if lo <= world_size <= hi])
            run = _launch(world_size, job, timeout)
            self._cache[world_size] = ScenarioResults(run, self.names(world_size))
        return self._cache[world_size]


# --------------------------------------------------------------------------------------------
# assertions on outcomes


def assert_raised(outcome: Outcome, exc_type: type, match: str | None = None) -> None:
    """``outcome`` is an exception of ``exc_type`` whose message contains ``match`` (any case)."""
    if outcome.ok:
        raise AssertionError(
            f"rank {outcome.rank}: expected {exc_type.__name__}"
            + (f" mentioning {match!r}" if match else "") + f", got a return value {outcome.value!r:.200}")
    if not outcome.is_instance(exc_type):
        raise AssertionError(
            f"rank {outcome.rank}: expected {exc_type.__name__}, got {outcome.describe()}")
    if match is not None and match.lower() not in outcome.message.lower():
        raise AssertionError(
            f"rank {outcome.rank}: {exc_type.__name__} message does not mention {match!r}: "
            f"{outcome.message!r}")


# --------------------------------------------------------------------------------------------
# helpers shared by the zero_ext optimizer tests (tests/test_zero_*.py)

# ZERO_EXT_TEST_AGAINST_TORCH=1 runs the scenarios against torch's own
# ZeroRedundancyOptimizer: a check of the tests themselves (torch fails the edge cases on
# purpose, but must pass the plain parity, state-dict and Join scenarios).
AGAINST_TORCH = os.environ.get("ZERO_EXT_TEST_AGAINST_TORCH", "0") == "1"


def zero_class():
    if AGAINST_TORCH:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    else:
        from zero_ext import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


def make_zero(params, optimizer_class, pg=None, **kwargs):
    """Construct the optimizer under test on process group ``pg`` (None = default group)."""
    if AGAINST_TORCH:
        kwargs.pop("sharding", None)
    return zero_class()(params, optimizer_class, process_group=pg, **kwargs)


def make_params(shapes, seed: int = 0, dtypes=None):
    """Leaf tensors with requires_grad, identical on every rank (seeded, rank-independent)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        t = torch.randn(shape, generator=g) * 0.5
        if dtypes is not None:
            t = t.to(dtypes[i])
        out.append(t.requires_grad_())
    return out


def clones(params):
    """Independent leaf copies (same values, dtypes and requires_grad)."""
    return [p.detach().clone().requires_grad_(p.requires_grad) for p in params]


def fake_grads(params, step: int, seed: int = 0, skip=None):
    """Set .grad of every trainable param to seeded noise, identical on every rank.

    ``skip(i, step) -> bool`` leaves param i's grad as None on that step.
    """
    import torch

    for i, p in enumerate(params):
        if not p.requires_grad or (skip is not None and skip(i, step)):
            p.grad = None
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def detached(params):
    return [p.detach().clone() for p in params]


def sd_diff(a, b, path="sd", atol=0.0, rtol=0.0) -> list:
    """Differences between two (optimizer state) dict trees; tensors compared by value,
    dtype, shape and device (within atol/rtol), everything else with ==."""
    import torch

    out = []
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return [f"{path}: {a.dtype}/{tuple(a.shape)}/{a.device} vs "
                    f"{b.dtype}/{tuple(b.shape)}/{b.device}"]
        if atol == 0 and rtol == 0:
            ok = torch.equal(a, b)
        else:
            ok = torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)
        if not ok:
            d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            out.append(f"{path}: values differ (max abs diff {d:.3g})")
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{path}: keys {sorted(map(str, set(a) - set(b)))} only in first, "
                       f"{sorted(map(str, set(b) - set(a)))} only in second")
        for k in a:
            if k in b:
                out += sd_diff(a[k], b[k], f"{path}[{k!r}]", atol, rtol)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        for i, (x, y) in enumerate(zip(a, b)):
            out += sd_diff(x, y, f"{path}[{i}]", atol, rtol)
        return out
    if a != b:
        out.append(f"{path}: {a!r} vs {b!r}")
    return out


def assert_params_close(got, want, atol, rtol, what="param"):
    """Elementwise closeness of two lists of tensors, with dtype preserved."""
    import torch

    assert len(got) == len(want), f"{len(got)} {what}s vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what} {i}: dtype {g.dtype} vs {w.dtype}"
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol,
                                   msg=lambda m, i=i: f"{what} {i}: {m}")


def assert_same_on_every_rank(per_rank, what="param"):
    """Bitwise equality of every rank's tensors with rank 0's (params are replicated)."""
    import torch

    for r in range(1, len(per_rank)):
        for i, (a, b) in enumerate(zip(per_rank[0], per_rank[r])):
            assert torch.equal(a, b), f"{what} {i} differs between rank 0 and rank {r}"


def error_of(fn: Callable) -> tuple[str, str] | None:
    """Call fn(); (exception type name, message) if it raised, else None: a rank's outcome
    as plain, picklable data for a test to compare across ranks."""
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))


def gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


WORLD_SIZES = (1, 2, 3)


# --------------------------------------------------------------------------------------------
# helpers for the contract tests (tests/test_real_use.py, tests/test_contract_harness.py)


def fresh_grads(params, step: int, seed: int = 0, skip=None):
    """Like ``fake_grads``, but a frozen param (requires_grad False) KEEPS whatever .grad it
    has (None or a stale one), as after a real backward: torch optimizers still step it."""
    import torch

    for i, p in enumerate(params):
        if not p.requires_grad:
            continue
        if skip is not None and skip(i, step):
            p.grad = None
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + i)
        if p.dtype.is_complex:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        else:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def torch_rule_max_load(group_sizes, world_size: int) -> int:
    """Largest per-rank load (in elements) of torch's ZeroRedundancyOptimizer partition:
    group by group, params sorted by size (largest first), each to the least loaded rank."""
    loads = [0] * world_size
    for sizes in group_sizes:
        for n in sorted(sizes, reverse=True):
            r = min(range(world_size), key=lambda k: loads[k])
            loads[r] += n
    return max(loads)


def store_allgather(store, key: str, rank: int, world_size: int, value,
                    timeout_s: float = GROUP_TIMEOUT_S) -> list:
    """Every rank's picklable ``value`` through the rendezvous store, independent of any
    process group (usable after a collective went wrong). ``key`` must be unique per call."""
    store.set(f"{key}/{rank}", pickle.dumps(value))
    out = []
    deadline = time.monotonic() + timeout_s
    for r in range(world_size):
        k = f"{key}/{r}"
        while True:
            if store.check([k]):
                out.append(pickle.loads(store.get(k)))
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"harness: rank {r} never published {key!r}")
            time.sleep(0.002)
    return out


def run_specs(world_size: int, fn: Callable, specs: list, timeout: float = DEFAULT_TIMEOUT_S,
              prefix: str = "spec") -> ScenarioResults:
    """Run ``fn(spec, ctx)`` for every (picklable) spec in ONE world of ``world_size`` ranks,
    each as its own scenario (fresh process group, store barrier in between), named
    ``f"{prefix}{i}"``. ``fn`` must be a module-level function."""
    import functools

    names = [f"{prefix}{i}" for i in range(len(specs))]
    job = ("scenarios", [(n, functools.partial(fn, s), False) for n, s in zip(names, specs)])
    return ScenarioResults(_launch(world_size, job, timeout), names)
