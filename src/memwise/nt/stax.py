"""neural-tangents' ``stax``: layers as ``(init_fn, apply_fn, kernel_fn)`` triples.

Each constructor takes neural-tangents 0.6.5's arguments with its defaults and returns a
:class:`Layer`, a ``(init_fn, apply_fn, kernel_fn)`` tuple:

* ``init_fn(rng, input_shape) -> (output_shape, params)`` and ``apply_fn(params, inputs,
  **kwargs)``: the finite network, in neural-tangents' parameter layout (``Dense``:
  ``(W, b)`` with ``W`` (in, out) and ``b`` of the input's rank with ``out`` on the
  channel axis, or ``None`` without a bias; ``Conv``: ``W`` HWIO and ``b`` (1, ..., 1,
  out); weights and biases standard normal, scaled in ``apply_fn`` by ``W_std /
  sqrt(fan_in)`` and ``b_std``; under ``parameterization="standard"`` scaled at
  initialisation instead, with neural-tangents' width scalings ``s``), as
  ``jax.example_libraries.stax`` combines them (``serial`` params a list, ``parallel``
  a tuple);
* ``kernel_fn(x1, x2=None, get=...)``: the infinite-width kernel, computed by
  :mod:`memwise.ntk.kernels` (``get`` a string gives the array, a tuple a namedtuple of
  them in that order, as neural-tangents).

The kernels follow the recursion of Lee et al. 2018, Arora et al. 2019 and Novak et al.
2019/2020 (see :mod:`memwise.ntk.kernels`); the finite networks converge to them as the
widths grow (Jacot et al. 2018), which the tests check by Monte Carlo. Defaults that
differ from memwise's own layers: ``Conv`` pads ``"VALID"`` (``memwise.ntk.kernels.Conv``:
``"SAME"``). Layers and options of neural-tangents that are not here (``FanInProd``,
``"CIRCULAR"`` padding, ``FanInConcat`` along a batch or pixel axis, ...) raise
``NotImplementedError`` naming them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax, random
from jax.scipy.special import erf

from memwise.nt._triple import FanInConcat as FanInConcat
from memwise.nt._triple import FanInSum as FanInSum
from memwise.nt._triple import FanOut as FanOut
from memwise.nt._triple import (
    KernelFn,
    Layer,
    _check_default_axes,
    _check_width,
    _elementwise,
    _layer,
    _parameterization,
    _shape_only,
    _Standard,
    _unsupported,
    flattened,
    sized,
)
from memwise.nt._triple import parallel as parallel
from memwise.nt._triple import serial as serial
from memwise.ntk import kernels as _k

__all__ = [
    "ABRelu",
    "Abs",
    "AvgPool",
    "Conv",
    "Cos",
    "Dense",
    "Erf",
    "FanInConcat",
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
    "Relu",
    "Sigmoid_like",
    "Sin",
    "parallel",
    "serial",
]

_SIGMOID_LIKE_SCALE = 2.4020563531719796  # neural-tangents' Sigmoid_like: erf(x / this)


# ----------------------------------------------------------------------------------------
# Linear layers


def _scales(
    kernel: _k.Dense | _k.Conv, is_standard: bool, fan_in: int, s_in: int
) -> tuple[float, float, float, float]:
    """``(W, b)`` scales at initialisation, then ``(W, b)`` scales in ``apply_fn``.

    The NTK parameterization draws standard normals and scales them when applied; the
    standard one scales them when drawn (neural-tangents' ``s[0]``: the input's width
    scaling).
    """
    b_std = 0.0 if kernel.b_std is None else kernel.b_std
    if is_standard:
        return kernel.W_std / math.sqrt(fan_in / s_in), b_std, 1 / math.sqrt(s_in), 1.0
    return 1.0, 1.0, kernel.W_std / math.sqrt(fan_in), b_std


def Dense(  # noqa: N802 (neural-tangents' layer names)
    out_dim: int,
    W_std: float = 1.0,  # noqa: N803
    b_std: float | None = None,
    batch_axis: int = 0,
    channel_axis: int = -1,
    parameterization: str = "ntk",
    s: tuple[int, int] = (1, 1),
) -> Layer:
    """A dense layer on the channel (last) axis, as ``stax.Dense``.

    ``parameterization="standard"`` draws ``W`` with standard deviation ``W_std /
    sqrt(in_dim / s[0])`` and ``b`` with ``b_std`` (``out_dim * s[1]`` outputs) and
    applies ``x W / sqrt(s[0]) + b``, as neural-tangents; its kernel reads the input's
    channel count.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> init_fn, apply_fn, kernel_fn = stax.Dense(4, W_std=2.0, b_std=0.5)
        >>> shape, (W, b) = init_fn(jax.random.PRNGKey(0), (-1, 3))
        >>> shape, W.shape, b.shape, apply_fn((W, b), jnp.ones((2, 3))).shape
        ((-1, 4), (3, 4), (1, 4), (2, 4))
    """
    is_standard, s_in, s_out = _parameterization("Dense", parameterization, s)
    _check_default_axes("Dense", batch_axis, channel_axis)
    _check_width("Dense", "out_dim", out_dim)
    kernel = _k.Dense(W_std=W_std, b_std=b_std)
    width = out_dim * s_out if is_standard else out_dim

    def init_fn(rng, input_shape):
        rng_w, rng_b = random.split(rng)
        w = random.normal(rng_w, (input_shape[-1], width))
        b = (
            None
            if b_std is None
            else random.normal(rng_b, (1,) * (len(input_shape) - 1) + (width,))
        )
        w_scale, b_scale, _, _ = _scales(kernel, is_standard, input_shape[-1], s_in)
        return tuple(input_shape[:-1]) + (width,), (w * w_scale, None if b is None else b * b_scale)

    def apply_fn(params, inputs, **kwargs):
        w, b = params
        _, _, w_scale, b_scale = _scales(kernel, is_standard, inputs.shape[-1], s_in)
        outputs = w_scale * (inputs @ w)
        return outputs if b is None else outputs + b_scale * b

    return sized(init_fn, apply_fn, _Standard(kernel, s_in) if is_standard else kernel, width)


def _dimension_numbers(n_spatial: int) -> lax.ConvDimensionNumbers:
    """NHWC inputs, HWIO weights, for ``n_spatial`` pixel axes."""
    spatial = tuple(range(1, n_spatial + 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, n_spatial + 1, *spatial),
        rhs_spec=(n_spatial + 1, n_spatial, *range(n_spatial)),
        out_spec=(0, n_spatial + 1, *spatial),
    )


def _output_shape(fn: Callable, input_shape: Sequence[int], *others: Any) -> tuple[int, ...]:
    """``fn``'s output shape for an input of ``input_shape`` (a -1 batch kept as -1)."""
    batch = input_shape[0]
    concrete = (1,) + tuple(input_shape[1:])
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct(concrete, jnp.float32), *others).shape
    return (batch,) + tuple(out[1:])


def Conv(  # noqa: N802
    out_chan: int,
    filter_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
    W_std: float = 1.0,  # noqa: N803
    b_std: float | None = None,
    dimension_numbers: Any = None,
    parameterization: str = "ntk",
    s: tuple[int, int] = (1, 1),
) -> Layer:
    """A convolution over the pixel axes of NHWC inputs, as ``stax.Conv`` (``"VALID"``).

    ``parameterization="standard"`` as :func:`Dense`, with ``fan_in`` the input channels
    times the window size.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> init_fn, apply_fn, kernel_fn = stax.Conv(8, (3, 3))  # pads "VALID"
        >>> shape, (W, b) = init_fn(jax.random.PRNGKey(0), (2, 6, 6, 3))
        >>> shape, W.shape, b
        ((2, 4, 4, 8), (3, 3, 3, 8), None)
    """
    is_standard, s_in, s_out = _parameterization("Conv", parameterization, s)
    _check_width("Conv", "out_chan", out_chan)
    width = out_chan * s_out if is_standard else out_chan
    if padding == "CIRCULAR":
        raise _unsupported("Conv", "padding", padding, "use 'VALID' or 'SAME'")
    kernel = _k.Conv(
        filter_shape,  # type: ignore[arg-type]  # checked (any sequence) and stored as a tuple
        strides=strides,  # type: ignore[arg-type]
        padding=padding,
        W_std=W_std,
        b_std=b_std,
    )
    window, window_strides = kernel.filter_shape, kernel.strides
    assert window_strides is not None
    numbers = _dimension_numbers(len(window))
    if (
        dimension_numbers is not None
        and lax.conv_dimension_numbers(
            (1,) * (len(window) + 2), (1,) * (len(window) + 2), dimension_numbers
        )
        != numbers
    ):
        raise _unsupported(
            "Conv", "dimension_numbers", dimension_numbers, "use NHWC inputs and HWIO weights"
        )

    def conv(inputs, w):
        return lax.conv_general_dilated(
            inputs, w, window_strides, padding, dimension_numbers=numbers
        )

    def init_fn(rng, input_shape):
        rng_w, rng_b = random.split(rng)
        w_shape = window + (input_shape[-1], width)
        w = random.normal(rng_w, w_shape)
        b = None if b_std is None else random.normal(rng_b, (1,) * (len(window) + 1) + (width,))
        fan_in = input_shape[-1] * math.prod(window)
        w_scale, b_scale, _, _ = _scales(kernel, is_standard, fan_in, s_in)
        shape = _output_shape(conv, input_shape, jax.ShapeDtypeStruct(w_shape, jnp.float32))
        return shape, (w * w_scale, None if b is None else b * b_scale)

    def apply_fn(params, inputs, **kwargs):
        w, b = params
        fan_in = inputs.shape[-1] * math.prod(window)
        _, _, w_scale, b_scale = _scales(kernel, is_standard, fan_in, s_in)
        outputs = w_scale * conv(inputs, w.astype(inputs.dtype))
        return outputs if b is None else outputs + b_scale * b

    standard_kernel = _Standard(kernel, s_in, math.prod(window)) if is_standard else kernel
    return sized(init_fn, apply_fn, standard_kernel, width)


def AvgPool(  # noqa: N802
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
    normalize_edges: bool = False,
    batch_axis: int = 0,
    channel_axis: int = -1,
) -> Layer:
    """Average pooling over pixel windows, as ``stax.AvgPool`` (padded zeros counted).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> init_fn, apply_fn, _ = stax.AvgPool((2, 2), strides=(2, 2))
        >>> init_fn(jax.random.PRNGKey(0), (1, 4, 4, 3))[0]
        (1, 2, 2, 3)
    """
    if normalize_edges:
        raise _unsupported("AvgPool", "normalize_edges", normalize_edges, "use False (the default)")
    _check_default_axes("AvgPool", batch_axis, channel_axis)
    kernel = _k.AvgPool(
        window_shape,  # type: ignore[arg-type]  # checked (any sequence) and stored as a tuple
        strides=strides,  # type: ignore[arg-type]
        padding=padding,
    )
    window, window_strides = kernel.window_shape, kernel.strides
    assert window_strides is not None

    def pool(inputs):
        total = lax.reduce_window(
            inputs, 0.0, lax.add, (1, *window, 1), (1, *window_strides, 1), padding
        )
        return total / math.prod(window)

    def init_fn(rng, input_shape):
        return _output_shape(pool, input_shape), ()

    return _layer(init_fn, lambda params, inputs, **kwargs: pool(inputs), kernel)


def GlobalAvgPool(batch_axis: int = 0, channel_axis: int = -1) -> Layer:  # noqa: N802
    """The mean over the pixel axes, as ``stax.GlobalAvgPool``.

    Example::

        >>> import jax
        >>> from memwise.nt import stax
        >>> stax.GlobalAvgPool().init_fn(jax.random.PRNGKey(0), (2, 5, 5, 3))
        ((2, 3), ())
    """
    _check_default_axes("GlobalAvgPool", batch_axis, channel_axis)

    def init_fn(rng, input_shape):
        return (input_shape[0], input_shape[-1]), ()

    def apply_fn(params, inputs, **kwargs):
        return jnp.mean(inputs, axis=tuple(range(1, inputs.ndim - 1)))

    return _layer(init_fn, apply_fn, _k.GlobalAvgPool())


def Flatten(batch_axis: int = 0, batch_axis_out: int = 0) -> Layer:  # noqa: N802
    """Flatten all but the batch axis, as ``stax.Flatten``.

    Example::

        >>> import jax
        >>> from memwise.nt import stax
        >>> stax.Flatten().init_fn(jax.random.PRNGKey(0), (2, 5, 5, 3))
        ((2, 75), ())
    """
    if batch_axis != 0 or batch_axis_out != 0:
        raise _unsupported(
            "Flatten", "batch_axis, batch_axis_out", (batch_axis, batch_axis_out), "use 0, 0"
        )

    def init_fn(rng, input_shape):
        return (input_shape[0], math.prod(input_shape[1:])), ()

    def apply_fn(params, inputs, **kwargs):
        return inputs.reshape(inputs.shape[0], -1)

    return flattened(init_fn, apply_fn)


def Identity() -> Layer:  # noqa: N802
    """The identity, as ``stax.Identity``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.Identity().apply_fn((), jnp.ones(2))
        Array([1., 1.], dtype=float32)
    """
    return _layer(_shape_only, lambda params, inputs, **kwargs: inputs, _k.Identity())


# ----------------------------------------------------------------------------------------
# Activations and LayerNorm: parameter-free, shape-preserving


def ABRelu(a: float, b: float, do_stabilize: bool = False) -> Layer:  # noqa: N802
    """``a min(x, 0) + b max(x, 0)``, as ``stax.ABRelu``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.ABRelu(-0.5, 2.0).apply_fn((), jnp.array([-2.0, 3.0]))
        Array([1., 6.], dtype=float32)
    """
    kernel = _k.ABRelu(a, b)
    return _elementwise(
        lambda x: kernel.a * jnp.minimum(x, 0) + kernel.b * jnp.maximum(x, 0), kernel
    )


def Relu(do_stabilize: bool = False) -> Layer:  # noqa: N802
    """``max(x, 0)``, as ``stax.Relu`` (``do_stabilize`` has no effect on the values)."""
    return ABRelu(0.0, 1.0)


def LeakyRelu(alpha: float, do_stabilize: bool = False) -> Layer:  # noqa: N802
    """``alpha min(x, 0) + max(x, 0)``, as ``stax.LeakyRelu``."""
    _k.LeakyRelu(alpha)  # the argument check names LeakyRelu
    return ABRelu(alpha, 1.0)


def Abs(do_stabilize: bool = False) -> Layer:  # noqa: N802
    """``|x|``, as ``stax.Abs``."""
    return ABRelu(-1.0, 1.0)


def Erf(a: float = 1.0, b: float = 1.0, c: float = 0.0) -> Layer:  # noqa: N802
    """``a erf(b x) + c``, as ``stax.Erf``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.Erf(c=1.0).apply_fn((), jnp.zeros(1))
        Array([1.], dtype=float32)
    """
    kernel = _k.Erf(a, b, c)
    return _elementwise(lambda x: kernel.a * erf(kernel.b * x) + kernel.c, kernel)


def Sigmoid_like() -> Layer:  # noqa: N802
    """``0.5 erf(x / 2.4020563531719796) + 0.5``, as ``stax.Sigmoid_like``."""
    return Erf(a=0.5, b=1 / _SIGMOID_LIKE_SCALE, c=0.5)


def Gelu(approximate: bool = False) -> Layer:  # noqa: N802
    """``x Phi(x)``, as ``stax.Gelu`` (the exact form).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.Gelu().apply_fn((), jnp.array([0.0, 1.0]))
        Array([0.       , 0.8413447], dtype=float32)
    """
    if approximate:
        raise _unsupported("Gelu", "approximate", approximate, "use approximate=False")
    return _elementwise(lambda x: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))), _k.Gelu())


def Sin(a: float = 1.0, b: float = 1.0, c: float = 0.0) -> Layer:  # noqa: N802
    """``a sin(b x + c)``, as ``stax.Sin``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.Sin(a=2.0).apply_fn((), jnp.zeros(1))
        Array([0.], dtype=float32)
    """
    kernel = _k.Sin(a, b, c)
    return _elementwise(lambda x: kernel.a * jnp.sin(kernel.b * x + kernel.c), kernel)


def Cos(a: float = 1.0, b: float = 1.0, c: float = 0.0) -> Layer:  # noqa: N802
    """``a cos(b x + c)``, as ``stax.Cos``: ``Sin(a, b, c + pi / 2)``."""
    _k.Sin(a, b, c)  # the argument check, before c is shifted
    return Sin(a, b, c + math.pi / 2)


def LayerNorm(  # noqa: N802
    axis: int | Sequence[int] = -1,
    eps: float = 1e-12,
    batch_axis: int = 0,
    channel_axis: int = -1,
) -> Layer:
    """Normalisation over the channel axis, as ``stax.LayerNorm(axis=-1)``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> stax.LayerNorm().apply_fn((), jnp.array([[1.0, 3.0]]))
        Array([[-1.,  1.]], dtype=float32)
    """
    if axis not in (-1, (-1,), [-1]):
        raise _unsupported("LayerNorm", "axis", axis, "normalise over the channels, axis=-1")
    _check_default_axes("LayerNorm", batch_axis, channel_axis)
    kernel = _k.LayerNorm(eps=eps)

    def normalize(x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        return (x - mean) / jnp.sqrt(kernel.eps + var)

    return _elementwise(normalize, kernel)


# ----------------------------------------------------------------------------------------
# neural-tangents layers that memwise does not implement

_NOT_IMPLEMENTED = (
    "Aggregate",
    "AggregateImplementation",
    "AttentionMechanism",
    "Bool",
    "Diagonal",
    "MaskedArray",
    "Padding",
    "PositionalEmbedding",
    "Slice",
    "layer",
    "requires",
    "supports_masking",
    "BatchNorm",
    "Dropout",
    "DotGeneral",
    "ElementwiseNumerical",
    "Exp",
    "ExpNormalized",
    "FanInProd",
    "Gabor",
    "Gaussian",
    "GeneralConv",
    "GlobalMaxPool",
    "GlobalSelfAttention",
    "GlobalSumPool",
    "Hermite",
    "ImageResize",
    "Index",
    "ConvLocal",
    "ConvTranspose",
    "Monomial",
    "Polynomial",
    "Rbf",
    "RectifiedMonomial",
    "Sign",
    "SumPool",
    "Elementwise",
    "repeat",
    "unmask_fn",
)


def __getattr__(name: str) -> Any:
    if name in _NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"stax.{name} is not supported by memwise.nt (supported: {', '.join(__all__)})"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
