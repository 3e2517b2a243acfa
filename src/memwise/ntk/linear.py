"""Linear and pooling layers of infinite-width networks: covariances averaged over windows.

A ``Dense``/``Conv`` layer whose width goes to infinity under the NTK parameterization
(Jacot et al. 2018) maps the covariance of its inputs linearly (Lee et al. 2018, "Deep
neural networks as Gaussian processes"; Novak et al. 2019, "Bayesian deep convolutional
networks with many channels are Gaussian processes"): covariances are per pixel, averaged
over channels; a ``Conv`` window averages the covariance along the pixel diagonal
(weights are independent across taps; zero padding counts); ``AvgPool`` averages it over
every pair of pixels of the two windows (Arora et al. 2019, "On exact computation with an
infinitely wide neural net", CNTK with global average pooling; the Myrtle kernels of
Shankar et al. 2020, "Neural kernels without tangents"), which needs the full
pixel-by-pixel covariance at its input. For the NTK a linear layer adds its NNGP
(:func:`memwise.ntk._covariance._linear_ntk`). Values reproduce neural-tangents 0.6.5's
``stax`` to float64 rounding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise._dtypes import accumulation_dtype
from memwise.ntk._covariance import (
    Layer,
    _Layout,
    _linear_ntk,
    _map_ntk,
    _optional_real,
    _pixel_diagonal,
    _positive_ints,
    _real,
    register,
)

__all__ = ["AvgPool", "Conv", "Dense", "Flatten", "GlobalAvgPool", "Identity"]


@register
@dataclasses.dataclass(frozen=True)
class Dense(Layer):
    """Infinite-width dense layer on the channel axis (NTK parameterization).

    ``nngp' = W_std^2 nngp + b_std^2``, ``ntk' = nngp' + W_std^2 ntk``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])  # input covariance x x^T / 2
        >>> k.serial(k.Dense(W_std=2.0, b_std=0.5))(x, get="nngp")
        Array([[2.25, 0.25],
               [0.25, 2.25]], dtype=float32)
    """

    W_std: float = 1.0
    b_std: float | None = None
    affine = True

    def __post_init__(self):
        _set_stds(self, "Dense")

    def out_width(self, width):
        return None  # set by memwise.nt's layers, which know the finite width

    def apply(self, state, layout):
        nngp = self.W_std**2 * state.nngp
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * a)


@register
@dataclasses.dataclass(frozen=True)
class Identity(Layer):
    """The identity: covariances pass unchanged (a residual network's skip branch).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
        >>> k.serial(k.Identity())(x, get="nngp")  # the input covariance x x^T / 2
        Array([[0.5, 0. ],
               [0. , 0.5]], dtype=float32)
    """

    def apply(self, state, layout):
        return state.nngp, state.ntk


def _set_stds(layer: Any, name: str) -> None:
    """Check a linear layer's W_std (>= 0) and b_std (>= 0 or None); store them as floats."""
    object.__setattr__(layer, "W_std", _real(name, "W_std", layer.W_std, at_least=0.0))
    b_std = _optional_real(name, "b_std", layer.b_std, at_least=0.0)
    object.__setattr__(layer, "b_std", b_std)


def _window(
    name: str, window: Sequence[int], strides: Sequence[int] | None, padding: str, window_arg: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validated (window, strides) of a conv or pooling layer; strides default to 1."""
    window = _positive_ints(name, window_arg, window)
    if strides is None:
        strides_ = (1,) * len(window)
    else:
        strides_ = _positive_ints(name, "strides", strides, len(window))
    if not isinstance(padding, str) or padding not in ("SAME", "VALID"):
        raise ValueError(f"{name} padding must be 'SAME' or 'VALID', got {padding!r}")
    return window, strides_


def _check_pixel_axes(name: str, window: tuple[int, ...], layout: _Layout) -> None:
    if layout.spatial_ndim != len(window):
        raise ValueError(
            f"{name} with a {len(window)}-D window {window} needs inputs with "
            f"{len(window)} pixel axes, (n, *pixels, channels); got {layout.spatial_ndim}"
        )


def _check_fits(name: str, window: tuple[int, ...], pixels: tuple[int, ...], padding: str) -> None:
    """A VALID window larger than the image leaves no pixel (a NaN mean): say so."""
    if padding == "VALID" and any(w > p for w, p in zip(window, pixels)):
        raise ValueError(
            f"{name} window {window} with padding='VALID' is larger than the {pixels} "
            "pixels reaching it, which leaves no output pixel; use a smaller window, "
            "padding='SAME', or larger images"
        )


def _window_mean(
    cov: jax.Array,
    layout: _Layout,
    filter_shape: tuple[int, ...],
    strides: tuple[int, ...],
    padding: str,
) -> jax.Array:
    """Mean of ``cov`` over a conv window, the same offsets on every group of pixel axes.

    The weights of an infinite-width conv are independent across taps, so only pairs of
    pixels seen through the *same* tap correlate: a window slides along the diagonal of
    a full covariance, and over the pixels of a diagonal one. Zero padding counts in the
    mean, as in a conv layer that sees zeros.
    """
    dtype = cov.dtype
    cov = cov.astype(accumulation_dtype(dtype))  # low-precision sums lose the kernel's digits
    pixels = cov.shape[layout.batch_ndim : layout.batch_ndim + layout.spatial_ndim]
    _check_fits("Conv", filter_shape, pixels, padding)
    pads = lax.padtype_to_pads(pixels, filter_shape, strides, padding)
    if layout.full:
        total = _diagonal_window_sum(cov, layout, filter_shape, strides, pads)
    else:
        batch = (1,) * layout.batch_ndim
        total = lax.reduce_window(
            cov,
            0.0,
            lax.add,
            batch + filter_shape,
            batch + strides,
            [(0, 0)] * layout.batch_ndim + list(pads),
        )
    return (total / math.prod(filter_shape)).astype(dtype)


def _diagonal_window_sum(
    cov: jax.Array,
    layout: _Layout,
    filter_shape: tuple[int, ...],
    strides: tuple[int, ...],
    pads: Sequence[tuple[int, int]],
) -> jax.Array:
    """Sum of a full covariance over a window moving along its pixel diagonal.

    Entry ``(p, q)`` of the result sums ``cov[p + d, q + d]`` over the window's offsets
    ``d``. Flattened, a step of ``d`` along pixel axis ``i`` on both sides is one step of
    ``step(i) + step(s + i)`` in the zero-padded array (``step``: the flat distance of
    +1 along an axis), so each pixel axis is one dilated 1-D ``reduce_window``: no
    wrap-around, because the padding keeps ``p + d`` and ``q + d`` inside their axes.

    One ``reduce_window`` per axis, and one per axis in the backward pass, rather than a
    sum of shifted slices: XLA:CPU fused the slices' transpose (pads of the cotangent)
    into the layer's whole elementwise backward chain and recomputed it, cache-hostile,
    in every consumer (2.6x the time of a Myrtle kernel's KIP gradient at 32x32 pixels,
    and 1.9x its memory).
    """
    s = layout.spatial_ndim
    batch = cov.shape[: layout.batch_ndim]
    pixels = layout.pixels(cov)
    padded = jnp.pad(cov, [(0, 0)] * layout.batch_ndim + list(pads) * 2)
    dims = padded.shape[layout.batch_ndim :]
    step = [math.prod(dims[i + 1 :]) for i in range(2 * s)]  # flat distance of +1 on each axis
    flat = padded.reshape(*batch, math.prod(dims))
    ones = (1,) * layout.batch_ndim
    for axis, k in enumerate(filter_shape):
        dilation = step[axis] + step[s + axis]
        flat = lax.reduce_window(
            flat,
            0.0,
            lax.add,
            ones + (k,),
            ones + (1,),
            [(0, 0)] * layout.batch_ndim + [(0, (k - 1) * dilation)],
            window_dilation=ones + (dilation,),
        )
    out_pixels = [
        (p + lo + hi - k) // stride + 1
        for p, (lo, hi), k, stride in zip(pixels, pads, filter_shape, strides)
    ]
    corner = [slice(0, (n - 1) * stride + 1, stride) for n, stride in zip(out_pixels, strides)]
    return flat.reshape(*batch, *dims)[(slice(None),) * layout.batch_ndim + tuple(corner) * 2]


@register
@dataclasses.dataclass(frozen=True)
class Conv(Layer):
    """Infinite-width convolution over the pixel axes of NHWC (or N, *pixels, C) inputs.

    Args:
      filter_shape: window size per pixel axis, e.g. ``(3, 3)``.
      strides: step per pixel axis (default 1).
      padding: ``"SAME"`` or ``"VALID"``.
      W_std: weight standard deviation (NTK parameterization).
      b_std: bias standard deviation.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(
        ...     k.Conv((3, 3), strides=(2, 2)), k.Relu(), k.Flatten(), k.Dense())
        >>> jax.jit(kernel_fn)(jnp.ones((2, 8, 8, 1))).shape
        (2, 2)
    """

    filter_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    padding: str = "SAME"
    W_std: float = 1.0
    b_std: float | None = None
    affine = True

    def __post_init__(self):
        window, strides = _window(
            "Conv", self.filter_shape, self.strides, self.padding, "filter_shape"
        )
        object.__setattr__(self, "filter_shape", window)
        object.__setattr__(self, "strides", strides)
        _set_stds(self, "Conv")

    def out_layout(self, layout):
        _check_pixel_axes("Conv", self.filter_shape, layout)
        return layout

    def out_width(self, width):
        return None  # set by memwise.nt's layers, which know the finite width

    def apply(self, state, layout):
        strides = self.strides
        assert strides is not None  # resolved in __post_init__

        def window(a):
            return _window_mean(a, layout, self.filter_shape, strides, self.padding)

        nngp = self.W_std**2 * window(state.nngp)
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * window(a))


@register
@dataclasses.dataclass(frozen=True)
class AvgPool(Layer):
    """Average pooling over pixel windows (neural-tangents' ``stax.AvgPool``).

    The pooled covariance of two images is the mean of the covariance over every pixel
    of the first image's window paired with every pixel of the second's, so it needs the
    full pixel-by-pixel covariance at its input: every layer before the last pooling
    layer holds (H*W)^2 numbers per pair of images (614,656 for 28x28 inputs, 2.3 MiB per
    pair and per live layer in float32; 4,096 for 8x8), where a conv/flatten network
    holds H*W. The windows are averaged with the padded zeros counted (neural-tangents'
    ``normalize_edges=False``).

    Args:
      window_shape: pool size per pixel axis, e.g. ``(2, 2)``.
      strides: step per pixel axis; default 1 (as neural-tangents; pass ``(2, 2)`` for
        non-overlapping 2x2 pooling).
      padding: ``"VALID"`` (default) or ``"SAME"``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(
        ...     k.Conv((3, 3)), k.AvgPool((2, 2), strides=(2, 2)), k.Flatten())
        >>> jax.jit(kernel_fn)(jnp.ones((2, 4, 4, 1))).shape
        (2, 2)
    """

    window_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    padding: str = "VALID"
    pools = True

    def __post_init__(self):
        window, strides = _window(
            "AvgPool", self.window_shape, self.strides, self.padding, "window_shape"
        )
        object.__setattr__(self, "window_shape", window)
        object.__setattr__(self, "strides", strides)

    def out_layout(self, layout):
        _check_pixel_axes("AvgPool", self.window_shape, layout)
        return layout

    def apply(self, state, layout):
        if not layout.full:
            raise AssertionError("serial() keeps covariances full before a pooling layer")
        assert self.strides is not None  # resolved in __post_init__
        batch = (1,) * layout.batch_ndim
        window = batch + self.window_shape * 2
        strides = batch + self.strides * 2
        _check_fits("AvgPool", self.window_shape, layout.pixels(state.nngp), self.padding)
        pads = lax.padtype_to_pads(
            layout.pixels(state.nngp), self.window_shape, self.strides, self.padding
        )
        padding = [(0, 0)] * layout.batch_ndim + list(pads) * 2
        size = math.prod(self.window_shape) ** 2

        def pool(a):
            dtype = a.dtype
            total = lax.reduce_window(
                a.astype(accumulation_dtype(dtype)), 0.0, lax.add, window, strides, padding
            )
            return (total / size).astype(dtype)

        return pool(state.nngp), _map_ntk(state.ntk, pool)


@register
@dataclasses.dataclass(frozen=True)
class Flatten(Layer):
    """Flatten pixels and channels: the mean of the per-pixel (diagonal) covariances.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Conv((3, 3), padding="VALID"), k.Flatten())
        >>> kernel_fn(jnp.ones((2, 4, 4, 1)), get="nngp")  # every pixel sees 9 ones
        Array([[1., 1.],
               [1., 1.]], dtype=float32)
    """

    def out_layout(self, layout):
        return _Layout(layout.batch_ndim, 0, False)

    def out_width(self, width):
        return None  # channels times pixels

    def apply(self, state, layout):
        def flatten(a):
            if layout.spatial_ndim == 0:
                return a
            a = _pixel_diagonal(a, layout)
            return jnp.mean(a, axis=tuple(range(layout.batch_ndim, a.ndim)))

        return flatten(state.nngp), _map_ntk(state.ntk, flatten)


@register
@dataclasses.dataclass(frozen=True)
class GlobalAvgPool(Layer):
    """Average over pixels: the mean over all pixel *pairs* of the full covariance.

    Needs the full pixel-by-pixel covariance at its input (see :class:`AvgPool`).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(
        ...     k.Conv((3, 3)), k.Relu(), k.GlobalAvgPool(), k.Dense())
        >>> jax.jit(kernel_fn)(jnp.ones((2, 4, 4, 1))).shape
        (2, 2)
    """

    pools = True

    def out_layout(self, layout):
        if not layout.full and layout.spatial_ndim > 0:
            raise AssertionError("serial() keeps covariances full before a pooling layer")
        return _Layout(layout.batch_ndim, 0, False)

    def apply(self, state, layout):
        def pool(a):
            return jnp.mean(a, axis=layout.spatial_axes()) if layout.spatial_ndim else a

        return pool(state.nngp), _map_ntk(state.ntk, pool)
