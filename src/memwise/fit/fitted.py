"""``fit`` and ``Fitted``: a function whose ``"auto"`` knobs are planned under a budget.

:func:`fit` checks its options and returns a :class:`Fitted`. On the first call for an
argument signature (tree structure, shapes, dtypes, static values), ``Fitted`` traces
the function once to find its knobs (:mod:`memwise.knobs`), runs the search
(:mod:`memwise.fit.search`) with a ``compile_plan`` that compiles the program under a
plan and reads XLA's ``memory_analysis()`` (never running it), optionally tunes by
timing (:mod:`memwise.fit.tuning`), and records the :class:`~memwise.fit.plans.Plan`.
Every call then runs the function under that plan, checked to reach the knobs it was
planned with. Compiled memory is remembered per function and signature, so a later fit
of the same function with another budget reuses what an earlier one compiled.

A fitted function composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap`` whatever its
options: planning only needs the arguments' shapes, and tuning, which runs programs,
runs them outside the caller's trace.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax

from memwise import _arguments, knobs, measure
from memwise.fit import tuning
from memwise.fit.plans import MemoryBudgetError, Plan, PlanEntry, Trial
from memwise.fit.policies import with_policy
from memwise.fit.search import Search

__all__ = ["Fitted", "fit"]

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


@dataclasses.dataclass(eq=False, kw_only=True)
class _Signature(Search):
    """Everything ``fit`` keeps for one argument signature: its search, and its plan.

    One instance per signature, so each new signature gets its own ``max_compilations``
    (a signature planned second is planned exactly as if it were alone).
    """

    args: tuple  # abstract (jax.ShapeDtypeStruct) arguments
    kwargs: dict
    plan: Plan | None = None
    # JAX's trace caches are keyed on this while the plan runs (knobs.recording): traces
    # of jitted or checkpointed helpers are shared by the calls of this plan only.
    cache_key: Any = dataclasses.field(default_factory=knobs.fresh_cache_key)
    traced: bool = False  # whether a trace under cache_key has reached every knob

    def chosen(self) -> Plan:
        """The plan, once searched (see :meth:`Fitted._planned`)."""
        assert self.plan is not None
        return self.plan


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
        # A remat policy for the whole function only matters when fit plans its gradient:
        # with grad=False nothing outside differentiates it (blocks marked with mw.region
        # may still be differentiated inside fn, a training step's loss, say).
        fn, policies = self.fn, self.policies and self.grad

        @functools.wraps(fn)  # keeps fn's argument names in reports
        def planned(*args, **kwargs):
            with knobs.recording(indices, layout, cache_key=cache_key) as found:
                if policies:
                    label = f"whole {getattr(fn, '__name__', 'fn')}"
                    out = with_policy(fn, label, _where(fn))(*args, **kwargs)
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
        with _arguments.static_hint(self.fn, args, kwargs):
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
                self._knobs_of(abstract_args, abstract_kwargs),
                self.budget_bytes,
                self.max_compilations,
                _memory_cache(self.fn, (key, self.grad, self.argnums, self.policies)),
                verbose=self.verbose,
                args=abstract_args,
                kwargs=abstract_kwargs,
            )
            self._signatures[key] = state
        if state.plan is None:
            chosen = state.search(lambda indices: self._compile(indices, state))
            if chosen is None:
                self._raise_infeasible(state)
            timed: tuple[tuple[tuple, float], ...] = ()
            tuning_compilations = runs = 0
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

    def _tune(self, state: _Signature, chosen: Trial, args: tuple, kwargs: dict) -> tuning.Tuned:
        """``tune=True``: a local search by measurement (:mod:`memwise.fit.tuning`)."""

        def compile_plan(indices: tuple[int, ...]) -> tuple[Any, measure.CompiledMemory]:
            return measure.compile_measured(
                self._program(indices, state.layout),
                *state.args,
                grad=self.grad,
                argnums=self.argnums,
                **self._static,
                **state.kwargs,
            )

        def data() -> tuple[tuple, dict]:
            static = _arguments.static_arguments(self.fn, args, kwargs, **self._static)
            return tuning.example_data(args, kwargs, *static)

        return tuning.tune(
            state,
            chosen,
            compile_plan,
            data,
            tune_plans=self.tune_plans,
            tune_runs=self.tune_runs,
            verbose=self.verbose,
        )

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
        ``microbatches="auto"``, ``mw.region`` blocks and, on an accelerator with host
        memory, ``mw.scan(schedule="nested", offload="auto")`` (segment carries on the
        device or in host memory) are the knobs.
      budget: bytes (an int, or a string such as ``"8GiB"``, ``"2.5 GB"``, ``"1e9"``,
        ``"1,000,000"``), or a fraction of the device's memory such as ``0.8``.
      argnums: arguments differentiated when ``grad=True`` (never static ones).
      grad: plan for ``jax.grad(fn, argnums)`` (True) or for ``fn`` itself.
      policies: also choose a ``jax.checkpoint`` policy for ``fn`` as a whole (with
        ``grad=True`` only: with ``grad=False`` nothing differentiates ``fn`` from
        outside, so no policy could change its memory; ``mw.region`` blocks inside stay
        knobs either way).
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
        of iterations); under ``jax.jit`` or ``jax.grad`` it runs them outside the trace,
        on random arrays. ``plan.tuning_compilations`` and ``plan.timing_runs`` count
        that work apart from the search's ``plan.compilations``.

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
        >>> # all 200 carries would take 28 KiB
        >>> fitted = mw.fit(loss, budget="24KiB")
        >>> # planned on first call
        >>> g = jax.grad(fitted)(jnp.eye(16), jnp.ones((200, 16)))
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
