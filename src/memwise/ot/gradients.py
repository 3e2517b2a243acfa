"""Gradients of entropic OT at the solver's stopped potentials, in chunked memory.

Two custom VJPs, declared once, the cost and the tiling their non-differentiable parts:

* :func:`reg_ot_cost` by the envelope (Danskin) theorem: at the optimal potentials the
  regularised cost varies with the points, weights, epsilon and the cost's arrays as if
  the potentials were constants, so its backward pass is one chunked ``logsumexp`` at
  the stopped potentials (whose own chunked vjp yields ``sum_j P_ij grad_x C(x_i,
  y_j)``), plus one pass for the weights ``b``.
* :func:`potentials` by implicit differentiation of the fixed point ``f = T_b(g), g =
  T_a(f)`` with the gauge ``<a, f> = <b, g>`` (Luise, Rudi, Pontil, Ciliberto 2018;
  Eisenberger et al. 2022; OTT-JAX's ``ImplicitDiff``): one linear system in the plan,
  solved by Jacobi-preconditioned conjugate gradients, two chunked passes a step.

Both are first-order reverse-mode rules. Their inputs pass through
:func:`reverse_mode_only` (forward mode, also over a reverse pass, raises memwise's
``TypeError``) and their residuals through the second-order guard (differentiating a
rule again raises), both from the one guard in :mod:`memwise._jax_private`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy.sparse.linalg import cg

from memwise._jax_private import forbid_forward_mode, forbid_reverse_mode
from memwise._vjp import custom_vjp, dense, unwrap
from memwise.ot import marginals
from memwise.ot.marginals import Side
from memwise.ot.passes import epsilon_slope, kernel_apply, safe_log, softmin

__all__ = ["FIRST_ORDER_ONLY", "potentials", "reg_ot_cost", "reverse_mode_only"]

# Relative residual at which the potentials' implicit vjp stops its CG solve.
_CG_RTOL = {"float32": 1e-6, "float64": 1e-10}

FIRST_ORDER_ONLY = (
    "memwise.ot supports first-order reverse mode only (jax.grad, jax.vjp, "
    "jax.value_and_grad, jax.jacrev): its derivatives are custom reverse-mode rules at "
    "the converged potentials (envelope theorem for reg_ot_cost, implicit "
    "differentiation for f and g), so forward mode (jax.jvp, jax.jacfwd, jax.linearize) "
    "and second derivatives (jax.hessian, grad of grad) are not available; "
    "differentiating the rules again would silently drop how the potentials move. "
    "Differentiate once in reverse mode (for a Hessian-vector product, take finite "
    "differences of jax.grad)."
)


def reverse_mode_only(tree: Any) -> Any:
    """``tree``; forward mode through it raises, also over a reverse pass (hessian)."""
    return jax.tree.map(lambda v: forbid_forward_mode(v, FIRST_ORDER_ONLY, outer=True), tree)


def _values(args: tuple) -> tuple:
    """The forward rule's arguments as arrays (the toolkit passes ``CustomVJPPrimal``s)."""
    leaves, tree = jax.tree.flatten(args, is_leaf=lambda a: hasattr(a, "perturbed"))
    return jax.tree.unflatten(tree, unwrap(leaves)[0])


def _forward_mode_error(*_static: Any) -> str:
    return FIRST_ORDER_ONLY


def _first_order_only(tree: Any) -> Any:
    """The backward rules' inputs: differentiating a rule in reverse mode raises."""
    return jax.tree.map(lambda v: forbid_reverse_mode(v, FIRST_ORDER_ONLY), tree)


def _sides(relaxed: tuple, taus: tuple) -> tuple[Side, Side]:
    return Side(relaxed[0], taus[0]), Side(relaxed[1], taus[1])


def _cost_value(sides, a, b, eps, f, g, mass):
    side_a, side_b = sides
    return (
        marginals.mass_term(side_a, a, f, eps)
        + marginals.mass_term(side_b, b, g, eps)
        + eps * (jnp.sum(a) * jnp.sum(b) - mass)
    )


@functools.partial(custom_vjp, nondiff_argnums=(0, 1, 2), forward_mode_error=_forward_mode_error)
def reg_ot_cost(cost, chunk_size, relaxed, x, y, a, b, eps, consts, taus, f, g, mass):
    """``<a,f> + <b,g> + eps(|a||b| - mass)`` (relaxed sides: their mass terms) with a
    chunked vjp: the envelope theorem's when balanced, plus the potentials' cotangents
    when a marginal is relaxed (OTT's cost is not stationary at OTT's fixed point there,
    so its gradient goes on through :func:`potentials`)."""
    return _cost_value(_sides(relaxed, taus), a, b, eps, f, g, mass)


def _frozen_value(sides, a, b, eps, f, g, t_b):
    """The cost at frozen potentials, with the plan's mass from ``T_b(g)``."""
    plan_mass = jnp.sum(a * jnp.exp((f - t_b) / eps))
    return _cost_value(sides, a, b, eps, f, g, plan_mass)


def _reg_ot_cost_fwd(cost, chunk_size, relaxed, *args):
    args = _values(args)
    x, y, a, b, eps, consts, taus, f, g, mass = args
    return _cost_value(_sides(relaxed, taus), a, b, eps, f, g, mass), args


def _reg_ot_cost_bwd(cost, chunk_size, relaxed, residuals, cotangent):
    x, y, a, b, eps, consts, taus, f, g, mass = _first_order_only(residuals)
    sides = _sides(relaxed, taus)
    cotangent = dense(cotangent, jnp.zeros((), f.dtype))
    log_a, log_b = safe_log(a), safe_log(b)

    # The same value written with the potentials frozen: its gradient in everything
    # but b is the envelope gradient; the logsumexp's chunked vjp does the work.
    # T_b's own slope in eps is epsilon_slope's (see _potentials_bwd).
    held = jax.lax.stop_gradient(eps)

    def frozen(x, y, a, eps, consts):
        t_b = softmin(cost, consts, x, y, log_b + g / held, held, chunk_size)
        return _frozen_value(sides, a, b, eps, f, g, t_b), t_b

    _, vjp, t_b = jax.vjp(frozen, x, y, a, eps, consts, has_aux=True)
    dx, dy, da, deps, dconsts = vjp(cotangent)
    _, through_t = jax.vjp(functools.partial(_frozen_value, sides, a, b, eps, f, g), t_b)
    (dt_b,) = through_t(cotangent)
    deps = deps + jnp.sum(dt_b * epsilon_slope(cost, consts, x, y, eps, chunk_size, t_b, g, log_b))
    # b enters the logsumexp through log b (infinite slope at b_j = 0), so its
    # partial derivative (mass term)'_j + eps|a| - eps sum_i P_ij / b_j is written
    # out, with sum_i P_ij / b_j = exp((g_j - T_a(f)_j) / eps).
    t_a = softmin(cost, consts, x, y, log_a + f / eps, eps, chunk_size, axis=0)
    col_ratio = jnp.exp((g - t_a) / eps)
    db = cotangent * (
        marginals.weight_gradient(sides[1], g, eps) + eps * jnp.sum(a) - eps * col_ratio
    )
    zeros = jnp.zeros_like
    if any(relaxed):
        # d value / d(f, g): the penalty's marginal minus the plan's (0 at a balanced
        # optimum, the envelope theorem; not at OTT's unbalanced fixed point).
        df = cotangent * (
            marginals.fit_gradient(sides[0], a, f, eps) - a * jnp.exp((f - t_b) / eps)
        )
        dg = cotangent * (marginals.fit_gradient(sides[1], b, g, eps) - b * col_ratio)
        dtaus = jax.tree.map(zeros, taus)
        return (dx, dy, da, db, deps, dconsts, dtaus, df, dg, zeros(mass))
    # Balanced OT is finite only where sum(a) == sum(b): only changes of a weight
    # vector that keep its total are meaningful, and the potentials' free additive
    # constant would otherwise leak into the gradient. Centring projects onto them.
    return (
        dx,
        dy,
        da - jnp.mean(da),
        db - jnp.mean(db),
        deps,
        dconsts,
        jax.tree.map(zeros, taus),
        zeros(f),
        zeros(g),
        zeros(mass),
    )


reg_ot_cost.defvjp(_reg_ot_cost_fwd, _reg_ot_cost_bwd)


@functools.partial(custom_vjp, nondiff_argnums=(0, 1, 2, 3), forward_mode_error=_forward_mode_error)
def potentials(cost, chunk_size, max_steps, relaxed, x, y, a, b, eps, consts, taus, f, g):
    """The solver's stopped ``(f, g)``, given their implicit-function-theorem vjp."""
    return f, g


def _potentials_fwd(cost, chunk_size, max_steps, relaxed, *args):
    args = _values(args)
    return args[-2:], args


def _potentials_bwd(cost, chunk_size, max_steps, relaxed, residuals, cotangents):
    """Implicit differentiation of ``F = (f - U_a(T_b(g)), g - U_b(T_a(f))) = 0``.

    ``T_b(g)_i = -eps log sum_j b_j exp((g_j - C_ij) / eps)`` and ``U`` a side's update
    (:func:`memwise.ot.marginals.update`: ``tau T - (1 - tau) eps log w``, the identity
    when hard). With ``R = -dT_b/dg``, ``S = -dT_a/df`` (softmaxes), ``J = dF/d(f, g) =
    [I, tau_a R; tau_b S, I]`` and ``K = diag(r / tau_a, c / tau_b) J = [diag(r) /
    tau_a, P; P^T, diag(c) / tau_b]`` (``P`` the plan, ``r, c`` its marginals) is
    symmetric positive semi-definite; when balanced it is singular along the
    potentials' free constant ``(1, -1)``, which the gauge ``<a,f> = <b,g>`` fixes with
    multiplier ``nu`` (CG solves ``K + s u u^T`` there, ``u = (1, -1)``: the same
    solution off ``u``, see below); a relaxed side makes it definite (no gauge). The vjp solves ``J^T
    lam = v - nu (a, -b)`` for ``lam = diag(r / tau_a, c / tau_b) w`` from ``K w = rhs``
    by Jacobi-preconditioned CG, two chunked passes a step, and returns ``-lam .
    dF/dtheta - nu d(<a,f> - <b,g>)/dtheta``. A zero-weight point moves no other
    potential: its own is an output only (``lam = v`` there, moved to ``rhs``). tau is
    held fixed. Not reported yet: a CG solve still above ``_CG_RTOL`` after
    ``max_steps`` steps (small epsilon conditions ``K`` badly) returns its last iterate.
    """
    x, y, a, b, eps, consts, taus, f, g = _first_order_only(residuals)
    side_a, side_b = _sides(relaxed, taus)
    tau_a = side_a.tau if side_a.relaxed else 1.0
    tau_b = side_b.tau if side_b.relaxed else 1.0
    balanced = not any(relaxed)
    cotangents = dense(cotangents, (f, g))
    log_a, log_b = safe_log(a), safe_log(b)

    held = jax.lax.stop_gradient(eps)

    def transport(x, y, eps, consts):  # (U_a(T_b(g)), U_b(T_a(f))) as functions of the data
        # T's own slope in eps is epsilon_slope's (below), not the log-sum-exp's vjp
        t_b = softmin(cost, consts, x, y, log_b + g / held, held, chunk_size)
        t_a = softmin(cost, consts, x, y, log_a + f / held, held, chunk_size, axis=0)
        return (
            marginals.update(side_a, t_b, a, eps),
            marginals.update(side_b, t_a, b, eps),
        ), (t_b, t_a)

    _, pullback, (t_b, t_a) = jax.vjp(transport, x, y, eps, consts, has_aux=True)
    kernel = functools.partial(kernel_apply, cost, consts, x, y, eps, chunk_size)
    log_pf, log_pg = log_a + f / eps, log_b + g / eps  # log P = log_pf + log_pg - C/eps
    r, c = jnp.exp(log_pf - t_b / eps), jnp.exp(log_pg - t_a / eps)  # P's marginals
    v_f, v_g = cotangents
    nu = jnp.zeros((), f.dtype)
    if balanced:
        nu = (jnp.sum(v_f) - jnp.sum(v_g)) / (jnp.sum(a) + jnp.sum(b))
        v_f, v_g = v_f - nu * a, v_g + nu * b
    on_a, on_b = a > 0, b > 0
    out_f, out_g = jnp.where(on_a, 0.0, v_f), jnp.where(on_b, 0.0, v_g)
    rhs = (
        jnp.where(on_a, v_f - tau_b * kernel(log_pf, t_a / eps, out_g, axis=1), 0.0),  # S^T
        jnp.where(on_b, v_g - tau_a * kernel(t_b / eps, log_pg, out_f, axis=0), 0.0),
    )  # R^T
    r_diag, c_diag = r / tau_a, c / tau_b

    # Balanced, K's null vector u = (1, -1) over the points of positive weight. CG solves
    # K + s u u^T: definite, and its solution for a right-hand side off u is K's off u.
    # s puts u's eigenvalue of the preconditioned system at 1, inside the spectrum: K
    # alone let float32 CG grow w along u (a million times the solution after a few
    # hundred steps), stall at 1e-3, and the gradients along u, which cancel exactly,
    # came back as the difference of two large sums.
    u = (on_a.astype(f.dtype), -on_b.astype(g.dtype))

    def dot_u(w):
        return jnp.sum(w[0] * u[0]) + jnp.sum(w[1] * u[1])

    u_norm = dot_u(u)
    gauge = (jnp.sum(r) + jnp.sum(c)) / u_norm**2

    def plan_system(w):
        out = (
            r_diag * w[0] + kernel(log_pf, log_pg, w[1], axis=1),
            c_diag * w[1] + kernel(log_pf, log_pg, w[0], axis=0),
        )
        if not balanced:
            return out
        along = gauge * dot_u(w)
        return out[0] + along * u[0], out[1] + along * u[1]

    def jacobi(w):
        return jnp.where(r > 0, w[0] / r_diag, 0.0), jnp.where(c > 0, w[1] / c_diag, 0.0)

    if balanced:  # off u, as it is up to rounding
        along = dot_u(rhs) / u_norm
        rhs = (rhs[0] - along * u[0], rhs[1] - along * u[1])
    (w_f, w_g), _ = cg(
        plan_system, rhs, M=jacobi, maxiter=max_steps, tol=_CG_RTOL[jnp.dtype(f.dtype).name]
    )
    lam_f, lam_g = jnp.where(on_a, r_diag * w_f, v_f), jnp.where(on_b, c_diag * w_g, v_g)
    dx, dy, deps, dconsts = pullback((lam_f, lam_g))
    slope = functools.partial(epsilon_slope, cost, consts, x, y, eps, chunk_size)
    deps = deps + tau_a * jnp.sum(lam_f * slope(t_b, g, log_b))
    deps = deps + tau_b * jnp.sum(lam_g * slope(t_a, f, log_a, axis=0))
    # d T_a(f)_j / d a_i = -eps exp((f_i + T_a(f)_j - C_ij) / eps), finite at a_i = 0;
    # a relaxed side's update also holds -(1 - tau) eps log a.
    da = -tau_b * eps * kernel(f / eps, t_a / eps, lam_g, axis=1)
    db = -tau_a * eps * kernel(t_b / eps, g / eps, lam_f, axis=0)
    if side_a.relaxed:
        da = da - jnp.where(on_a, (1.0 - tau_a) * eps * lam_f / jnp.where(on_a, a, 1.0), 0.0)
    if side_b.relaxed:
        db = db - jnp.where(on_b, (1.0 - tau_b) * eps * lam_g / jnp.where(on_b, b, 1.0), 0.0)
    zeros = jnp.zeros_like
    dtaus = jax.tree.map(zeros, taus)
    if not balanced:
        return (dx, dy, da, db, deps, dconsts, dtaus, zeros(f), zeros(g))
    da, db = da - nu * f, db + nu * g
    return (dx, dy, da - jnp.mean(da), db - jnp.mean(db), deps, dconsts, dtaus, zeros(f), zeros(g))


potentials.defvjp(_potentials_fwd, _potentials_bwd)
