"""Unbalanced Gromov-Wasserstein's changes to each linearisation, in OTT-JAX 0.6's form
(Séjourné, Vialard, Peyré, NeurIPS 2021, "The Unbalanced Gromov Wasserstein Distance";
OTT's ``QuadraticProblem.update_linearization`` with ``tau_a < 1`` or ``tau_b < 1``).

With a relaxed marginal the plan's mass drifts, and the quadratic KL penalties of the
unbalanced problem change the linearised cost at a plan ``P`` of mass ``m`` in three ways:

* the plan is rescaled by ``s = sqrt(m_old / m)`` (``m_old`` the previous plan's mass,
  ``sum(a) sum(b)`` at first), and so are its marginals and the fused term;
* the linear solve's epsilon is ``epsilon`` times the rescaled plan's mass;
* a constant is added to the cost: ``eps sum_ij P_ij log P_ij + rho_a sum_i p_i log(p_i /
  a_i) + rho_b sum_j q_j log(q_j / b_j)`` (rescaled ``P``, ``p = P 1``, ``q = P^T 1``,
  ``rho = eps tau / (1 - tau)`` for a relaxed side, 0 for a hard one).

Every term is a sum over the marginals and one plan pass: with ``P_ij = a_i b_j exp((f_i
+ g_j - C_ij) / eps)``, ``sum P log P = <p, log a + f / eps> + <q, log b + g / eps> - <P,
C> / eps``, and ``<P, C>`` is :meth:`memwise.ot.TransportPlan.transport_cost`: nothing
``n x m`` is formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from memwise.ot.marginals import Side, log_weights
from memwise.ot.plan import TransportPlan

__all__ = ["correction", "product_correction", "rescale"]

Array = jax.Array


def _penalties(
    sides: tuple[Side, Side], eps: Array, p: Array, q: Array, a: Array, b: Array
) -> Array:
    """``rho_a sum p log(p / a) + rho_b sum q log(q / b)`` (OTT's ``-entr(p) - xlogy(p,
    a)``), relaxed sides only."""
    total = jnp.zeros((), p.dtype)
    for side, marginal, weights in zip(sides, (p, q), (a, b)):
        if side.relaxed:
            total = total + side.rho(eps) * jnp.sum(
                xlogy(marginal, marginal) - xlogy(marginal, weights)
            )
    return total


def product_correction(sides: tuple[Side, Side], eps: Array, a: Array, b: Array) -> Array:
    """The constant at the product plan ``a b^T`` (OTT's first linearisation): with
    ``A = sum(a)``, ``B = sum(b)``, ``sum P log P = B <a, log a> + A <b, log b>`` and the
    marginals ``a B``, ``b A``."""
    mass_a, mass_b = jnp.sum(a), jnp.sum(b)
    entropy = mass_b * jnp.sum(xlogy(a, a)) + mass_a * jnp.sum(xlogy(b, b))
    return eps * entropy + _penalties(sides, eps, a * mass_b, b * mass_a, a, b)


def _entropy(plan: TransportPlan, p: Array, q: Array) -> Array:
    """``sum_ij P_ij log P_ij`` from the marginals and one pass (see the module)."""

    def term(marginal, weights, potential):
        inner = log_weights(weights) + potential / plan.eps
        return jnp.sum(jnp.where(marginal > 0, marginal * inner, 0.0))

    cost = plan.transport_cost().astype(p.dtype)
    return term(p, plan.a, plan.f) + term(q, plan.b, plan.g) - cost / plan.eps


def correction(
    sides: tuple[Side, Side], eps: Array, plan: TransportPlan, p: Array, q: Array
) -> Array:
    """The constant added to the linearised cost at the (rescaled) ``plan``, of
    marginals ``p``, ``q``, for the solve at ``eps``."""
    return eps * _entropy(plan, p, q) + _penalties(sides, eps, p, q, plan.a, plan.b)


def rescale(plan: TransportPlan, old_mass: Array) -> tuple[Array, Array, Array, Array]:
    """``(s, s P 1, s P^T 1, m)`` for the plan of mass ``m``: ``s = sqrt(m_old / m)``,
    held (OTT stops its gradient). The rescaled plan ``s P`` is ``P`` with ``f`` moved
    by ``eps log s``."""
    p, q = plan.marginal(1), plan.marginal(0)
    mass = jax.lax.stop_gradient(jnp.sum(p))
    scale = jnp.sqrt(old_mass / mass)
    return scale, scale * p, scale * q, mass
