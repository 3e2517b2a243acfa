"""The Sinkhorn loops: log-domain updates until the marginals are met, never differentiated.

:func:`solve` alternates ``f = T_b(g)``, ``g = T_a(f)`` (Cuturi 2013, in the log domain
of Schmitzer 2019); :func:`solve_symmetric` makes the averaged updates
``f <- (f + T_a(f)) / 2`` of a self-transport problem ``OT(a, a)`` (Feydy et al. 2019,
Eq. 25). Both run in one ``lax.while_loop`` over chunked passes
(:mod:`memwise.ot.passes`), with epsilon annealing when asked
(:class:`memwise.ot.problem.EpsilonSchedule`), and stop when the L1 marginal error is
below the threshold at the target epsilon (after ``min_iterations``), on a NaN, or at
``max_iterations``. A relaxed marginal (:mod:`memwise.ot.marginals`) scales its update
by ``tau`` and measures its error against the marginal the penalty asks for. A solve
that holds the cost matrix (``chunk_size=None``) shifts each transform by the side's
last one (:func:`memwise.ot.passes.held_softmin`). Their inputs are stopped: gradients
come from :mod:`memwise.ot.gradients` at the potentials they return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from memwise.ot import marginals
from memwise.ot.marginals import HARD
from memwise.ot.passes import Placed, c_transform, max_cost, safe_log
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
    mass: Array
    last: tuple = ()  # (T_b(g), T_a(f)) of the last iteration, where a held solve reads them


def _marginal_error(weights, log_ratio, log_target=0.0):
    """``sum_k |w_k exp(log_ratio_k) - w_k exp(log_target_k)|`` (the plan's marginal over
    ``w`` is ``exp(log_ratio)``; the target over ``w`` is 1 for a hard marginal),
    overflow-safe, NaN if the state is not finite."""
    ratio = jnp.expm1(jnp.minimum(log_ratio - log_target, 80.0))
    error = jnp.sum(
        jnp.where(
            weights > 0, weights * jnp.exp(jnp.minimum(log_target, 80.0)) * jnp.abs(ratio), 0.0
        )
    )
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
    min_iterations: int,
    mass: Array,
    last: tuple = (),
) -> _Loop:
    """Run ``body`` until converged at the target epsilon (after min_iterations), NaN, or
    max_iterations."""

    def keep_going(state: _Loop) -> Array:
        at_target = schedule.at(state.iteration - 1) <= schedule.target
        converged = (
            at_target
            & (state.error < threshold)
            & (state.iteration > 0)
            & (state.iteration >= min_iterations)
        )
        return (state.iteration < max_iterations) & ~converged & ~jnp.isnan(state.error)

    init = _Loop(
        jnp.zeros((), jnp.int32),
        f,
        g,
        g_next,
        jnp.asarray(jnp.inf, f.dtype),
        -jnp.ones((max_iterations,), f.dtype),
        mass,
        last,
    )
    return jax.lax.while_loop(keep_going, body, init)


def solve(
    cost,
    consts,
    x,
    y,
    a,
    b,
    eps,
    g_init,
    *,
    chunk_size,
    max_iterations,
    threshold,
    scaling,
    side_a=HARD,
    side_b=HARD,
    min_iterations=0,
):
    """Alternating log-domain updates; returns ``(f, g, errors, n_iterations, error,
    mass)``, ``mass`` the total mass of the plan of the returned ``(f, g)``.

    Each iteration sets ``f`` from ``T_b(g)`` (rows optimal), then computes ``T_a(f)``:
    that both measures the column error of ``(f, g)`` and gives the next ``g``. The loop
    stops before taking it, so the returned pair is the one whose error was measured.
    """
    log_a, log_b = safe_log(a), safe_log(b)
    schedule = _schedule(cost, consts, x, y, eps, chunk_size, scaling)
    transform = c_transform(cost, consts, x, y, chunk_size)

    def body(state: _Loop) -> _Loop:
        eps_k = schedule.at(state.iteration)
        g = state.g_next
        last_b, last_a = state.last or (None, None)
        t_b = transform(log_b + g / eps_k, eps_k, last_b)
        f = marginals.update(side_a, t_b, a, eps_k)
        t_a = transform(log_a + f / eps_k, eps_k, last_a, axis=0)
        g_next = marginals.update(side_b, t_a, b, eps_k)
        target = marginals.relaxed_target(side_b, b, g, eps_k)
        # A traced epsilon <= 0 cannot be rejected up front: it shows as a NaN error.
        error = jnp.where(eps > 0, _marginal_error(b, (g - t_a) / eps_k, target), jnp.nan)
        if side_a.relaxed:  # the rows carry what the penalty on a leaves them
            mass = jnp.sum(jnp.where(a > 0, a * jnp.exp((f - t_b) / eps_k), 0.0))
        else:  # f = T_b(g) exactly: the plan's rows sum to a
            mass = state.mass
        return _Loop(
            state.iteration + 1,
            f,
            g,
            g_next,
            error,
            state.errors.at[state.iteration].set(error),
            mass,
            (t_b, t_a) if state.last else (),
        )

    out = _loop(
        body,
        jnp.zeros_like(a),
        g_init,
        g_init,
        schedule,
        threshold,
        max_iterations,
        min_iterations,
        jnp.sum(a),
        (jnp.zeros_like(a), jnp.zeros_like(b)) if chunk_size.held else (),
    )
    return out.f, out.g, out.errors, out.iteration, out.error, out.mass


def solve_symmetric(
    cost,
    consts,
    x,
    a,
    eps,
    f_init,
    *,
    chunk_size,
    max_iterations,
    threshold,
    scaling,
    side=HARD,
    min_iterations=0,
):
    """Averaged updates ``f <- (f + T_a(f)) / 2`` for OT(a, a) (Feydy et al. Eq. 25);
    returns ``(f, errors, n_iterations, error, mass)``. ``side`` relaxes both marginals
    alike (one ``tau``), so the problem stays symmetric.

    The error is the L1 error of both marginals of ``(f, f)`` (as OTT-JAX measures
    parallel updates); the loop stops before averaging once it is below ``threshold``.
    """
    log_a = safe_log(a)
    schedule = _schedule(cost, consts, x, x, eps, chunk_size, scaling)
    transform = c_transform(cost, consts, x, x, chunk_size)

    def body(state: _Loop) -> _Loop:
        eps_k = schedule.at(state.iteration)
        f = state.f
        t = transform(log_a + f / eps_k, eps_k, state.g_next)  # g_next: the last T_a(f)
        target = marginals.relaxed_target(side, a, f, eps_k)
        error = jnp.where(eps > 0, 2.0 * _marginal_error(a, (f - t) / eps_k, target), jnp.nan)
        done = (eps_k <= eps) & (error < threshold) & (state.iteration + 1 >= min_iterations)
        # g carries the row mass of (f, f), needed for reg_ot_cost when the loop stops.
        mass = jnp.sum(jnp.where(a > 0, a * jnp.exp((f - t) / eps_k), 0.0))
        f_next = jnp.where(done, f, 0.5 * (f + marginals.update(side, t, a, eps_k)))
        return _Loop(
            state.iteration + 1,
            f_next,
            jnp.broadcast_to(mass, (1,)),
            t,
            error,
            state.errors.at[state.iteration].set(error),
            state.mass,
        )

    out = _loop(
        body,
        f_init,
        jnp.zeros((1,), a.dtype),
        f_init,
        schedule,
        threshold,
        max_iterations,
        min_iterations,
        jnp.sum(a),
    )
    converged_at_stop = out.error < threshold
    # When the loop ran out of iterations the last f was averaged after its mass was
    # measured; the mass of the returned f is then only known to within the error.
    return (
        out.f,
        out.errors,
        out.iteration,
        out.error,
        out.g[0] if side.relaxed else jnp.where(converged_at_stop, out.g[0], jnp.sum(a)),
    )
