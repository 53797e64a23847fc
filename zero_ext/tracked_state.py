"""Optimizer state whose changes are counted: the fused engine's check that the state still
holds the tensors its step was built for, in O(1) per step instead of one look-up per tensor.

The engine (engine.py, ``_StateSnapshot``) must see every change a script makes to an
optimizer's state between steps: a dict replaced (``opt.state[p] = {}``), an entry
replaced (``st["exp_avg"] = torch.zeros_like(...)``), a load. Checking every entry by
identity costs about 50 ns per tensor in Python; at 20000 tensors that is 2-3 ms a step, as
long as the host step of 20M elements itself (offload_optimizer). Here the state is a
``defaultdict`` subclass (:class:`TrackedState`) whose per-param dicts are ``dict``
subclasses (:class:`TrackedDict`); every Python-level change to either (``[]=``, ``del``,
``pop``, ``clear``, ``update``, ...) adds one to a :class:`Generation` they share, so a
check whose generation did not move has nothing to look at. In-place changes of the tensors'
values need nothing (the kernel reads them), and a tensor's memory replaced in place
(``t.data = u``, ``set_``) is not a change of the dicts: the compiled plan checks every
state tensor's storage at each step for that.

Only ``offload_optimizer`` installs it (:func:`track`), on its local optimizer when that is
stepped by the fused AdamW (whose state belongs to it: its host part is packed into flat
host buffers anyway; torch's own steps of other classes write their state at every step,
where counting would only cost). What users see of it: ``isinstance(state,
collections.defaultdict)`` and ``isinstance(st, dict)`` hold, copies (``copy.copy``,
``deepcopy``, pickling, ``dict(st)``) are plain dicts and defaultdicts, and the
optimizer's ``state_dict()`` returns plain dicts.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

__all__ = ["Generation", "TrackedDict", "TrackedState", "track", "generation_of"]


class Generation:
    """A counter of changes (shared by one state and its per-param dicts). `untracked`: a
    value that is not a TrackedDict of this generation was put into the state (a script's
    ``state[p] = {}``): changes of that dict would not be counted (:func:`track` again)."""

    __slots__ = ("value", "untracked")

    def __init__(self) -> None:
        self.value = 0
        self.untracked = False


def _bumps(name: str):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        try:
            return base(self, *args, **kwargs)
        finally:  # (a failed pop / del may still have changed nothing: counted anyway)
            self.generation.value += 1

    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


_MUTATORS = ("__setitem__", "__delitem__", "clear", "pop", "popitem", "setdefault", "update",
             "__ior__")


class TrackedDict(dict):
    """A per-param state dict whose changes bump `generation`."""

    __slots__ = ("generation",)

    def __init__(self, generation: Generation, *args, **kwargs) -> None:
        self.generation = generation
        dict.__init__(self, *args, **kwargs)

    # copies and pickles are plain dicts (a checkpoint never names this class)
    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)

    def __reduce__(self):
        return dict, (dict(self),)


for _name in _MUTATORS:
    setattr(TrackedDict, _name, _bumps(_name))


class _NewDict:
    """TrackedState's default_factory: a fresh TrackedDict of the generation."""

    __slots__ = ("generation",)

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    def __call__(self) -> TrackedDict:
        return TrackedDict(self.generation)


class TrackedState(defaultdict):
    """An optimizer's ``state`` (param -> dict) whose changes bump `generation`; a missing
    param gets a fresh :class:`TrackedDict` (as ``defaultdict(dict)`` gives a dict)."""

    __slots__ = ("generation",)

    def __init__(self, generation: Generation, items=()) -> None:
        self.generation = generation
        defaultdict.__init__(self, _NewDict(generation))
        for k, v in (items.items() if hasattr(items, "items") else items):
            defaultdict.__setitem__(self, k, v)

    def __reduce_ex__(self, protocol):
        return defaultdict, (dict,), None, None, iter((k, dict(v) if isinstance(v, dict)
                                                        else v) for k, v in self.items())

    def __reduce__(self):
        return self.__reduce_ex__(2)

    def __copy__(self):
        return defaultdict(dict, self)

    def __repr__(self) -> str:
        return f"TrackedState({dict.__repr__(self)})"


for _name in _MUTATORS:
    setattr(TrackedState, _name, _bumps(_name))


def _state_setitem(self, key, value):
    defaultdict.__setitem__(self, key, value)
    gen = self.generation
    gen.value += 1
    if type(value) is not TrackedDict or value.generation is not gen:
        gen.untracked = True


def _state_adds(name: str):
    counted = getattr(TrackedState, name)

    def method(self, *args, **kwargs):
        self.generation.untracked = True  # (whatever it adds: checked again by track())
        return counted(self, *args, **kwargs)

    method.__name__ = name
    return method


TrackedState.__setitem__ = _state_setitem
for _name in ("setdefault", "update", "__ior__"):
    setattr(TrackedState, _name, _state_adds(_name))


def generation_of(state: Any) -> Optional[Generation]:
    """The generation counting every change of `state` and of each of its dicts, or None
    where some change would go uncounted (a plain state, or a plain dict in it)."""
    if type(state) is not TrackedState:
        return None
    gen = state.generation
    for st in state.values():
        if type(st) is not TrackedDict or st.generation is not gen:
            return None
    return gen


def track(optim) -> Generation:
    """Makes ``optim.state`` tracked (its dicts too) unless it already is; returns its
    generation. The per-param dicts become new objects (their tensors are the same): a
    reference a script kept to an old one no longer reaches the optimizer. The optimizer's
    ``state_dict()`` returns plain dicts (a post-hook, registered once)."""
    state = optim.state
    if type(state) is TrackedState and not state.generation.untracked:
        return state.generation
    gen = generation_of(state)
    if gen is not None:
        gen.untracked = False
        return gen
    gen = state.generation if type(state) is TrackedState else Generation()
    gen.untracked = False
    items = [(k, v if type(v) is TrackedDict and v.generation is gen
              else TrackedDict(gen, v) if isinstance(v, dict) else v)
             for k, v in state.items()]
    optim.state = TrackedState(gen, items)
    gen.value += 1
    if not getattr(optim, "_zero_ext_plain_state_dict", False):
        optim.register_state_dict_post_hook(_plain_state_dict)
        optim._zero_ext_plain_state_dict = True
    return gen


def _plain_state_dict(optim, state_dict: dict) -> dict:
    """(state_dict post-hook) Plain dicts in the returned state: a checkpoint loads with
    ``torch.load(weights_only=True)`` and without zero_ext."""
    st = state_dict.get("state")
    if isinstance(st, dict) and any(type(v) is TrackedDict for v in st.values()):
        state_dict["state"] = {k: dict(v) if type(v) is TrackedDict else v
                               for k, v in st.items()}
    return state_dict
