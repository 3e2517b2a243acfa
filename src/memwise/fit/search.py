"""The search over plans: pressure path, bisection, descent. Plain Python, no JAX.

A plan is one candidate index per knob (:mod:`memwise.knobs`: candidates ordered from
the most memory to the least, with a predicted cost each). :class:`Search` finds the
fastest predicted plan whose compiled peak fits a budget, calling ``compile_plan`` only
for plans whose memory it does not know yet, at most ``max_compilations`` times:

1. *Pressure path* (:func:`pressure_levels`): one level p in [0, 1] maps to every knob
   at once (candidate ``round(p * (len - 1))``). If the most-memory plan does not fit,
   the leanest is compiled, first with remat policies left at "save everything", then
   with them too, stepping back along the path while peaks fall (a tiny tile's
   bookkeeping can make the leanest plan a few KiB larger than the next).
2. *Bisection* over the path's distinct plans for the least pressure that fits,
   assuming peaks fall along it.
3. *Descent*: knob by knob, to any candidate predicted faster while the plan still fits,
   largest predicted saving first.

Honest limits: the bisection assumes monotone peaks along the path, and the descent may
miss a plan that changes two knobs at once to reach a lower cost. Tested exhaustively on
small made-up knobs, compiling nothing (``tests/test_fit_search.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from memwise import knobs, measure
from memwise.fit.plans import Trial, predicted_cost

__all__ = ["Compile", "Search", "pressure_levels"]

Compile = Callable[[tuple[int, ...]], measure.CompiledMemory]


def pressure_levels(
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


@dataclasses.dataclass(eq=False)
class Search:
    """The search over the plans of one argument signature, and every plan it compiled.

    ``memory`` maps plans to their compiled memory and may be shared with earlier
    searches of the same function (plans found there are reused without compiling);
    ``trials`` holds this search's view of them under its own budget.
    """

    layout: list[knobs.Knob]  # the knobs, in the order the trace reaches them
    budget_bytes: int
    max_compilations: int
    memory: dict[tuple[int, ...], measure.CompiledMemory]
    trials: dict[tuple[int, ...], Trial] = dataclasses.field(default_factory=dict)
    compilations: int = 0
    verbose: bool = False

    def room(self) -> int:
        return self.max_compilations - self.compilations

    def trial(self, indices: tuple[int, ...], compile_plan: Compile) -> Trial:
        """The trial of plan ``indices``, compiling it (and counting that) when its memory
        is not known yet."""
        compiled_now = indices not in self.memory
        if compiled_now:
            self.compilations += 1
            self.memory[indices] = compile_plan(indices)
        return self._record(indices, "compiled" if compiled_now else "known")

    def timed_trial(self, indices: tuple[int, ...], memory: measure.CompiledMemory) -> Trial:
        """Records a plan compiled to be timed (``tune=True``), counted apart."""
        self.memory.setdefault(indices, memory)
        return self._record(indices, "timing")

    def _record(self, indices: tuple[int, ...], how: str) -> Trial:
        if indices not in self.trials:
            peak = self.memory[indices].peak_bytes
            self.trials[indices] = Trial(
                indices,
                tuple(k.candidates[i] for k, i in zip(self.layout, indices)),
                peak,
                predicted_cost(self.layout, indices),
                peak <= self.budget_bytes,
            )
            if self.verbose:
                self.say(self.trials[indices], how)
        return self.trials[indices]

    def say(self, trial: Trial, how: str) -> None:
        """One line per plan for ``fit(verbose=True)``: knobs, peak vs budget, cost."""
        knob_text = ", ".join(f"{k.kind}={v!s}" for k, v in zip(self.layout, trial.values))
        verdict = "fits" if trial.fits else "over"
        what = {
            "compiled": f"compiled plan {self.compilations} of at most {self.max_compilations}",
            "known": "plan already compiled by an earlier fit of this function (not compiled again)",
            "timing": "compiled a plan to time it (not counted in max_compilations)",
        }[how]
        print(
            f"mw.fit: {what}: {knob_text or 'no knobs'} -> peak "
            f"{measure.format_bytes(trial.peak_bytes)} vs budget "
            f"{measure.format_bytes(self.budget_bytes)} ({verdict}), predicted time "
            f"{trial.cost:.2f}x",
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
        return sorted(found, key=lambda c: (predicted_cost(self.layout, c), c))

    def best(self) -> Trial | None:
        fitting = [t for t in self.trials.values() if t.fits]
        return min(fitting, key=lambda t: (t.cost, t.peak_bytes)) if fitting else None

    def leanest(self) -> tuple[int, ...]:
        return pressure_levels(self.layout)[-1]

    def search(self, compile_plan: Compile) -> Trial | None:
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
                levels = pressure_levels(self.layout, active)
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
        self, levels: list[tuple[int, ...]], compile_plan: Compile, keep: int = 0
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
                saving = current.cost - predicted_cost(self.layout, candidate)
                if saving > 1e-9 and (known is None or known.fits):
                    moves.append((saving, index > current.indices[k], candidate))
        # Leaner moves first among equal savings: they fit whenever the current plan does.
        return [(saving, c) for saving, _, c in sorted(moves, reverse=True)]

    def _relax(self, compile_plan: Compile) -> None:
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
