"""``jax.checkpoint`` policies as a knob: the whole function, and blocks marked with :func:`region`.

A remat policy decides which intermediates of a differentiated block are saved for the
backward pass and which are recomputed (JAX's ``jax.checkpoint_policies``). ``mw.fit``
treats it as one more ``"auto"`` knob (:mod:`memwise.knobs`) whose candidates run from
saving everything (fastest, most memory) to saving nothing. A policy only matters for a
block that is differentiated: the whole-function knob exists only when ``fit`` plans a
gradient (``grad=True``); a :func:`region` inside a function that takes its own gradient
(a training step planned with ``grad=False``) is still a knob.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from memwise import knobs

__all__ = ["POLICIES", "POLICY_COST", "region", "with_policy"]

# Most memory (saves everything, fastest) first. The costs are the forward work redone in
# the backward, relative to forward + backward ~ 3 forward passes: a coarse order only.
POLICIES: dict[str, Any] = {
    "everything_saveable": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
POLICY_COST = (1.0, 1.15, 1.2, 1.34)


def with_policy(f: Callable, label: str, source: str | None = None) -> Callable:
    """``f`` under the remat policy a plan gives the knob ``label`` (a ``policy`` knob)."""
    choice = knobs.auto(
        "policy",
        candidates=tuple(POLICIES),
        cost=POLICY_COST,
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
            return with_policy(f, f"region {name!r}")(*args, **kwargs)

        return marked

    return wrap
