"""The entropic transport plan as an operator: applied, summed and mapped tile by tile.

The plan of a solve is ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / eps)``; it is
never formed. Every operation here is one or two chunked passes
(:func:`memwise.ot.passes.kernel_apply`, :func:`memwise.ot.passes.softmin`, both
:func:`memwise.pairwise_reduce`), so it holds O(n + m + tile) memory forward and
backward and is differentiable (first order, reverse mode) in the points, the weights,
epsilon, the potentials (implicitly, through the solve) and the cost's arrays.
Conventions follow OTT-JAX 0.6's ``SinkhornOutput``: ``apply(v, axis=0)`` is ``P^T v``,
``axis=1`` is ``P v``; ``marginal(1)`` is ``P 1``, ``marginal(0)`` is ``P^T 1``; the
entropic map of points ``z`` is the barycentric projection ``T(z) = sum_j w_j(z) y_j``
with ``w(z) = softmax_j(log b_j + (g_j - C(z, y_j)) / eps)`` (for the squared Euclidean
cost ``z - grad f(z) / 2`` for the c-transform ``f`` of ``g``; Pooladian and Niles-Weed
2021). OTT-JAX's ``to_dual_potentials().transport`` is the same map for uniform ``b``;
for other weights it counts ``log b`` twice (its ``g`` holds ``eps log b`` already).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from memwise.ot.costs import cost_matrix
from memwise.ot.passes import Placed, kernel_apply, plan_cost, safe_log, softmin

__all__ = ["MATRIX_WARNING_SIZE", "TransportPlan"]

Array = jax.Array

# matrix() above this many entries warns: it is the n x m array the solver avoids.
MATRIX_WARNING_SIZE = 10_000_000


@jax.tree_util.register_pytree_node_class
class TransportPlan:
    """The plan of one solve, as an operator (never an ``n x m`` array).

    Args:
      x: ``[n, d]`` source points.
      y: ``[m, d]`` target points.
      a: ``[n]`` source weights.
      b: ``[m]`` target weights.
      f: ``[n]`` potential of ``x``.
      g: ``[m]`` potential of ``y``.
      eps: epsilon.
      consts: the arrays the cost closes over.
      cost: the cost, a function of ``(xi, yj, *consts)``.
      chunk: where the passes run (their tiles).
      dtype: the dtype results are returned in.
      center: the held point subtracted from the clouds before the solve (``x`` and
        ``y`` here are about it; the squared Euclidean cost's, see
        :func:`memwise.ot.costs.center`), or None.

    Build one with :func:`memwise.ot.sinkhorn` (``out.plan``), not by hand.
    """

    def __init__(
        self,
        x: Array,
        y: Array,
        a: Array,
        b: Array,
        f: Array,
        g: Array,
        eps: Array,
        consts: tuple,
        *,
        cost: Any,
        chunk: Placed,
        dtype: Any,
        center: Array | None = None,
    ) -> None:
        self.x, self.y, self.a, self.b = x, y, a, b
        self.f, self.g, self.eps, self.consts = f, g, eps, consts
        self.cost, self.chunk, self.dtype, self.center = cost, chunk, dtype, center

    def tree_flatten(self):
        children = (
            self.x, self.y, self.a, self.b, self.f, self.g, self.eps, self.consts, self.center
        )  # fmt: skip
        return children, (self.cost, self.chunk, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        cost, chunk, dtype = aux
        *arrays, center = children
        return cls(*arrays, cost=cost, chunk=chunk, dtype=dtype, center=center)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.x.shape[0], self.y.shape[0])

    def _logs(self) -> tuple[Array, Array]:
        return safe_log(self.a) + self.f / self.eps, safe_log(self.b) + self.g / self.eps

    def apply(self, v: Array, *, axis: int = 0) -> Array:
        """``P^T v`` (``axis=0``, ``v`` of shape ``[n]`` or ``[batch, n]``) or ``P v``
        (``axis=1``, ``v`` of shape ``[m]`` or ``[batch, m]``): OTT-JAX's ``apply``.

        Raises:
          ValueError: for an axis other than 0 or 1, or ``v`` of the wrong length.

        Example::

            >>> import jax, jax.numpy as jnp, memwise as mw
            >>> x, y = jnp.zeros((3, 2)), jnp.ones((4, 2))
            >>> out = mw.ot.sinkhorn(x, y, epsilon=1.0)
            >>> out.plan.apply(jnp.ones(3), axis=0)  # P^T 1: b = 1/4 each
            Array([0.25, 0.25, 0.25, 0.25], dtype=float32)
        """
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (P^T v) or 1 (P v), got {axis!r}")
        v = jnp.asarray(v)
        length = self.shape[0] if axis == 0 else self.shape[1]
        if v.ndim not in (1, 2) or v.shape[-1] != length:
            raise ValueError(
                f"v must have shape [{length}] or [batch, {length}] for axis={axis} (one "
                f"entry per {'source' if axis == 0 else 'target'} point), got {v.shape}"
            )
        vector = v.astype(self.x.dtype)
        vector = vector if vector.ndim == 1 else vector.T
        left, right = self._logs()
        # kernel_apply's axis=1 sums over j (P v), axis=0 over i (P^T v): OTT's axes.
        out = kernel_apply(
            self.cost,
            self.consts,
            self.x,
            self.y,
            self.eps,
            self.chunk,
            left,
            right,
            vector,
            axis=axis,
        )
        out = out if v.ndim == 1 else out.T
        return out.astype(self.dtype)

    def marginal(self, axis: int) -> Array:
        """``P 1`` (``axis=1``, ``[n]``) or ``P^T 1`` (``axis=0``, ``[m]``), in the log
        domain (one ``logsumexp`` pass): OTT-JAX's ``marginal``.

        Raises:
          ValueError: for an axis other than 0 or 1.

        Example::

            >>> import jax.numpy as jnp, memwise as mw
            >>> out = mw.ot.sinkhorn(jnp.zeros((3, 2)), jnp.ones((4, 2)), epsilon=1.0)
            >>> out.plan.marginal(1).round(4)  # P 1 = a
            Array([0.3333, 0.3333, 0.3333], dtype=float32)
        """
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (P^T 1) or 1 (P 1), got {axis!r}")
        left, right = self._logs()
        if axis == 1:
            t = softmin(self.cost, self.consts, self.x, self.y, right, self.eps, self.chunk)
            out = jnp.exp(left - t / self.eps)
        else:
            t = softmin(self.cost, self.consts, self.x, self.y, left, self.eps, self.chunk, axis=0)
            out = jnp.exp(right - t / self.eps)
        return out.astype(self.dtype)

    def transport_cost(self) -> Array:
        """``<P, C> = sum_ij P_ij C(x_i, y_j)``, the plan's bare transport cost (OTT-JAX's
        ``primal_cost``).

        Example::

            >>> import jax.numpy as jnp, memwise as mw
            >>> out = mw.ot.sinkhorn(jnp.zeros((3, 2)), jnp.ones((4, 2)), epsilon=1.0)
            >>> float(out.plan.transport_cost())  # every pair costs |x - y|^2 = 2
            2.0
        """
        left, right = self._logs()
        value = plan_cost(self.cost, self.consts, self.x, self.y, self.eps, self.chunk, left, right)
        return value.astype(self.dtype)

    def transport(self, points: Array | None = None) -> Array:
        """The entropic (barycentric) map ``T(z) = sum_j softmax_j(log b_j + (g_j -
        C(z, y_j)) / eps) y_j`` of ``points`` (``[k, d]``; ``None``: the source points
        ``x``): the plan's rows normalised, applied to ``y``, for the source points.
        For the squared Euclidean cost and uniform ``b`` it is OTT-JAX's
        ``to_dual_potentials().transport``. New points need no new solve: two chunked
        passes over ``k x m``.

        Raises:
          ValueError: for points that are not ``[k, d]`` with the clouds' ``d``.
          TypeError: for points that are not floats.

        Example::

            >>> import jax.numpy as jnp, memwise as mw
            >>> y = jnp.array([[0.0, 0.0], [4.0, 0.0]])
            >>> out = mw.ot.sinkhorn(jnp.array([[0.0, 0.0], [4.0, 0.0]]), y,
            ...                      epsilon=0.1)
            >>> out.plan.transport(jnp.array([[0.5, 0.0]])).round(3)  # near y_0
            Array([[0., 0.]], dtype=float32)
        """
        z = self.x if points is None else jnp.asarray(points)
        if z.ndim != 2 or z.shape[1] != self.x.shape[1]:
            raise ValueError(
                f"points must be a [k, {self.x.shape[1]}] array (the clouds' dimension), "
                f"got shape {z.shape}"
            )
        if not jnp.issubdtype(z.dtype, jnp.floating):
            raise TypeError(f"points must hold floats, got {z.dtype}")
        z = z.astype(self.x.dtype)
        if points is not None and self.center is not None:
            z = z - self.center  # where the clouds are
        _, right = self._logs()
        # Row normaliser -t/eps, then the softmax-weighted average of y.
        t = softmin(self.cost, self.consts, z, self.y, right, self.eps, self.chunk)
        out = kernel_apply(
            self.cost,
            self.consts,
            z,
            self.y,
            self.eps,
            self.chunk,
            t / self.eps,
            right,
            self.y,
            axis=1,
        )
        if self.center is not None:
            out = out + self.center
        return out.astype(self.dtype)

    def matrix(self) -> Array:
        """The dense ``[n, m]`` plan, for inspection of small problems only.

        Warns (``ResourceWarning``) above ``MATRIX_WARNING_SIZE`` entries: this is the
        array every other method avoids; use :meth:`apply`, :meth:`marginal` or
        :meth:`transport` instead.

        Example::

            >>> import jax.numpy as jnp, memwise as mw
            >>> out = mw.ot.sinkhorn(jnp.zeros((3, 2)), jnp.ones((4, 2)), epsilon=1.0)
            >>> out.plan.matrix().shape
            (3, 4)
        """
        n, m = self.shape
        if n * m > MATRIX_WARNING_SIZE:
            warnings.warn(
                f"TransportPlan.matrix() forms the {n} x {m} plan ({n * m * 4 / 2**20:.0f} "
                "MiB in float32); use plan.apply(v), plan.marginal(axis) or "
                "plan.transport(points), which work tile by tile",
                ResourceWarning,
                stacklevel=2,
            )
        cost = cost_matrix(self.cost, self.consts, self.x, self.y)
        left, right = self._logs()
        return jnp.exp(left[:, None] + right[None, :] - cost / self.eps).astype(self.dtype)
