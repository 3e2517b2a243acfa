"""Memory knobs left as ``"auto"``: where they register, and how a plan reaches them.

Every primitive with a memory/compute trade-off (``scan(checkpoints=...)``, the
``chunk_size=`` of the chunked primitives, ``accumulate_grad(microbatches=...)``) calls
:func:`auto` when the user passed ``"auto"``. Outside :func:`memwise.fit` that returns the
knob's documented default. Inside ``fit``'s tracing it records the knob (kind, candidates,
predicted compute of each candidate, the user's source line) and returns the value the
plan under test assigns to it. Knobs are identified by the order in which the trace
reaches them: the i-th knob of a given kind, source line, label and candidates in one
trace is the same knob in every trace of the function, even when JAX traces a function
more than once (``jax.checkpoint``, ``custom_vjp``).

Candidates are ordered from the fastest (most memory) to the leanest (least memory), so a
plan is one index per knob and "more pressure" means "a larger index". This module only
records; the search lives in ``memwise.fit.search``.

JAX reuses the trace of a function it has traced before (``jax.jit``, ``jax.checkpoint``,
keyed on argument types and the trace context), and a reused trace neither records its
knobs again nor takes a new plan's values. Each recording therefore sets a JAX user
context (``jax.make_user_context``, part of every such cache key) to its ``cache_key``:
a fresh value unless the caller shares one between recordings of the same plan.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import os
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax

__all__ = ["CACHES_KEYED_ON_PLAN", "Knob", "auto", "fresh_cache_key", "recording", "user_source"]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One ``"auto"`` knob reached by a trace.

    Attributes:
      kind: what the knob sets: ``"checkpoints"``, ``"chunk_size"``, ``"microbatches"``,
        ``"policy"``, ``"ring"`` or ``"offload"``.
      source: ``file:line`` of the user's call that left the knob as ``"auto"``.
      candidates: allowed values, fastest (most memory) first, leanest last.
      cost: predicted time of each candidate, relative to candidate 0 (1.0). Scans count
        body evaluations (nondecreasing); chunks predict each tiling's time from XLA's
        cost analysis of one tile and the machine's balance (``memwise.costmodel``), so a
        mid-size tile may cost less than the largest.
      default: the value used outside ``fit``.
      label: optional name shown in plans (e.g. the region a remat policy applies to).

    Example::

        >>> from memwise import knobs
        >>> with knobs.recording() as found:
        ...     _ = knobs.auto("checkpoints", candidates=[100, 10], cost=[1.0, 1.5],
        ...                    default=10, source="model.py:7")
        >>> found[0]
        Knob(kind='checkpoints', source='model.py:7', candidates=(100, 10),
             cost=(1.0, 1.5),
             default=10, label='')
    """

    kind: str
    source: str
    candidates: tuple
    cost: tuple
    default: Any
    label: str = ""

    @property
    def key(self) -> tuple:
        """What identifies the knob across traces (with its occurrence number)."""
        return (self.kind, self.source, self.label, self.candidates)


class _Recorder:
    def __init__(self, plan: Sequence[int] | None, layout: Sequence[Knob] | None):
        # plan[i] is the candidate index of layout[i]; occurrences of one key are
        # assigned in order, cyclically when a function is traced more than once.
        self.assign: dict[tuple, list[int]] | None = None
        if plan is not None:
            if layout is None:
                raise ValueError("recording(plan) needs the layout of knobs the plan indexes")
            if len(plan) != len(layout):
                raise ValueError(f"plan has {len(plan)} entries for {len(layout)} knobs")
            self.assign = {}
            for knob, index in zip(layout, plan):
                self.assign.setdefault(knob.key, []).append(int(index))
        self.seen: dict[tuple, int] = {}
        self.knobs: list[Knob] = []


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "memwise_knob_recorder", default=None
)

# Created at import, before any trace: a user context made inside a trace would leave the
# entries cached during that trace keyed without it. JAX releases without user contexts
# fall back to fit clearing JAX's caches (see fit.Fitted._compile).
_make_user_context = getattr(jax, "make_user_context", None)
_PLAN_CONTEXT = _make_user_context(None) if _make_user_context is not None else None
CACHES_KEYED_ON_PLAN = _PLAN_CONTEXT is not None
_CACHE_KEYS = itertools.count()


def fresh_cache_key() -> Hashable:
    """A value no recording has used: a recording under it re-traces every function.

    Example::

        >>> from memwise import knobs
        >>> knobs.fresh_cache_key() != knobs.fresh_cache_key()
        True
    """
    return ("memwise", next(_CACHE_KEYS))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_source() -> str:
    """``file:line`` of the innermost stack frame outside memwise and JAX.

    Example::

        >>> from memwise import knobs
        >>> knobs.user_source()  # here: the doctest's own "file"
        '<doctest ...>:1'
    """
    for frame in reversed(traceback.extract_stack()):
        filename = os.path.abspath(frame.filename)
        if filename.startswith(_PACKAGE_DIR) or f"{os.sep}jax{os.sep}" in filename:
            continue
        if f"{os.sep}contextlib.py" in filename:
            continue
        return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


def auto(
    kind: str,
    *,
    candidates: Sequence[Any],
    cost: Sequence[float] | Callable[[Any], float],
    default: Any,
    label: str = "",
    source: str | None = None,
) -> Any:
    """Resolve an ``"auto"`` knob: its default outside ``fit``, the plan's value inside.

    Args:
      kind: ``"checkpoints"``, ``"chunk_size"``, ``"microbatches"``, ``"policy"``,
        ``"ring"`` or ``"offload"``.
      candidates: allowed values ordered fastest (most memory) first.
      cost: predicted relative time per candidate, or a function of a candidate
        (called only inside ``fit``, where the costs are used).
      default: value used when no plan is active.
      label: optional name shown in plans.
      source: where the knob is set; by default the innermost user frame's ``file:line``.

    Example::

        >>> from memwise import knobs
        >>> def chunk_size():  # what a primitive does with chunk_size="auto"
        ...     return knobs.auto("chunk_size", candidates=[4096, 1024, 256],
        ...                       cost=[1.0, 1.0, 1.1], default=1024,
        ...                       source="model.py:3")
        >>> chunk_size()  # outside mw.fit: the default
        1024
        >>> with knobs.recording() as found:
        ...     _ = chunk_size()
        >>> # the plan picks candidate 2
        >>> with knobs.recording(plan=[2], layout=found):
        ...     planned = chunk_size()
        >>> planned
        256
    """
    candidates = tuple(candidates)
    if not candidates:
        raise ValueError(f"knob {kind!r} needs at least one candidate")
    if not callable(cost) and len(cost) != len(candidates):
        raise ValueError(f"knob {kind!r}: {len(cost)} costs for {len(candidates)} candidates")
    recorder = _RECORDER.get()
    if recorder is None:
        return default  # a cost function may compile: it runs only where costs are used
    costs = tuple(float(cost(c)) for c in candidates) if callable(cost) else tuple(cost)
    knob = Knob(kind, source or user_source(), candidates, costs, default, label)
    recorder.knobs.append(knob)
    occurrence = recorder.seen.get(knob.key, 0)
    recorder.seen[knob.key] = occurrence + 1
    if recorder.assign is None or knob.key not in recorder.assign:
        return default
    indices = recorder.assign[knob.key]
    return candidates[indices[occurrence % len(indices)]]


@contextlib.contextmanager
def recording(
    plan: Sequence[int] | None = None,
    layout: Sequence[Knob] | None = None,
    *,
    cache_key: Hashable | None = None,
) -> Iterator[list[Knob]]:
    """Record the knobs a trace reaches; give ``layout[i]`` its candidate ``plan[i]``.

    ``layout`` is the list of knobs a previous recording of the same function yielded.
    With ``plan=None`` every knob takes its default. Yields the list of knobs reached,
    filled as tracing proceeds.

    ``cache_key`` keys JAX's trace caches while recording. By default it is fresh, so
    every jitted or checkpointed function is traced again and all its knobs are recorded.
    Recordings that assign the same plan may pass the same key to share JAX's caches: a
    knob inside a reused trace keeps that plan's value but is not recorded again.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> from memwise import knobs
        >>> def loss(xs):
        ...     h, _ = mw.scan(lambda h, x: (h + x, None), 0.0, xs,
        ...                    checkpoints="auto")
        ...     return h
        >>> with knobs.recording() as found:
        ...     _ = jax.eval_shape(loss, jnp.ones(100))
        >>> [knob.kind for knob in found]
        ['checkpoints']
    """
    recorder = _Recorder(plan, layout)
    token = _RECORDER.set(recorder)
    keyed = (
        _PLAN_CONTEXT(fresh_cache_key() if cache_key is None else cache_key)
        if _PLAN_CONTEXT is not None
        else contextlib.nullcontext()
    )
    try:
        with keyed:
            yield recorder.knobs
    finally:
        _RECORDER.reset(token)
