"""Infinite-width NNGP and NTK kernels of conv, pooling, residual and dense networks.

A network of ``Dense``/``Conv`` layers whose widths go to infinity under the NTK
parameterization (Jacot et al. 2018) is a Gaussian process whose covariance (the NNGP
kernel) and neural tangent kernel follow a recursion over layers (Lee et al. 2018,
"Deep neural networks as Gaussian processes"; Arora et al. 2019, "On exact computation
with an infinitely wide neural net"; Novak et al. 2019, "Bayesian deep convolutional
networks with many channels are Gaussian processes"; Novak et al. 2020,
neural-tangents). This module implements that recursion directly and reproduces
neural-tangents 0.6.5 (``stax``, NTK parameterization) to float64 rounding: per-pixel
covariances averaged over channels; a ``Conv`` window averages the covariance along the
pixel diagonal (weights are independent across taps; zero padding counts); ``AvgPool``
averages it over every pair of pixels of the two windows (Arora et al. 2019, "CNTK with
global average pooling", and the Myrtle kernels of Shankar et al. 2020, "Neural kernels
without tangents"); residual branches add (``FanOut``, ``parallel``, ``FanInSum``: the
kernel of a sum of independent Gaussian branches is the sum of their kernels). For the NTK
a linear layer adds its NNGP, and an activation (:mod:`memwise.ntk.elementwise`)
multiplies it by the expected derivative product.

Memory: for images the state of a pair of inputs is one number per pixel (the
covariances stay *diagonal* in space: a ``Conv`` of a diagonal covariance is diagonal,
and ``Flatten`` reads only the diagonal). Pooling mixes pixels, so every layer before the
last ``AvgPool``/``GlobalAvgPool`` holds the full pixel-by-pixel covariance, (H*W)^2
numbers per pair of images (614,656 for 28x28, 2.3 MiB in float32), as neural-tangents
does; after the last pooling layer the covariance is diagonal again. ``kernel_fn(x1,
x2)`` computes the whole (n1, n2) kernel at once; tile it with
:func:`memwise.ntk.kernel_regression`, :func:`memwise.ntk.predict` or
:func:`memwise.ntk.kip_loss` (which use :mod:`memwise.chunked`) for large inputs.

A kernel is evaluated in two steps so that tiles share work: :meth:`KernelFn.prepare`
computes each input's own variances at every layer that reads them (cost linear in n;
with pooling, each input's own pixel-by-pixel covariance), and :meth:`KernelFn.cross`
the kernel between two prepared sets (cost n1 * n2).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise.engine import accumulation_dtype
from memwise.ntk._covariance import (
    Layer,
    _broadcast_variances,
    _is_zero_ntk,
    _Layout,
    _linear_ntk,
    _map_ntk,
    _pixel_diagonal,
    _positive_ints,
    _real,
    _State,
)
from memwise.ntk.elementwise import (
    ABRelu,
    Abs,
    Erf,
    Gelu,
    LayerNorm,
    LeakyRelu,
    Relu,
    Sigmoid_like,
    Sin,
)

__all__ = [
    "ABRelu",
    "Abs",
    "AvgPool",
    "Conv",
    "Dense",
    "Erf",
    "FanInSum",
    "FanOut",
    "Flatten",
    "Gelu",
    "GlobalAvgPool",
    "Identity",
    "KernelFn",
    "Layer",
    "LayerNorm",
    "LeakyRelu",
    "Prepared",
    "Relu",
    "Sigmoid_like",
    "Sin",
    "parallel",
    "serial",
]

_GETS = ("nngp", "ntk")


# ----------------------------------------------------------------------------------------
# Linear layers


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

    def __post_init__(self):
        _set_stds(self, "Dense")

    def apply(self, state, layout):
        nngp = self.W_std**2 * state.nngp
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * a)


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


def _set_stds(layer: Layer, name: str) -> None:
    """Check a linear layer's W_std (>= 0) and b_std (>= 0 or None); store them as floats."""
    object.__setattr__(layer, "W_std", _real(name, "W_std", layer.W_std, at_least=0.0))  # type: ignore[attr-defined]
    b_std = _real(name, "b_std", layer.b_std, at_least=0.0, optional=True)  # type: ignore[attr-defined]
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
    if not layout.full:
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
    out_pixels = [
        (p + lo + hi - k) // s + 1 for p, (lo, hi), k, s in zip(pixels, pads, filter_shape, strides)
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
      W_std: weight standard deviation (NTK parameterization).
      b_std: bias standard deviation.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Conv((3, 3), strides=(2, 2)), k.Relu(), k.Flatten(), k.Dense())
        >>> jax.jit(kernel_fn)(jnp.ones((2, 8, 8, 1))).shape
        (2, 2)
    """

    filter_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    padding: str = "SAME"
    W_std: float = 1.0
    b_std: float | None = None

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

    def apply(self, state, layout):
        strides = self.strides
        assert strides is not None  # resolved in __post_init__

        def window(a):
            return _window_mean(a, layout, self.filter_shape, strides, self.padding)

        nngp = self.W_std**2 * window(state.nngp)
        if self.b_std is not None:
            nngp = nngp + self.b_std**2
        return nngp, _linear_ntk(state.ntk, nngp, lambda a: self.W_std**2 * window(a))


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
        >>> kernel_fn = k.serial(k.Conv((3, 3)), k.AvgPool((2, 2), strides=(2, 2)), k.Flatten())
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

    def apply(self, state, layout):
        def flatten(a):
            if layout.spatial_ndim == 0:
                return a
            a = _pixel_diagonal(a, layout)
            return jnp.mean(a, axis=tuple(range(layout.batch_ndim, a.ndim)))

        return flatten(state.nngp), _map_ntk(state.ntk, flatten)


@dataclasses.dataclass(frozen=True)
class GlobalAvgPool(Layer):
    """Average over pixels: the mean over all pixel *pairs* of the full covariance.

    Needs the full pixel-by-pixel covariance at its input (see :class:`AvgPool`).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Conv((3, 3)), k.Relu(), k.GlobalAvgPool(), k.Dense())
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


# ----------------------------------------------------------------------------------------
# Walking the layers: one flow of covariances, or branches of them


class _Flow(NamedTuple):
    """The covariances between the layers: nngp, ntk (None / 0.0 as in _State), layout."""

    nngp: jax.Array
    ntk: Any
    layout: _Layout


def _to_diagonal(flow: _Flow) -> _Flow:
    """Keep only the per-pixel covariances (nothing downstream pools any more)."""
    layout = flow.layout
    if not layout.full or layout.spatial_ndim == 0:
        return flow
    diagonal = lambda a: _pixel_diagonal(a, layout)  # noqa: E731
    return _Flow(diagonal(flow.nngp), _map_ntk(flow.ntk, diagonal), layout.diagonal())


class _Walk:
    """One pass over a network's layers, for one input's own covariance or a cross kernel.

    With ``variances=None`` (:meth:`KernelFn.prepare`) each layer that reads variances
    takes them from the covariance it receives and records them; otherwise
    (:meth:`KernelFn.cross`) it takes the next recorded pair. ``last_pool`` is the index,
    in visiting order, of the last pooling layer: after it the covariance is diagonal.
    """

    def __init__(self, last_pool: int, variances: list | None = None):
        self.collect = variances is None
        self.variances = [] if variances is None else variances
        self.n_read = 0
        self.n_steps = 0
        self.last_pool = last_pool

    def step(self, layer: Layer, flow: Any) -> _Flow:
        if isinstance(flow, list):
            raise ValueError(
                f"{layer!r} takes one input but gets {len(flow)} branches; join them first "
                f"with FanInSum(), or give each its own layer with parallel(...)"
            )
        var1 = var2 = None
        if layer.needs_variances:
            if self.collect:
                diag = _pixel_diagonal(flow.nngp, flow.layout)
                self.variances.append(diag)
                var1, var2 = _broadcast_variances(diag, diag, flow.layout)
            else:
                diag1, diag2 = self.variances[self.n_read]
                self.n_read += 1
                var1, var2 = _broadcast_variances(diag1, diag2, flow.layout)
        out_layout = layer.out_layout(flow.layout)
        nngp, ntk = layer.apply(_State(flow.nngp, flow.ntk, var1, var2), flow.layout)
        flow = _Flow(nngp, ntk, out_layout)
        index, self.n_steps = self.n_steps, self.n_steps + 1
        return _to_diagonal(flow) if index == self.last_pool else flow


# ----------------------------------------------------------------------------------------
# Residual structure


@dataclasses.dataclass(frozen=True)
class FanOut(Layer):
    """Copy the input into ``n`` branches (for :func:`parallel`, then :class:`FanInSum`).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> branches = k.parallel(k.Relu(), k.Abs())
        >>> kernel_fn = k.serial(k.Dense(), k.FanOut(2), branches, k.FanInSum())
        >>> float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0])  # 0.5 + 1.0
        1.5
    """

    n: int

    def __post_init__(self):
        if not isinstance(self.n, (int, np.integer)) or isinstance(self.n, (bool, np.bool_)):
            raise TypeError(f"FanOut n must be an int (the number of branches), got {self.n!r}")
        if self.n < 1:
            raise ValueError(
                f"FanOut n must be a positive int (the number of branches), got {self.n!r}"
            )
        object.__setattr__(self, "n", int(self.n))

    def _leaves(self):
        return iter(())

    def _walk(self, walk, flow):
        if isinstance(flow, list):
            raise ValueError(f"FanOut({self.n}) gets {len(flow)} branches; join them first")
        return [flow] * self.n


@dataclasses.dataclass(frozen=True)
class _Parallel(Layer):
    layers: tuple[Layer, ...]

    def __repr__(self) -> str:
        return f"parallel({', '.join(map(repr, self.layers))})"

    def _leaves(self):
        for layer in self.layers:
            yield from layer._leaves()

    def _walk(self, walk, flow):
        if not isinstance(flow, list) or len(flow) != len(self.layers):
            got = f"{len(flow)} branches" if isinstance(flow, list) else "one input"
            raise ValueError(
                f"{self!r} applies {len(self.layers)} layers to {len(self.layers)} branches "
                f"but gets {got}; put FanOut({len(self.layers)}) before it"
            )
        return [layer._walk(walk, branch) for layer, branch in zip(self.layers, flow)]


def parallel(*layers: Layer) -> Layer:
    """Apply ``layers[i]`` to branch ``i`` (after :class:`FanOut`), as ``stax.parallel``.

    Each layer may itself be a :func:`serial` network.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> block = k.serial(k.FanOut(2), k.parallel(k.Identity(), k.Relu()), k.FanInSum())
        >>> float(k.serial(k.Dense(), block)(jnp.ones((1, 3)), get="nngp")[0, 0])  # 1 + 0.5
        1.5
    """
    _check_layers(layers, "parallel")
    if not layers:
        raise ValueError("parallel() needs at least one layer (one per branch)")
    return _Parallel(tuple(layers))


def _add_ntk(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return None
    if _is_zero_ntk(a):
        return b
    if _is_zero_ntk(b):
        return a
    return a + b


@dataclasses.dataclass(frozen=True)
class FanInSum(Layer):
    """Sum the branches: independent Gaussian branches add their kernels (NNGP and NTK).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.FanOut(3), k.FanInSum())
        >>> float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0])  # three copies of 1.0
        3.0
    """

    def _leaves(self):
        return iter(())

    def _walk(self, walk, flow):
        if not isinstance(flow, list):
            raise ValueError(
                "FanInSum() joins branches but gets one input; put FanOut(n) "
                "and parallel(...) before it"
            )
        # A branch past the network's last pooling layer is per-pixel; the others may
        # still be pixel-by-pixel, which nothing downstream needs.
        if any(not branch.layout.full for branch in flow):
            flow = [_to_diagonal(branch) for branch in flow]
        shapes = {branch.nngp.shape for branch in flow}
        if len(shapes) > 1:
            raise ValueError(
                f"FanInSum() branches must have the same pixel shape, got kernels of shapes "
                f"{sorted(shapes)}; use the same strides and padding in every branch"
            )
        nngp, ntk = flow[0].nngp, flow[0].ntk
        for branch in flow[1:]:
            nngp = nngp + branch.nngp
            ntk = _add_ntk(ntk, branch.ntk)
        return _Flow(nngp, ntk, flow[0].layout)


# ----------------------------------------------------------------------------------------
# serial


class Prepared(NamedTuple):
    """An input set with its own per-pixel variances at every layer that reads them.

    ``x`` is the input (n, ..., channels); ``variances[k]`` the variances (n, *pixels)
    at the input of the k-th such layer (activations, ``LayerNorm``), in the order the
    layers run. Row ``i`` of every leaf belongs to input ``i``, so a Prepared can be
    sliced and chunked along its leading axis like the input itself.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> p = k.serial(k.Dense(), k.Relu(), k.Dense()).prepare(jnp.ones((3, 2)))
        >>> p.x.shape, [v.shape for v in p.variances]  # Relu reads each input's variance
        ((3, 2), [(3,)])
    """

    x: jax.Array
    variances: tuple[jax.Array, ...]


def _check_gets(get: str | Sequence[str]) -> tuple[tuple[str, ...], bool]:
    single = isinstance(get, str)
    gets = (get,) if isinstance(get, str) else tuple(get)
    if not gets or any(g not in _GETS for g in gets):
        raise ValueError(f"get must be 'nngp', 'ntk' or a tuple of them, got {get!r}")
    return gets, single


class KernelFn(Layer):
    """The NNGP / NTK kernel of an infinite-width network built by :func:`serial`.

    A KernelFn is also a layer: ``serial`` networks nest (e.g. inside :func:`parallel`).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Relu(), k.Dense())
        >>> p1, p2 = kernel_fn.prepare(jnp.ones((3, 2))), kernel_fn.prepare(jnp.ones((4, 2)))
        >>> kernel_fn.cross(p1, p2).shape  # as kernel_fn(x1, x2), each variance computed once
        (3, 4)
    """

    def __init__(self, layers: Sequence[Layer]):
        self.layers = tuple(layers)
        pools = [i for i, layer in enumerate(self._leaves()) if layer.pools]
        # Layers up to the last pooling layer need pixel-by-pixel covariances.
        self._last_pool = pools[-1] if pools else -1

    def __repr__(self) -> str:
        return f"serial({', '.join(map(repr, self.layers))})"

    def __eq__(self, other: Any) -> bool:
        return type(other) is KernelFn and other.layers == self.layers

    def __hash__(self) -> int:
        return hash((KernelFn, self.layers))

    def _leaves(self):
        for layer in self.layers:
            yield from layer._leaves()

    def _walk(self, walk, flow):
        for layer in self.layers:
            flow = layer._walk(walk, flow)
        return flow

    @property
    def pools(self) -> bool:
        """Whether the network pools, so that its inputs need pixel-by-pixel covariances."""
        return self._last_pool >= 0

    def _input_layout(self, x: jax.Array, batch_ndim: int) -> _Layout:
        return _Layout(batch_ndim, x.ndim - 2, self._last_pool >= 0 and x.ndim > 2)

    def _check_input(self, x: Any, name: str) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim < 2:
            raise ValueError(
                f"{name} must be (n, features) or (n, *pixels, channels), got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        return x

    def _input_covariance(self, x1: jax.Array, x2: jax.Array | None, layout: _Layout) -> jax.Array:
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

    def _run(self, flow: _Flow, variances: list | None) -> tuple[_Flow, _Walk]:
        walk = _Walk(self._last_pool, variances)
        flow = self._walk(walk, flow)
        if isinstance(flow, list):
            raise ValueError(f"the network ends in {len(flow)} branches; join them with FanInSum()")
        return flow, walk

    def prepare(self, x: jax.Array) -> Prepared:
        """The variances of ``x`` at every layer that reads them (cost linear in ``len(x)``).

        With pooling this holds each input's own pixel-by-pixel covariance, (H*W)^2
        numbers per input (see :class:`AvgPool`).
        """
        x = self._check_input(x, "x")
        layout = self._input_layout(x, 1)
        cov = self._input_covariance(x, None, layout)
        _, walk = self._run(_Flow(cov, None, layout), None)
        return Prepared(x, tuple(walk.variances))

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
        ntk: Any = 0.0 if "ntk" in gets else None  # 0.0: the symbolic zero of _is_zero_ntk
        variances = list(zip(p1.variances, p2.variances))
        flow, _ = self._run(_Flow(nngp, ntk, layout), variances)
        nngp, ntk = flow.nngp, flow.ntk
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

            >>> import jax, jax.numpy as jnp
            >>> from memwise.ntk import kernels as k
            >>> kernel_fn = k.serial(k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
            >>> ntk = jax.jit(kernel_fn)  # get="ntk"
            >>> ntk(jnp.ones((4, 8, 8, 1)), jnp.ones((2, 8, 8, 1))).shape
            (4, 2)

        Memory: the cross kernel holds one (n1, n2, *pixels) array per live layer (the
        pixel axes twice up to the last pooling layer); tile large sets with
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

_LAYER_NAMES = (
    "Dense, Conv, AvgPool, Flatten, GlobalAvgPool, Identity, Relu, LeakyRelu, ABRelu, Abs, "
    "Erf, Sigmoid_like, Gelu, Sin, LayerNorm, FanOut, parallel, FanInSum, serial"
)


def _check_layers(layers: Sequence[Any], where: str) -> None:
    for layer in layers:
        if not isinstance(layer, Layer):
            raise TypeError(
                f"{where}() takes layers from memwise.ntk.kernels ({_LAYER_NAMES}), got {layer!r}"
            )


def serial(*layers: Layer) -> KernelFn:
    """The infinite-width kernel of ``layers`` applied in order.

    Layers (NTK parameterization, widths -> infinity; the readout width does not change
    the kernel): linear :class:`Dense`, :class:`Conv`, :class:`AvgPool`,
    :class:`Flatten`, :class:`GlobalAvgPool`, :class:`Identity`; activations
    :func:`Relu`, :func:`LeakyRelu`, :class:`ABRelu`, :func:`Abs`, :class:`Erf`,
    :func:`Sigmoid_like`, :class:`Gelu`, :class:`Sin`; :class:`LayerNorm`; residual
    structure :class:`FanOut`, :func:`parallel`, :class:`FanInSum`, and nested ``serial``.
    Values agree with neural-tangents' ``stax.serial`` of the same layers.

    Args:
      *layers: the layers, in order.

    Returns:
      A :class:`KernelFn`: ``kernel_fn(x1, x2=None, *, get="ntk")``.

    Memory/compute: one (n1, n2, *pixels) array per live layer, the pixel axes twice up
    to the last pooling layer (:class:`AvgPool`, :class:`GlobalAvgPool`).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(W_std=1.5, b_std=0.05), k.Relu(), k.Dense())
        >>> nngp = jax.jit(lambda x1, x2: kernel_fn(x1, x2, get="nngp"))
        >>> nngp(jnp.ones((3, 5)), jnp.ones((2, 5))).shape
        (3, 2)
        >>> block = k.serial(k.FanOut(2), k.parallel(k.Identity(), k.serial(k.Relu(),
        ...                  k.Conv((3, 3)))), k.FanInSum())
        >>> resnet = k.serial(k.Conv((3, 3)), block, k.Relu(), k.GlobalAvgPool(), k.Dense())
        >>> jax.jit(resnet)(jnp.ones((2, 6, 6, 3))).shape  # the NTK of x with itself
        (2, 2)
    """
    _check_layers(layers, "serial")
    return KernelFn(layers)
