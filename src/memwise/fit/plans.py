"""What ``mw.fit`` records: the plans it compiled and the one it chose.

A :class:`Trial` is one compiled plan (candidate indices, compiled peak, predicted cost,
whether it fits); a :class:`Plan` is the chosen one, per knob a :class:`PlanEntry`, with
what the search and the tuning cost. :func:`predicted_cost` is the cost model the search
orders plans by: knob overheads relative to the fastest candidates, summed. Plain
records, no JAX: the search (:mod:`memwise.fit.search`) and ``Fitted`` build them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from memwise import knobs, measure

__all__ = ["MemoryBudgetError", "Plan", "PlanEntry", "Trial", "predicted_cost"]


class MemoryBudgetError(RuntimeError):
    """No plan compiles to a peak within the budget.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> fitted = mw.fit(lambda x: jnp.sum(jnp.sin(x) ** 2), budget="1KiB")
        >>> fitted(jnp.ones(10_000))
        Traceback (most recent call last):
          ...
        memwise.fit.MemoryBudgetError: no plan fits the budget of 1.0 KiB
        (1,024 B): ...
    """


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


def predicted_cost(found: Sequence[knobs.Knob], indices: Sequence[int]) -> float:
    """Predicted time relative to the fastest-candidate plan: knob overheads summed."""
    return 1.0 + sum(k.cost[i] / k.cost[0] - 1.0 for k, i in zip(found, indices))


# Raised to users as memwise.fit.MemoryBudgetError, the public name (also in tracebacks).
MemoryBudgetError.__module__ = "memwise.fit"
