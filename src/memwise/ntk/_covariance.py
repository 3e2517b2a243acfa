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
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
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


@jax.custom_jvp
def _safe_sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(max(x, 0))`` whose derivative is 0 (not infinite) where ``x`` is zero.

    For variances, which scale with the inputs (a row scaled by 1e-3 has variances near
    1e-6, not rounding noise), only zero counts as zero (as neural-tangents' ``_sqrt``,
    whose tolerance is 1e-30); ``0.5 / sqrt(x)`` is finite for every positive float,
    subnormals included. An all-zero input has zero variance; its kernel row is the limit
    of a row scaled by t -> 0 (see :func:`_correlation`). For ``sin^2`` of an angle,
    :func:`_aligned_sin2` makes aligned pairs exactly zero first.
    """
    return jnp.sqrt(jnp.maximum(x, 0.0))


@_safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _safe_sqrt(x)
    positive = x > 0
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
    norm = _safe_sqrt(var1) * _safe_sqrt(var2)
    # The zero-variance test runs on each input's own variances, not on the pair tile:
    # a mask and a guarded copy of the (rows, cols, pixels) tile would be kept for the
    # backward pass (+34% gradient memory for the KIP report's conv kernel).
    cos = cov * (_inverse_sqrt(var1) * _inverse_sqrt(var2))
    return norm, jnp.clip(cos, -1.0, 1.0)


def _inverse_sqrt(var: jax.Array) -> jax.Array:
    """``1 / sqrt(var)``, and 0 where ``var`` is zero (``cos`` of such a pair is 0)."""
    positive = var > 0
    return jnp.where(positive, lax.rsqrt(jnp.where(positive, var, 1.0)), 0.0)


# Pairs whose sin(theta)^2 is below 2 * _ALIGNED_EPS machine epsilons (cosine within
# about _ALIGNED_EPS eps of +-1) count as aligned: an input against itself, or against
# its negative. See _aligned_sin2.
_ALIGNED_EPS = 32


def _aligned_sin2(cos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``((1 - c)(1 + c), sin(theta)^2 with aligned pairs made exactly 0)``.

    The arc-cosine kernels read ``theta = arccos(c)``, whose derivative is infinite at
    ``c = +-1``: ``theta ~ sqrt(2 (1 - c))``, so a rounding error ``delta`` in ``c``
    moves ``theta`` by ``sqrt(2 delta)``. On the diagonal of a kernel (an input against
    itself) ``c`` is 1 only up to rounding, because the covariance of the pair and the
    variances of its two sides are different sums (a matrix product against a sum of
    squares: up to 6 eps apart for 784 features), so ``theta`` came out near
    ``sqrt(eps)`` (3e-4 in float32) instead of 0 and a ReLU NTK 1e-4 too small.

    So ``sin^2 = (1 - c)(1 + c)`` (exact near +-1, where ``1 - c^2`` and ``arccos`` lose
    half the digits) counts as zero below ``2 tol``, ``tol = 32 eps`` of ``cos``'s dtype
    (a cosine within ``tol`` of +-1), and between ``2 tol`` and ``4 tol`` ramps linearly
    from 0 back to its own value: the kernel stays continuous, and beyond ``4 tol``
    nothing changes. The shift is never larger than the rounding noise of ``c`` itself:
    two distinct inputs that close cannot be told apart from aligned ones by rounded
    arithmetic anyway (a rounding error of a few eps in ``c`` moves ``theta`` as much).
    ``theta = atan2(sin, c)`` is then exactly 0 (or pi) for aligned pairs. Call it in at
    least float32: 32 eps of bfloat16 would count angles up to 0.7 as zero.
    """
    tol = _ALIGNED_EPS * jnp.finfo(cos.dtype).eps
    sin2 = (1.0 - cos) * (1.0 + cos)
    return sin2, jnp.clip(2.0 * sin2 - 4.0 * tol, 0.0, sin2)


# ----------------------------------------------------------------------------------------
# Checking a layer's hyperparameters (each layer's constructor, before any tracing)


def _real(layer: str, arg: str, value: Any, *, at_least: float | None = None) -> float:
    """A layer's numeric hyperparameter as a Python float, or an error naming both.

    Layers are static (a kernel function is a pytree without leaves), so a hyperparameter
    is a Python or NumPy number, never an array.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{layer} {arg} must be a real number (e.g. 1.0), got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{layer} {arg} must be finite, got {value!r}")
    if at_least is not None and number < at_least:
        raise ValueError(f"{layer} {arg} must be >= {at_least:g}, got {value!r}")
    return number


def _optional_real(
    layer: str, arg: str, value: Any, *, at_least: float | None = None
) -> float | None:
    """:func:`_real`, or None for None (e.g. no bias)."""
    if value is None:
        return None
    try:
        return _real(layer, arg, value, at_least=at_least)
    except TypeError:
        raise TypeError(f"{layer} {arg} must be a real number or None, got {value!r}") from None


def _positive_ints(layer: str, arg: str, value: Any, length: int | None = None) -> tuple[int, ...]:
    """A window or strides argument: a tuple of positive ints (``length`` of them)."""
    try:
        items = tuple(value)
    except TypeError:
        items = None
    if items is None or not all(
        isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in items
    ):
        raise TypeError(f"{layer} {arg} must be a tuple of ints, e.g. (3, 3), got {value!r}")
    if not items or min(items) < 1 or (length is not None and len(items) != length):
        count = f"{length} positive ints" if length is not None else "positive ints"
        raise ValueError(f"{layer} {arg} must be {count}, e.g. (3, 3), got {value!r}")
    return tuple(int(i) for i in items)


# ----------------------------------------------------------------------------------------
# The layer protocol


class Layer:
    """Base class of the layers of :func:`memwise.ntk.kernels.serial`.

    A layer maps the covariances of its input to those of its output. Single-input
    layers implement :meth:`apply` (and :meth:`out_layout` when they change the pixel
    axes); layers that read each input's own variances (activations, ``LayerNorm``) set
    ``needs_variances``; layers that need the pixel-by-pixel covariance at their input
    (pooling) set ``pools``. Combinators (``serial``, ``FanOut``, ``parallel``,
    ``FanInSum``) override :meth:`_walk` instead. A public layer is decorated with
    :func:`register` (and imported into :mod:`memwise.ntk.kernels`, which exports every
    registered name).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> isinstance(k.Relu(), k.Layer), isinstance(k.serial(k.Dense()), k.Layer)
        (True, True)
    """

    needs_variances = False
    # A nonlinearity: its closed form needs a Gaussian input, the same in every channel
    # (what it raises otherwise: neural-tangents' error for the layer).
    needs_gaussian = False
    gaussian_error: type[Exception] = ValueError
    # A random affine map (Dense, Conv): its output is Gaussian whatever its input.
    affine = False

    def out_width(self, width: int | None) -> int | None:
        """The finite network's channel count after the layer (None: not known)."""
        return width

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


# ----------------------------------------------------------------------------------------
# The registry of public layers

_Constructor = TypeVar("_Constructor", bound=Callable[..., Any])

# Public name -> constructor (a Layer subclass, or a function returning a layer), in the
# order the defining modules register them. memwise.ntk.kernels exports exactly these
# (and its kernel types); error messages list them.
_LAYERS: dict[str, Callable[..., Any]] = {}


def register(constructor: _Constructor) -> _Constructor:
    """Record a public layer (class or factory) under its ``__name__``; returns it as is.

    Example::

        >>> from memwise.ntk import _covariance, kernels as k
        >>> _covariance._LAYERS["Dense"] is k.Dense
        True
    """
    name = constructor.__name__
    if _LAYERS.get(name, constructor) is not constructor:
        raise ValueError(f"a layer named {name!r} is already registered")
    _LAYERS[name] = constructor
    return constructor


def _check_layers(layers: Sequence[Any], where: str) -> None:
    """Each of ``layers`` is a Layer, or a TypeError listing the layers to use."""
    for layer in layers:
        if not isinstance(layer, Layer):
            names = ", ".join(_LAYERS)
            raise TypeError(
                f"{where}() takes layers from memwise.ntk.kernels ({names}), got {layer!r}"
            )
