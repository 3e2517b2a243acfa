"""Activations and ``LayerNorm`` of infinite-width networks, in closed form.

The pre-activations of an infinitely wide layer are Gaussian, so an elementwise
nonlinearity phi maps the covariance ``nngp`` of two inputs (variances ``var1``,
``var2``) to ``E[phi(u) phi(v)]`` and, for the NTK, multiplies it by the expected
derivative product ``E[phi'(u) phi'(v)]`` (Jacot et al. 2018; Lee et al. 2019). These
expectations have closed forms for the layers here, which reproduce neural-tangents
0.6.5's ``stax`` values (Novak et al. 2020) to float64 rounding:

* ``ABRelu(a, b)`` (``a min(x, 0) + b max(x, 0)``; ``Relu``, ``LeakyRelu``, ``Abs``): the
  arc-cosine kernel of degree 1 (Cho & Saul 2009, "Kernel methods for deep learning"),
  leaky variant as in Tsuchida, Roosta & Gallagher 2018. The angle is exact for an input
  with itself or its negative (see ``memwise.ntk._covariance._aligned_sin2``: the arc-cosine
  has an infinite slope there, so rounding in the cosine cost half the digits).
* ``Erf(a, b, c)`` (``a erf(b x) + c``; ``Sigmoid_like``): Williams 1997, "Computing with
  infinite networks".
* ``Gelu``: Tsuchida, Pearce, van der Heide, Roosta & Gallagher 2021, "Avoiding kernel
  fixed points" (arXiv:2002.08517).
* ``Sin(a, b, c)`` (``a sin(b x + c)``): the Gaussian expectation of a product of sines
  (the random Fourier features identity of Rahimi & Recht 2007).
* ``LayerNorm``: in the infinite-width limit the feature mean is 0 and the feature
  variance is the input's variance at that pixel, so the covariance is divided by
  ``sqrt((eps + var1)(eps + var2))`` (neural-tangents' ``stax.LayerNorm`` over features).

Hyperparameters are checked when a layer is built (a TypeError/ValueError naming the
layer and the argument) and stored as Python floats.

Each layer acts pixel by pixel (on a per-pixel or a pixel-by-pixel covariance alike) and
reads each input's own variances, which :meth:`memwise.ntk.kernels.KernelFn.prepare`
computes once per input.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from memwise._dtypes import accumulation_dtype
from memwise.ntk._covariance import (
    Layer,
    _aligned_sin2,
    _correlation,
    _real,
    _scale_ntk,
    register,
)

__all__ = [
    "ABRelu",
    "Abs",
    "Erf",
    "Gelu",
    "LayerNorm",
    "LeakyRelu",
    "Relu",
    "Sigmoid_like",
    "Sin",
]


def _set_reals(layer: Layer, name: str, **limits: float | None) -> None:
    """Check each named field of a frozen layer and store it as a Python float."""
    for arg, at_least in limits.items():
        value = _real(name, arg, getattr(layer, arg), at_least=at_least)
        object.__setattr__(layer, arg, value)


@register
@dataclasses.dataclass(frozen=True)
class ABRelu(Layer):
    """``a min(x, 0) + b max(x, 0)``: the arc-cosine kernel of degree 1 (Cho & Saul 2009).

    With ``cos(theta) = nngp / sqrt(var1 var2)``, ``f = (a - b)^2 / (2 pi)`` and
    ``d = (a^2 + b^2) / 2 - f theta``:
    ``nngp' = sqrt(var1 var2) (f sin(theta) + d cos(theta))`` and ``ntk' = d ntk``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.ABRelu(0.5, 2.0))
        >>> # (a^2 + b^2) / 2
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        2.125
    """

    a: float
    b: float
    needs_variances = True
    needs_gaussian = True

    def __post_init__(self):
        _set_reals(self, "ABRelu", a=None, b=None)

    def apply(self, state, layout):
        norm, cos = _correlation(state.nngp, state.var1, state.var2)
        factor = (self.a - self.b) ** 2 / (2 * jnp.pi)
        mean_square = (self.a**2 + self.b**2) / 2
        value, derivative = _arc_cosine(
            cos.astype(accumulation_dtype(cos.dtype)), factor, mean_square
        )
        nngp = norm * value.astype(cos.dtype)
        return nngp, _scale_ntk(state.ntk, derivative.astype(cos.dtype))


# A custom JVP: J'(c) = d(c), the arc-cosine kernel's own derivative identity (the
# derivative of f sin + d c, whose two 1/sin terms cancel), and d'(c) = f / sin. The plain
# derivative of the clip, sqrt and atan2 chain kept more pair-sized residuals for the
# backward pass (+25% for a Myrtle kernel's KIP gradient); this keeps d, which the NTK
# needs anyway, and f / sin.
@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _arc_cosine(cos: jax.Array, factor: float, mean_square: float) -> tuple[jax.Array, jax.Array]:
    """``(J(c), d(c))``: ``J = f sin + d c`` and ``d = (a^2 + b^2) / 2 - f theta``.

    ``sin`` and ``theta`` are exact for aligned pairs (:func:`_aligned_sin2`); there ``d``
    has zero derivative (an input moving with itself stays at angle 0, as
    neural-tangents' ``_arccos``/``_sqrt``).
    """
    sin2 = _aligned_sin2(cos)[1]
    sin = jnp.sqrt(sin2)
    derivative = mean_square - factor * jnp.arctan2(sin, cos)
    # (sin, cos) / radius is the unit vector at that angle: exactly (0, +-1) for aligned
    # pairs (sqrt(c^2) is |c| in floating point), whose c is only +-1 up to rounding.
    radius = jnp.sqrt(sin2 + cos * cos)
    return (factor * sin + derivative * cos) / radius, derivative


@_arc_cosine.defjvp
def _arc_cosine_jvp(factor, mean_square, primals, tangents):
    (cos,), (dcos,) = primals, tangents
    value, derivative = _arc_cosine(cos, factor, mean_square)
    sin = jnp.sqrt(_aligned_sin2(cos)[1])
    positive = sin > 0
    curvature = jnp.where(positive, factor / jnp.where(positive, sin, 1.0), 0.0)
    return (value, derivative), (derivative * dcos, curvature * dcos)


@register
def Relu() -> ABRelu:  # noqa: N802 (neural-tangents' layer names)
    """ReLU, ``max(x, 0)``: ``ABRelu(0, 1)``.

    ``nngp' = sqrt(var1 var2) (sin theta + (pi - theta) cos theta) / (2 pi)``,
    ``ntk' = ntk (pi - theta) / (2 pi)``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Relu())
        >>> # E[relu(z)^2]
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.5
    """
    return ABRelu(0.0, 1.0)


@register
def LeakyRelu(alpha: float) -> ABRelu:  # noqa: N802
    """Leaky ReLU, ``alpha min(x, 0) + max(x, 0)``: ``ABRelu(alpha, 1)``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.LeakyRelu(0.1))
        >>> # (0.1^2 + 1) / 2
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.505
    """
    return ABRelu(_real("LeakyRelu", "alpha", alpha), 1.0)


@register
def Abs() -> ABRelu:  # noqa: N802
    """Absolute value, ``|x|``: ``ABRelu(-1, 1)``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Abs())
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)  # E[z^2]
        1.0
    """
    return ABRelu(-1.0, 1.0)


@register
@dataclasses.dataclass(frozen=True)
class Erf(Layer):
    """``a erf(b x) + c`` (Williams 1997).

    With the inputs scaled by ``b`` (covariances by ``b^2``):
    ``nngp' = a^2 2/pi arcsin(2 nngp / sqrt((1 + 2 var1)(1 + 2 var2))) + c^2`` and
    ``ntk' = a^2 ntk 4 / (pi sqrt((1 + 2 var1)(1 + 2 var2) - 4 nngp^2))``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Erf())
        >>> # 2/pi arcsin(2/3)
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.4646
    """

    a: float = 1.0
    b: float = 1.0
    c: float = 0.0
    needs_variances = True
    needs_gaussian = True

    def __post_init__(self):
        _set_reals(self, "Erf", a=None, b=None, c=None)

    def apply(self, state, layout):
        scale = self.b**2
        cov, var1, var2 = (scale * v for v in (state.nngp, state.var1, state.var2))
        prod = (1 + 2 * var1) * (1 + 2 * var2)
        nngp = 2 / jnp.pi * jnp.arcsin(jnp.clip(2 * cov / jnp.sqrt(prod), -1.0, 1.0))
        derivative = 4 * scale / (jnp.pi * jnp.sqrt(prod - 4 * cov**2))
        return self.a**2 * nngp + self.c**2, _scale_ntk(state.ntk, self.a**2 * derivative)


@register
def Sigmoid_like() -> Erf:  # noqa: N802
    """``0.5 erf(x / 2.4020563531719796) + 0.5``, neural-tangents' sigmoid stand-in.

    The constant minimises the squared distance to the logistic sigmoid on [-5, 5].

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Sigmoid_like())
        >>> # E[f(z)^2], z ~ N(0, 1)
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.2914
    """
    return Erf(a=0.5, b=1 / 2.4020563531719796, c=0.5)


@register
@dataclasses.dataclass(frozen=True)
class Gelu(Layer):
    """GELU, ``x Phi(x)`` (arXiv:2002.08517, as neural-tangents' ``stax.Gelu``).

    With ``p = var1 var2``, ``q = (1 + var1)(1 + var2)``, ``delta = sqrt(q - nngp^2)``:
    ``nngp' = nngp / 4 + ((nngp^2 + p delta^2) / (q delta) + nngp arctan(nngp / delta)) / (2 pi)``;
    ``ntk' = ntk (1/4 + arctan(nngp / delta) / (2 pi)
    + nngp / (2 pi delta) (1 / delta^2 + (1 - p) / q + 1))``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Gelu())
        >>> # E[gelu(z)^2]
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.4252
    """

    needs_variances = True
    needs_gaussian = True

    def apply(self, state, layout):
        cov = state.nngp
        prod = state.var1 * state.var2
        prod_plus_1 = (state.var1 + 1) * (state.var2 + 1)
        delta_squared = prod_plus_1 - cov**2  # >= 1 + var1 + var2 > 0
        delta = jnp.sqrt(delta_squared)
        angle = jnp.arctan2(cov, delta)
        nngp = ((cov**2 + prod * delta_squared) / (prod_plus_1 * delta) + cov * angle) / (
            2 * jnp.pi
        ) + 0.25 * cov
        derivative = (
            0.25
            + angle / (2 * jnp.pi)
            + (1 / delta_squared + (1 - prod) / prod_plus_1 + 1) * cov / (2 * jnp.pi * delta)
        )
        return nngp, _scale_ntk(state.ntk, derivative)


@register
@dataclasses.dataclass(frozen=True)
class Sin(Layer):
    """``a sin(b x + c)``.

    With ``s = var1 + var2``, ``e+ = exp(b^2 (nngp - s / 2))`` and
    ``e- = exp(-b^2 (nngp + s / 2)) cos(2 c)``: ``nngp' = a^2 / 2 (e+ - e-)`` and
    ``ntk' = ntk a^2 b^2 / 2 (e+ + e-)``.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.Sin())
        >>> # (1 - exp(-2)) / 2
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)
        0.4323
    """

    a: float = 1.0
    b: float = 1.0
    c: float = 0.0
    needs_variances = True
    needs_gaussian = True

    def __post_init__(self):
        _set_reals(self, "Sin", a=None, b=None, c=None)

    def apply(self, state, layout):
        scale = self.b**2
        half_sum = 0.5 * (state.var1 + state.var2)
        plus = jnp.exp(scale * (state.nngp - half_sum))
        minus = jnp.exp(-scale * (state.nngp + half_sum)) * jnp.cos(2 * self.c)
        half_a2 = self.a**2 / 2
        return half_a2 * (plus - minus), _scale_ntk(state.ntk, half_a2 * scale * (plus + minus))


@register
@dataclasses.dataclass(frozen=True)
class LayerNorm(Layer):
    """Layer normalisation over features (channels), per pixel.

    ``nngp' = nngp / sqrt((eps + var1)(eps + var2))``, the same for ``ntk``
    (neural-tangents' ``stax.LayerNorm(axis=-1, eps=1e-12)``).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(W_std=3.0), k.LayerNorm())
        >>> round(float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0]), 4)  # 9 / 9
        1.0
    """

    eps: float = 1e-12
    needs_variances = True
    # neural-tangents' LayerNorm refuses a concatenation's non-Gaussian channels.
    needs_gaussian = True
    gaussian_error = NotImplementedError

    def __post_init__(self):
        _set_reals(self, "LayerNorm", eps=0.0)

    def apply(self, state, layout):
        inverse = 1 / jnp.sqrt((self.eps + state.var1) * (self.eps + state.var2))
        return state.nngp * inverse, _scale_ntk(state.ntk, inverse)
