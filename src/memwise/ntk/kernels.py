"""Infinite-width NNGP and NTK kernels of conv, pooling, residual and dense networks.

A network of ``Dense``/``Conv`` layers whose widths go to infinity under the NTK
parameterization (Jacot et al. 2018) is a Gaussian process whose covariance (the NNGP
kernel) and neural tangent kernel follow a recursion over layers (Lee et al. 2018,
"Deep neural networks as Gaussian processes"; Arora et al. 2019, "On exact computation
with an infinitely wide neural net"; Novak et al. 2019, "Bayesian deep convolutional
networks with many channels are Gaussian processes"; Novak et al. 2020,
neural-tangents). This package implements that recursion directly and reproduces
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

This module is the kernel function (:class:`KernelFn`, :func:`serial`) and the namespace
users import layers from; the layers live by concept: :mod:`memwise.ntk.linear` (linear
and pooling layers), :mod:`memwise.ntk.elementwise` (activations, ``LayerNorm``),
:mod:`memwise.ntk.branching` (``FanOut``, ``parallel``, ``FanInSum``), with the walk over
layers in ``memwise.ntk._walk`` and the covariance state, the layer protocol and the
registry of public layers in ``memwise.ntk._covariance``. Every layer decorated with
``register`` there is exported here (``__all__`` is generated from the registry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from memwise._dtypes import accumulation_dtype
from memwise.ntk._covariance import (
    _LAYERS,
    Layer,
    _check_layers,
    _is_zero_ntk,
    _Layout,
    register,
)
from memwise.ntk._walk import _Flow, _Walk

# Re-exported (``X as X``): memwise.ntk.kernels is where users import every layer from.
from memwise.ntk.branching import FanInSum as FanInSum
from memwise.ntk.branching import FanOut as FanOut
from memwise.ntk.branching import parallel as parallel
from memwise.ntk.elementwise import ABRelu as ABRelu
from memwise.ntk.elementwise import Abs as Abs
from memwise.ntk.elementwise import Erf as Erf
from memwise.ntk.elementwise import Gelu as Gelu
from memwise.ntk.elementwise import LayerNorm as LayerNorm
from memwise.ntk.elementwise import LeakyRelu as LeakyRelu
from memwise.ntk.elementwise import Relu as Relu
from memwise.ntk.elementwise import Sigmoid_like as Sigmoid_like
from memwise.ntk.elementwise import Sin as Sin
from memwise.ntk.linear import AvgPool as AvgPool
from memwise.ntk.linear import Conv as Conv
from memwise.ntk.linear import Dense as Dense
from memwise.ntk.linear import Flatten as Flatten
from memwise.ntk.linear import GlobalAvgPool as GlobalAvgPool
from memwise.ntk.linear import Identity as Identity

_GETS = ("nngp", "ntk")


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
        >>> # Relu reads each input's variance
        >>> p.x.shape, [v.shape for v in p.variances]
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
        >>> p1 = kernel_fn.prepare(jnp.ones((3, 2)))
        >>> p2 = kernel_fn.prepare(jnp.ones((4, 2)))
        >>> # as kernel_fn(x1, x2), each variance computed once
        >>> kernel_fn.cross(p1, p2).shape
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
        _, walk = self._run(_Flow(cov, None, layout, x.shape[-1]), None)
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
        flow, _ = self._run(_Flow(nngp, ntk, layout, x1.shape[-1]), variances)
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


@register
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
        >>> kernel_fn = k.serial(
        ...     k.Dense(W_std=1.5, b_std=0.05), k.Relu(), k.Dense())
        >>> nngp = jax.jit(lambda x1, x2: kernel_fn(x1, x2, get="nngp"))
        >>> nngp(jnp.ones((3, 5)), jnp.ones((2, 5))).shape
        (3, 2)
        >>> block = k.serial(
        ...     k.FanOut(2),
        ...     k.parallel(k.Identity(), k.serial(k.Relu(), k.Conv((3, 3)))),
        ...     k.FanInSum())
        >>> resnet = k.serial(
        ...     k.Conv((3, 3)), block, k.Relu(), k.GlobalAvgPool(), k.Dense())
        >>> # the NTK of x with itself
        >>> jax.jit(resnet)(jnp.ones((2, 6, 6, 3))).shape
        (2, 2)
    """
    _check_layers(layers, "serial")
    return KernelFn(layers)


# The namespace: every registered layer (each module's @register) and the kernel types.
__all__ = sorted([*_LAYERS, "KernelFn", "Layer", "Prepared"])
