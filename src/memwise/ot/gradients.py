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
from memwise.ot.passes import kernel_apply, safe_log, softmin

__all__ = ["FIRST_ORDER_ONLY", "potentials", "reg_ot_cost", "reverse_mode_only"]

# Relative residual at which the potentials' implicit vjp stops its CG solve.
_CG_RTOL = {"float32": 1e-5, "float64": 1e-10}

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


@functools.partial(custom_vjp, nondiff_argnums=(0, 1), forward_mode_error=_forward_mode_error)
def reg_ot_cost(cost, chunk_size, x, y, a, b, eps, consts, f, g, mass):
    """``<a,f> + <b,g> + eps(|a||b| - mass)`` with a chunked envelope-theorem vjp."""
    return jnp.sum(a * f) + jnp.sum(b * g) + eps * (jnp.sum(a) * jnp.sum(b) - mass)


def _reg_ot_cost_fwd(cost, chunk_size, *args):
    args = _values(args)
    x, y, a, b, eps, consts, f, g, mass = args
    value = jnp.sum(a * f) + jnp.sum(b * g) + eps * (jnp.sum(a) * jnp.sum(b) - mass)
    return value, args


def _reg_ot_cost_bwd(cost, chunk_size, residuals, cotangent):
    x, y, a, b, eps, consts, f, g, mass = _first_order_only(residuals)
    cotangent = dense(cotangent, jnp.zeros((), f.dtype))
    log_a, log_b = safe_log(a), safe_log(b)

    # The same value written with the potentials frozen: its gradient in everything
    # but b is the envelope gradient; the logsumexp's chunked vjp does the work.
    def frozen(x, y, a, eps, consts):
        t_b = softmin(cost, consts, x, y, log_b + g / eps, eps, chunk_size)
        plan_mass = jnp.sum(a * jnp.exp((f - t_b) / eps))
        return jnp.sum(a * f) + jnp.sum(b * g) + eps * (jnp.sum(a) * jnp.sum(b) - plan_mass)

    _, vjp = jax.vjp(frozen, x, y, a, eps, consts)
    dx, dy, da, deps, dconsts = vjp(cotangent)
    # b enters the logsumexp through log b (infinite slope at b_j = 0), so its
    # partial derivative g_j + eps|a| - eps sum_i P_ij / b_j is written out, with
    # sum_i P_ij / b_j = exp((g_j - T_a(f)_j) / eps).
    t_a = softmin(cost, consts, x, y, log_a + f / eps, eps, chunk_size, axis=0)
    db = cotangent * (g + eps * jnp.sum(a) - eps * jnp.exp((g - t_a) / eps))
    # Balanced OT is finite only where sum(a) == sum(b): only changes of a weight
    # vector that keep its total are meaningful, and the potentials' free additive
    # constant would otherwise leak into the gradient. Centring projects onto them.
    zeros = jnp.zeros_like
    return (
        dx,
        dy,
        da - jnp.mean(da),
        db - jnp.mean(db),
        deps,
        dconsts,
        zeros(f),
        zeros(g),
        zeros(mass),
    )


reg_ot_cost.defvjp(_reg_ot_cost_fwd, _reg_ot_cost_bwd)


@functools.partial(custom_vjp, nondiff_argnums=(0, 1, 2), forward_mode_error=_forward_mode_error)
def potentials(cost, chunk_size, max_steps, x, y, a, b, eps, consts, f, g):
    """The solver's stopped ``(f, g)``, given their implicit-function-theorem vjp."""
    return f, g


def _potentials_fwd(cost, chunk_size, max_steps, *args):
    args = _values(args)
    return args[-2:], args


def _potentials_bwd(cost, chunk_size, max_steps, residuals, cotangents):
    """Implicit differentiation of ``F = (f - T_b(g), g - T_a(f)) = 0``, ``<a,f> = <b,g>``.

    ``T_b(g)_i = -eps log sum_j b_j exp((g_j - C_ij) / eps)``. With ``R = -dT_b/dg``,
    ``S = -dT_a/df`` (softmaxes), ``J = dF/d(f, g) = [I R; S I]`` and
    ``K = diag(r, c) J = [diag(r) P; P^T diag(c)]`` (``P`` the plan, ``r, c`` its
    marginals) is symmetric positive semi-definite, singular only along the potentials'
    free constant ``(1, -1)``, which the gauge fixes with multiplier ``nu``. The vjp
    solves ``J^T lam = v - nu (a, -b)`` for ``lam = diag(r, c) w`` from ``K w = rhs`` by
    Jacobi-preconditioned CG, two chunked passes a step, and returns
    ``lam . dT/dtheta - nu d(<a,f> - <b,g>)/dtheta``. A zero-weight point moves no
    other potential: its own is an output only (``lam = v`` there, moved to ``rhs``).
    Not reported yet: a CG solve still above ``_CG_RTOL`` after ``max_steps`` steps
    (small epsilon conditions ``K`` badly) returns its last iterate.
    """
    x, y, a, b, eps, consts, f, g = _first_order_only(residuals)
    cotangents = dense(cotangents, (f, g))
    log_a, log_b = safe_log(a), safe_log(b)

    def transport(x, y, eps, consts):  # (T_b(g), T_a(f)) as functions of the data
        return (
            softmin(cost, consts, x, y, log_b + g / eps, eps, chunk_size),
            softmin(cost, consts, x, y, log_a + f / eps, eps, chunk_size, axis=0),
        )

    (t_b, t_a), pullback = jax.vjp(transport, x, y, eps, consts)
    kernel = functools.partial(kernel_apply, cost, consts, x, y, eps, chunk_size)
    log_pf, log_pg = log_a + f / eps, log_b + g / eps  # log P = log_pf + log_pg - C/eps
    r, c = jnp.exp(log_pf - t_b / eps), jnp.exp(log_pg - t_a / eps)  # P's marginals
    v_f, v_g = cotangents
    nu = (jnp.sum(v_f) - jnp.sum(v_g)) / (jnp.sum(a) + jnp.sum(b))
    v_f, v_g = v_f - nu * a, v_g + nu * b
    on_a, on_b = a > 0, b > 0
    out_f, out_g = jnp.where(on_a, 0.0, v_f), jnp.where(on_b, 0.0, v_g)
    rhs = (
        jnp.where(on_a, v_f - kernel(log_pf, t_a / eps, out_g, axis=1), 0.0),  # S^T
        jnp.where(on_b, v_g - kernel(t_b / eps, log_pg, out_f, axis=0), 0.0),
    )  # R^T

    def plan_system(w):
        return (
            r * w[0] + kernel(log_pf, log_pg, w[1], axis=1),
            c * w[1] + kernel(log_pf, log_pg, w[0], axis=0),
        )

    def jacobi(w):
        return jnp.where(r > 0, w[0] / r, 0.0), jnp.where(c > 0, w[1] / c, 0.0)

    (w_f, w_g), _ = cg(
        plan_system, rhs, M=jacobi, maxiter=max_steps, tol=_CG_RTOL[jnp.dtype(f.dtype).name]
    )
    lam_f, lam_g = jnp.where(on_a, r * w_f, v_f), jnp.where(on_b, c * w_g, v_g)
    dx, dy, deps, dconsts = pullback((lam_f, lam_g))
    # d T_a(f)_j / d a_i = -eps exp((f_i + T_a(f)_j - C_ij) / eps), finite at a_i = 0.
    da = -eps * kernel(f / eps, t_a / eps, lam_g, axis=1) - nu * f
    db = -eps * kernel(t_b / eps, g / eps, lam_f, axis=0) + nu * g
    zeros = jnp.zeros_like
    return (dx, dy, da - jnp.mean(da), db - jnp.mean(db), deps, dconsts, zeros(f), zeros(g))


potentials.defvjp(_potentials_fwd, _potentials_bwd)
