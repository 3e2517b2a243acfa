"""The Sinkhorn loops: log-domain updates until the marginals are met, never differentiated.

:func:`solve` alternates ``f = T_b(g)``, ``g = T_a(f)`` (Cuturi 2013, in the log domain
of Schmitzer 2019); :func:`solve_symmetric` makes the averaged updates
``f <- (f + T_a(f)) / 2`` of a self-transport problem ``OT(a, a)`` (Feydy et al. 2019,
Eq. 25). Both run in one ``lax.while_loop`` over chunked passes
(:mod:`memwise.ot.passes`), with epsilon annealing when asked
(:class:`memwise.ot.problem.EpsilonSchedule`), and stop when the L1 marginal error is
below the threshold at the target epsilon, on a NaN, or at ``max_iterations``. Their
inputs are stopped: gradients come from :mod:`memwise.ot.gradients` at the potentials
they return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from memwise.ot.passes import Placed, max_cost, safe_log, softmin
from memwise.ot.problem import EpsilonSchedule

__all__ = ["solve", "solve_symmetric"]

Array = jax.Array


class _Loop(NamedTuple):
    iteration: Array
    f: Array
    g: Array
    g_next: Array
    error: Array
    errors: Array


def _marginal_error(weights, log_ratio):
    """``sum_k |w_k exp(log_ratio_k) - w_k|``, overflow-safe, NaN if the state is not finite."""
    ratio = jnp.expm1(jnp.minimum(log_ratio, 80.0))
    error = jnp.sum(jnp.where(weights > 0, weights * jnp.abs(ratio), 0.0))
    return jnp.where(jnp.all(jnp.isfinite(log_ratio)), error, jnp.nan)


def _schedule(
    cost: Callable,
    consts: tuple,
    x: Array,
    y: Array,
    eps: Array,
    chunk_size: Placed,
    scaling: float | None,
) -> EpsilonSchedule:
    """Annealing starts at the largest cost (no pass without annealing)."""
    start = None if scaling is None else max_cost(cost, consts, x, y, chunk_size)
    return EpsilonSchedule(eps, start, scaling)


def _loop(
    body: Callable[[_Loop], _Loop],
    f: Array,
    g: Array,
    g_next: Array,
    schedule: EpsilonSchedule,
    threshold: float,
    max_iterations: int,
) -> _Loop:
    """Run ``body`` until converged at the target epsilon, NaN, or max_iterations."""

    def keep_going(state: _Loop) -> Array:
        at_target = schedule.at(state.iteration - 1) <= schedule.target
        converged = at_target & (state.error < threshold) & (state.iteration > 0)
        return (state.iteration < max_iterations) & ~converged & ~jnp.isnan(state.error)

    init = _Loop(
        jnp.zeros((), jnp.int32),
        f,
        g,
        g_next,
        jnp.asarray(jnp.inf, f.dtype),
        -jnp.ones((max_iterations,), f.dtype),
    )
    return jax.lax.while_loop(keep_going, body, init)


def solve(cost, consts, x, y, a, b, eps, g_init, *, chunk_size, max_iterations, threshold, scaling):
    """Alternating log-domain updates; returns ``(f, g, errors, n_iterations, error,
    mass)``, ``mass`` the total mass of the plan of the returned ``(f, g)``.

    Each iteration sets ``f = T_b(g)`` (rows exact), then computes ``T_a(f)``: that both
    measures the column error of ``(f, g)`` and is the next ``g``. The loop stops before
    taking it, so the returned pair is the one whose error was measured.
    """
    log_a, log_b = safe_log(a), safe_log(b)
    schedule = _schedule(cost, consts, x, y, eps, chunk_size, scaling)

    def body(state: _Loop) -> _Loop:
        eps_k = schedule.at(state.iteration)
        g = state.g_next
        f = softmin(cost, consts, x, y, log_b + g / eps_k, eps_k, chunk_size)
        g_next = softmin(cost, consts, x, y, log_a + f / eps_k, eps_k, chunk_size, axis=0)
        # A traced epsilon <= 0 cannot be rejected up front: it shows as a NaN error.
        error = jnp.where(eps > 0, _marginal_error(b, (g - g_next) / eps_k), jnp.nan)
        return _Loop(
            state.iteration + 1, f, g, g_next, error, state.errors.at[state.iteration].set(error)
        )

    out = _loop(body, jnp.zeros_like(a), g_init, g_init, schedule, threshold, max_iterations)
    mass = jnp.sum(a)  # f = T_b(g) exactly: the plan's rows sum to a
    return out.f, out.g, out.errors, out.iteration, out.error, mass


def solve_symmetric(
    cost, consts, x, a, eps, f_init, *, chunk_size, max_iterations, threshold, scaling
):
    """Averaged updates ``f <- (f + T_a(f)) / 2`` for OT(a, a) (Feydy et al. Eq. 25);
    returns ``(f, errors, n_iterations, error, mass)``.

    The error is the L1 error of both marginals of ``(f, f)`` (as OTT-JAX measures
    parallel updates); the loop stops before averaging once it is below ``threshold``.
    """
    log_a = safe_log(a)
    schedule = _schedule(cost, consts, x, x, eps, chunk_size, scaling)

    def body(state: _Loop) -> _Loop:
        eps_k = schedule.at(state.iteration)
        f = state.f
        t = softmin(cost, consts, x, x, log_a + f / eps_k, eps_k, chunk_size)
        error = jnp.where(eps > 0, 2.0 * _marginal_error(a, (f - t) / eps_k), jnp.nan)
        done = (eps_k <= eps) & (error < threshold)
        # g carries the row mass of (f, f), needed for reg_ot_cost when the loop stops.
        mass = jnp.sum(jnp.where(a > 0, a * jnp.exp((f - t) / eps_k), 0.0))
        f_next = jnp.where(done, f, 0.5 * (f + t))
        return _Loop(
            state.iteration + 1,
            f_next,
            jnp.broadcast_to(mass, (1,)),
            t,
            error,
            state.errors.at[state.iteration].set(error),
        )

    out = _loop(body, f_init, jnp.zeros((1,), a.dtype), f_init, schedule, threshold, max_iterations)
    converged_at_stop = out.error < threshold
    # When the loop ran out of iterations the last f was averaged after its mass was
    # measured; the mass of the returned f is then only known to within the error.
    return (
        out.f,
        out.errors,
        out.iteration,
        out.error,
        jnp.where(converged_at_stop, out.g[0], jnp.sum(a)),
    )
