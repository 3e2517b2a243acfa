"""Infinite-width NNGP and NTK kernels of conv and dense networks, computed layer by layer.

A network of ``Dense``/``Conv`` layers whose widths go to infinity under the NTK
parameterization (Jacot et al. 2018) is a Gaussian process whose covariance (the NNGP
kernel) and neural tangent kernel follow a recursion over layers (Lee et al. 2018,
Arora et al. 2019, "On exact computation with an infinitely wide neural net";
Novak et al. 2020, neural-tangents). This module implements that recursion directly
and reproduces neural-tangents 0.6.5 (``stax``, NTK parameterization) to float64
rounding: per-pixel covariances averaged over channels, a ``Conv`` window divides by the
number of taps (zero padding counts), ReLU and Erf use their closed-form Gaussian
expectations (arc-cosine kernel of Cho & Saul 2009; Williams 1997), and for the NTK a
linear layer adds its NNGP while a nonlinearity multiplies by the expected derivative
product.

Memory: for images the state of a pair of inputs is one number per pixel (the
covariances stay *diagonal* in space: a ``Conv`` of a diagonal covariance is diagonal,
and ``Flatten`` reads only the diagonal). Only the layers before a ``GlobalAvgPool``
need the full pixel-by-pixel covariance (H*W)^2 per pair, as neural-tangents does when
it cannot prove the off-diagonal unused. ``kernel_fn(x1, x2)`` computes the whole
(n1, n2) kernel at once; tile it with :func:`memwise.ntk.kernel_regression` /
:func:`memwise.ntk.kip_loss` (which use :mod:`memwise.chunked`) for large inputs.

A kernel is evaluated in two steps so that tiles share work: :meth:`KernelFn.prepare`
computes each input's own variances at every nonlinearity (cost linear in n), and
:meth:`KernelFn.cross` the kernel between two prepared sets (cost n1 * n2).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from memwise.engine import accumulation_dtype

__all__ = [
    "Conv",
    "Dense",
    "Erf",
    "Flatten",
    "GlobalAvgPool",
    "KernelFn",
    "Prepared",
    "Relu",
    "serial",
]

_GETS = ("nngp", "ntk")


# ----------------------------------------------------------------------------------------
# The state flowing through the layers


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


class _State(NamedTuple):
    nngp: jax.Array
    ntk: jax.Array | float | None  # None: not requested; 0.0: exactly zero so far
    # Variances of the two sides, broadcastable against nngp (see _broadcast_variances).
    var1: jax.Array
    var2: jax.Array


def _diagonal(cov: jax.Array, layout: _Layout) -> jax.Array:
    """The per-pixel variances (n, *pixels) of an input's own covariance."""
    if not layout.full or layout.spatial_ndim == 0:
        return cov
    n = cov.shape[0]
    pixels = cov.shape[1 : 1 + layout.spatial_ndim]
    size = math.prod(pixels)
    flat = cov.reshape(n, size, size)
    return jnp.diagonal(flat, axis1=1, axis2=2).reshape(n, *pixels)


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


def _correlation(cov: jax.Array, var1: jax.Array, var2: jax.Array):
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
# Layers


class Layer:
    """Base class of the layers of :func:`serial`. A layer maps covariances to covariances."""

    def out_layout(self, layout: _Layout) -> _Layout:
        return layout

    def apply(self, state: _State, layout: _Layout) -> tuple[jax.Array, jax.Array | None]:
        raise NotImplementedError

    @property
    def nonlinear(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Dense(Layer):
    """Infinite-width dense layer on the channel axis (NTK parameterization).

    ``nngp' = W_std^2 nngp + b_std^2``, ``ntk' = nngp' + W_std^2 ntk``.
    """

    W_std: float = 1.0
    b_std: float | None = None

    def apply(self, state, layout):
        nngp = self.W_std**2 * state.nngp
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * a)


def _linear_ntk(ntk: Any, nngp: jax.Array, transform) -> Any:
    """NTK parameterization: a linear layer's own weights add its NNGP to the NTK."""
    if ntk is None:
        return None
    if _is_zero_ntk(ntk):
        return nngp
    return nngp + transform(ntk)


def _scale_ntk(ntk: Any, factor) -> Any:
    if ntk is None or _is_zero_ntk(ntk):
        return ntk
    return ntk * factor


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
    pads = lax.padtype_to_pads(pixels, filter_shape, strides, padding)
    if not layout.full:
        batch = (1,) * layout.batch_ndim
        total = lax.reduce_window(
            cov, 0.0, lax.add, batch + filter_shape, batch + strides,
            [(0, 0)] * layout.batch_ndim + list(pads),
        )
        return (total / math.prod(filter_shape)).astype(dtype)
    out_pixels = [
        (p + lo + hi - k) // s + 1
        for p, (lo, hi), k, s in zip(pixels, pads, filter_shape, strides)
    ]
    pad_config = [(0, 0)] * cov.ndim
    for first in layout.groups():
        for d, (lo, hi) in enumerate(pads):
            pad_config[first + d] = (lo, hi)
    padded = jnp.pad(cov, pad_config)
    total = None
    for offsets in itertools.product(*(range(k) for k in filter_shape)):
        index = [slice(None)] * cov.ndim
        for first in layout.groups():
            for d, (offset, n_out, s) in enumerate(zip(offsets, out_pixels, strides)):
                index[first + d] = slice(offset, offset + (n_out - 1) * s + 1, s)
        term = padded[tuple(index)]
        total = term if total is None else total + term
    return (total / math.prod(filter_shape)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Conv(Layer):
    """Infinite-width convolution over the pixel axes of NHWC (or N, *pixels, C) inputs.

    Args:
      filter_shape: window size per pixel axis, e.g. ``(3, 3)``.
      strides: step per pixel axis (default 1).
      padding: ``"SAME"`` or ``"VALID"``.
      W_std, b_std: weight and bias standard deviations (NTK parameterization).
    """

    filter_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    padding: str = "SAME"
    W_std: float = 1.0
    b_std: float | None = None

    def __post_init__(self):
        filter_shape = tuple(int(k) for k in self.filter_shape)
        if not filter_shape or min(filter_shape) < 1:
            raise ValueError(f"Conv filter_shape must be positive ints, got {self.filter_shape!r}")
        strides = (1,) * len(filter_shape) if self.strides is None else tuple(self.strides)
        if len(strides) != len(filter_shape) or min(strides) < 1:
            raise ValueError(
                f"Conv strides must be {len(filter_shape)} positive ints, got {self.strides!r}"
            )
        if self.padding not in ("SAME", "VALID"):
            raise ValueError(f"Conv padding must be 'SAME' or 'VALID', got {self.padding!r}")
        object.__setattr__(self, "filter_shape", filter_shape)
        object.__setattr__(self, "strides", strides)

    def out_layout(self, layout):
        if layout.spatial_ndim != len(self.filter_shape):
            raise ValueError(
                f"Conv with filter_shape {self.filter_shape} needs inputs with "
                f"{len(self.filter_shape)} pixel axes, got {layout.spatial_ndim}"
            )
        return layout

    def apply(self, state, layout):
        def window(a):
            return _window_mean(a, layout, self.filter_shape, self.strides, self.padding)

        nngp = self.W_std**2 * window(state.nngp)
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * window(a))


@dataclasses.dataclass(frozen=True)
class Relu(Layer):
    """ReLU: the arc-cosine kernel of degree 1 (Cho & Saul 2009).

    With ``cos(theta) = nngp / sqrt(var1 var2)``:
    ``nngp' = sqrt(var1 var2) (sin theta + (pi - theta) cos theta) / (2 pi)`` and
    ``ntk' = ntk (pi - theta) / (2 pi)``.
    """

    @property
    def nonlinear(self):
        return True

    def apply(self, state, layout):
        norm, cos = _correlation(state.nngp, state.var1, state.var2)
        sin = _safe_sqrt(1.0 - cos**2, "rounding")
        theta = jnp.arctan2(sin, cos)
        nngp = norm * (sin + (jnp.pi - theta) * cos) / (2 * jnp.pi)
        return nngp, _scale_ntk(state.ntk, (jnp.pi - theta) / (2 * jnp.pi))


@dataclasses.dataclass(frozen=True)
class Erf(Layer):
    """Erf nonlinearity (Williams 1997).

    ``nngp' = 2/pi arcsin(2 nngp / sqrt((1 + 2 var1)(1 + 2 var2)))`` and
    ``ntk' = ntk 4 / (pi sqrt((1 + 2 var1)(1 + 2 var2) - 4 nngp^2))``.
    """

    @property
    def nonlinear(self):
        return True

    def apply(self, state, layout):
        prod = (1 + 2 * state.var1) * (1 + 2 * state.var2)
        nngp = 2 / jnp.pi * jnp.arcsin(jnp.clip(2 * state.nngp / jnp.sqrt(prod), -1.0, 1.0))
        if state.ntk is None or _is_zero_ntk(state.ntk):
            return nngp, state.ntk
        return nngp, state.ntk * 4 / (jnp.pi * jnp.sqrt(prod - 4 * state.nngp**2))


@dataclasses.dataclass(frozen=True)
class Flatten(Layer):
    """Flatten pixels and channels: the mean of the per-pixel (diagonal) covariances."""

    def out_layout(self, layout):
        return _Layout(layout.batch_ndim, 0, False)

    def apply(self, state, layout):
        def flatten(a):
            if layout.spatial_ndim == 0:
                return a
            if layout.full:
                a = _diagonal_pairs(a, layout)
            return jnp.mean(a, axis=tuple(range(layout.batch_ndim, a.ndim)))

        ntk = state.ntk if state.ntk is None or _is_zero_ntk(state.ntk) else flatten(state.ntk)
        return flatten(state.nngp), ntk


def _diagonal_pairs(a: jax.Array, layout: _Layout) -> jax.Array:
    """The entries (p, p) of a full pixel-by-pixel covariance: (*batch, *pixels)."""
    batch = a.shape[: layout.batch_ndim]
    pixels = a.shape[layout.batch_ndim : layout.batch_ndim + layout.spatial_ndim]
    size = math.prod(pixels)
    flat = a.reshape(*batch, size, size)
    return jnp.diagonal(flat, axis1=-2, axis2=-1).reshape(*batch, *pixels)


@dataclasses.dataclass(frozen=True)
class GlobalAvgPool(Layer):
    """Average over pixels: the mean over all pixel *pairs* of the full covariance."""

    def out_layout(self, layout):
        if not layout.full and layout.spatial_ndim > 0:
            raise AssertionError("serial() keeps covariances full before GlobalAvgPool")
        return _Layout(layout.batch_ndim, 0, False)

    def apply(self, state, layout):
        def pool(a):
            return jnp.mean(a, axis=layout.spatial_axes()) if layout.spatial_ndim else a

        ntk = state.ntk if state.ntk is None or _is_zero_ntk(state.ntk) else pool(state.ntk)
        return pool(state.nngp), ntk


# ----------------------------------------------------------------------------------------
# serial


class Prepared(NamedTuple):
    """An input set with its own per-pixel variances at every nonlinearity.

    ``x`` is the input (n, ..., channels); ``variances[k]`` the variances (n, *pixels)
    of the k-th nonlinearity's input. Row ``i`` of every leaf belongs to input ``i``, so
    a Prepared can be sliced and chunked along its leading axis like the input itself.
    """

    x: jax.Array
    variances: tuple[jax.Array, ...]


def _check_gets(get: str | Sequence[str]) -> tuple[tuple[str, ...], bool]:
    single = isinstance(get, str)
    gets = (get,) if single else tuple(get)
    if not gets or any(g not in _GETS for g in gets):
        raise ValueError(f"get must be 'nngp', 'ntk' or a tuple of them, got {get!r}")
    return gets, single


class KernelFn:
    """The NNGP / NTK kernel of an infinite-width network built by :func:`serial`."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = tuple(layers)
        pools = [i for i, layer in enumerate(self.layers) if isinstance(layer, GlobalAvgPool)]
        # Layers before the last GlobalAvgPool need pixel-by-pixel covariances.
        self._full_until = pools[-1] if pools else -1

    def __repr__(self) -> str:
        return f"serial({', '.join(map(repr, self.layers))})"

    def _input_layout(self, x: jax.Array, batch_ndim: int) -> _Layout:
        return _Layout(batch_ndim, x.ndim - 2, self._full_until >= 0 and x.ndim > 2)

    def _check_input(self, x: Any, name: str) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim < 2:
            raise ValueError(
                f"{name} must be (n, features) or (n, *pixels, channels), got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        return x

    def _input_covariance(self, x1: jax.Array, x2: jax.Array | None, layout: _Layout):
        s = layout.spatial_ndim
        letters = "hwdefgijkl"[:s]
        primed = "HWDEFGIJKL"[:s]
        if x2 is None:  # an input's own covariance (n, *pixels[, *pixels])
            x2 = x1
            if layout.full:
                spec = f"a{letters}c,a{primed}c->a{letters}{primed}"
            else:
                spec = f"a{letters}c,a{letters}c->a{letters}"
        elif layout.full:
            spec = f"a{letters}c,b{primed}c->ab{letters}{primed}"
        else:
            spec = f"a{letters}c,b{letters}c->ab{letters}"
        dtype = jnp.result_type(x1.dtype, x2.dtype)
        # The channel sum in at least float32, then back to the inputs' dtype.
        cov = jnp.einsum(spec, x1, x2, preferred_element_type=accumulation_dtype(dtype))
        return (cov / x1.shape[-1]).astype(dtype)

    def prepare(self, x: jax.Array) -> Prepared:
        """The variances of ``x`` at every nonlinearity (cost linear in ``len(x)``)."""
        x = self._check_input(x, "x")
        layout = self._input_layout(x, 1)
        cov = self._input_covariance(x, None, layout)
        variances = []
        for layer in self.layers:
            diag = _diagonal(cov, layout)
            if layer.nonlinear:
                variances.append(diag)
            var1, var2 = _broadcast_variances(diag, diag, layout)
            out_layout = layer.out_layout(layout)
            cov, _ = layer.apply(_State(cov, None, var1, var2), layout)
            layout = out_layout
        return Prepared(x, tuple(variances))

    def cross(
        self, p1: Prepared, p2: Prepared, *, get: str | Sequence[str] = "ntk"
    ) -> jax.Array | tuple[jax.Array, ...]:
        """The kernel between two prepared input sets: (n1, n2[, *pixels]) per ``get``."""
        gets, single = _check_gets(get)
        x1, x2 = p1.x, p2.x
        if x1.shape[1:] != x2.shape[1:]:
            raise ValueError(
                f"x1 and x2 must have the same shape per input, got {x1.shape[1:]} and "
                f"{x2.shape[1:]}"
            )
        layout = self._input_layout(x1, 2)
        nngp = self._input_covariance(x1, x2, layout)
        ntk = 0.0 if "ntk" in gets else None
        nonlinear = 0
        for layer in self.layers:
            if layer.nonlinear:
                var1, var2 = _broadcast_variances(
                    p1.variances[nonlinear], p2.variances[nonlinear], layout
                )
                nonlinear += 1
            else:
                var1 = var2 = None
            out_layout = layer.out_layout(layout)
            nngp, ntk = layer.apply(_State(nngp, ntk, var1, var2), layout)
            layout = out_layout
        if _is_zero_ntk(ntk):  # no linear layer: the NTK is zero
            ntk = jnp.zeros_like(nngp)
        values = {"nngp": nngp, "ntk": ntk}
        out = tuple(values[g] for g in gets)
        return out[0] if single else out

    def __call__(
        self,
        x1: jax.Array,
        x2: jax.Array | None = None,
        *,
        get: str | Sequence[str] = "ntk",
    ) -> jax.Array | tuple[jax.Array, ...]:
        """The kernel between ``x1`` (n1, ...) and ``x2`` (n2, ...) (``x1`` when None).

        Example::

            >>> import jax.numpy as jnp
            >>> from memwise.ntk import kernels as k
            >>> kernel_fn = k.serial(k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
            >>> kernel_fn(jnp.ones((4, 8, 8, 1)), get="ntk").shape
            (4, 4)

        Memory: the cross kernel holds one (n1, n2, *pixels) array per live layer (the
        pixel axes twice before a GlobalAvgPool); tile large sets with
        :func:`memwise.ntk.kernel_regression` / :func:`memwise.ntk.kip_loss`.
        """
        x1 = self._check_input(x1, "x1")
        p1 = self.prepare(x1)
        if x2 is None:
            return self.cross(p1, p1, get=get)
        x2 = self._check_input(x2, "x2")
        if x1.shape[1:] != x2.shape[1:]:
            raise ValueError(
                f"x1 and x2 must have the same shape per input, got {x1.shape[1:]} and "
                f"{x2.shape[1:]}"
            )
        return self.cross(p1, self.prepare(x2), get=get)


# A kernel function is a pytree without leaves (its layers are static), so it can be an
# argument of jit-compiled functions.
jax.tree_util.register_pytree_node(
    KernelFn, lambda kernel: ((), kernel.layers), lambda layers, _: KernelFn(layers)
)


def serial(*layers: Layer) -> KernelFn:
    """The infinite-width kernel of ``layers`` applied in order.

    Layers: :class:`Dense`, :class:`Conv`, :class:`Relu`, :class:`Erf`, :class:`Flatten`,
    :class:`GlobalAvgPool` (NTK parameterization, widths -> infinity; the readout width
    does not change the kernel). Values agree with neural-tangents' ``stax.serial`` of the
    same layers.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(W_std=1.5, b_std=0.05), k.Relu(), k.Dense())
        >>> kernel_fn(jnp.ones((3, 5)), jnp.ones((2, 5)), get="nngp").shape
        (3, 2)
    """
    for layer in layers:
        if not isinstance(layer, Layer):
            raise TypeError(
                f"serial() takes layers from memwise.ntk.kernels (Dense, Conv, Relu, Erf, "
                f"Flatten, GlobalAvgPool), got {layer!r}"
            )
    return KernelFn(layers)
