"""Choose every memory knob left as ``"auto"`` so the compiled program meets a budget.

Each ``"auto"`` knob a function's trace reaches registers itself (``memwise.knobs``) with
its candidates, ordered fastest-first, and a predicted compute cost per candidate. With
``policies=True`` the function as a whole, and every block marked with :func:`region`,
becomes one more knob whose candidates are ``jax.checkpoint`` policies, from saving
everything to saving nothing.

The search never runs the program; it compiles and reads XLA's ``memory_analysis()``:

1. *Pressure path.* One pressure level p in [0, 1] maps to every knob at once
   (candidate index round(p * (len - 1))). p = 0 is the fastest plan; if it fits, done.
   Otherwise p = 1 (the leanest plan) is compiled, first with the remat policies left
   at "save everything" (they recompute whole regions), then, if that does not fit,
   with them too; if even the leanest plan does not fit, no plan can (knobs are
   monotone), and :class:`MemoryBudgetError` says what dominates.
2. *Bisection* over the distinct plans of the path finds the least pressure that fits
   (log2 of the number of levels compilations), assuming peak memory decreases along it.
3. *Greedy relaxation*: knob by knob, step back towards faster candidates while the
   program still fits, largest predicted saving first, until ``max_compilations``.

Every compiled plan is remembered per argument signature, and the fastest predicted plan
known to fit is chosen, so a larger budget never gets a slower predicted plan. The cost
model is coarse by design (relative recomputation per knob, summed as overheads): it only
has to order plans; the memory claim is always verified by compiling. Honest limits: the
bisection assumes monotone peaks along the path, and the greedy step may miss a plan that
changes two knobs at once to reach a lower cost.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from memwise import knobs, measure

__all__ = ["Fitted", "MemoryBudgetError", "Plan", "fit", "parse_budget", "region"]


class MemoryBudgetError(RuntimeError):
    """No plan compiles to a peak within the budget."""


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
        "policy", candidates=tuple(POLICIES), cost=_POLICY_COST,
        default="everything_saveable", label=label, source=source,
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

        @mw.region("encoder")
        def encoder(params, x):
            ...
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
# budgets

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def device_memory_bytes() -> int:
    """Memory of the default device: the allocator's limit, or the host's RAM on CPU."""
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory_stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return measure.host_memory_bytes()


def parse_budget(budget: int | float | str) -> int:
    """Bytes from ``1 << 30``, ``"8GiB"``, ``"512MB"`` or a device fraction like ``0.8``."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes, a size string or a fraction, not a bool")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return budget
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(
                f"a float budget is a fraction of device memory in (0, 1], got {budget}; "
                "pass bytes as an int or a string like '8GiB'"
            )
        return int(budget * device_memory_bytes())
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if match is None or match[2].lower() not in _UNITS:
            raise ValueError(
                f"cannot read budget {budget!r}; write bytes with a unit such as '8GiB', "
                "'512MB' or '1.5 GB'"
            )
        value = int(float(match[1]) * _UNITS[match[2].lower()])
        if value <= 0:
            raise ValueError(f"budget must be positive, got {budget!r}")
        return value
    raise TypeError(f"budget must be bytes, a size string or a fraction, got {type(budget).__name__}")


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
    """The chosen value of every knob, the verified compiled peak and predicted cost."""

    entries: tuple[PlanEntry, ...]
    peak_bytes: int
    cost: float
    budget_bytes: int

    @property
    def values(self) -> tuple:
        return tuple(e.value for e in self.entries)

    def to_text(self) -> str:
        lines = [
            f"plan: peak {measure.format_bytes(self.peak_bytes)} within budget "
            f"{measure.format_bytes(self.budget_bytes)}, predicted compute {self.cost:.2f}x"
        ]
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


# Compiled peaks of every plan tried, per function and argument signature, shared by all
# fits of the same function: a plan verified under one budget serves every larger budget.
_PEAKS: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def _peak_cache(fn: Callable, key: Any) -> dict[tuple[int, ...], int]:
    try:
        per_fn = _PEAKS.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: cache on the Fitted only
        per_fn = {}
    return per_fn.setdefault(key, {})


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def _check_reached(found: Sequence[knobs.Knob], reached: Sequence[knobs.Knob]) -> bool:
    return {k.key for k in found} <= {k.key for k in reached}


def _signature(args: Sequence[Any], kwargs: dict) -> Any:
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    shapes = tuple(
        (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
        for x in leaves
    )
    return tree, shapes


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree
    )


class Fitted:
    """``fn`` with its ``"auto"`` knobs chosen to meet a memory budget. See :func:`fit`."""

    def __init__(self, fn, budget, argnums, grad, policies, max_compilations):
        self.fn = fn
        self.budget_bytes = parse_budget(budget)
        self.argnums = argnums
        self.grad = grad
        self.policies = policies
        self.max_compilations = max_compilations
        self.compilations = 0
        self._plans: dict[Any, Plan] = {}
        self._indices: dict[Any, tuple[int, ...]] = {}
        self._trials: dict[Any, dict[tuple[int, ...], Trial]] = {}
        self._found: dict[Any, list[knobs.Knob]] = {}
        self._last: Any = None
        self._last_args: tuple | None = None
        functools.update_wrapper(self, fn)

    # the program under a plan ---------------------------------------------------------

    def _program(
        self, indices: Sequence[int] | None, layout: Sequence[knobs.Knob] | None = None,
        sink: list | None = None,
    ) -> Callable:
        fn, policies = self.fn, self.policies

        @functools.wraps(fn)  # keeps fn's argument names in reports
        def planned(*args, **kwargs):
            with knobs.recording(indices, layout) as found:
                if policies:
                    label = f"whole {getattr(fn, '__name__', 'fn')}"
                    out = _with_policy(fn, label, _where(fn))(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
            if sink is not None:
                sink.extend(found)
            return out

        return planned

    def _knobs_of(self, args, kwargs) -> list[knobs.Knob]:
        found: list[knobs.Knob] = []
        jax.eval_shape(self._program(None, None, found), *args, **kwargs)
        return found

    def _measure(self, indices, found, args, kwargs) -> measure.CompiledMemory:
        self.compilations += 1
        for attempt in range(2):
            reached: list[knobs.Knob] = []
            memory = measure.compiled_memory(
                self._program(indices, found, reached), *args, grad=self.grad,
                argnums=self.argnums, **kwargs,
            )
            if _check_reached(found, reached):
                return memory
            # A knob was not traced again: an inner jax.jit / checkpoint replayed a cached
            # trace made under another plan. Clear JAX's trace caches once and retry.
            jax.clear_caches()
        raise RuntimeError(
            "mw.fit could not apply its plan: some 'auto' knobs were not traced again "
            f"({sorted({k.source for k in found} - {k.source for k in reached})}). "
            "They may sit inside a function whose trace JAX caches across calls; call "
            "them directly inside the fitted function."
        )

    # planning ------------------------------------------------------------------------

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for arguments of these shapes (planned on first use, then cached)."""
        key = _signature(args, kwargs)
        if key not in self._plans:
            self._plans[key] = self._search(key, _abstract(args), _abstract(kwargs))
        self._last, self._last_args = key, (_abstract(args), _abstract(kwargs))
        return self._plans[key]

    def _search(self, key, args, kwargs) -> Plan:
        found = self._knobs_of(args, kwargs)
        self._found[key] = found
        trials = self._trials.setdefault(key, {})
        budget = self.budget_bytes
        peaks = _peak_cache(self.fn, (key, self.grad, self.argnums, self.policies))
        for indices, peak in peaks.items():
            trials[indices] = Trial(
                indices, tuple(k.candidates[i] for k, i in zip(found, indices)), peak,
                _predicted_cost(found, indices), peak <= budget,
            )

        def trial(indices: tuple[int, ...]) -> Trial:
            if indices not in trials:
                peaks[indices] = self._measure(indices, found, args, kwargs).peak_bytes
                trials[indices] = Trial(
                    indices, tuple(k.candidates[i] for k, i in zip(found, indices)),
                    peaks[indices], _predicted_cost(found, indices), peaks[indices] <= budget,
                )
            return trials[indices]

        def best_known() -> Trial | None:
            fitting = [t for t in trials.values() if t.peak_bytes <= budget]
            return min(fitting, key=lambda t: (t.cost, t.peak_bytes)) if fitting else None

        # Remat policies recompute whole regions; try them only when the other knobs
        # alone cannot meet the budget.
        is_policy = [k.kind == "policy" for k in found]
        stages = [[not p for p in is_policy], [True] * len(found)]
        if all(is_policy) or not any(is_policy):
            stages = stages[1:]
        active = stages[-1]
        if not trial(tuple([0] * len(found))).fits:
            for active in stages:
                levels = _pressure_levels(found, active)
                if trial(levels[-1]).fits:
                    break
            else:
                self._raise_infeasible(found, levels[-1], args, kwargs)
            low, high = 0, len(levels) - 1  # levels[low] does not fit, levels[high] fits
            while high - low > 1 and self._room():
                mid = (low + high) // 2
                if trial(levels[mid]).fits:
                    high = mid
                else:
                    low = mid
        self._relax(found, trial, best_known)
        chosen = best_known()
        assert chosen is not None
        entries = tuple(
            PlanEntry(k.kind, k.label, k.source, k.candidates[i], i, len(k.candidates))
            for k, i in zip(found, chosen.indices)
        )
        self._indices[key] = chosen.indices
        return Plan(entries, chosen.peak_bytes, chosen.cost, budget)

    def _room(self) -> bool:
        return self.compilations < self.max_compilations

    def _relax(self, found, trial, best_known) -> None:
        improved = True
        while improved and self._room():
            improved = False
            current = best_known()
            steps = []
            for k, knob in enumerate(found):
                if current.indices[k] > 0:
                    candidate = list(current.indices)
                    candidate[k] -= 1
                    saving = current.cost - _predicted_cost(found, candidate)
                    if saving > 1e-9:
                        steps.append((saving, tuple(candidate)))
            for _, candidate in sorted(steps, reverse=True):
                if not self._room():
                    return
                if trial(candidate).fits:
                    improved = True
                    break

    def _raise_infeasible(self, found, leanest, args, kwargs) -> None:
        program = self._program(leanest, found)
        self.compilations += 1
        report = measure.memory_report(program, *args, grad=self.grad, argnums=self.argnums, **kwargs)
        parts = {
            "arguments": report.argument_bytes,
            "outputs": report.output_bytes,
            "temporaries": report.temp_bytes,
        }
        dominant = max(parts, key=parts.get)
        detail = f"{dominant} ({measure.format_bytes(parts[dominant])})"
        if report.residuals and dominant != "arguments":
            top = report.residuals[0]
            detail += (
                f"; the largest residual is {measure.format_bytes(top.nbytes)} "
                f"({top.dtype}{list(top.shape)}) from {top.source}"
            )
        knob_text = ", ".join(f"{k.kind}={k.candidates[i]!s} at {k.source}"
                              for k, i in zip(found, leanest)) or "no 'auto' knobs"
        raise MemoryBudgetError(
            f"no plan fits the budget of {measure.format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B): the "
            f"smallest peak reached is {measure.format_bytes(report.peak_bytes)} ({report.peak_bytes:,} B) "
            f"(leanest plan: {knob_text}). It is dominated by {detail}. Raise the budget, "
            "leave more knobs as 'auto', or mark blocks with mw.region."
        )

    # use -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.plan_for(*args, **kwargs)
        key = self._last
        reached: list[knobs.Knob] = []
        out = self._program(self._indices[key], self._found[key], reached)(*args, **kwargs)
        if not _check_reached(self._found[key], reached):
            raise RuntimeError(
                "mw.fit: this call of the fitted function did not reach the knobs it was "
                f"planned with ({[k.source for k in self._found[key]]} vs "
                f"{[k.source for k in reached]}); call 'auto' primitives from the same "
                "lines on every call"
            )
        return out

    @property
    def plan(self) -> Plan:
        """The plan chosen for the most recent arguments."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the fitted function (or plan_for) first")
        return self._plans[self._last]

    @property
    def frontier(self) -> list[Trial]:
        """Every plan compiled for the most recent arguments, by predicted cost."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the fitted function (or plan_for) first")
        return sorted(self._trials[self._last].values(), key=lambda t: (t.cost, t.peak_bytes))

    @property
    def report(self) -> measure.MemoryReport:
        """Memory report of the chosen program for the most recent arguments."""
        if self._last is None:
            raise RuntimeError("no plan yet: call the fitted function (or plan_for) first")
        args, kwargs = self._last_args
        return self.report_for(*args, **kwargs)

    def report_for(self, *args: Any, **kwargs: Any) -> measure.MemoryReport:
        self.plan_for(*args, **kwargs)
        program = self._program(self._indices[self._last], self._found[self._last])
        return measure.memory_report(program, *args, grad=self.grad, argnums=self.argnums, **kwargs)

    def plan_text(self, *args: Any, **kwargs: Any) -> str:
        return self.plan_for(*args, **kwargs).to_text()


def fit(
    fn: Callable,
    *,
    budget: int | float | str,
    argnums: int | Sequence[int] = 0,
    grad: bool = True,
    policies: bool = True,
    max_compilations: int = 10,
) -> Fitted:
    """Chooses every ``"auto"`` knob inside ``fn`` so its compiled peak fits ``budget``.

    ``fitted(*args)`` computes exactly ``fn(*args)``; ``jax.grad(fitted, argnums)`` (or
    ``fitted`` itself with ``grad=False``) compiles to a program whose peak (XLA's
    ``memory_analysis()``) is at most ``budget``, the fastest such plan the search found.
    Planning compiles (never runs) the program for the arguments' shapes and dtypes, at
    most ``max_compilations`` times, once per new argument signature.

    Args:
      fn: the function; its ``mw.scan(checkpoints="auto")``, ``chunk_size="auto"``,
        ``microbatches="auto"`` and ``mw.region`` blocks are the knobs.
      budget: bytes, a string such as ``"8GiB"`` / ``"512MB"``, or a fraction of the
        device's memory such as ``0.8``.
      argnums: arguments differentiated when ``grad=True``.
      grad: plan for ``jax.grad(fn, argnums)`` (True) or for ``fn`` itself.
      policies: also choose a ``jax.checkpoint`` policy for ``fn`` as a whole.

    Raises:
      MemoryBudgetError: when even the leanest plan exceeds the budget; the message says
        the smallest peak reached and what dominates it.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def loss(w, xs):
        ...     def step(h, x):
        ...         return jnp.tanh(h @ w + x), None
        ...     h, _ = mw.scan(step, jnp.zeros(64), xs, checkpoints="auto")
        ...     return jnp.sum(h)
        >>> fitted = mw.fit(loss, budget="4MiB")
        >>> g = jax.grad(fitted)(jnp.eye(64), jnp.ones((1000, 64)))  # doctest: +SKIP
        >>> print(fitted.plan)  # doctest: +SKIP
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(max_compilations, int) or max_compilations < 2:
        raise ValueError(f"max_compilations must be an int >= 2, got {max_compilations!r}")
    if not isinstance(argnums, int):
        argnums = tuple(argnums)
    return Fitted(fn, budget, argnums, grad, policies, max_compilations)
