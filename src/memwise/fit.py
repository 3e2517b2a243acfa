"""Choose every memory knob left as ``"auto"`` so the compiled program meets a budget.

Each ``"auto"`` knob a function's trace reaches registers itself (``memwise.knobs``) with
its candidates, ordered from the most memory to the least, and a predicted time per
candidate: body evaluations for scans, a roofline for chunk sizes (XLA's cost analysis of
one tile body and the machine's measured balance, ``memwise.costmodel``). With
``policies=True`` the function as a whole, and every block marked with :func:`region`,
becomes one more knob whose candidates are ``jax.checkpoint`` policies, from saving
everything to saving nothing.

The search never runs the program; it compiles and reads XLA's ``memory_analysis()``:

1. *Pressure path.* One pressure level p in [0, 1] maps to every knob at once
   (candidate index round(p * (len - 1))). p = 0 is the most-memory plan; if it fits,
   the search goes on at step 3. Otherwise p = 1 (the leanest plan) is compiled, first
   with the remat policies left at "save everything" (they recompute whole regions),
   then, if that does not fit, with them too. Knobs are monotone in memory but for a few
   KiB at the lean end (a tiny tile's bookkeeping), so where the leanest plan does not
   fit the search steps back along the path while peaks fall; if none fits, no plan
   can, and :class:`MemoryBudgetError` says what dominates.
2. *Bisection* over the distinct plans of the path finds the least pressure that fits
   (log2 of the number of levels compilations), assuming peak memory decreases along it.
3. *Descent*: knob by knob, move to any candidate predicted faster while the program
   still fits, largest predicted saving first, until ``max_compilations``. A leaner
   candidate can be faster (a cache-sized tile for a memory-bound pair function); it
   fits whenever the current plan does, and is compiled to verify it.

With ``tune=True`` a local search by measurement follows, from the model's choice: the
plan and its neighbours that fit (one candidate larger or smaller on one knob) are
compiled and run, interleaved (a warm-up and 5 timed runs each); the search moves to the
neighbour with the fastest run among those faster than the plan in most rounds too, and
times its neighbours in turn, until none is faster or 6 plans have been timed. The model
orders distant candidates well and neighbouring ones poorly (a 10-20% cache effect
between two mid-size tiles), which is what timing the neighbours settles. Those
compilations and runs are counted apart from the search's. ``verbose=True`` prints every
plan as it is compiled.

Each argument signature (tree structure, shapes and dtypes) is searched on its own, with
its own ``max_compilations``: a shape planned after another gets the plan it would get
alone. Every compiled plan is remembered per signature, and the fastest predicted plan
known to fit is chosen, so a larger budget never gets a slower predicted plan. The cost
model only has to order plans (knob overheads relative to the most-memory plan, summed);
the memory claim is always verified by compiling. Honest limits: the bisection assumes
monotone peaks along the path, and the descent may miss a plan that changes two knobs at
once to reach a lower cost.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from memwise import _arguments, knobs, measure

__all__ = ["Fitted", "MemoryBudgetError", "Plan", "Trial", "fit", "region"]


class MemoryBudgetError(RuntimeError):
    """No plan compiles to a peak within the budget.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> fitted = mw.fit(lambda x: jnp.sum(jnp.sin(x) ** 2), budget="1KiB")
        >>> fitted(jnp.ones(10_000))
        Traceback (most recent call last):
          ...
        memwise.fit.MemoryBudgetError: no plan fits the budget of 1.0 KiB (1,024 B): ...
    """


# --------------------------------------------------------------------------------------
# remat policies as a knob

# Most memory (saves everything, fastest) first. The costs are the forward work redone in
# the backward, relative to forward + backward ~ 3 forward passes: a coarse order only.
POLICIES: dict[str, Any] = {
    "everything_saveable": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
_POLICY_COST = (1.0, 1.15, 1.2, 1.34)


def _with_policy(f: Callable, label: str, source: str | None = None) -> Callable:
    """``f`` under the remat policy a plan gives the knob ``label`` (a ``policy`` knob)."""
    choice = knobs.auto(
        "policy",
        candidates=tuple(POLICIES),
        cost=_POLICY_COST,
        default="everything_saveable",
        label=label,
        source=source,
    )
    return _apply_policy(f, choice)


def _apply_policy(f: Callable, name: str) -> Callable:
    if name == "everything_saveable":
        return f

    # A fresh function each time: jax.checkpoint caches its trace per function object,
    # which would replay the knobs of the plan traced first.
    def fresh(*args, **kwargs):
        return f(*args, **kwargs)

    return jax.checkpoint(fresh, policy=POLICIES[name])


def region(name: str) -> Callable[[Callable], Callable]:
    """Marks a block whose ``jax.checkpoint`` policy ``mw.fit`` may choose.

    Outside ``fit`` the block runs unchanged (everything saveable). Inside, it is one
    knob whose candidates go from saving everything to ``nothing_saveable``.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> @mw.region("encoder")
        ... def encoder(w, x):
        ...     return jnp.tanh(x @ w)
        >>> encoder(jnp.eye(2), jnp.ones(2))  # outside mw.fit: unchanged
        Array([0.7615942, 0.7615942], dtype=float32)
        >>> fitted = mw.fit(lambda w, x: jnp.sum(encoder(w, x) ** 2), budget="1MiB")
        >>> print(fitted.plan_text(jnp.eye(2), jnp.ones(2)))
        plan: peak ...
          policy (whole <lambda>) ...
          policy (region 'encoder') ...
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"region(name) needs a non-empty string name, got {name!r}")

    def wrap(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"region({name!r}) decorates a function, got {type(f).__name__}")

        @functools.wraps(f)
        def marked(*args, **kwargs):
            return _with_policy(f, f"region {name!r}")(*args, **kwargs)

        return marked

    return wrap


# --------------------------------------------------------------------------------------
# plans


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    kind: str
    label: str
    source: str
    value: Any
    index: int
    n_candidates: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen value of every knob, the verified compiled peak and predicted cost.

    ``compilations`` is how many programs the search compiled for this argument
    signature (at most ``max_compilations``; plans already compiled by an earlier fit of
    the same function are reused without compiling).
    """

    entries: tuple[PlanEntry, ...]
    peak_bytes: int
    cost: float
    budget_bytes: int
    compilations: int = 0
    # With tune=True: the plans timed, (knob values, fastest run's seconds in the last
    # round that timed them), fastest first; the extra compilations they needed and the
    # timing runs, counted apart from the search.
    timed: tuple[tuple[tuple, float], ...] = ()
    tuning_compilations: int = 0
    timing_runs: int = 0

    @property
    def values(self) -> tuple:
        return tuple(e.value for e in self.entries)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(e.index for e in self.entries)

    def to_text(self) -> str:
        lines = [
            f"plan: peak {measure.format_bytes(self.peak_bytes)} within budget "
            f"{measure.format_bytes(self.budget_bytes)}, predicted time {self.cost:.2f}x "
            f"({self.compilations} compilations)"
        ]
        if self.timed:
            seconds = dict(self.timed).get(self.values, self.timed[0][1])
            lines.append(
                f"  tuned: timed {len(self.timed)} plans ({self.tuning_compilations} more "
                f"compilations, {self.timing_runs} timing runs); kept the plan below, "
                f"{seconds * 1e3:.1f} ms at its fastest run"
            )
        if not self.entries:
            lines.append("  (no 'auto' knobs reached)")
        for e in self.entries:
            what = f"{e.kind} ({e.label})" if e.label else e.kind
            lines.append(
                f"  {what:<28} = {e.value!s:<32} (candidate {e.index + 1}/{e.n_candidates})"
                f"  {e.source}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


@dataclasses.dataclass(frozen=True)
class Trial:
    """One compiled plan: candidate indices, peak bytes, predicted cost, whether it fit."""

    indices: tuple[int, ...]
    values: tuple
    peak_bytes: int
    cost: float
    fits: bool


def _predicted_cost(found: Sequence[knobs.Knob], indices: Sequence[int]) -> float:
    """Predicted time relative to the fastest-candidate plan: knob overheads summed."""
    return 1.0 + sum(k.cost[i] / k.cost[0] - 1.0 for k, i in zip(found, indices))


def _pressure_levels(
    found: Sequence[knobs.Knob], active: Sequence[bool] | None = None
) -> list[tuple[int, ...]]:
    """Distinct plans of the one-parameter path p -> round(p * (len_k - 1)), p in [0, 1].

    Knobs not ``active`` stay at their fastest candidate.
    """
    active = [True] * len(found) if active is None else active
    sizes = [len(k.candidates) if on else 1 for k, on in zip(found, active)]
    breaks = {0.0, 1.0}
    for size in sizes:
        for j in range(1, size - 1):
            breaks.add((j - 0.5) / (size - 1) + 1e-9)  # where round() moves to j
        if size > 1:
            breaks.add((size - 1.5) / (size - 1) + 1e-9)
    levels: list[tuple[int, ...]] = []
    for p in sorted(b for b in breaks if 0 <= b <= 1):
        plan = tuple(int(math.floor(p * (s - 1) + 0.5)) if s > 1 else 0 for s in sizes)
        if not levels or levels[-1] != plan:
            levels.append(plan)
    return levels


# Compiled memory of every plan tried, per function and argument signature, shared by all
# fits of the same function: a plan verified under one budget serves every larger budget.
_MEMORY: weakref.WeakKeyDictionary[Callable, dict] = weakref.WeakKeyDictionary()


def _memory_cache(fn: Callable, key: Any) -> dict[tuple[int, ...], measure.CompiledMemory]:
    try:
        per_fn = _MEMORY.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: cache on this fit only
        per_fn = {}
    return per_fn.setdefault(key, {})


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def _check_reached(found: Sequence[knobs.Knob], reached: Sequence[knobs.Knob]) -> bool:
    return {k.key for k in found} <= {k.key for k in reached}


_SAME_KNOBS_FIX = (
    "fn must reach the same 'auto' knobs, from the same lines, on every trace: do not "
    "choose them from Python state that changes between calls, nor cache their results "
    "outside JAX (functools.cache)."
    + (
        ""
        if knobs.CACHES_KEYED_ON_PLAN
        else (
            f" jax {jax.__version__} has no jax.make_user_context, so a jax.jit or "
            "jax.checkpoint helper traced earlier keeps the knobs of that trace: upgrade jax, "
            "or call the helper's undecorated function inside fn."
        )
    )
)


_Compile = Callable[[tuple[int, ...]], measure.CompiledMemory]


@dataclasses.dataclass(eq=False)
class _Signature:
    """Everything ``fit`` keeps for one argument signature, and the search over its plans.

    One instance per signature, so each new signature gets its own ``max_compilations``
    (a signature planned second is planned exactly as if it were alone). The search is
    plain Python over candidate indices: it only calls ``compile_plan`` for plans whose
    memory is not known yet, and counts those calls.
    """

    args: tuple  # abstract (jax.ShapeDtypeStruct) arguments
    kwargs: dict
    layout: list[knobs.Knob]  # the knobs, in the order the trace reaches them
    budget_bytes: int
    max_compilations: int
    memory: dict[tuple[int, ...], measure.CompiledMemory]  # shared, see _memory_cache
    trials: dict[tuple[int, ...], Trial] = dataclasses.field(default_factory=dict)
    compilations: int = 0
    plan: Plan | None = None
    # JAX's trace caches are keyed on this while the plan runs (knobs.recording): traces
    # of jitted or checkpointed helpers are shared by the calls of this plan only.
    cache_key: Any = dataclasses.field(default_factory=knobs.fresh_cache_key)
    traced: bool = False  # whether a trace under cache_key has reached every knob
    verbose: bool = False

    def room(self) -> int:
        return self.max_compilations - self.compilations

    def trial(self, indices: tuple[int, ...], compile_plan: _Compile) -> Trial:
        compiled_now = indices not in self.memory
        if compiled_now:
            self.compilations += 1
            self.memory[indices] = compile_plan(indices)
        if indices not in self.trials:
            peak = self.memory[indices].peak_bytes
            self.trials[indices] = Trial(
                indices,
                tuple(k.candidates[i] for k, i in zip(self.layout, indices)),
                peak,
                _predicted_cost(self.layout, indices),
                peak <= self.budget_bytes,
            )
            if self.verbose:
                self.say(self.trials[indices], "compiled" if compiled_now else "known")
        return self.trials[indices]

    def say(self, trial: Trial, how: str) -> None:
        """One line per plan for ``fit(verbose=True)``: knobs, peak vs budget, cost."""
        knob_text = ", ".join(f"{k.kind}={v!s}" for k, v in zip(self.layout, trial.values))
        verdict = "fits" if trial.fits else "over"
        print(
            f"mw.fit: {how} plan {self.compilations}/{self.max_compilations}: "
            f"{knob_text or 'no knobs'} -> peak {measure.format_bytes(trial.peak_bytes)} "
            f"vs budget {measure.format_bytes(self.budget_bytes)} ({verdict}), "
            f"predicted time {trial.cost:.2f}x",
            flush=True,
        )

    def neighbours(self, indices: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Plans one candidate away from ``indices`` on one knob, either way, fastest
        predicted first; those already known not to fit are left out, and so is a remat
        policy where the plan has none (as in the search, policies recompute whole
        regions and are tried only when the other knobs cannot meet the budget)."""
        found = []
        for k, knob in enumerate(self.layout):
            if knob.kind == "policy" and indices[k] == 0:
                continue
            for index in (indices[k] - 1, indices[k] + 1):
                candidate = indices[:k] + (index,) + indices[k + 1 :]
                known = self.trials.get(candidate)
                if 0 <= index < len(knob.candidates) and (known is None or known.fits):
                    found.append(candidate)
        return sorted(found, key=lambda c: (_predicted_cost(self.layout, c), c))

    def best(self) -> Trial | None:
        fitting = [t for t in self.trials.values() if t.fits]
        return min(fitting, key=lambda t: (t.cost, t.peak_bytes)) if fitting else None

    def chosen(self) -> Plan:
        """The plan, once searched (see :meth:`Fitted._planned`)."""
        assert self.plan is not None
        return self.plan

    def leanest(self) -> tuple[int, ...]:
        return _pressure_levels(self.layout)[-1]

    def search(self, compile_plan: _Compile) -> Trial | None:
        """The fastest predicted plan known to fit; None when even the leanest does not."""
        for indices in list(self.memory):  # plans compiled by earlier fits: free
            self.trial(indices, compile_plan)
        if not self.trial(tuple([0] * len(self.layout)), compile_plan).fits:
            # Remat policies recompute whole regions; try them only when the other knobs
            # alone cannot meet the budget (and when there is room to try both).
            is_policy = [k.kind == "policy" for k in self.layout]
            stages = [[not p for p in is_policy], [True] * len(self.layout)]
            if all(is_policy) or not any(is_policy) or self.room() < 2:
                stages = stages[1:]
            for stage, active in enumerate(stages):
                levels = _pressure_levels(self.layout, active)
                high = self._lean_end(levels, compile_plan, keep=len(stages) - 1 - stage)
                if high is not None:
                    break
            else:
                return None
            low = 0  # levels[low] does not fit, levels[high] fits
            while high - low > 1 and self.room() > 0:
                mid = (low + high) // 2
                if self.trial(levels[mid], compile_plan).fits:
                    high = mid
                else:
                    low = mid
        self._relax(compile_plan)
        return self.best()

    def _lean_end(
        self, levels: list[tuple[int, ...]], compile_plan: _Compile, keep: int = 0
    ) -> int | None:
        """The leanest level of the path that fits, walking back from its end while peaks
        fall; None when the peaks rise first (no plan of the path fits). The walk leaves
        ``keep`` compilations for the stages after this one.

        The leanest plan holds the least memory but for a few KiB: a tile of 16 x 16
        pairs kept 2 KiB more bookkeeping than one of 32 x 16 in a Sinkhorn divergence.
        """
        index = len(levels) - 1
        last = self.trial(levels[index], compile_plan)
        while not last.fits:
            if index == 0 or self.room() <= keep:
                return None
            previous = self.trial(levels[index - 1], compile_plan)
            if not previous.fits and previous.peak_bytes >= last.peak_bytes:
                return None
            index, last = index - 1, previous
        return index

    def _moves(self, current: Trial) -> list[tuple[float, tuple[int, ...]]]:
        """Single-knob changes of ``current`` predicted faster, largest saving first.

        A knob's candidates are ordered by memory, not by time: a leaner candidate (a
        cache-sized tile) may be predicted faster, and is then tried as well.
        """
        moves = []
        for k, knob in enumerate(self.layout):
            for index in range(len(knob.candidates)):
                candidate = current.indices[:k] + (index,) + current.indices[k + 1 :]
                known = self.trials.get(candidate)
                if index == current.indices[k] or (known is not None and not known.fits):
                    continue
                saving = current.cost - _predicted_cost(self.layout, candidate)
                if saving > 1e-9 and (known is None or known.fits):
                    moves.append((saving, index > current.indices[k], candidate))
        # Leaner moves first among equal savings: they fit whenever the current plan does.
        return [(saving, c) for saving, _, c in sorted(moves, reverse=True)]

    def _relax(self, compile_plan: _Compile) -> None:
        """Move knob by knob to candidates predicted faster while the program still fits."""
        improved = True
        while improved and self.room() > 0:
            improved = False
            best = self.best()
            assert best is not None  # relaxing starts from a plan that fits
            for _, candidate in self._moves(best):
                if candidate not in self.memory and self.room() <= 0:
                    return
                if self.trial(candidate, compile_plan).fits:
                    improved = True
                    break


class Fitted:
    """``fn`` with its ``"auto"`` knobs chosen to meet a memory budget. See :func:`fit`."""

    def __init__(
        self,
        fn: Callable,
        budget: int | float | str,
        argnums: int | tuple[int, ...],
        grad: bool,
        policies: bool,
        max_compilations: int,
        static: dict[str, Any],
        verbose: bool = False,
        tune: bool = False,
        tune_plans: int = 6,
        tune_runs: int = 5,
    ) -> None:
        self.fn = fn
        self.verbose = verbose
        self.tune, self.tune_plans, self.tune_runs = tune, tune_plans, tune_runs
        self.budget_bytes = measure.parse_budget(budget)
        self.argnums = argnums
        self.grad = grad
        self.policies = policies
        self.max_compilations = max_compilations
        self._static = static  # static_argnums and static_argnames, as for jax.jit
        self._signatures: dict[Any, _Signature] = {}
        self._last: _Signature | None = None
        functools.update_wrapper(self, fn)

    @property
    def compilations(self) -> int:
        """Programs compiled while planning, summed over every argument signature.

        ``max_compilations`` bounds each signature's share, ``plan.compilations``.
        """
        return sum(s.compilations for s in self._signatures.values())

    # the program under a plan ---------------------------------------------------------

    def _program(
        self,
        indices: Sequence[int] | None,
        layout: Sequence[knobs.Knob] | None = None,
        sink: list | None = None,
        cache_key: Any = None,
    ) -> Callable:
        """``fn`` under a plan; ``cache_key=None`` traces every helper again (see knobs)."""
        fn, policies = self.fn, self.policies

        @functools.wraps(fn)  # keeps fn's argument names in reports
        def planned(*args, **kwargs):
            with knobs.recording(indices, layout, cache_key=cache_key) as found:
                if policies:
                    label = f"whole {getattr(fn, '__name__', 'fn')}"
                    out = _with_policy(fn, label, _where(fn))(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
            if sink is not None:
                sink.extend(found)
            return out

        return planned

    def _knobs_of(self, args: tuple, kwargs: dict) -> list[knobs.Knob]:
        found: list[knobs.Knob] = []
        # Checks the arguments (static ones, argnums) before anything is compiled.
        program, args, kwargs, _ = _arguments.prepare(
            self._program(None, None, found),
            args,
            kwargs,
            grad=self.grad,
            argnums=self.argnums,
            **self._static,
        )
        with _arguments.static_hint(self.fn):
            jax.eval_shape(program, *args, **kwargs)
        return found

    def _compile(self, indices: tuple[int, ...], state: _Signature) -> measure.CompiledMemory:
        # Without user contexts (older JAX) a jitted or checkpointed helper may replay a
        # trace made under another plan: clear JAX's caches once and retry.
        attempts = 1 if knobs.CACHES_KEYED_ON_PLAN else 2
        reached: list[knobs.Knob] = []
        for attempt in range(attempts):
            reached = []
            memory = measure.compiled_memory(
                self._program(indices, state.layout, reached),
                *state.args,
                grad=self.grad,
                argnums=self.argnums,
                **self._static,
                **state.kwargs,
            )
            if _check_reached(state.layout, reached):
                return memory
            if attempt + 1 < attempts:
                jax.clear_caches()
        missing = {k.source for k in state.layout} - {k.source for k in reached}
        raise RuntimeError(
            f"mw.fit could not apply its plan: the 'auto' knobs at {sorted(missing)} were "
            f"reached when fn was first traced but not when it was traced again. " + _SAME_KNOBS_FIX
        )

    def _planned_program(self, state: _Signature) -> Callable:
        """``fn`` under the chosen plan, checked to reach the knobs it was planned with.

        All calls share ``state.cache_key``, so a jitted or checkpointed helper traced
        under this plan is reused (its knobs keep the plan's values, unrecorded) and is
        never reused under another plan. The first trace must reach every planned knob.
        """
        plan = state.chosen()

        @functools.wraps(self.fn)
        def checked(*args, **kwargs):
            reached: list[knobs.Knob] = []
            out = self._program(plan.indices, state.layout, reached, state.cache_key)(
                *args, **kwargs
            )
            planned, keys = {k.key for k in state.layout}, {k.key for k in reached}
            reused = state.traced and knobs.CACHES_KEYED_ON_PLAN  # JAX may reuse a trace
            if keys - planned or (planned - keys and not reused):
                raise RuntimeError(
                    "mw.fit: this call of the fitted function did not reach the knobs it "
                    f"was planned with ({[k.source for k in state.layout]} vs "
                    f"{[k.source for k in reached]}). " + _SAME_KNOBS_FIX
                )
            state.traced = True
            return out

        return checked

    # planning ------------------------------------------------------------------------

    def _planned(self, args: tuple, kwargs: dict) -> _Signature:
        """The state of this argument signature, searched on first use."""
        static = _arguments.static_arguments(self.fn, args, kwargs, **self._static)
        key = _arguments.signature(args, kwargs, *static)
        state = self._signatures.get(key)
        if state is None:
            abstract_args, abstract_kwargs = _arguments.abstract(args, kwargs, *static)
            state = _Signature(
                abstract_args,
                abstract_kwargs,
                self._knobs_of(abstract_args, abstract_kwargs),
                self.budget_bytes,
                self.max_compilations,
                _memory_cache(self.fn, (key, self.grad, self.argnums, self.policies)),
                verbose=self.verbose,
            )
            self._signatures[key] = state
        if state.plan is None:
            chosen = state.search(lambda indices: self._compile(indices, state))
            if chosen is None:
                self._raise_infeasible(state)
            timed, tuning_compilations, runs = (), 0, 0
            if self.tune:
                chosen, timed, tuning_compilations, runs = self._tune(state, chosen, args, kwargs)
            entries = tuple(
                PlanEntry(k.kind, k.label, k.source, k.candidates[i], i, len(k.candidates))
                for k, i in zip(state.layout, chosen.indices)
            )
            state.plan = Plan(
                entries,
                chosen.peak_bytes,
                chosen.cost,
                self.budget_bytes,
                state.compilations,
                timed,
                tuning_compilations,
                runs,
            )
        self._last = state
        return state

    def _tune(
        self, state: _Signature, chosen: Trial, args: tuple, kwargs: dict
    ) -> tuple[Trial, tuple, int, int]:
        """A local search by measurement, from the model's choice.

        Times the current plan with its untimed neighbours (one candidate away on one
        knob, :meth:`_Signature.neighbours`) that fit, interleaved round by round, moves
        to the fastest neighbour by its fastest run (other work on the machine only adds
        time) among those faster than the current plan in most rounds too (a burst of
        other work slows a few runs), and repeats until none is faster or
        ``tune_plans`` plans have been timed. Each plan is compiled once (the search's
        memory results are not executables); one that exceeds the budget is dropped.
        """
        static_positions, static_names = _arguments.static_arguments(
            self.fn, args, kwargs, **self._static
        )
        data_args, data_kwargs = _example_data(args, kwargs, static_positions, static_names)
        executables: dict[tuple[int, ...], Any] = {}
        compilations = runs = 0

        def executable(indices: tuple[int, ...]) -> Any:
            """The compiled plan, or None when its peak exceeds the budget."""
            nonlocal compilations
            if indices not in executables:
                compiled, memory = measure.compile_measured(
                    self._program(indices, state.layout),
                    *args,
                    grad=self.grad,
                    argnums=self.argnums,
                    **self._static,
                    **kwargs,
                )
                compilations += 1
                if indices not in state.memory:
                    state.memory[indices] = memory
                    state.trial(indices, state.memory.__getitem__)
                executables[indices] = compiled if memory.peak_bytes <= state.budget_bytes else None
            return executables[indices]

        def time_round(plans: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[float]]:
            nonlocal runs
            samples: dict[tuple[int, ...], list[float]] = {i: [] for i in plans}
            for round_ in range(self.tune_runs + 1):  # round 0 warms up
                for indices in plans:
                    start = time.perf_counter()
                    jax.block_until_ready(executables[indices](*data_args, **data_kwargs))
                    if round_:
                        samples[indices].append(time.perf_counter() - start)
                    runs += 1
            return samples

        current = chosen.indices
        if executable(current) is None:  # pragma: no cover - the search verified it fits
            return chosen, (), compilations, runs
        measured: dict[tuple[int, ...], float] = {}
        while len(measured) < self.tune_plans:
            fresh: list[tuple[int, ...]] = []
            for candidate in state.neighbours(current):
                if len(measured) + len(fresh) + (current not in measured) >= self.tune_plans:
                    break
                if candidate not in measured and executable(candidate) is not None:
                    fresh.append(candidate)
            if not fresh:
                break
            samples = time_round([current, *fresh])
            measured.update({i: min(v) for i, v in samples.items()})
            # A move needs a neighbour faster by its fastest run and in most rounds (its
            # run next to the current plan's): a burst of other work slows a few runs.
            faster = [
                i
                for i in fresh
                if measured[i] < measured[current]
                and 2 * sum(a < b for a, b in zip(samples[i], samples[current])) > len(samples[i])
            ]
            if not faster:
                break
            current = min(faster, key=measured.__getitem__)
        ranked = sorted(measured, key=measured.__getitem__)
        timed = tuple((state.trials[i].values, measured[i]) for i in ranked)
        if self.verbose:
            for values, seconds in timed:
                print(
                    f"mw.fit: timed {values}: {seconds * 1e3:.2f} ms (fastest of {self.tune_runs})",
                    flush=True,
                )
        return state.trials[current], timed, compilations, runs

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for arguments of these shapes (planned on first use, then cached)."""
        return self._planned(args, kwargs).chosen()

    def _raise_infeasible(self, state: _Signature) -> NoReturn:
        leanest = state.leanest()
        memory = state.memory[leanest]
        parts = {
            "arguments": memory.argument_bytes,
            "outputs": memory.output_bytes,
            "temporaries": memory.temp_bytes,
        }
        dominant = max(parts, key=parts.__getitem__)
        detail = f"{dominant} ({measure.format_bytes(parts[dominant])})"
        if self.grad and dominant != "arguments":
            residuals = measure.residuals(  # traced, not compiled
                self._program(leanest, state.layout),
                *state.args,
                argnums=self.argnums,
                **self._static,
                **state.kwargs,
            )
            if residuals:
                top = residuals[0]
                detail += (
                    f"; the largest residual is {measure.format_bytes(top.nbytes)} "
                    f"({top.dtype}{list(top.shape)}) from {top.source}"
                )
        knob_text = (
            ", ".join(
                f"{k.kind}={k.candidates[i]!s} at {k.source}" for k, i in zip(state.layout, leanest)
            )
            or "no 'auto' knobs"
        )
        budget, peak = self.budget_bytes, memory.peak_bytes
        raise MemoryBudgetError(
            f"no plan fits the budget of {measure.format_bytes(budget)} ({budget:,} B): the "
            f"smallest peak reached is {measure.format_bytes(peak)} ({peak:,} B) "
            f"(leanest plan: {knob_text}). It is dominated by {detail}. Raise the budget, "
            "leave more knobs as 'auto', or mark blocks with mw.region."
        )

    # use -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._planned_program(self._planned(args, kwargs))(*args, **kwargs)

    def _latest(self) -> _Signature:
        if self._last is None:
            raise RuntimeError("no plan yet: call the fitted function (or plan_for) first")
        return self._last

    @property
    def plan(self) -> Plan:
        """The plan chosen for the most recent arguments."""
        return self._latest().chosen()

    @property
    def frontier(self) -> list[Trial]:
        """Every plan compiled for the most recent arguments, by predicted cost."""
        return sorted(self._latest().trials.values(), key=lambda t: (t.cost, t.peak_bytes))

    @property
    def report(self) -> measure.MemoryReport:
        """Memory report of the chosen program for the most recent arguments."""
        state = self._latest()
        return self.report_for(*state.args, **state.kwargs)

    def report_for(self, *args: Any, **kwargs: Any) -> measure.MemoryReport:
        """Memory report of the chosen program for arguments of these shapes."""
        program = self._planned_program(self._planned(args, kwargs))
        return measure.memory_report(
            program, *args, grad=self.grad, argnums=self.argnums, **self._static, **kwargs
        )

    def plan_text(self, *args: Any, **kwargs: Any) -> str:
        """The plan for arguments of these shapes, as text."""
        return self.plan_for(*args, **kwargs).to_text()


def _example_data(
    args: tuple, kwargs: dict, static_positions: frozenset[int], static_names: frozenset[str]
) -> tuple[tuple, dict]:
    """What ``tune`` runs on: the arguments when concrete, else random arrays like them.

    Static arguments are left out as the compiled executable expects (None in place of
    positional ones).
    """
    key = [jax.random.PRNGKey(0)]

    def concrete(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray)) and not isinstance(leaf, jax.core.Tracer):
            return leaf
        shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
        key[0], sub = jax.random.split(key[0])
        if jnp.issubdtype(dtype, jnp.floating):
            return jax.random.normal(sub, shape, dtype)
        return jnp.zeros(shape, dtype)

    data_args = tuple(
        None if i in static_positions else jax.tree.map(concrete, a) for i, a in enumerate(args)
    )
    data_kwargs = {k: jax.tree.map(concrete, v) for k, v in kwargs.items() if k not in static_names}
    return data_args, data_kwargs


def fit(
    fn: Callable,
    *,
    budget: int | float | str,
    argnums: int | Sequence[int] = 0,
    grad: bool = True,
    policies: bool = True,
    max_compilations: int = 10,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    verbose: bool = False,
    tune: bool = False,
) -> Fitted:
    """Chooses every ``"auto"`` knob inside ``fn`` so its compiled peak fits ``budget``.

    ``fitted(*args)`` computes exactly ``fn(*args)``; ``jax.grad(fitted, argnums)`` (or
    ``fitted`` itself with ``grad=False``) compiles to a program whose peak (XLA's
    ``memory_analysis()``) is at most ``budget``, the fastest such plan the search found.
    Planning compiles (never runs) the program for the arguments' shapes and dtypes, at
    most ``max_compilations`` times for each new argument signature.

    Args:
      fn: the function; its ``mw.scan(checkpoints="auto")``, ``chunk_size="auto"``,
        ``microbatches="auto"`` and ``mw.region`` blocks are the knobs.
      budget: bytes (an int, or a string such as ``"8GiB"``, ``"2.5 GB"``, ``"1e9"``,
        ``"1,000,000"``), or a fraction of the device's memory such as ``0.8``.
      argnums: arguments differentiated when ``grad=True`` (never static ones).
      grad: plan for ``jax.grad(fn, argnums)`` (True) or for ``fn`` itself.
      policies: also choose a ``jax.checkpoint`` policy for ``fn`` as a whole.
      max_compilations: compilations allowed to plan one argument signature (>= 2).
      static_argnums: arguments passed to ``fn`` as Python values, as ``jax.jit``
        passes static arguments (hashable; each value is planned on its own). Call
        ``jax.grad(fitted)`` inside ``jax.jit`` with the same static arguments.
      static_argnames: the same, by name.
      verbose: print each plan as it is compiled: its knob values, compiled peak against
        the budget and predicted time.
      tune: after the search, time plans near the chosen one: it and its neighbours that
        fit (one candidate away on one knob), 5 timed runs each after a warm-up, then
        the neighbours of the fastest (by its fastest run, and faster in most rounds),
        until none is faster or 6 plans have been timed; the plan held is kept. It runs
        the program on the arguments when they are concrete arrays, else on random arrays of
        their shapes (a data-dependent loop, e.g. Sinkhorn's, may then run another number
        of iterations). ``plan.tuning_compilations`` and ``plan.timing_runs`` count that
        work apart from the search's ``plan.compilations``.

    Raises:
      MemoryBudgetError: when even the leanest plan exceeds the budget; the message says
        the smallest peak reached and what dominates it.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def loss(w, xs):
        ...     def step(h, x):
        ...         return jnp.tanh(h @ w + x), None
        ...     h, _ = mw.scan(step, jnp.zeros(16), xs, checkpoints="auto")
        ...     return jnp.sum(h)
        >>> fitted = mw.fit(loss, budget="24KiB")  # all 200 carries would take 28 KiB
        >>> g = jax.grad(fitted)(jnp.eye(16), jnp.ones((200, 16)))  # planned on first call
        >>> print(fitted.plan)
        plan: peak ... within budget 24.0 KiB, predicted time ...
          policy (whole loss) ...
          checkpoints ...
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for name, flag in (
        ("grad", grad),
        ("policies", policies),
        ("verbose", verbose),
        ("tune", tune),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if (
        isinstance(max_compilations, bool)
        or not isinstance(max_compilations, int)
        or max_compilations < 2
    ):
        raise ValueError(f"max_compilations must be an int >= 2, got {max_compilations!r}")
    nums = _arguments.index_tuple(argnums, "argnums")
    if not nums:
        raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
    _arguments.check_static_options(fn, static_argnums, static_argnames)
    clash = set(nums) & set(_arguments.index_tuple(static_argnums, "static_argnums"))
    if grad and clash:
        raise ValueError(
            f"argnums={argnums!r} names static argument(s) {sorted(clash)} "
            f"(static_argnums={static_argnums!r}); differentiate array arguments only"
        )
    static = {"static_argnums": static_argnums, "static_argnames": static_argnames}
    argnums = argnums if isinstance(argnums, int) else nums
    return Fitted(
        fn, budget, argnums, grad, policies, max_compilations, static, verbose=verbose, tune=tune
    )
