"""Names a saved residual by the operation whose derivative it is, not by JAX's helper op.

A residual that a primitive's differentiation rule computes only for the backward pass
is reported by JAX under the helper's own name: ``jnp.tanh`` keeps ``tanh(x)`` and
``1 - tanh(x)``, reported as ``tanh`` and ``sub``; ``h ** 2`` keeps ``2 * h``, reported as
``mul``. Neither ``sub`` nor ``mul`` is in the user's code. This module finds those
helpers in the traced ``vjp`` program and names them ``tanh derivative`` and
``integer_pow derivative``.

What it relies on: in the jaxpr of ``jax.vjp(f, ...)`` (primal outputs, then residuals),
a helper is an equation none of whose outputs the primal outputs need (it exists only
to be saved), and JAX emits a rule's helpers right after the primitive they
differentiate, before the next primitive of the user's program. A helper is attributed
to the latest primitive before it that produced or consumed one of the primal values it
reads. Only generic arithmetic helpers are renamed: a helper with a telling name
(``cos`` for ``sin``, ``exp``) keeps it. When JAX's report and this analysis do not line
up (a JAX release that orders residuals differently), the names are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["name_derivatives"]

# Helpers whose own name says nothing about the user's operation.
_GENERIC = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "integer_pow",
        "square",
        "select_n",
        "max",
        "min",
        "sign",
        "convert_element_type",
        "broadcast_in_dim",
        "gt",
        "ge",
        "lt",
        "le",
        "eq",
        "ne",
    }
)


def _is_var(atom: Any) -> bool:
    return not hasattr(atom, "val")  # Literals carry a value; variables do not


def _has_subprogram(eqn: Any) -> bool:
    # jit, custom_jvp_call, scan, cond ...: their derivative is not one rule's helpers
    return any(hasattr(p, "eqns") or hasattr(p, "jaxpr") for p in eqn.params.values())


def _derivative_of(jaxpr: Any, n_primal_outputs: int) -> dict[Any, str]:
    """Output variable of each generic helper -> the primitive it differentiates."""
    needed = {v for v in jaxpr.outvars[:n_primal_outputs] if _is_var(v)}
    primal = [False] * len(jaxpr.eqns)
    for k in range(len(jaxpr.eqns) - 1, -1, -1):  # what the primal outputs depend on
        eqn = jaxpr.eqns[k]
        if any(v in needed for v in eqn.outvars) or eqn.effects:
            primal[k] = True
            needed.update(v for v in eqn.invars if _is_var(v))
    touched_by: dict[Any, int] = {}  # primal value -> latest primal eqn producing/reading it
    reads: dict[Any, frozenset] = {}  # helper output -> primal values it was computed from
    labels: dict[Any, str] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        inputs = [v for v in eqn.invars if _is_var(v)]
        if primal[k]:
            for v in (*inputs, *eqn.outvars):
                touched_by[v] = k
            continue
        sources = frozenset().union(*(reads.get(v, frozenset({v})) for v in inputs))
        for v in eqn.outvars:
            reads[v] = sources
        owners = [touched_by[v] for v in sources if v in touched_by]
        if eqn.primitive.name not in _GENERIC or not owners:
            continue
        owner = jaxpr.eqns[max(owners)]
        if not _has_subprogram(owner):
            for v in eqn.outvars:
                labels[v] = f"{owner.primitive.name} derivative"
    return labels


def name_derivatives(
    full_jaxpr: Any, n_primal_outputs: int, saved: Sequence[tuple[Any, str]]
) -> list[tuple[Any, str]]:
    """JAX's ``(aval, description)`` residual list, helpers renamed for their operation.

    Args:
      full_jaxpr: the jaxpr of ``jax.vjp`` (primal outputs, then the residuals).
      n_primal_outputs: how many of its outputs are primal outputs.
      saved: what JAX's saved-residual analysis reported for the residual outputs, in
        its order (literals, constants, arguments, then equation outputs in program
        order), e.g. ``"output of sub from model.py:8 (loss)"``.

    Returns:
      ``saved`` with ``output of sub`` replaced by ``output of tanh derivative`` where
      the ``sub`` is ``tanh``'s helper.
    """
    labels = _derivative_of(full_jaxpr, n_primal_outputs)
    if not labels:
        return list(saved)
    # as JAX's analysis: a reduce_precision is looked through to what it rounds
    rounded = {
        e.outvars[0]: e.invars[0] for e in full_jaxpr.eqns if e.primitive.name == "reduce_precision"
    }
    residuals = {rounded.get(v, v) for v in full_jaxpr.outvars[n_primal_outputs:] if _is_var(v)}
    produced = [(v, eqn) for eqn in full_jaxpr.eqns for v in eqn.outvars if v in residuals]
    renamed, position = [], 0
    for aval, description in saved:
        if description.startswith(("output of ", "named ")):  # an equation's output
            if position == len(produced):
                return list(saved)  # not the order this module assumes
            var, eqn = produced[position]
            position += 1
            prefix = f"output of {eqn.primitive.name} from "
            if var in labels:
                if not description.startswith(prefix):
                    return list(saved)
                description = f"output of {labels[var]} from " + description[len(prefix) :]
        renamed.append((aval, description))
    return renamed if position == len(produced) else list(saved)
