"""The covariance state that infinite-width layers transform, and its shared arithmetic.

A layer of an infinitely wide network maps the covariance of its inputs (the NNGP
kernel) and the neural tangent kernel to those of its outputs (Lee et al. 2018; Novak et
al. 2020, neural-tangents). This module holds what every such layer shares: how a
covariance array is laid out (per pixel, or pixel by pixel), the state passed from layer
to layer, the NTK-parameterization rules for linear layers, and square roots and
correlations whose derivatives stay finite where a variance or an angle vanishes.
Layers themselves live in :mod:`memwise.ntk.kernels` (linear layers, combinators,
``serial``) and :mod:`memwise.ntk.elementwise` (activations, ``LayerNorm``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Layer"]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a covariance array is laid out.

    ``batch_ndim`` leading axes index inputs (2 for a cross kernel (n1, n2), 1 for an
    input's own variances (n,)); then ``spatial_ndim`` pixel axes, repeated a second time
    when ``full`` (pixel-by-pixel covariance) rather than diagonal.
    """

    batch_ndim: int
    spatial_ndim: int
    full: bool

    def groups(self) -> list[int]:
        """First axis of each group of pixel axes (one group, or two when full)."""
        first = self.batch_ndim
        if self.full:
            return [first, first + self.spatial_ndim]
        return [first]

    def spatial_axes(self) -> tuple[int, ...]:
        n_groups = 2 if self.full else 1
        return tuple(range(self.batch_ndim, self.batch_ndim + n_groups * self.spatial_ndim))

    def pixels(self, cov: jax.Array) -> tuple[int, ...]:
        return cov.shape[self.batch_ndim : self.batch_ndim + self.spatial_ndim]

    def diagonal(self) -> _Layout:
        return _Layout(self.batch_ndim, self.spatial_ndim, False)


class _State(NamedTuple):
    nngp: jax.Array
    ntk: jax.Array | float | None  # None: not requested; 0.0: exactly zero so far
    # Variances of the two sides, broadcastable against nngp (see _broadcast_variances);
    # None for layers that do not read them.
    var1: jax.Array | None
    var2: jax.Array | None


def _pixel_diagonal(a: jax.Array, layout: _Layout) -> jax.Array:
    """The entries (p, p) of a full pixel-by-pixel covariance: (*batch, *pixels).

    A diagonal covariance is returned as it is.
    """
    if not layout.full or layout.spatial_ndim == 0:
        return a
    batch = a.shape[: layout.batch_ndim]
    pixels = layout.pixels(a)
    size = math.prod(pixels)
    flat = a.reshape(*batch, size, size)
    return jnp.diagonal(flat, axis1=-2, axis2=-1).reshape(*batch, *pixels)


def _broadcast_variances(
    diag1: jax.Array, diag2: jax.Array, layout: _Layout
) -> tuple[jax.Array, jax.Array]:
    """Variances (n1, *pixels), (n2, *pixels) shaped to broadcast against a covariance."""
    s = layout.spatial_ndim
    if layout.batch_ndim == 1:
        # An input's own covariance: both sides are the same input.
        if layout.full:
            return diag1.reshape(diag1.shape + (1,) * s), diag1.reshape(
                diag1.shape[:1] + (1,) * s + diag1.shape[1:]
            )
        return diag1, diag1
    if layout.full:
        v1 = diag1.reshape(diag1.shape[:1] + (1,) + diag1.shape[1:] + (1,) * s)
        v2 = diag2.reshape((1,) + diag2.shape[:1] + (1,) * s + diag2.shape[1:])
    else:
        v1 = diag1[:, None]
        v2 = diag2[None, :]
    return v1, v2


def _is_zero_ntk(ntk: Any) -> bool:
    """The NTK of the input is exactly zero: a Python 0.0 until the first linear layer.

    Kept symbolic so that no array of zeros is windowed or scaled (XLA would spend seconds
    constant-folding those windows on large tiles).
    """
    return isinstance(ntk, float) and ntk == 0.0


def _linear_ntk(ntk: Any, nngp: jax.Array, transform: Callable[[jax.Array], jax.Array]) -> Any:
    """NTK parameterization: a linear layer's own weights add its NNGP to the NTK."""
    if ntk is None:
        return None
    if _is_zero_ntk(ntk):
        return nngp
    return nngp + transform(ntk)


def _map_ntk(ntk: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
    """``fn(ntk)`` for a layer without weights; the symbolic zero and None pass through."""
    if ntk is None or _is_zero_ntk(ntk):
        return ntk
    return fn(ntk)


def _scale_ntk(ntk: Any, factor: Any) -> Any:
    return _map_ntk(ntk, lambda a: a * factor)


# ----------------------------------------------------------------------------------------
# Square roots with a finite derivative at zero


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _safe_sqrt(x: jax.Array, zero_below: str) -> jax.Array:
    """``sqrt(max(x, 0))`` whose derivative is 0 (not infinite) where ``x`` is (near) zero.

    ``zero_below="rounding"``: for ``1 - cos^2``, O(1) quantities. sin(theta) is
    identically zero on the diagonal of a kernel (an input against itself); its true
    derivative along such inputs is zero, while sqrt's would be infinite, so values at
    the rounding level (8 eps) count as that zero.

    ``zero_below="zero"``: for variances, which scale with the inputs (a row scaled by
    1e-3 has variances near 1e-6, not rounding noise): only zero counts as zero (as
    neural-tangents' ``_sqrt``, whose tolerance is 1e-30); ``0.5 / sqrt(x)`` is finite
    for every positive float, subnormals included. An all-zero input has zero variance;
    its kernel row is the limit of a row scaled by t -> 0 (see :func:`_correlation`).
    """
    return jnp.sqrt(jnp.maximum(x, 0.0))


@_safe_sqrt.defjvp
def _safe_sqrt_jvp(zero_below, primals, tangents):
    (x,), (t,) = primals, tangents
    y = _safe_sqrt(x, zero_below)
    tiny = 8 * jnp.finfo(jnp.result_type(x)).eps if zero_below == "rounding" else 0.0
    positive = x > tiny
    return y, jnp.where(positive, t * 0.5 / jnp.where(positive, y, 1.0), 0.0)


def _correlation(cov: jax.Array, var1: jax.Array, var2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sqrt(var1 var2), cos)``, ``cos = cov / sqrt(var1 var2)`` clipped to [-1, 1].

    An input of zero variance (an all-zero input with no bias, or a pixel whose whole
    receptive field is zero) has zero covariance with everything: ``cos`` is 0/0. Its
    kernel entries are the limit of a scaled input, t -> 0: a ReLU's output variance and
    covariances go to zero whatever the angle, so any ``cos`` gives the limit; as
    neural-tangents (``_arctan2(..., fill_zero=pi / 2)``) the pair counts as orthogonal,
    ``cos = 0``. Both square roots and the division have finite derivatives there.
    """
    norm = _safe_sqrt(var1, "zero") * _safe_sqrt(var2, "zero")
    # The zero-variance test runs on each input's own variances, not on the pair tile:
    # a mask and a guarded copy of the (rows, cols, pixels) tile would be kept for the
    # backward pass (+34% gradient memory for the KIP report's conv kernel).
    cos = cov * (_inverse_sqrt(var1) * _inverse_sqrt(var2))
    return norm, jnp.clip(cos, -1.0, 1.0)


def _inverse_sqrt(var: jax.Array) -> jax.Array:
    """``1 / sqrt(var)``, and 0 where ``var`` is zero (``cos`` of such a pair is 0)."""
    positive = var > 0
    return jnp.where(positive, lax.rsqrt(jnp.where(positive, var, 1.0)), 0.0)


# ----------------------------------------------------------------------------------------
# The layer protocol


class Layer:
    """Base class of the layers of :func:`memwise.ntk.kernels.serial`.

    A layer maps the covariances of its input to those of its output. Single-input
    layers implement :meth:`apply` (and :meth:`out_layout` when they change the pixel
    axes); layers that read each input's own variances (activations, ``LayerNorm``) set
    ``needs_variances``; layers that need the pixel-by-pixel covariance at their input
    (pooling) set ``pools``. Combinators (``serial``, ``FanOut``, ``parallel``,
    ``FanInSum``) override :meth:`_walk` instead.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> isinstance(k.Relu(), k.Layer), isinstance(k.serial(k.Dense()), k.Layer)
        (True, True)
    """

    needs_variances = False

    @property
    def pools(self) -> bool:
        """Whether the layer needs the pixel-by-pixel covariance at its input."""
        return False

    def out_layout(self, layout: _Layout) -> _Layout:
        return layout

    def apply(self, state: _State, layout: _Layout) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def _leaves(self):
        """The single-input layers in the order :meth:`_walk` visits them."""
        yield self

    def _walk(self, walk, flow):
        return walk.step(self, flow)
