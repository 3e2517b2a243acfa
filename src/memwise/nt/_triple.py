"""The ``(init_fn, apply_fn, kernel_fn)`` triple of :mod:`memwise.nt.stax`, and its checks.

neural-tangents' layers (Novak et al. 2020) are triples: the finite network's
initialisation and application, in ``jax.example_libraries.stax``'s convention, and the
infinite-width kernel function. Here the kernel function wraps a
:class:`memwise.ntk.kernels.KernelFn` behind neural-tangents' call signature
(``kernel_fn(x1, x2=None, get=None)``); the checks turn neural-tangents options that
memwise lacks into ``NotImplementedError`` naming them. The combinators (``serial``,
``parallel``, ``FanOut``, ``FanInSum``) compose triples as ``jax.example_libraries.stax``
does (``serial`` params a list, split keys per layer) and their kernels as
:func:`memwise.ntk.kernels.serial` does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from memwise._arguments import positive_int
from memwise.ntk import kernels as _k
from memwise.ntk._covariance import _is_zero_ntk, _State
from memwise.ntk.branching import _ConcatChannels

__all__ = ["FanInConcat", "FanInSum", "FanOut", "KernelFn", "Layer", "parallel", "serial"]


@functools.cache
def named_tuple(name: str, fields: tuple[str, ...]) -> type:
    """One namedtuple class per (name, fields): results of two calls have the same type
    (and the same pytree structure, so jit and tree maps treat them alike)."""
    return collections.namedtuple(name, fields)


class KernelFn:
    """neural-tangents' ``kernel_fn(x1, x2=None, get=None)`` over a memwise kernel.

    ``kernel`` is the :class:`memwise.ntk.kernels.KernelFn` (tile it with
    :func:`memwise.ntk.kernel_regression`, :func:`memwise.ntk.kip_loss`, ...).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> _, _, kernel_fn = stax.serial(
        ...     stax.Dense(512), stax.Relu(), stax.Dense(1))
        >>> kernel_fn(jnp.ones((2, 3)), None, "nngp").shape
        (2, 2)
        >>> kernel_fn(jnp.ones((2, 3)), get=("ntk", "nngp"))._fields
        ('ntk', 'nngp')
    """

    def __init__(self, kernel: _k.KernelFn):
        self.kernel = kernel

    def __repr__(self) -> str:
        return f"KernelFn({self.kernel!r})"

    def __call__(
        self,
        x1: jax.Array,
        x2: jax.Array | None = None,
        get: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        if kwargs:
            raise NotImplementedError(
                f"kernel_fn keyword arguments {sorted(kwargs)} (neural-tangents' masking, "
                "dropout and aggregation inputs) are not supported by memwise.nt"
            )
        if get is None:
            raise NotImplementedError(
                "kernel_fn(..., get=None) returns neural-tangents' Kernel object, which "
                "memwise.nt does not build; pass get='nngp', get='ntk' or ('nngp', 'ntk')"
            )
        gets = (get,) if isinstance(get, str) else tuple(get)
        for g in gets:
            if g in ("cov1", "cov2", "shape1", "shape2", "is_gaussian", "x1_is_x2"):
                raise NotImplementedError(
                    f"get={g!r} (a field of neural-tangents' Kernel object) is not supported "
                    "by memwise.nt; pass 'nngp' and/or 'ntk'"
                )
        for name, x in (("x1", x1), ("x2", x2)):
            if isinstance(x, (tuple, list, dict)):
                raise NotImplementedError(
                    f"kernel_fn({name}=a {type(x).__name__} of inputs): several inputs (a "
                    "network starting with stax.parallel) are not supported by memwise.nt; "
                    "pass one array per input set"
                )
        try:
            values = self.kernel(x1, x2, get=gets)
        except ValueError as e:
            if "branches; join them" not in str(e):
                raise
            raise NotImplementedError(
                "kernel_fn of a network ending in several branches (neural-tangents returns "
                "a list of kernels) is not supported by memwise.nt; compute each branch's "
                "network on its own, or join them with stax.FanInSum()"
            ) from e
        if values[0].ndim > 2:
            raise NotImplementedError(
                f"kernel_fn of a network whose output keeps its pixel axes (kernel shape "
                f"{values[0].shape}): neural-tangents returns the pixel-by-pixel covariance "
                "(n1, n2, H, H, W, W), which memwise.nt does not build; end the network with "
                "stax.Flatten() or stax.GlobalAvgPool()"
            )
        if isinstance(get, str):
            return values[0]
        return named_tuple("Kernel", gets)(*values)


class Layer(NamedTuple):
    """A layer: ``(init_fn, apply_fn, kernel_fn)``, unpacked as neural-tangents' triples."""

    init_fn: Callable[..., Any]
    apply_fn: Callable[..., Any]
    kernel_fn: KernelFn


def _layer(init_fn: Callable, apply_fn: Callable, kernel: _k.Layer) -> Layer:
    return Layer(init_fn, apply_fn, KernelFn(_k.serial(kernel)))


@dataclasses.dataclass(frozen=True)
class _Channels(_k.Layer):
    """``layer`` (a Dense or Conv kernel) with the finite layer's channel count after it,
    which neural-tangents' ``FanInConcat`` weighs the branches by."""

    layer: _k.Layer
    width: int

    def __repr__(self) -> str:
        return repr(self.layer)

    def _leaves(self):
        yield from self.layer._leaves()

    def _walk(self, walk, flow):
        return self.layer._walk(walk, flow)._replace(width=self.width)


@dataclasses.dataclass(frozen=True)
class _Flattened(_k.Layer):
    """``Flatten`` with the finite network's channel count after it: the channels times
    the pixels, which a standard-parameterized layer after it reads as its fan-in."""

    layer: _k.Layer

    def __repr__(self) -> str:
        return repr(self.layer)

    def _leaves(self):
        yield from self.layer._leaves()

    def _walk(self, walk, flow):
        pixels = flow.layout.pixels(flow.nngp)
        width = None if flow.width is None else flow.width * math.prod(pixels)
        return self.layer._walk(walk, flow)._replace(width=width)


def flattened(init_fn: Callable, apply_fn: Callable) -> Layer:
    """neural-tangents' ``Flatten`` (see :class:`_Flattened`)."""
    return _layer(init_fn, apply_fn, _Flattened(_k.Flatten()))


def sized(init_fn: Callable, apply_fn: Callable, kernel: _k.Layer, width: int) -> Layer:
    """A layer whose output has ``width`` channels (Dense, Conv)."""
    return _layer(init_fn, apply_fn, _Channels(kernel, width))


def _unsupported(layer: str, option: str, value: Any, use: str) -> NotImplementedError:
    return NotImplementedError(
        f"stax.{layer}({option}={value!r}) is not supported by memwise.nt; {use}"
    )


def _parameterization(layer: str, parameterization: Any, s: Any) -> tuple[bool, int, int]:
    """``(standard, s_in, s_out)`` of a Dense or Conv layer, checked."""
    if not isinstance(parameterization, str) or parameterization.lower() not in ("ntk", "standard"):
        raise ValueError(
            f"stax.{layer} parameterization must be 'ntk' or 'standard', got {parameterization!r}"
        )
    if (
        not isinstance(s, (tuple, list))
        or len(s) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in s)
    ):
        raise ValueError(
            f"stax.{layer} s must be two positive ints (the input and output width "
            f"scalings of the standard parameterization), got {s!r}"
        )
    return parameterization.lower() == "standard", s[0], s[1]


@dataclasses.dataclass(frozen=True)
class _Standard(_k.Layer):
    """``layer`` (a Dense or Conv kernel) in the standard parameterization.

    The finite layer draws its weights with variance ``W_std^2 / (fan_in / s_in)``
    (Sohl-Dickstein et al. 2020, "On the infinite width limit of neural networks with a
    standard parameterization"), so its NNGP is the NTK parameterization's and the
    gradient with respect to its weights scales with the input width: ``ntk' = (fan_in /
    s_in) unit(nngp) + W_std^2 unit(ntk)``, plus 1 with a bias, where ``unit`` is the
    layer's window mean and ``fan_in`` the input channels times the window size, as in
    neural-tangents. It reads the input's channel count on the way.
    """

    layer: _k.Dense | _k.Conv
    s_in: int
    window_size: int = 1

    def __repr__(self) -> str:
        return f"{self.layer!r} (standard parameterization)"

    def _leaves(self):
        yield from self.layer._leaves()

    def _walk(self, walk, flow):
        if flow.width is None:
            raise NotImplementedError(
                f"{self!r} after branches of different widths: the standard "
                "parameterization needs its input's channel count; use "
                "parameterization='ntk'"
            )
        fan_in = flow.width * self.window_size / self.s_in
        return walk.step(_StandardAt(self.layer, fan_in), flow)


@dataclasses.dataclass(frozen=True)
class _StandardAt(_k.Layer):
    """:class:`_Standard` at an input of known width: ``fan_in / s_in`` fixed."""

    layer: _k.Dense | _k.Conv
    fan_in: float
    affine = True

    def out_layout(self, layout):
        return self.layer.out_layout(layout)

    def out_width(self, width):
        return None

    def apply(self, state, layout):
        layer = self.layer
        unit = dataclasses.replace(layer, W_std=1.0, b_std=None)

        def mean(a):
            return unit.apply(_State(a, None, None, None), layout)[0]

        nngp_mean = mean(state.nngp)
        nngp = layer.W_std**2 * nngp_mean
        if layer.b_std is not None:
            nngp = nngp + layer.b_std**2
        if state.ntk is None:
            return nngp, None
        ntk = self.fan_in * nngp_mean
        if not _is_zero_ntk(state.ntk):
            ntk = ntk + layer.W_std**2 * mean(state.ntk)
        if layer.b_std is not None:
            ntk = ntk + 1.0
        return nngp, ntk


def _check_default_axes(layer: str, batch_axis: int, channel_axis: int) -> None:
    if batch_axis != 0 or channel_axis != -1:
        raise _unsupported(
            layer,
            "batch_axis, channel_axis",
            (batch_axis, channel_axis),
            "put the batch first and the channels last (NHWC), the defaults",
        )


def _check_width(layer: str, arg: str, value: Any) -> None:
    positive_int(value, f"stax.{layer} {arg}", accepts=" (the width)")


def _shape_only(rng, input_shape):
    return input_shape, ()


def _elementwise(fn: Callable[[jax.Array], jax.Array], kernel: _k.Layer) -> Layer:
    return _layer(_shape_only, lambda params, inputs, **kwargs: fn(inputs), kernel)


# ----------------------------------------------------------------------------------------
# Combinators


def _check_layers(layers: Sequence[Any], where: str) -> None:
    for layer in layers:
        if not isinstance(layer, Layer):
            raise TypeError(
                f"stax.{where}() takes layers of memwise.nt.stax ((init_fn, apply_fn, "
                f"kernel_fn) triples built by it), got {layer!r}"
            )


def serial(*layers: Layer) -> Layer:
    """Layers in order, as ``stax.serial`` (params: a list, one entry per layer).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> init_fn, apply_fn, kernel_fn = stax.serial(
        ...     stax.Dense(16), stax.Relu(), stax.Dense(1))
        >>> shape, params = init_fn(jax.random.PRNGKey(0), (-1, 3))
        >>> shape, len(params), apply_fn(params, jnp.ones((2, 3))).shape
        ((-1, 1), 3, (2, 1))
    """
    _check_layers(layers, "serial")

    def init_fn(rng, input_shape):
        params = []
        for layer in layers:
            rng, layer_rng = random.split(rng)
            input_shape, param = layer.init_fn(layer_rng, input_shape)
            params.append(param)
        return input_shape, params

    def apply_fn(params, inputs, **kwargs):
        for layer, param in zip(layers, params):
            inputs = layer.apply_fn(param, inputs, **kwargs)
        return inputs

    kernel = _k.serial(*(layer.kernel_fn.kernel for layer in layers))
    return Layer(init_fn, apply_fn, KernelFn(kernel))


def parallel(*layers: Layer) -> Layer:
    """``layers[i]`` on branch ``i`` (after :func:`FanOut`), as ``stax.parallel``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> block = stax.serial(
        ...     stax.FanOut(2), stax.parallel(stax.Identity(), stax.Relu()),
        ...     stax.FanInSum())
        >>> block.apply_fn(block.init_fn(jax.random.PRNGKey(0), (1, 2))[1],
        ...                jnp.array([[-1.0, 2.0]]))
        Array([[-1.,  4.]], dtype=float32)
    """
    _check_layers(layers, "parallel")

    def init_fn(rng, input_shape):
        rngs = random.split(rng, len(layers))
        pairs = [layer.init_fn(r, s) for layer, r, s in zip(layers, rngs, input_shape)]
        return [shape for shape, _ in pairs], tuple(param for _, param in pairs)

    def apply_fn(params, inputs, **kwargs):
        return [layer.apply_fn(p, x, **kwargs) for layer, p, x in zip(layers, params, inputs)]

    kernel = _k.parallel(*(layer.kernel_fn.kernel for layer in layers))
    return Layer(init_fn, apply_fn, KernelFn(_k.serial(kernel)))


def FanOut(num: int) -> Layer:  # noqa: N802
    """``num`` copies of the input, as ``stax.FanOut``."""
    kernel = _k.FanOut(num)

    def init_fn(rng, input_shape):
        return [input_shape] * num, ()

    return _layer(init_fn, lambda params, inputs, **kwargs: [inputs] * num, kernel)


def FanInSum() -> Layer:  # noqa: N802
    """The sum of the branches, as ``stax.FanInSum``."""

    def init_fn(rng, input_shape):
        return input_shape[0], ()

    def apply_fn(params, inputs, **kwargs):
        return sum(inputs[1:], inputs[0])

    return _layer(init_fn, apply_fn, _k.FanInSum())


def FanInConcat(axis: int = -1) -> Layer:  # noqa: N802
    """The branches concatenated along ``axis``, as ``stax.FanInConcat``.

    The kernel is neural-tangents': along the channel axis, the branches' kernels
    averaged with weights their channel counts (equal weights when the counts are
    equal). The result is not Gaussian, so an affine layer (``Dense``, ``Conv``) must
    come before the next nonlinearity (a ``ValueError`` otherwise, as in
    neural-tangents). The finite network concatenates along any axis; the kernel of a
    concatenation along the batch or pixel axes raises ``NotImplementedError``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.nt import stax
        >>> _, _, kernel_fn = stax.serial(
        ...     stax.FanOut(2),
        ...     stax.parallel(stax.Dense(64), stax.Dense(192, W_std=2.0)),
        ...     stax.FanInConcat())
        >>> # (64 * 1 + 192 * 4) / 256
        >>> float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0])
        3.25
    """
    if isinstance(axis, bool) or not hasattr(axis, "__index__"):
        raise TypeError(f"stax.FanInConcat axis must be an int, got {axis!r}")
    axis = operator.index(axis)

    def init_fn(rng, input_shape):
        ax = axis % len(input_shape[0])
        size = sum(shape[ax] for shape in input_shape)
        first = tuple(input_shape[0])
        return first[:ax] + (size,) + first[ax + 1 :], ()

    def apply_fn(params, inputs, **kwargs):
        return jnp.concatenate(inputs, axis)

    return _layer(init_fn, apply_fn, _ConcatChannels(axis))
