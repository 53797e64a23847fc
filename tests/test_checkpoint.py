"""Sharded checkpoints (zero_ext.checkpoint) and the chunked consolidation (state.consolidate).

The story runs in two spawned gloo worlds plus this process (world 1, torch.distributed not
initialized), every resume compared with an uninterrupted plain torch.optim.AdamW run (fp32
atol/rtol 1e-6, bf16 1e-2) and with the hyperparameters changed before the save coming back:

* world 1 trains K steps in both sharding modes and saves;
* world 3 loads those in both modes and continues; trains afresh, saves, consolidates (tiny
  and default message sizes: same dict, equal to AdamW's); saves an Adafactor optimizer
  (non-per-element state);
* world 2 loads the world-3 checkpoints in both modes and continues, the Adafactor one too;
  interrupted saves (rank 0 raising before the swap, rank 1 raising while preparing, a crash
  between the two renames) leave the previous checkpoint loadable; each kind of mismatched
  checkpoint raises ValueError naming it on every rank, without a hang, changing nothing;
* world 1 loads the world-3 checkpoints and continues;
* `python -m zero_ext.checkpoint convert` gives what consolidate_state_dict gives, and
  torch.optim.AdamW loads it and continues like the uninterrupted run.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from _dist import (assert_same_on_every_rank, detached, fake_grads, gloo_available,
                   make_params, make_zero, run_world, sd_diff)

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with gloo")

AdamW = torch.optim.AdamW
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("param", "flat", "even")
# sizes chosen so that flat sharding cuts several params between ranks at worlds 2 and 3
SHAPES = [(40, 6), (12,), (6, 12), (6,), (25,), (3, 3, 3), (1,), (64,), (5, 4), (2,), (10, 3)]
DTYPES = [torch.float32] * 10 + [torch.bfloat16]
DEFAULTS = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
LR0_AT_SAVE = 7e-3  # group 0's lr is changed before the save; it must travel with it
K = 3  # steps before the checkpoint, and again after it
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-2, 1e-2)}


def groups(ps):
    return [{"params": [ps[i] for i in (0, 2, 5, 8)], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ps[i] for i in (1, 3, 6, 9, 10)], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [ps[i] for i in (4, 7)], "amsgrad": True}]


def new_params():
    return make_params(SHAPES, seed=5, dtypes=DTYPES)


NEVER = 9  # never gets a grad: no state in any format


def _skip(i, s):
    return i == NEVER or (i + s) % 5 == 0  # some params miss some steps, as with real models


def train(opt, ps, steps):
    for s in steps:
        fake_grads(ps, s, seed=3, skip=_skip)
        opt.step()


def reference():
    """Uninterrupted plain AdamW: params after K and after 2K steps, state dict after K."""
    ps = new_params()
    ref = AdamW(groups(ps), **DEFAULTS)
    train(ref, ps, range(K))
    ref.param_groups[0]["lr"] = LR0_AT_SAVE
    at_k, sd_k = detached(ps), copy.deepcopy(ref.state_dict())
    train(ref, ps, range(K, 2 * K))
    return at_k, sd_k, detached(ps)


@pytest.fixture(scope="module")
def ref():
    return reference()


def assert_close_params(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}: param {i} dtype {g.dtype} vs {w.dtype}"
        atol, rtol = TOL[w.dtype]
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol,
                                   msg=lambda m, i=i: f"{what}: param {i}: {m}")


def close_to_reference(sd, ref_sd) -> list:
    """Groups exactly, state within the tolerance of its dtype (fp32 1e-6; bf16 state can
    differ from torch's for-loop AdamW by one bf16 ulp)."""
    diffs = sd_diff(sd["param_groups"], ref_sd["param_groups"], "param_groups")
    if set(sd["state"]) != set(ref_sd["state"]):
        return diffs + [f"state for params {sorted(sd['state'])} vs {sorted(ref_sd['state'])}"]
    for pid, st in sd["state"].items():
        for name, v in st.items():
            w = ref_sd["state"][pid].get(name)
            tol = TOL.get(w.dtype, (0, 0)) if isinstance(w, torch.Tensor) else (0, 0)
            diffs += sd_diff(v, w, f"state[{pid}][{name!r}]", *tol)
    return diffs


def trainable(ps):
    """Leaf copies that require grad (detached() results do not)."""
    return [p.detach().clone().requires_grad_() for p in ps]


def _zero(ps, mode, pg=None):
    return make_zero(groups(ps), AdamW, pg, sharding=mode, **DEFAULTS)


def _resume(ps_at_k, mode, path, pg=None):
    """Fresh optimizer on the checkpointed params, load, K more steps."""
    from zero_ext import checkpoint

    ps = trainable(ps_at_k)
    opt = _zero(ps, mode, pg)
    checkpoint.load(opt, path)
    lr0 = opt.param_groups[0]["lr"]
    train(opt, ps, range(K, 2 * K))
    return ps, opt, lr0


# --------------------------------------------------------------------------------------------
# The story, in two spawned worlds (spawning and importing is the slow part):
#   world 1 (this process, no torch.distributed): train K, save "w1_<mode>"
#   world 3: load the world-1 checkpoints and continue; train K afresh, save "w3_<mode>",
#            consolidate; Adafactor save
#   world 2: load the world-3 checkpoints and continue; interrupted saves; mismatches
#   world 1 again: load the world-3 checkpoints and continue


def _adafactor_groups(ps):
    return [{"params": ps[:5], "lr": 1e-2}, {"params": ps[5:10], "lr": 3e-3}]


def _resume_all(prefix, root, starts) -> dict:
    out = {}
    for save_mode in MODES:
        for load_mode in MODES:
            ps, opt, lr0 = _resume(starts[save_mode], load_mode,
                                   os.path.join(root, f"{prefix}_{save_mode}"))
            out[(save_mode, load_mode)] = {"params": detached(ps), "lr0": lr0}
    return out


def _w3(rank, world, root, w1_starts):
    from zero_ext import checkpoint, state

    out = {"from_w1": _resume_all("w1", root, w1_starts)}
    for mode in MODES:
        ps = new_params()
        opt = _zero(ps, mode)
        train(opt, ps, range(K))
        opt.param_groups[0]["lr"] = LR0_AT_SAVE
        checkpoint.save(opt, os.path.join(root, f"w3_{mode}"))
        sds = {}
        default = state.CONSOLIDATE_CHUNK
        for chunk in (5, 64, default):
            state.CONSOLIDATE_CHUNK = chunk
            try:
                opt.consolidate_state_dict(to=world - 1)
            finally:
                state.CONSOLIDATE_CHUNK = default
            sds[chunk] = opt.state_dict() if rank == world - 1 else None
        out[mode] = {"params": detached(ps), "sds": sds, "split": _split_params(opt)}
    # non-per-element state (Adafactor's row/col statistics), param sharding only
    ps = make_params(SHAPES[:10], seed=8)
    opt = make_zero(_adafactor_groups(ps), torch.optim.Adafactor, None)
    train(opt, ps, range(K))
    checkpoint.save(opt, os.path.join(root, "w3_adafactor"))
    out["adafactor"] = detached(ps)
    return out


def _split_params(opt):
    """Params whose state this rank holds only part of (flat mode)."""
    if opt.sharding != "flat":
        return []
    return sorted({pc.param_id for b in opt.plan.buckets for pc in b.pieces(opt.rank)
                   if pc.length < opt._all_params[pc.param_id].numel()})


def _w2(rank, world, root, w3_starts, adafactor_start):
    from zero_ext import checkpoint

    out = {"from_w3": _resume_all("w3", root, w3_starts)}
    checkpoint.DIRECT_READS = False  # DCP's own reader: the same bytes must come back
    try:
        ps, _, _ = _resume(w3_starts["flat"], "param", os.path.join(root, "w3_flat"))
        out["dcp_reader"] = detached(ps)
    finally:
        checkpoint.DIRECT_READS = True
    ps = trainable(adafactor_start)
    opt = make_zero(_adafactor_groups(ps), torch.optim.Adafactor, None)
    checkpoint.load(opt, os.path.join(root, "w3_adafactor"))
    train(opt, ps, range(K, 2 * K))
    out["adafactor"] = detached(ps)
    out["atomic"] = _atomic(rank, root)
    out["mismatch"] = _mismatch(rank, root)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zero_ext_ckpt"))


@pytest.fixture(scope="module")
def w1(root):
    """World 1 in this process, torch.distributed not initialized: train, save."""
    from zero_ext import checkpoint

    assert not (dist.is_available() and dist.is_initialized())
    out = {}
    for mode in MODES:
        ps = new_params()
        opt = _zero(ps, mode)
        train(opt, ps, range(K))
        opt.param_groups[0]["lr"] = LR0_AT_SAVE
        checkpoint.save(opt, os.path.join(root, f"w1_{mode}"))
        out[mode] = detached(ps)
    return out


@pytest.fixture(scope="module")
def w3(root, w1):
    return run_world(_w3, 3, root, w1)


@pytest.fixture(scope="module")
def w2(root, w3):
    starts = {m: w3[0][m]["params"] for m in MODES}
    return run_world(_w2, 2, root, starts, w3[0]["adafactor"])


@pytest.fixture(scope="module")
def w1_again(root, w3):
    """World 1 without torch.distributed: load the world-3 checkpoints, continue."""
    return _resume_all("w3", root, {m: w3[0][m]["params"] for m in MODES})


def test_params_before_the_checkpoints_match_reference(w1, w3, ref):
    at_k = ref[0]
    for mode in MODES:
        assert_close_params(w1[mode], at_k, f"world 1 {mode}")
        assert_same_on_every_rank([v[mode]["params"] for v in w3])
        assert_close_params(w3[0][mode]["params"], at_k, f"world 3 {mode}")
    assert any(v["flat"]["split"] for v in w3), "flat mode should split some params"


@pytest.mark.parametrize("mode", MODES)
def test_consolidate_chunks(w3, ref, mode):
    """Tiny messages (packing and splitting) and the default give the same dict, which is
    torch.optim.AdamW's."""
    sds = w3[-1][mode]["sds"]
    never_id = [i for g in groups(list(range(len(SHAPES)))) for i in g["params"]].index(NEVER)
    assert never_id not in sds[max(sds)]["state"], "a param that never had a grad has no state"
    chunks = sorted(sds)
    for c in chunks[1:]:
        diffs = sd_diff(sds[c], sds[chunks[0]])
        assert not diffs, f"chunk {c} vs {chunks[0]}:\n" + "\n".join(diffs[:10])
    diffs = close_to_reference(sds[chunks[0]], ref[1])
    assert not diffs, "consolidated state differs from AdamW's:\n" + "\n".join(diffs[:10])


def _check_resumed(per_rank, ref, what):
    assert_same_on_every_rank([v["params"] for v in per_rank])
    assert_close_params(per_rank[0]["params"], ref[2], what)
    for v in per_rank:
        assert v["lr0"] == LR0_AT_SAVE, "the group hyperparameters must come from the checkpoint"


@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("save_mode", MODES)
def test_world1_to_world3(w3, ref, save_mode, load_mode):
    _check_resumed([v["from_w1"][(save_mode, load_mode)] for v in w3], ref,
                   f"saved {save_mode}@1 (no dist), loaded {load_mode}@3")


@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("save_mode", MODES)
def test_world3_to_world2(w2, ref, save_mode, load_mode):
    _check_resumed([v["from_w3"][(save_mode, load_mode)] for v in w2], ref,
                   f"saved {save_mode}@3, loaded {load_mode}@2")


@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("save_mode", MODES)
def test_world3_to_world1_without_dist(w1_again, ref, save_mode, load_mode):
    _check_resumed([w1_again[(save_mode, load_mode)]], ref,
                   f"saved {save_mode}@3, loaded {load_mode}@1 (no dist)")


def test_direct_reads_match_dcp_reader(w2):
    for v in w2:
        for a, b in zip(v["dcp_reader"], v["from_w3"][("flat", "param")]["params"]):
            assert torch.equal(a, b)


def test_adafactor_whole_state_world3_to_world2(w2):
    ps = make_params(SHAPES[:10], seed=8)
    ref = torch.optim.Adafactor(_adafactor_groups(ps))
    train(ref, ps, range(2 * K))
    assert_same_on_every_rank([v["adafactor"] for v in w2])
    assert_close_params(w2[0]["adafactor"], detached(ps), "Adafactor 3 -> 2")


# --------------------------------------------------------------------------------------------
# the converter


def _check_converted(sd, w3, ref, mode):
    consolidated = w3[-1][mode]["sds"]
    diffs = sd_diff(sd, consolidated[max(consolidated)])
    assert not diffs, "converter output differs from consolidate_state_dict's:\n" + \
        "\n".join(diffs[:10])
    ps = trainable(w3[0][mode]["params"])
    plain = AdamW(groups(ps), **DEFAULTS)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["lr"] == LR0_AT_SAVE
    train(plain, ps, range(K, 2 * K))
    assert_close_params(detached(ps), ref[2], f"converted {mode} checkpoint into AdamW")


def test_convert_cli(root, w3, ref, tmp_path):
    """The real command line, in a fresh interpreter (flat checkpoint)."""
    out = tmp_path / "optim.pt"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "zero_ext.checkpoint", "convert",
                           os.path.join(root, "w3_flat"), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_converted(torch.load(out, weights_only=True), w3, ref, "flat")


def test_convert_in_process(root, w3, ref, tmp_path):
    from zero_ext import checkpoint

    out = tmp_path / "optim.pt"
    assert checkpoint.main(["convert", os.path.join(root, "w3_param"), str(out)]) == 0
    _check_converted(torch.load(out, weights_only=True), w3, ref, "param")
    assert checkpoint.main(["info", os.path.join(root, "w3_param")]) == 0


def test_convert_cli_reports_missing_checkpoint(tmp_path):
    from zero_ext import checkpoint

    assert checkpoint.main(["convert", str(tmp_path / "nothing"), str(tmp_path / "o.pt")]) == 1


def _one_process_inside_a_job(rank, world, root):
    """Single-process checkpoint work while torch.distributed is initialized: an optimizer
    built before init_process_group (no process group: world 1) saved and loaded after it,
    and convert() run by rank 0 alone. Rank 1 takes part in nothing meanwhile (it waits on
    the store), so a save or load that issued collectives over the default group would time
    out here: torch 2.6's dcp.save / dcp.load have no `no_dist` and decide "one process"
    from dist.is_initialized() alone."""
    import datetime
    import time

    from zero_ext import checkpoint

    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    ps, ps2 = new_params(), new_params()
    solo, solo2 = _zero(ps, "flat"), _zero(ps2, "flat")  # built without a process group
    assert solo.world_size == 1 and solo.process_group is None
    train(solo, ps, range(K))
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    out = None
    if rank == 0:
        path = os.path.join(root, "solo")
        try:
            checkpoint.save(solo, path)
            checkpoint.load(solo2, path)
            converted = checkpoint.convert(path, os.path.join(root, "solo.pt"))
        finally:
            store.set("solo_done", "1")
        want = solo.state_dict()
        out = {"loaded": sd_diff(solo2.state_dict(), want), "converted": sd_diff(converted, want)}
    else:
        deadline = time.monotonic() + 120
        while not store.check(["solo_done"]):
            assert time.monotonic() < deadline, "rank 0 never finished its single-process work"
            time.sleep(0.05)
    return out


def test_single_process_checkpoints_inside_an_initialized_job(tmp_path):
    out = run_world(_one_process_inside_a_job, 2, str(tmp_path))[0]
    assert out["loaded"] == [], out["loaded"][:10]
    assert out["converted"] == [], out["converted"][:10]


# --------------------------------------------------------------------------------------------
# interrupted saves


class _Boom(RuntimeError):
    pass


def _atomic(rank, root):
    from zero_ext import checkpoint, state

    def consolidated(opt):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if rank == 0 else None

    path = os.path.join(root, "atomic")
    ps = new_params()
    opt = _zero(ps, "flat")
    train(opt, ps, range(K))
    checkpoint.save(opt, path)
    good = consolidated(opt)
    at_save = detached(ps)
    train(opt, ps, range(K, K + 1))  # the state moves on; a failed save must not show it
    out = {"errors": {}}

    def boom(p):
        raise _Boom("simulated crash before the swap")

    checkpoint._before_swap = boom  # only rank 0 swaps
    try:
        checkpoint.save(opt, path)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["before_swap"] = (type(exc).__name__, str(exc))
    finally:
        checkpoint._before_swap = None
    out["tmp_left"] = os.path.isdir(path + checkpoint.TMP_SUFFIX)

    real = state.local_state

    def failing(o):
        if rank == 1:
            raise _Boom("simulated failure while preparing rank 1's share")
        return real(o)

    state.local_state = failing
    try:
        checkpoint.save(opt, path)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["rank1_prepare"] = (type(exc).__name__, str(exc))
    finally:
        state.local_state = real

    # the previous checkpoint is intact and loadable
    opt2 = _zero(trainable(at_save), "param")
    checkpoint.load(opt2, path)
    out["after_failures"] = consolidated(opt2)

    # a crash between the two renames: only "<path>.zero_ext-old" exists
    dist.barrier()
    if rank == 0:
        os.rename(path, path + checkpoint.OLD_SUFFIX)
    dist.barrier()
    opt3 = _zero(trainable(at_save), "flat")
    checkpoint.load(opt3, path)
    out["from_old"] = consolidated(opt3)

    # the next save recovers, replaces it and leaves nothing behind
    checkpoint.save(opt, path)
    dist.barrier()
    out["newest"] = consolidated(opt)
    opt4 = _zero(trainable(at_save), "flat")
    checkpoint.load(opt4, path)
    out["reloaded_newest"] = consolidated(opt4)
    out["leftovers"] = sorted(n for n in os.listdir(root) if n.startswith("atomic."))
    out["good"] = good

    # a path that is not a checkpoint is never replaced
    other = os.path.join(root, "not_a_checkpoint")
    if rank == 0:
        os.makedirs(other, exist_ok=True)
        with open(os.path.join(other, "precious.txt"), "w") as f:
            f.write("keep me")
    dist.barrier()
    try:
        checkpoint.save(opt, other)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["not_a_checkpoint"] = (type(exc).__name__, str(exc))
    out["precious_kept"] = os.path.isfile(os.path.join(other, "precious.txt"))
    return out


@pytest.fixture(scope="module")
def atomic(w2):
    return [v["atomic"] for v in w2]


def test_interrupted_save_raises_on_every_rank(atomic):
    for r, v in enumerate(atomic):
        for case in ("before_swap", "rank1_prepare"):
            assert case in v["errors"], f"rank {r}: save did not fail in case {case}"
        assert "simulated crash" in v["errors"]["before_swap"][1]
        assert "rank 1" in v["errors"]["rank1_prepare"][1] or r == 1
        assert v["errors"]["not_a_checkpoint"][0] == "ValueError"
        assert "not a zero_ext" in v["errors"]["not_a_checkpoint"][1]
        assert v["precious_kept"]
    assert atomic[0]["tmp_left"], "the failed save's temporary directory should remain"


def test_interrupted_save_keeps_previous_checkpoint(atomic):
    v = atomic[0]
    for case in ("after_failures", "from_old"):
        diffs = sd_diff(v[case], v["good"])
        assert not diffs, f"{case}: the previous checkpoint changed:\n" + "\n".join(diffs[:10])
    assert sd_diff(v["newest"], v["good"]), "the last save should hold the newer state"
    diffs = sd_diff(v["reloaded_newest"], v["newest"])
    assert not diffs, "\n".join(diffs[:10])
    assert v["leftovers"] == [], f"leftover directories: {v['leftovers']}"


def _w2_killed(rank, world, root):
    from zero_ext import checkpoint

    path = os.path.join(root, "killed")
    ps = new_params()
    opt = _zero(ps, "flat")
    train(opt, ps, range(K))
    opt.param_groups[0]["lr"] = LR0_AT_SAVE
    checkpoint.save(opt, path)
    train(opt, ps, range(K, K + 1))

    def die(_path):
        os._exit(17)  # rank 0 dies after writing the new checkpoint, before the swap

    checkpoint._before_swap = die
    checkpoint.save(opt, path)
    return "rank 0 should not get here"


def test_killed_save_keeps_previous_checkpoint(root, ref):
    """A rank process dying in the middle of a save: the others are stopped by the harness,
    and the previous checkpoint is still complete (loaded here at world 1, no dist)."""
    from zero_ext import checkpoint

    with pytest.raises(AssertionError, match="world of 2 ranks failed"):
        run_world(_w2_killed, 2, root, timeout=120)
    path = os.path.join(root, "killed")
    assert os.path.isdir(path + checkpoint.TMP_SUFFIX), "the unfinished save stays aside"
    ps, _, lr0 = _resume(ref[0], "param", path)
    _check_resumed([{"params": detached(ps), "lr0": lr0}], ref, "after a killed save")


# --------------------------------------------------------------------------------------------
# checkpoints that do not fit


def _mismatch_cases():
    base = list(zip(SHAPES, DTYPES))
    return {
        "param count": (base + [((3,), torch.float32)], None),
        "param group count": (base, lambda ps: [{"params": ps[:6]}, {"params": ps[6:]}]),
        "param group 1": (base, lambda ps: [{"params": [ps[i] for i in (0, 2, 5, 8, 1)]},
                                            {"params": [ps[i] for i in (3, 6, 9, 10)]},
                                            {"params": [ps[i] for i in (4, 7)]}]),
        "shape": ([((6, 40), torch.float32)] + base[1:], None),
        "dtype": (base[:3] + [((6,), torch.float64)] + base[4:], None),
    }


def _mismatch(rank, root):
    from zero_ext import checkpoint

    path = os.path.join(root, "fit")
    ps = new_params()
    opt = _zero(ps, "param")
    train(opt, ps, range(1))
    checkpoint.save(opt, path)
    out = {}
    for name, (spec, make_groups) in _mismatch_cases().items():
        for mode in MODES:
            shapes = [s for s, _ in spec]
            ps2 = make_params(shapes, seed=9, dtypes=[d for _, d in spec])
            if make_groups is not None:
                gs = make_groups(ps2)
            else:
                gs = groups(ps2)
                gs[1]["params"] += ps2[len(SHAPES):]  # "param count": one more param
            opt2 = make_zero(gs, AdamW, None, sharding=mode, **DEFAULTS)
            train(opt2, ps2, range(2))
            opt2.param_groups[0]["lr"] = 0.123
            before = (copy.deepcopy(opt2.optim.state_dict()),
                      [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                       for g in opt2.param_groups])
            try:
                checkpoint.load(opt2, path)
                err = None
            except Exception as exc:  # noqa: BLE001
                err = (type(exc).__name__, str(exc))
            after = (opt2.optim.state_dict(),
                     [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups])
            out[(name, mode)] = {"error": err, "changed": sd_diff(after, before)}
    # a directory that is no checkpoint at all
    try:
        checkpoint.load(opt, os.path.join(root, "missing"))
        out["missing"] = None
    except Exception as exc:  # noqa: BLE001
        out["missing"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def mismatch(w2):
    return [v["mismatch"] for v in w2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(_mismatch_cases()))
def test_mismatched_checkpoint_raises_everywhere(mismatch, case, mode):
    for r, v in enumerate(mismatch):
        got = v[(case, mode)]
        assert got["error"] is not None, f"rank {r}: loading a checkpoint with a different " \
                                         f"{case} did not raise"
        assert got["error"][0] == "ValueError", f"rank {r}: {got['error']}"
        assert case in got["error"][1], f"rank {r}: message does not name {case!r}: " \
                                        f"{got['error'][1]}"
        assert not got["changed"], f"rank {r}: a failed load changed the optimizer:\n" + \
            "\n".join(got["changed"][:10])


def test_missing_checkpoint_raises_everywhere(mismatch):
    for v in mismatch:
        assert v["missing"] is not None and v["missing"][0] == "FileNotFoundError", v["missing"]


# --------------------------------------------------------------------------------------------
# CUDA state (skipped without a GPU): world 1 without torch.distributed, and world 2 on gloo
# with CUDA tensors (both ranks on one GPU; consolidation stages through host memory)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def train_any_device(opt, ps, steps):
    proxies = [torch.empty(p.shape, dtype=p.dtype, requires_grad=True) for p in ps]
    for s in steps:
        fake_grads(proxies, s, seed=3, skip=_skip)
        for p, q in zip(ps, proxies):
            p.grad = None if q.grad is None else q.grad.to(p.device)
        opt.step()


def _cuda_story(root, mode_save, mode_load, pg_world):
    from zero_ext import checkpoint

    ps = [p.detach().cuda().requires_grad_() for p in new_params()]
    opt = _zero(ps, mode_save)
    train_any_device(opt, ps, range(K))
    opt.param_groups[0]["lr"] = LR0_AT_SAVE
    path = os.path.join(root, f"cuda_{pg_world}_{mode_save}")
    checkpoint.save(opt, path)
    opt.consolidate_state_dict(0)
    sd = opt.state_dict() if opt.rank == 0 else None
    ps2 = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = _zero(ps2, mode_load)
    checkpoint.load(opt2, path)
    state_devices = {str(v.device) for st in opt2.optim.state.values() for k, v in st.items()
                     if isinstance(v, torch.Tensor) and k != "step"}
    train_any_device(opt2, ps2, range(K, 2 * K))
    return {"params": [p.detach().cpu() for p in ps2], "sd": sd, "path": path,
            "state_devices": state_devices}


def _cuda_w2(rank, world, root):
    torch.cuda.set_device(0)
    return {m: _cuda_story(root, m, other, world)
            for m, other in (("flat", "param"), ("param", "flat"))}


def _check_cuda(v, ref, what):
    from zero_ext import checkpoint

    assert_close_params(v["params"], ref[2], what)
    assert v["state_devices"] <= {"cuda:0"}, v["state_devices"]
    if v["sd"] is not None:
        assert all(t.device.type == "cpu" for st in v["sd"]["state"].values()
                   for t in st.values() if isinstance(t, torch.Tensor))
        diffs = sd_diff(checkpoint.load_full(v["path"]), v["sd"])
        assert not diffs, "\n".join(diffs[:10])


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_world1(tmp_path, ref, mode):
    other = "flat" if mode == "param" else "param"
    _check_cuda(_cuda_story(str(tmp_path), mode, other, 1), ref, f"cuda {mode}@1 -> {other}@1")


@needs_cuda
def test_cuda_world2_gloo(tmp_path, ref):
    for r, out in enumerate(run_world(_cuda_w2, 2, str(tmp_path))):
        for mode, v in out.items():
            _check_cuda(v, ref, f"rank {r}: cuda {mode}@2")
