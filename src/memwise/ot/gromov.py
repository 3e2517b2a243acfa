"""Entropic Gromov-Wasserstein between point clouds (plain and fused), in memory linear in
the number of points: nothing of size ``n x m`` (or ``n x n``) is ever stored.

Gromov-Wasserstein (GW) compares two clouds through their own distances: it looks for the
plan ``P`` (marginals ``a``, ``b``) that minimises ``sum_ijkl (Cx_ik - Cy_jl)^2 P_ij
P_kl`` + ``epsilon KL(P | a b^T)``, with ``Cx``, ``Cy`` the squared Euclidean distances
within each cloud. The solver is Peyré, Cuturi and Solomon's (ICML 2016): each outer
iteration linearises the quadratic loss at the current plan (their eq. 6, with the square
loss ``L(c, c') = (c - c')^2``),

    C_ij = (Cx^2 p)_i + (Cy^2 q)_j - 2 (Cx P Cy)_ij,   p = P 1,  q = P^T 1,

(``Cx^2`` elementwise) and solves that linear entropic problem with
:func:`memwise.ot.sinkhorn`. Fused GW (Vayer, Chapel, Flamary, Tavenard, Courty, ICML 2019)
adds ``fused_penalty`` times the squared Euclidean cost between the two clouds' features.

Memory. ``Cx = A B^T`` with ``A_i = (|x_i|^2, 1, -2 x_i)`` and ``B_k = (1, |x_k|^2,
x_k)``, rank ``d + 2`` (likewise ``Cy``), so ``Cx P Cy = A (B^T P A') B'^T`` needs the plan
applied to ``d + 2`` vectors (chunked passes, :meth:`memwise.ot.TransportPlan.apply`) and
a ``(d + 2) x (d' + 2)`` product. ``(Cx^2 p)_i`` is one chunked sum over pairs
(:func:`memwise.pairwise_reduce`). The linearised cost is then an inner product of
augmented points of dimension ``d' + 4`` (plus the features' for fused GW), which the
chunked Sinkhorn tiles as any cost: per outer iteration, memory O((n + m) d) and a tile.

Unbalanced GW (``tau_a``, ``tau_b`` < 1: Séjourné, Vialard, Peyré, NeurIPS 2021) relaxes
the marginals by KL penalties, as :func:`memwise.ot.sinkhorn` does; OTT-JAX's form of it
changes each linearisation (the plan rescaled to the previous plan's mass, the linear
solve's epsilon times that mass, a constant added to the cost), all sums over the
plan's marginals and one pass over it (:mod:`memwise.ot.gromov_unbalanced`).

Conventions: OTT-JAX 0.6's ``GromovWasserstein`` with its defaults (square loss, no
cost rescaling; unbalanced, ``QuadraticProblem(tau_a=..., tau_b=...)`` with its default
``gw_unbalanced_correction=True``): the first linearisation at the product plan ``a
b^T``, an absolute ``epsilon`` (default 1), the outer loop run at least
``min_iterations`` times and stopped once two successive linear costs agree to
``threshold`` (relative), and the reported ``reg_gw_cost`` the regularised cost of the
linearisation at the final plan, taken at the last solve's potentials. Its gradient is OTT's: the envelope theorem at
that linearisation, the plan held fixed (OTT stops the gradient through it). That is not
the derivative of ``reg_gw_cost`` itself: the fixed point of these iterations is
stationary for ``quadratic + 2 epsilon KL``, not for the reported cost, so the plan's
own dependence on the points is dropped (finite differences of ``reg_gw_cost`` differ).
Each linear solve stops by :func:`memwise.ot.sinkhorn`'s rule (the marginal error
checked every iteration; OTT's checks it every tenth), so with both libraries' default
inner thresholds (1e-3) the two agree to about that threshold (at 500 points: 1.5e-5
relative in the value, 4e-3 in the gradients), and to 1e-6 with tight inner thresholds
(``sinkhorn_options=dict(threshold=1e-9)``). Unbalanced, the same holds (at 500 points
a side, inner threshold 1e-12: values 1e-13, plans 1e-13, gradients 1e-11 relative);
the plan returned is OTT's, the last solve's rescaled by ``sqrt(previous mass / its
mass)``. Strongly relaxed marginals or a small epsilon can keep OTT's unbalanced outer
loop from settling (the costs cycle, or the plan's mass and the cost grow without
bound); memwise follows the same iterates: read ``converged`` and ``costs``, and
raise epsilon or ``tau`` towards 1 where they do not settle.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import positive_int
from memwise._dtypes import accumulation_dtype
from memwise._jax_private import forbid_reverse_mode
from memwise.ot import gromov_unbalanced as unbalanced
from memwise.ot.api import sinkhorn
from memwise.ot.costs import InnerProduct
from memwise.ot.gradients import reg_ot_cost, reverse_mode_only
from memwise.ot.marginals import Side, held_potential
from memwise.ot.passes import auxiliary
from memwise.ot.plan import TransportPlan
from memwise.ot.problem import _check_points, _check_tau, _check_weights, check_scalar, side_of
from memwise.pairwise import pairwise_reduce

_WEIGHTS_GRADIENT = (
    "memwise.ot.gromov_wasserstein differentiates its cost with respect to x, y, the "
    "features and epsilon, not the weights a and b (its outer loop is not "
    "differentiated); pass a and b through jax.lax.stop_gradient, or differentiate "
    "mw.ot.sinkhorn on a cost you hold fixed"
)

__all__ = ["GromovWassersteinResult", "gromov_wasserstein"]

_SINKHORN_OPTIONS = frozenset(inspect.signature(sinkhorn).parameters)
_SET_HERE = frozenset({"x", "y", "a", "b", "epsilon", "cost", "init", "tau_a", "tau_b", "reach"})

Array = jax.Array


class GromovWassersteinResult(NamedTuple):
    """What :func:`gromov_wasserstein` returns.

    Attributes:
      reg_gw_cost: the regularised cost of the linearisation at the final plan, at the
        last solve's potentials (OTT-JAX's ``GWOutput.reg_gw_cost``); differentiable
        (first order, reverse mode) in the points and features.
      plan: the final plan (:class:`memwise.ot.TransportPlan`, never formed):
        ``out.plan.apply(v, axis=...)``, ``out.plan.marginal(axis)``.
      costs: ``[max_iterations]``, the linear solves' ``reg_ot_cost`` per outer
        iteration, ``-1`` for iterations not run (OTT's ``costs``).
      n_iterations: outer iterations run.
      converged: the outer loop stopped by its criterion (not ``max_iterations``) and
        every linear solve converged.
      epsilon: the regularisation given (unbalanced, each linear solve runs at it
        times the rescaled plan's mass, as OTT-JAX's).
    """

    reg_gw_cost: Array
    plan: TransportPlan
    costs: Array
    n_iterations: Array
    converged: Array
    epsilon: Array

    def apply(self, v: Array, *, axis: int = 0) -> Array:
        """:meth:`memwise.ot.TransportPlan.apply`: ``P^T v`` (axis 0) or ``P v`` (axis 1)."""
        return self.plan.apply(v, axis=axis)


# The linearised cost: an inner product of augmented points (see the module), which a
# fused kernel serves on the matrix unit.
_inner = InnerProduct()


def _fourth(xi: Array, xk: Array) -> Array:
    # Expanded, so that over a tile the cross term is one matrix product (the
    # difference would hold rows x cols x d values), as OTT's factored form does.
    return jnp.square(jnp.sum(xi * xi) + jnp.sum(xk * xk) - 2.0 * jnp.dot(xi, xk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _squared_distances_applied(
    x: Array, weights: Array, chunk_size: Any, implementation: str | None
) -> Array:
    """``(Cx^2 w)_i = sum_k |x_i - x_k|^4 w_k``: one chunked sum over pairs.

    Its gradient uses the symmetry of ``|x_i - x_k|^4``: ``x`` is both operands, so the
    pass's own gradient would accumulate one cotangent per operand (two ``[n, d]``
    buffers); here ``d/dx_j = sum_k (c_j w_k + w_j c_k) d/dx_j |x_j - x_k|^4`` is the
    row operand's gradient of one pass with the two weights ``(w, c)`` as columns, and
    row cotangents ``(c, w)``.
    """
    return pairwise_reduce(
        _fourth,
        x,
        x,
        reduce="sum",
        weights=weights,
        chunk_size=chunk_size,
        implementation=auxiliary(implementation),
    )


def _squared_distances_applied_fwd(x, weights, chunk_size, implementation):
    return _squared_distances_applied(x, weights, chunk_size, implementation), (x, weights)


def _squared_distances_applied_bwd(chunk_size, implementation, residuals, ct):
    x, weights = residuals
    held = jax.lax.stop_gradient(x)

    def both(x):  # [n, 2]: sum_k f(x_i, x_k) w_k and sum_k f(x_i, x_k) c_k
        pair = jnp.stack([weights, ct], axis=1)
        return pairwise_reduce(
            _fourth,
            x,
            held,
            reduce="sum",
            weights=pair,
            chunk_size=chunk_size,
            implementation=auxiliary(implementation),
        )

    sums, vjp = jax.vjp(both, x)
    (ct_x,) = vjp(jnp.stack([ct, weights], axis=1))
    # d/dw_k sum_i c_i sum_k f(x_i, x_k) w_k = sum_i f(x_k, x_i) c_i: by the symmetry of
    # f, the second column of the same pass.
    return ct_x.astype(x.dtype), sums[:, 1].astype(weights.dtype)


_squared_distances_applied.defvjp(_squared_distances_applied_fwd, _squared_distances_applied_bwd)


@jax.custom_vjp
def _held_apply(plan: Any, v: Array) -> Array:
    """``P v`` for a plan held fixed, ``v`` of shape ``[m, k]``; its vjp is ``P^T ct``
    (the plan's own arrays are its only residual: differentiating through the passes
    would keep each pass's operands)."""
    return _columns(plan, v, axis=1)


def _columns(plan: Any, v: Array, axis: int) -> Array:
    """The plan applied to each column of ``v`` in its own pass: applied to the whole
    batch at once a tile would hold rows x cols x batch values."""
    return jnp.stack([plan.apply(column, axis=axis) for column in v.T], axis=1)


def _held_apply_fwd(plan, v):
    return _held_apply(plan, v), plan


def _held_apply_bwd(plan, ct):
    return jax.tree.map(jnp.zeros_like, plan), _columns(plan, ct, axis=0)


_held_apply.defvjp(_held_apply_fwd, _held_apply_bwd)


def _linearised(x, y, fx, fy, penalty, plan, p, q, chunk_size, shift=0.0, implementation=None):
    """The augmented points whose inner products are the linearised cost at ``plan``
    (marginals ``p = P 1``, ``q = P^T 1``; see the module docstring), plus the constant
    ``shift`` (unbalanced GW's correction, :mod:`memwise.ot.gromov_unbalanced`).

    With ``Cx = A B^T``, ``A = [|x|^2, 1, -2x]``, ``B = [1, |x|^2, x]`` (and ``A'``,
    ``B'`` of ``y``): ``C_ij = u_i + v_j - 2 (A G)_i . B'_j`` with ``G = B^T P A'``,
    ``u = Cx^2 p``, ``v = Cy^2 q``. ``P A' = [P |y|^2, p, -2 P y]`` takes ``d' + 1``
    applications of the plan (``P 1 = p``); ``A`` and ``B`` are never formed.
    """
    sq_y = jnp.sum(y * y, axis=1)
    columns = jnp.concatenate([sq_y[:, None], y], axis=1)
    if isinstance(plan, _Product):
        applied = plan.apply(columns.T, axis=1).T
    else:
        applied = _held_apply(plan, columns)  # [P |y|^2, P y]: [n, d' + 1]
    u = _squared_distances_applied(x, p, chunk_size, implementation) + shift
    v = _squared_distances_applied(y, q, chunk_size, implementation)
    return _augmented(x, y, fx, fy, jnp.asarray(penalty, x.dtype), applied, p, u, v)


def _b(x: Array, sq_x: Array, c: Array) -> Array:
    """``B c`` with ``B = [1, |x|^2, x]`` (never formed): ``[n, k]`` for ``c`` ``[d + 2, k]``."""
    return c[0] + sq_x[:, None] * c[1] + x @ c[2:]


def _b_transposed(x: Array, sq_x: Array, w: Array) -> Array:
    """``B^T w``: ``[d + 2, k]`` for ``w`` ``[n, k]``."""
    return jnp.concatenate([jnp.sum(w, 0, keepdims=True), (sq_x @ w)[None], x.T @ w])


def _swapped(g: Array) -> Array:
    """``S g`` with ``A = B S``: ``[g_1, g_0, -2 g_2:]`` (``S`` is symmetric)."""
    return jnp.concatenate([g[1:2], g[:1], -2.0 * g[2:]])


def _placement(width: int, dtype: Any) -> np.ndarray:
    """``place`` in ``P A' = [P |y|^2, p, -2 P y] = [P |y|^2, P y] place + p e_1``
    (``width = d' + 2`` columns; column 1, ``p``'s, is zero)."""
    place = np.zeros((width - 1, width), dtype)
    place[0, 0] = 1.0
    place[1:, 2:] = -2.0 * np.eye(width - 2)
    return place


@jax.custom_vjp
def _augmented(x, y, fx, fy, penalty, applied, p, u, v):
    """``_linearised``'s algebra, given ``applied = [P |y|^2, P y]`` and ``u``, ``v``.

    Its backward is written out: the cotangents of the ``[n, d' + 4]`` augmented points
    reach ``x`` through products with ``(d + 2) x (d' + 2)`` matrices, so that no slice
    of them and no ``[n, d' + 2]`` product (``P A'``, ``A G`` or their cotangents) is
    formed; JAX's own backward held about five such arrays at once.
    """
    return _augmented_fwd(x, y, fx, fy, penalty, applied, p, u, v)[0]


def _augmented_fwd(x, y, fx, fy, penalty, applied, p, u, v):
    sq_x = jnp.sum(x * x, axis=1)
    sq_y = jnp.sum(y * y, axis=1)
    place = _placement(applied.shape[1] + 1, applied.dtype)
    # G = B^T P A' = (B^T [P |y|^2, P y]) place + (B^T p) e_1: P A' is never formed.
    g = _b_transposed(x, sq_x, applied) @ place
    g = g.at[:, 1].set(_b_transposed(x, sq_x, p[:, None])[:, 0])
    left = [u[:, None], jnp.ones_like(u)[:, None], _b(x, sq_x, _swapped(g))]  # A G = B S G
    ones = jnp.ones_like(v)[:, None]
    right = [ones, v[:, None], -2.0 * ones, -2.0 * sq_y[:, None], -2.0 * y]
    if fx is not None:
        left[0] = left[0] + penalty * jnp.sum(fx * fx, 1, keepdims=True)
        right[1] = right[1] + penalty * jnp.sum(fy * fy, 1, keepdims=True)
        left.append(fx)
        right.append(-2.0 * penalty * fy)
    points = jnp.concatenate(left, 1), jnp.concatenate(right, 1)
    return points, (x, y, fx, fy, penalty, applied, p, g)


def _augmented_bwd(residuals, cotangents):
    x, y, fx, fy, penalty, applied, p, g = residuals
    ct_left, ct_right = cotangents
    sq_x = jnp.sum(x * x, axis=1)
    width = g.shape[1]
    place = _placement(width, g.dtype)
    # A G is left's columns 2 : 2 + width; its cotangent is read through products with
    # this selection (zero elsewhere), never sliced out.
    select = np.zeros((ct_left.shape[1], width), g.dtype)
    select[2 : 2 + width] = np.eye(width)
    ct_g = _swapped(_b_transposed(x, sq_x, ct_left) @ select)  # S B^T ct_AG
    # d/dx_i of sum(w * (B c)) is 2 x_i (w_i . c_1) + c_2:^T w_i, for A G = B (S G) and
    # for G = B^T W (W = P A' = applied place + p e_1): h = [w c_1, w c_2:^T] summed.
    h = (
        ct_left @ (select @ _swapped(g)[1:].T)
        + applied @ (place @ ct_g[1:].T)
        + p[:, None] * ct_g[1:, 1]
    )
    ct_x = 2.0 * x * h[:, :1] + h[:, 1:]
    ct_applied = _b(x, sq_x, ct_g @ place.T)  # ct_W = B ct_G, placed back
    ct_p = _b(x, sq_x, ct_g[:, 1:2])[:, 0]
    d = y.shape[1]
    # right = [1, v, -2, -2 |y|^2, -2 y, -2 penalty fy]
    ct_y = -2.0 * ct_right[:, 4 : 4 + d] - 4.0 * y * ct_right[:, 3:4]
    ct_fx = ct_fy = None
    ct_penalty = jnp.zeros_like(penalty)
    if fx is not None:
        sq_fx, sq_fy = jnp.sum(fx * fx, axis=1), jnp.sum(fy * fy, axis=1)
        ct_features = ct_right[:, 4 + d :]
        ct_fx = ct_left[:, 2 + width :] + 2.0 * penalty * ct_left[:, :1] * fx
        ct_fy = -2.0 * penalty * ct_features + 2.0 * penalty * ct_right[:, 1:2] * fy
        ct_penalty = (
            ct_left[:, 0] @ sq_fx + ct_right[:, 1] @ sq_fy - 2.0 * jnp.sum(ct_features * fy)
        )
    return ct_x, ct_y, ct_fx, ct_fy, ct_penalty, ct_applied, ct_p, ct_left[:, 0], ct_right[:, 1]


_augmented.defvjp(_augmented_fwd, _augmented_bwd)


def gromov_wasserstein(
    x: Array,
    y: Array,
    a: Array | None = None,
    b: Array | None = None,
    *,
    epsilon: float | Array = 1.0,
    x_features: Array | None = None,
    y_features: Array | None = None,
    fused_penalty: float = 1.0,
    tau_a: float | Array = 1.0,
    tau_b: float | Array = 1.0,
    max_iterations: int = 50,
    min_iterations: int = 5,
    threshold: float = 1e-3,
    sinkhorn_options: dict | None = None,
    chunk_size: Any = "auto",
) -> GromovWassersteinResult:
    """Entropic Gromov-Wasserstein between ``x`` and ``y``, fused with their features'
    squared Euclidean cost when ``x_features``/``y_features`` are given; in chunked
    memory (nothing ``n x m`` is formed).

    The same problem and iterations as OTT-JAX's ``GromovWasserstein`` on
    ``QuadraticProblem(PointCloud(x), PointCloud(y), [PointCloud(x_features,
    y_features)], fused_penalty=..., tau_a=..., tau_b=...)`` (see the module docstring
    for the conventions).

    Args:
      x: ``[n, d]`` points; their squared Euclidean distances are one side's costs.
      y: ``[m, d']`` points (``d'`` may differ from ``d``).
      a: ``[n]`` weights (uniform when None).
      b: ``[m]`` weights (uniform when None).
      epsilon: the entropic regularisation, absolute (OTT's ``GromovWasserstein``
        default is 1.0).
      x_features: ``[n, k]`` features of ``x`` for fused GW (with ``y_features``).
      y_features: ``[m, k]`` features of ``y``.
      fused_penalty: the weight of the features' linear cost, >= 0: the problem is
        ``quadratic + fused_penalty * linear`` (OTT's form; fused GW's ``alpha`` in
        ``(1 - alpha) quadratic + alpha linear`` is ``fused_penalty = alpha / (1 -
        alpha)`` with epsilon divided by ``1 - alpha``).
      tau_a: the relaxation of the marginal ``a``, in (0, 1], as in
        :func:`memwise.ot.sinkhorn` and OTT-JAX: ``1.0`` (the default) a hard
        constraint, ``tau < 1`` a KL penalty of weight ``rho = eps tau / (1 - tau)``.
        With either below 1 this is OTT-JAX's unbalanced GW (Séjourné, Vialard, Peyré
        2021; see the module docstring): each linear solve runs at ``epsilon`` times the
        rescaled plan's mass, with a constant added to its cost, and the weights'
        totals may differ. A float (or a 0-d array; not differentiated).
      tau_b: the same for ``b``.
      max_iterations: outer iterations at most.
      min_iterations: outer iterations at least.
      threshold: the outer loop stops when two successive linear costs agree to this
        relative tolerance.
      sinkhorn_options: keyword arguments of each linear solve
        (:func:`memwise.ot.sinkhorn`: ``threshold``, ``max_iterations``, ...).
      chunk_size: the tiles of every chunked pass.

    Returns:
      A :class:`GromovWassersteinResult`.

    Raises:
      TypeError/ValueError: bad points or weights, features given for one side only or
        of different widths, a negative ``fused_penalty`` or ``epsilon`` (Python, NumPy
        or concrete JAX numbers; a traced one is not checked), iteration counts that are
        not positive ints or ``min_iterations > max_iterations``, a threshold that is
        not a positive finite float, ``tau_a`` or ``tau_b`` outside (0, 1];
        ``TypeError`` for a gradient with respect to the weights ``a`` or ``b`` (the
        outer loop is not differentiated), naming the fix.

    Example::

        >>> import jax, memwise as mw
        >>> x = jax.random.normal(jax.random.PRNGKey(0), (60, 2))
        >>> rotated = x @ jax.numpy.array([[0.0, -1.0], [1.0, 0.0]])  # same distances
        >>> solve = jax.jit(mw.ot.gromov_wasserstein)  # one program, not one per step
        >>> out = solve(x, rotated, epsilon=0.05)
        >>> moved = out.plan.apply(rotated.T, axis=1).T * 60  # where each x_i is sent
        >>> bool(jax.numpy.mean(jax.numpy.sum((moved - rotated) ** 2, 1)) < 0.1)
        True

    Unbalanced, points that nothing in the other cloud resembles are left out of the
    plan (a balanced plan must send the 8 outliers their weight, 8/38 of the mass):

        >>> x = x[:30]
        >>> outliers = 4.0 + jax.random.normal(jax.random.PRNGKey(1), (8, 2))
        >>> y = jax.numpy.concatenate([x, outliers])
        >>> out = solve(x, y, epsilon=2.0, tau_a=0.9, tau_b=0.9)
        >>> received = out.plan.marginal(0)  # P^T 1, the mass each y_j receives
        >>> bool(received[30:].sum() < 1e-6 * received[:30].sum())
        True
    """
    x = _check_points("x", x)
    y = _check_points("y", y)
    n, m = x.shape[0], y.shape[0]
    dtype = jnp.result_type(x, y)
    # bfloat16 and float16 clouds are solved in float32, as mw.ot.sinkhorn solves them
    # (the linearised cost's sums of fourth powers need the range and the bits).
    work = accumulation_dtype(dtype)
    x, y = x.astype(work), y.astype(work)
    # A cloud's own distances do not change when it moves: each is centred (the shift
    # held), so that the augmented points' powers of |x|^2 keep float32's bits (100 from
    # the origin in 3 dimensions the cost was -inf).
    x = x - jax.lax.stop_gradient(jnp.mean(x, axis=0))
    y = y - jax.lax.stop_gradient(jnp.mean(y, axis=0))
    a = jnp.full((n,), 1.0 / n, work) if a is None else _check_weights("a", a, n, work)
    b = jnp.full((m,), 1.0 / m, work) if b is None else _check_weights("b", b, m, work)
    if (x_features is None) != (y_features is None):
        raise ValueError(
            "fused Gromov-Wasserstein needs both x_features and y_features (or neither)"
        )
    fx = fy = None
    if x_features is not None:
        fx = _check_points("x_features", x_features).astype(work)
        fy = _check_points("y_features", y_features).astype(work)
        if fx.shape[0] != n or fy.shape[0] != m or fx.shape[1] != fy.shape[1]:
            raise ValueError(
                f"x_features and y_features must be [n, k] = [{n}, k] and [m, k] = [{m}, k] "
                f"with the same k, got {fx.shape} and {fy.shape}"
            )
    check_scalar("epsilon", epsilon, 0.0, closed=False)
    check_scalar("fused_penalty", fused_penalty, 0.0, closed=True)
    _check_tau("tau_a", tau_a)
    _check_tau("tau_b", tau_b)
    max_iterations = positive_int(max_iterations, "max_iterations")
    min_iterations = positive_int(min_iterations, "min_iterations")
    if min_iterations > max_iterations:
        raise ValueError(
            f"min_iterations ({min_iterations}) must be at most max_iterations ({max_iterations})"
        )
    check_scalar("threshold", threshold, 0.0, closed=False)
    # Forward mode, also over a reverse pass (jax.hessian), raises memwise.ot's message
    # at the inputs, not the message of whichever pass it reaches first.
    x, y, a, b, fx, fy = reverse_mode_only((x, y, a, b, fx, fy))
    # The outer loop (a lax.while_loop, which has no reverse rule) sees the weights held
    # constant; the final cost sees them behind a guard, so that a gradient in them
    # raises this message, not JAX's about while_loop.
    guarded = tuple(forbid_reverse_mode(w, _WEIGHTS_GRADIENT) for w in (a, b))
    a, b = jax.lax.stop_gradient((a, b))
    options = dict(sinkhorn_options or {})
    for key in options:
        if key in _SET_HERE:
            raise ValueError(f"sinkhorn_options may not set {key!r}: the solver sets it")
        if key not in _SINKHORN_OPTIONS:
            raise ValueError(
                f"sinkhorn_options has {key!r}, which mw.ot.sinkhorn does not take; it takes "
                f"{sorted(_SINKHORN_OPTIONS - _SET_HERE)}"
            )
    options.setdefault("chunk_size", chunk_size)
    impl = options.get("implementation")

    # A traced tau is relaxed and held (not differentiated), as in mw.ot.sinkhorn.
    def side(tau: Any) -> Side:
        return side_of(
            jax.lax.stop_gradient(tau) if isinstance(tau, jax.core.Tracer) else tau, work
        )

    sides = (side(tau_a), side(tau_b))
    relaxed = sides[0].relaxed or sides[1].relaxed
    taus = {name: side.tau for name, side in zip(("tau_a", "tau_b"), sides) if side.relaxed}
    # The solves run on a held epsilon: the loop is not differentiated; the final
    # cost's envelope gradient reaches epsilon itself.
    held_eps = jax.lax.stop_gradient(jnp.asarray(epsilon, work))

    def solve(points, eps):
        px, qy = points
        return sinkhorn(px, qy, a, b, epsilon=eps, cost=_inner, **taus, **options)

    def linearise(plan, old_mass, x, y, fx, fy, eps):
        """The linearisation at ``plan``: its points, the solve's epsilon, the plan it
        was taken at (rescaled when unbalanced) and that plan's mass before rescaling."""
        if not relaxed:
            p, q = plan.marginal(1), plan.marginal(0)
            points = _linearised(
                x, y, fx, fy, fused_penalty, plan, p, q, chunk_size, implementation=impl
            )
            return points, eps, plan, old_mass
        scale, p, q, mass = unbalanced.rescale(plan, old_mass)
        plan = plan_of(plan.x, plan.y, plan.f + plan.eps * jnp.log(scale), plan.g, plan.eps,
                       weights=(plan.a, plan.b))  # fmt: skip
        eps = eps * jax.lax.stop_gradient(jnp.sum(p))
        shift = unbalanced.correction(sides, eps, plan, p, q)
        points = _linearised(
            x, y, fx, fy, fused_penalty * scale, plan, p, q, chunk_size, shift, impl
        )
        return points, eps, plan, mass

    sx, sy, sfx, sfy = jax.lax.stop_gradient((x, y, fx, fy))
    # The first linearisation at the product plan a b^T: P A' = a (b^T A'); unbalanced,
    # at epsilon times its mass, with its correction (OTT's QuadraticInitializer).
    product = _Product(a, b)
    mass = jnp.sum(a) * jnp.sum(b) if relaxed else jnp.asarray(1.0, work)
    eps = held_eps * mass if relaxed else held_eps
    shift = unbalanced.product_correction(sides, eps, a, b) if relaxed else 0.0
    first = solve(
        _linearised(sx, sy, sfx, sfy, fused_penalty, product, a, b, chunk_size, shift, impl), eps
    )

    template = first.plan  # the cost and tiling every solve shares

    def plan_of(px, qy, f, g, eps, weights=(a, b)):
        return TransportPlan(
            px, qy, weights[0], weights[1], f, g, eps, template.consts,
            cost=template.cost, chunk=template.chunk, dtype=template.dtype,
        )  # fmt: skip

    def cond(state):
        i, costs, _ = state
        stable = (i >= 2) & jnp.isclose(costs[i - 2], costs[i - 1], rtol=threshold)
        finite = jnp.isfinite(costs[jnp.maximum(i - 1, 0)])
        go_on = (i <= 2) | (finite & ~stable) | (i < min_iterations)
        return (i < max_iterations) & go_on

    def body(state):
        i, costs, (points, f, g, eps, old_mass, all_converged) = state
        plan = plan_of(points[0], points[1], f, g, eps)
        new_points, new_eps, _, mass = linearise(plan, old_mass, sx, sy, sfx, sfy, held_eps)
        new = solve(new_points, new_eps)
        costs = costs.at[i].set(new.reg_ot_cost)
        converged = all_converged & new.converged
        return i + 1, costs, (new_points, new.f, new.g, new_eps, mass, converged)

    first_points = jax.lax.stop_gradient(first.plan.x), jax.lax.stop_gradient(first.plan.y)
    costs = -jnp.ones((max_iterations,), first.reg_ot_cost.dtype)
    loop = (first_points, first.f, first.g, eps, mass, first.converged)
    n_iter, costs, loop = jax.lax.while_loop(cond, body, (jnp.asarray(0), costs, loop))
    points, f, g, solved_eps, old_mass, all_converged = jax.lax.stop_gradient(loop)

    # OTT's output: the linearisation at the final plan (held fixed), its regularised
    # cost at the last potentials, differentiated by the envelope theorem.
    a, b = guarded
    last = plan_of(points[0], points[1], f, g, solved_eps, weights=guarded)
    (px, qy), eps, plan, _ = linearise(last, old_mass, x, y, fx, fy, jnp.asarray(epsilon, work))
    if relaxed:
        # OTT holds its potentials, ours plus eps log(weight), at the last solve's
        # epsilon, and reads them at this linearisation's.
        f = held_potential(f, a, solved_eps, eps)
        g = held_potential(g, b, solved_eps, eps)
    at = plan_of(px, qy, f, g, eps, weights=guarded)
    mass = jax.lax.stop_gradient(jnp.sum(at.marginal(1)))
    reg = reg_ot_cost(
        template.cost, template.chunk, (sides[0].relaxed, sides[1].relaxed), px, qy, a, b,
        eps, template.consts, tuple(jnp.asarray(side.tau, work) for side in sides), f, g, mass,
    )  # fmt: skip
    if isinstance(epsilon, jax.core.Tracer) and not relaxed:
        # OTT holds its own potentials, ours plus eps log(weight), fixed: off the
        # optimum of this last linearisation the choice shows in d/d eps, by
        # -sum_i (a_i - (P 1)_i) log a_i and the same for b (a relaxed side's cost
        # passes the potentials' cotangents on, through held_potential above).
        def drift(weights, marginal):
            safe = jnp.where(weights > 0, weights, 1.0)
            return jnp.sum(jnp.where(weights > 0, (weights - marginal) * jnp.log(safe), 0.0))

        slope = -drift(a, at.marginal(1)) - drift(b, at.marginal(0))
        reg = reg + (eps - jax.lax.stop_gradient(eps)) * jax.lax.stop_gradient(slope)
    converged = (n_iter < max_iterations) & all_converged
    # Solved in the working dtype, returned in the input's (the plan's outputs too).
    children, (cost, chunk, _) = plan.tree_flatten()
    plan = TransportPlan.tree_unflatten((cost, chunk, dtype), children)
    return GromovWassersteinResult(
        reg.astype(dtype),
        plan,
        costs.astype(dtype),
        n_iter,
        converged,
        jnp.asarray(epsilon, work).astype(dtype),
    )


class _Product:
    """The product plan ``a b^T`` as an operator (its ``apply`` only)."""

    def __init__(self, a: Array, b: Array) -> None:
        self.a, self.b = a, b

    def apply(self, v: Array, *, axis: int) -> Array:
        assert axis == 1  # P v = a (b . v)
        return (v @ self.b)[..., None] * self.a
