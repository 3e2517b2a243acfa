"""The transport problem of one call: data, weights, cost, epsilon and its schedule, options.

:func:`prepare` checks a public call's input once, up front (every bad value a
``ValueError``/``TypeError`` naming the argument and the fix), and resolves it into a
:class:`Problem` that the solver loops, the gradients and the public functions read:
the points and weights in the working dtype, the cost with its hoisted arrays, where
the passes run, epsilon (OTT-JAX 0.6's default when ``None``), the solver options, and
the marginal penalties ``tau_a``/``tau_b`` in OTT-JAX's convention (OTT's
``LinearProblem``: ``tau = rho / (rho + epsilon)`` for a KL penalty ``rho`` on a
marginal; ``1.0`` is a hard constraint, balanced OT), resolved into one
:class:`memwise.ot.marginals.Side` per marginal. The loops read them for the updates and
the marginal error, the cost for its mass terms, the implicit differentiation for its
linear system; only a balanced problem (both sides hard) has the mass check, the
rescale of ``b`` (:meth:`Problem.balanced_b`), the potentials' gauge and the centred
weight gradients. ``reach`` is GeomLoss's spelling of the same penalty: ``rho =
reach**p`` for a cost growing like ``|x - y|**p``, ``tau = rho / (rho + epsilon)``.

Epsilon annealing (:class:`EpsilonSchedule`) follows GeomLoss (Feydy et al. 2019,
Sec. 3.1): epsilon starts at the largest cost and shrinks by a constant factor per
iteration down to its target.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import non_negative_int, positive_int
from memwise.engine.kernels import check_implementation
from memwise.ot.costs import CostFn, center, cost_exponent, resolve_cost
from memwise.ot.gradients import reverse_mode_only
from memwise.ot.marginals import HARD, Side
from memwise.ot.passes import Placed, default_epsilon, placement
from memwise.sharding import first_items
from memwise.tiling import ChunkSize, pair_bytes, tiling

__all__ = ["EpsilonSchedule", "Problem", "prepare"]

Array = jax.Array


class EpsilonSchedule(NamedTuple):
    """Epsilon at iteration ``k``: ``max(start * scaling**k, target)``; ``target`` when
    ``scaling`` is None (no annealing)."""

    target: Array
    start: Array | None
    scaling: float | None

    def at(self, iteration: Array) -> Array:
        if self.scaling is None:
            return self.target
        assert self.start is not None
        return jnp.maximum(
            self.start * self.scaling ** iteration.astype(self.target.dtype), self.target
        )


class Problem(NamedTuple):
    """A validated call: the data, the cost with its hoisted arrays, tiling, epsilon and
    the solver options."""

    x: Array
    y: Array
    a: Array
    b: Array
    cost: Any  # (xi, yj, *consts) -> scalar
    consts: tuple
    chunk: Placed
    eps: Array
    dtype: Any  # of the results: the points' dtype (the solve runs in at least float32)
    mass_rtol: float  # relative mismatch of sum(a), sum(b) that is only rounding
    max_iterations: int
    threshold: float
    epsilon_scaling: float | None
    # OTT-JAX's marginal penalties tau_a, tau_b; a hard side is balanced.
    side_a: Side = HARD
    side_b: Side = HARD
    min_iterations: int = 0
    cost_gradient: str = "exact"
    # The held point subtracted from x and y (memwise.ot.costs.center); None: as given.
    center: Array | None = None

    @property
    def is_balanced(self) -> bool:
        return not (self.side_a.relaxed or self.side_b.relaxed)

    def balanced_b(self) -> tuple[Array, Array]:
        """``(b, balanced)``: ``b`` rescaled to ``sum(a)``, and whether the totals agree.

        Unequal totals have no balanced plan: traced weights (concrete ones raised in
        :func:`prepare`) make the problem NaN, so it reports converged=False. A
        rounding-level mismatch would keep the column error from falling below it: b
        takes a's total.
        """
        total_a, total_b = jnp.sum(self.a), jnp.sum(self.b)
        balanced = jnp.abs(total_a - total_b) <= self.mass_rtol * jnp.maximum(total_a, total_b)
        return self.b * jax.lax.stop_gradient(total_a / total_b), balanced


def prepare(
    x: Any,
    y: Any,
    a: Any,
    b: Any,
    cost: str | CostFn,
    epsilon: Any,
    chunk_size: ChunkSize | None,
    max_iterations: int,
    threshold: float,
    epsilon_scaling: float | None,
    *,
    tau_a: Any = 1.0,
    tau_b: Any = 1.0,
    reach: Any = None,
    min_iterations: int = 0,
    cost_gradient: str = "exact",
    implementation: str | None = None,
) -> Problem:
    """The :class:`Problem` of a public call, every input checked before any solve."""
    _check_options(epsilon, max_iterations, threshold, epsilon_scaling)
    if non_negative_int(min_iterations, "min_iterations") > max_iterations:
        raise ValueError(
            f"min_iterations ({min_iterations}) must be at most max_iterations ({max_iterations})"
        )
    if cost_gradient not in ("exact", "envelope"):
        raise ValueError(
            f'cost_gradient must be "exact" or "envelope" (OTT-JAX\'s use_danskin=True: '
            f"the potentials held fixed, exact only when balanced), got {cost_gradient!r}"
        )
    check_implementation(implementation)
    if implementation == "pallas" and chunk_size is None:
        raise ValueError(
            "implementation='pallas' runs the chunked passes (a fused kernel over tiles of "
            "pairs); chunk_size=None holds the cost matrix: pass implementation=None or "
            "'xla' for a held cost matrix, or a chunk_size"
        )
    relaxed = _check_relaxation(tau_a, tau_b, reach, cost)
    x, y = _check_points("x", x), _check_points("y", y)
    where = (x, y)  # before the casts: the inputs' own sharding decides the placement
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension: x is {x.shape}, y is {y.shape}")
    dtype = jnp.result_type(x.dtype, y.dtype)
    # Half-precision potentials cannot resolve C / epsilon (bfloat16 keeps 8 bits):
    # solve in float32, return in `dtype`.
    work = jnp.promote_types(dtype, jnp.float32)
    x, y = x.astype(work), y.astype(work)
    a = _check_weights("a", a, x.shape[0], work)
    b = _check_weights("b", b, y.shape[0], work)
    # Totals that differ by the weights' rounding only (4 ulps of their own dtype, at
    # least 1e-5) are balanced: the solve rescales b to sum(a).
    mass_rtol = max(1e-5, *(4 * float(jnp.finfo(w.dtype).eps) for w in (a, b)))
    a, b = a.astype(work), b.astype(work)
    if not relaxed and _is_concrete(a) and _is_concrete(b):
        total_a, total_b = float(np.sum(np.asarray(a))), float(np.sum(np.asarray(b)))
        if abs(total_a - total_b) > mass_rtol * max(total_a, total_b):
            raise ValueError(
                f"a and b must have the same total for balanced OT, got sum(a) = "
                f"{total_a:.6g} and sum(b) = {total_b:.6g}; normalise both (a / a.sum(), "
                "b / b.sum()), leave them None for uniform weights, or relax a marginal "
                "(tau_a, tau_b < 1 or reach=...) for unbalanced OT"
            )
    cost_fn, consts = resolve_cost(cost, x, y)
    offset = center(cost_fn, x, y)
    if offset is not None:
        x, y = x - offset, y - offset
    # One tiling (one "auto" knob for memwise.fit) serves every pass of the call: the
    # solves, the backward and the divergence's self terms (their sizes clipped).
    chunk = placement(
        *where,
        tiling(
            x.shape[0],
            y.shape[0],
            "auto" if chunk_size is None else chunk_size,
            pair_bytes=lambda: pair_bytes(cost_fn, first_items(x), first_items(y), *consts),
        ),
        held=chunk_size is None,
    )._replace(implementation=implementation)
    if epsilon is None:
        stopped = jax.lax.stop_gradient((consts, x, y))
        eps = jax.lax.stop_gradient(
            default_epsilon(cost_fn, stopped[0], stopped[1], stopped[2], chunk)
        )
    else:
        eps = jnp.asarray(epsilon, work)
    x, y, a, b, consts, eps = reverse_mode_only((x, y, a, b, consts, eps))
    side_a, side_b = _sides(tau_a, tau_b, reach, cost, eps, work)
    return Problem(
        x,
        y,
        a,
        b,
        cost_fn,
        consts,
        chunk,
        eps,
        dtype,
        mass_rtol,
        max_iterations,
        threshold,
        epsilon_scaling,
        side_a,
        side_b,
        int(min_iterations),
        cost_gradient,
        offset,
    )


def _check_tau(name: str, tau: Any) -> None:
    if not _is_concrete(tau):
        return  # a traced tau is a relaxed side; its range cannot be checked
    if not _is_real(tau) and not (hasattr(tau, "shape") and np.shape(tau) == ()):
        raise TypeError(
            f"{name} must be a float in (0, 1] (1.0: the marginal is a hard constraint), "
            f"got {tau!r}"
        )
    value = float(np.asarray(tau))
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"{name} must be in (0, 1] (OTT-JAX's convention: 1.0 balanced, tau = rho / "
            f"(rho + epsilon) for a KL penalty rho on the marginal), got {tau!r}"
        )


def _check_relaxation(tau_a: Any, tau_b: Any, reach: Any, cost: Any) -> bool:
    """Whether a marginal is relaxed; every bad tau/reach raised here."""
    _check_tau("tau_a", tau_a)
    _check_tau("tau_b", tau_b)
    if reach is None:
        return not (_is_hard(tau_a) and _is_hard(tau_b))
    if not (_is_hard(tau_a) and _is_hard(tau_b)):
        raise ValueError(
            "pass either reach (GeomLoss's spelling) or tau_a/tau_b (OTT-JAX's), not both: "
            f"got reach={reach!r}, tau_a={tau_a!r}, tau_b={tau_b!r}"
        )
    if _is_concrete(reach) and not (_is_real(reach) and 0 < reach < float("inf")):
        raise ValueError(f"reach must be None (balanced) or a positive finite float, got {reach!r}")
    if cost_exponent(cost) is None:
        raise ValueError(
            f"reach needs the power p of distance the cost grows with (rho = reach**p); "
            f"cost {cost!r} has none: pass tau_a and tau_b instead (tau = rho / (rho + "
            "epsilon)), or give a callable cost an `exponent` attribute"
        )
    return True


def _is_hard(tau: Any) -> bool:
    return _is_concrete(tau) and float(np.asarray(tau)) == 1.0


def _sides(tau_a: Any, tau_b: Any, reach: Any, cost: Any, eps: Array, work: Any) -> tuple:
    if reach is not None:
        # GeomLoss: rho = reach**p; tau at the target epsilon, held fixed while annealing
        # (OTT-JAX's convention) and in the gradient in epsilon.
        exponent = cost_exponent(cost)
        assert exponent is not None
        rho = jnp.asarray(reach, work) ** exponent
        tau = jax.lax.stop_gradient(rho / (rho + eps))
        return Side(True, tau), Side(True, tau)

    return side_of(tau_a, work), side_of(tau_b, work)


def side_of(tau: Any, work: Any) -> Side:
    """The :class:`Side` of a checked ``tau``: hard at 1.0, relaxed otherwise (a traced
    tau is relaxed, an array of ``work``'s dtype)."""
    if _is_hard(tau):
        return Side(False)
    return Side(True, float(tau) if _is_concrete(tau) else jnp.asarray(tau, work))


def check_scalar(name: str, value: Any, low: float, *, closed: bool) -> None:
    """A scalar option known now is a finite number above ``low`` (or equal to it,
    ``closed``): a ``TypeError`` for what is not a number, a ``ValueError`` naming the
    bound otherwise. A traced value passes (its value is not known while tracing)."""
    if not _is_concrete(value):
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and (number >= low if closed else number > low)):
        bound = f">= {low:g}" if closed else f"> {low:g}"
        raise ValueError(f"{name} must be finite and {bound}, got {number!r}")


def _is_concrete(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _is_real(value: Any) -> TypeGuard[float | np.integer | np.floating]:
    # np.isscalar also admits strings and complex numbers, which then fail to compare.
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_options(epsilon: Any, max_iterations: Any, threshold: Any, epsilon_scaling: Any) -> None:
    if epsilon is not None and _is_concrete(epsilon):
        try:
            eps_value = np.asarray(epsilon)
        except Exception:  # an object NumPy cannot read (re-raised below)
            eps_value = np.asarray(None)
        if eps_value.dtype.kind not in "fiu":
            raise TypeError(
                f"epsilon must be a positive finite scalar (a float or a 0-d float array; "
                f"None for 0.05 x std of the cost matrix), got {epsilon!r} "
                f"({type(epsilon).__name__}); pass e.g. epsilon=0.1"
            )
        if eps_value.shape != () or not np.isfinite(eps_value) or eps_value <= 0:
            raise ValueError(
                f"epsilon must be a positive finite scalar (or None for 0.05 x std of the "
                f"cost matrix), got {epsilon!r}"
            )
    positive_int(max_iterations, "max_iterations")
    if not _is_real(threshold) or not threshold > 0:
        raise ValueError(f"threshold must be a positive float, got {threshold!r}")
    if epsilon_scaling is not None and not (_is_real(epsilon_scaling) and 0 < epsilon_scaling < 1):
        raise ValueError(
            "epsilon_scaling must be None (plain Sinkhorn) or a float in (0, 1), the "
            f"factor epsilon shrinks by per iteration (e.g. 0.5); got {epsilon_scaling!r}"
        )


def _as_array(name: str, value: Any, what: str) -> Array:
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{name} must be {what}, got {type(value).__name__} ({err}); pass a jax or "
            "NumPy array of floats"
        ) from None


def _check_points(name: str, points: Any) -> Array:
    points = _as_array(name, points, "a [num_points, dim] array of floats")
    if points.ndim != 2:
        raise ValueError(
            f"{name} must be a [num_points, dim] array, got shape {points.shape}; "
            f"reshape 1-D data with {name}[:, None]"
        )
    if points.shape[0] == 0:
        raise ValueError(f"{name} has no points (shape {points.shape})")
    if not jnp.issubdtype(points.dtype, jnp.floating):
        raise TypeError(
            f"{name} must hold floats, got {points.dtype}; convert with {name}.astype(jnp.float32)"
        )
    if _is_concrete(points) and not np.all(np.isfinite(np.asarray(points))):
        raise ValueError(f"{name} contains NaN or infinite coordinates; drop those points")
    return points


def _check_weights(name: str, weights: Any, size: int, dtype: Any) -> Array:
    if weights is None:
        return jnp.full((size,), 1.0 / size, dtype)
    weights = _as_array(name, weights, f"None or a ({size},) array of nonnegative weights")
    if weights.shape != (size,):
        raise ValueError(
            f"{name} must have shape ({size},) (one weight per point), got {weights.shape}"
        )
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{name} must hold floats, got {weights.dtype}")
    if _is_concrete(weights):
        values = np.asarray(weights)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{name} contains NaN or infinite weights")
        if np.any(values < 0):
            raise ValueError(f"{name} has negative weights; weights must be >= 0")
        if not np.any(values > 0):
            raise ValueError(f"{name} is all zeros; at least one point needs weight > 0")
    return weights
