"""How each marginal of the transport problem is enforced: exactly (balanced) or by a penalty.

OTT-JAX 0.6's convention (``LinearProblem(tau_a, tau_b)``, Sejourne, Feydy, Vialard,
Trouve, Peyre 2019, "Sinkhorn divergences for unbalanced optimal transport"): a marginal
with ``tau = 1`` is a hard constraint; ``tau < 1`` relaxes it by a KL penalty of weight
``rho = epsilon tau / (1 - tau)``. In this package's potentials (``P_ij = a_i b_j
exp((f_i + g_j - C_ij) / eps)``, OTT's ``f`` minus ``eps log a``) OTT's log-domain
updates read ``f = tau_a T_b(g) - (1 - tau_a) eps log a``, the marginal term of its
``reg_ot_cost`` is ``<a, f>`` (hard) or ``-rho <a, exp(-f / rho) - 1>`` (relaxed), and
its unbalanced error compares the plan's marginal with ``a exp(-(f + eps log a) / rho)``.
(OTT's updates solve the problem with the entropy ``-H(P)``, its cost formula is the
dual of the one with ``KL(P | a b^T)``; they coincide when balanced. memwise follows
OTT so that values, potentials and gradients agree with it.)

A :class:`Side` is resolved once per marginal; every formula here is a plain function of
arrays, shared by the loops, the cost and the implicit differentiation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "HARD",
    "Side",
    "fit_gradient",
    "held_potential",
    "log_weights",
    "mass_term",
    "offset",
    "relaxed_target",
]

Array = jax.Array


class Side(NamedTuple):
    """One marginal: ``relaxed`` (static) and its ``tau`` (a float or a 0-d array)."""

    relaxed: bool
    tau: Any = 1.0

    def rho(self, eps: Array) -> Array:
        """The KL penalty's weight ``eps tau / (1 - tau)`` (relaxed sides only)."""
        return eps * self.tau / (1.0 - self.tau)


# A marginal that is a hard constraint (balanced on that side).
HARD = Side(False)


def log_weights(weights: Array) -> Array:
    """``log w`` where ``w > 0``, 0 where ``w = 0`` (a point that carries no mass)."""
    return jnp.log(jnp.where(weights > 0, weights, 1.0))


def held_potential(potential: Array, weights: Array, solved_eps: Array, eps: Array) -> Array:
    """A potential of the solve at ``solved_eps`` as the potential at ``eps`` that OTT
    holds fixed in its Danskin gradient: OTT's potentials are ours plus ``eps log w``, so
    the weights and ``eps`` still move ours."""
    log_w = log_weights(weights)
    return jax.lax.stop_gradient(potential + solved_eps * log_w) - eps * log_w


def offset(side: Side, weights: Array, eps: Array) -> Array:
    """``(1 - tau) eps log w`` where ``w > 0`` (0 where hard or ``w = 0``): the update is
    ``f = tau T(g) - offset``. A zero-weight point carries no mass: its potential is
    extended by ``tau T(g)``, finite."""
    if not side.relaxed:
        return jnp.zeros_like(weights)
    return jnp.where(weights > 0, (1.0 - side.tau) * eps * log_weights(weights), 0.0)


def update(side: Side, transform: Array, weights: Array, eps: Array) -> Array:
    """The Sinkhorn update of one potential from its soft c-transform ``T``."""
    if not side.relaxed:
        return transform
    return side.tau * transform - offset(side, weights, eps)


def relaxed_target(side: Side, weights: Array, potential: Array, eps: Array) -> Array:
    """Log of the marginal the optimum asks for, over ``w``: ``-(h + eps log w) / rho``
    (0 when hard: the marginal is ``w`` itself)."""
    if not side.relaxed:
        return jnp.zeros_like(potential)
    return -(potential + eps * log_weights(weights)) / side.rho(eps)


def mass_term(side: Side, weights: Array, potential: Array, eps: Array) -> Array:
    """The marginal's term in ``reg_ot_cost``: ``<w, h>`` or ``-rho <w, exp(-h/rho) - 1>``."""
    if not side.relaxed:
        return jnp.sum(weights * potential)
    rho = side.rho(eps)
    return -rho * jnp.sum(weights * jnp.expm1(-potential / rho))


def fit_gradient(side: Side, weights: Array, potential: Array, eps: Array) -> Array:
    """``d mass_term / d potential``: ``w`` or ``w exp(-h / rho)``."""
    if not side.relaxed:
        return weights
    return weights * jnp.exp(-potential / side.rho(eps))


def weight_gradient(side: Side, potential: Array, eps: Array) -> Array:
    """``d mass_term / d w``: ``h`` or ``-rho (exp(-h / rho) - 1)``."""
    if not side.relaxed:
        return potential
    rho = side.rho(eps)
    return -rho * jnp.expm1(-potential / rho)
