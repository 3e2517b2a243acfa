"""Choose every memory knob left as ``"auto"`` so the compiled program meets a budget.

Each ``"auto"`` knob a function's trace reaches registers itself (``memwise.knobs``) with
its candidates, ordered from the most memory to the least, and a predicted time per
candidate: body evaluations for scans, the measured cost of host offload for a nested
scan's segment carries (``offload="auto"``, on an accelerator), a roofline for chunk sizes (XLA's cost analysis of
one tile body and the machine's measured balance, ``memwise.costmodel``). With
``policies=True`` the function as a whole (when ``fit`` plans its gradient) and every
block marked with :func:`region` become one more knob each, whose candidates are
``jax.checkpoint`` policies, from saving everything to saving nothing.

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

# PlanEntry and POLICIES stay importable from here, as from the single module it was.
from memwise.fit.fitted import Fitted, fit
from memwise.fit.plans import MemoryBudgetError, Plan, Trial
from memwise.fit.plans import PlanEntry as PlanEntry
from memwise.fit.policies import POLICIES as POLICIES
from memwise.fit.policies import region

__all__ = ["Fitted", "MemoryBudgetError", "Plan", "Trial", "fit", "region"]
