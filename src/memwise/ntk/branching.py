"""Branching layers of infinite-width networks: ``FanOut``, ``parallel``, ``FanInSum``.

A residual block copies its input into branches, applies a network to each, and sums
them. Infinitely wide branches with independent weights are independent Gaussian
processes, so the kernel of their sum is the sum of their kernels, NNGP and NTK alike
(Novak et al. 2020, neural-tangents' ``stax.FanInSum``; the branches of a ResNet block,
He et al. 2016).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memwise._arguments import positive_int
from memwise.ntk._covariance import Layer, _check_layers, _is_zero_ntk, register
from memwise.ntk._walk import _Flow, _to_diagonal

__all__ = ["FanInSum", "FanOut", "parallel"]


@register
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
        n = positive_int(self.n, "FanOut n", accepts=" (the number of branches)")
        object.__setattr__(self, "n", n)

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


@register
def parallel(*layers: Layer) -> Layer:
    """Apply ``layers[i]`` to branch ``i`` (after :class:`FanOut`), as ``stax.parallel``.

    Each layer may itself be a :func:`serial` network.

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> block = k.serial(
        ...     k.FanOut(2), k.parallel(k.Identity(), k.Relu()), k.FanInSum())
        >>> # 1 + 0.5
        >>> float(k.serial(k.Dense(), block)(jnp.ones((1, 3)), get="nngp")[0, 0])
        1.5
    """
    _check_layers(layers, "parallel")
    if not layers:
        raise ValueError("parallel() needs at least one layer (one per branch)")
    return _Parallel(tuple(layers))


def _check_branches(name: str, flow: Any) -> None:
    if not isinstance(flow, list):
        raise ValueError(
            f"{name}() joins branches but gets one input; put FanOut(n) and parallel(...) before it"
        )


def _same_pixels(name: str, flow: list) -> list:
    """The branches in one layout, or a ValueError if their pixel shapes differ.

    A branch past the network's last pooling layer is per-pixel; the others may still be
    pixel-by-pixel, which nothing downstream needs.
    """
    if any(not branch.layout.full for branch in flow):
        flow = [_to_diagonal(branch) for branch in flow]
    shapes = {branch.nngp.shape for branch in flow}
    if len(shapes) > 1:
        raise ValueError(
            f"{name}() branches must have the same pixel shape, got kernels of shapes "
            f"{sorted(shapes)}; use the same strides and padding in every branch"
        )
    return flow


def _add_ntk(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return None
    if _is_zero_ntk(a):
        return b
    if _is_zero_ntk(b):
        return a
    return a + b


@register
@dataclasses.dataclass(frozen=True)
class FanInSum(Layer):
    """Sum the branches: independent Gaussian branches add their kernels (NNGP and NTK).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.ntk import kernels as k
        >>> kernel_fn = k.serial(k.Dense(), k.FanOut(3), k.FanInSum())
        >>> # three copies of 1.0
        >>> float(kernel_fn(jnp.ones((1, 3)), get="nngp")[0, 0])
        3.0
    """

    def _leaves(self):
        return iter(())

    def _walk(self, walk, flow):
        _check_branches("FanInSum", flow)
        flow = _same_pixels("FanInSum", flow)
        if not all(branch.gaussian for branch in flow):
            raise NotImplementedError(
                "FanInSum() of a concatenation of channels (FanInConcat) is not supported "
                "(neural-tangents' FanInSum needs Gaussian inputs too); put an affine "
                "layer (Dense, Conv) after the concatenation"
            )
        nngp, ntk = flow[0].nngp, flow[0].ntk
        for branch in flow[1:]:
            nngp = nngp + branch.nngp
            ntk = _add_ntk(ntk, branch.ntk)
        widths = {branch.width for branch in flow}
        return _Flow(nngp, ntk, flow[0].layout, widths.pop() if len(widths) == 1 else None)


@dataclasses.dataclass(frozen=True)
class _ConcatChannels(Layer):
    """Concatenate the branches' channels: their kernels averaged, weighted by the finite
    network's channel counts (equal weights when the counts are equal), as
    neural-tangents' ``stax.FanInConcat`` on the channel axis.

    The counts come from each branch's last layer of :mod:`memwise.nt.stax` (memwise's
    own layers have no width), so this layer is reached through
    ``memwise.nt.stax.FanInConcat``. The result is not Gaussian (its channels differ):
    an affine layer must come before the next nonlinearity. ``axis`` is the
    concatenation axis of the activations; only the channel (last) axis is supported.
    """

    axis: int = -1

    def _leaves(self):
        return iter(())

    def _walk(self, walk, flow):
        _check_branches("FanInConcat", flow)
        ndim = flow[0].layout.spatial_ndim + 2  # batch, pixels, channels
        if not -ndim <= self.axis < ndim:
            raise ValueError(
                f"FanInConcat(axis={self.axis}) is out of range for inputs of {ndim} axes"
            )
        if self.axis % ndim != ndim - 1:
            raise NotImplementedError(
                f"FanInConcat(axis={self.axis}) on inputs of {ndim} axes: memwise.nt "
                "concatenates along the channel (last) axis only; neural-tangents' "
                "concatenation along the batch or pixel axes is not supported"
            )
        flow = _same_pixels("FanInConcat", flow)
        widths = [branch.width for branch in flow]
        if None in widths:
            raise NotImplementedError(
                f"FanInConcat() of branches of channel counts {widths}: memwise.nt knows "
                "a branch's count from its last Dense or Conv (or the input's), not after "
                "Flatten; concatenate before flattening"
            )
        weights = [1] * len(flow) if len(set(widths)) == 1 else widths
        total = sum(weights)
        nngp = sum(w * branch.nngp for w, branch in zip(weights, flow)) / total
        ntk: Any = flow[0].ntk
        if ntk is not None:
            terms = [(w, b.ntk) for w, b in zip(weights, flow) if not _is_zero_ntk(b.ntk)]
            ntk = sum(w * a for w, a in terms) / total if terms else 0.0
        return _Flow(nngp, ntk, flow[0].layout, sum(widths), gaussian=False)
