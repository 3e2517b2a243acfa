"""neural-tangents' API on memwise: ``import memwise.nt as nt`` for ``import neural_tangents as nt``.

neural-tangents (Novak et al. 2020) is no longer maintained and does not import on
current JAX. This package keeps its names, argument conventions and defaults so that a
program moves over by changing its import; the kernels are memwise's
(:mod:`memwise.ntk.kernels`, equal to neural-tangents 0.6.5's to float64 rounding).

* :mod:`memwise.nt.stax`: the layers, each returning ``(init_fn, apply_fn, kernel_fn)``
  (the finite network in neural-tangents' parameter layout, and the infinite-width
  kernel), with neural-tangents' defaults: ``Conv`` pads ``"VALID"`` here, where
  :class:`memwise.ntk.kernels.Conv` pads ``"SAME"``.
* :func:`batch`: a kernel function in (batch_size x batch_size) tiles, in memwise's tile
  loop (memory bounded by a tile).
* :func:`empirical_kernel_fn`, :func:`empirical_ntk_fn`, :func:`empirical_nngp_fn`,
  :func:`empirical_ntk_vp_fn`, :func:`monte_carlo_kernel_fn`: finite networks' kernels,
  the NTK by :func:`memwise.ntk.empirical`'s tiles when ``vmap_axes`` is given.
* :func:`linearize`, :func:`taylor_expand`: :func:`memwise.linearize`'s pytrees (the
  expansion point an argument of compiled programs, not a constant).
* :mod:`memwise.nt.predict`: ``gradient_descent_mse``, ``gradient_descent_mse_ensemble``,
  ``gp_inference``, ``max_learning_rate``.

A layer or option neural-tangents has and this package does not raises
``NotImplementedError`` naming it; it never computes something else.
"""

from typing import Any

from memwise.nt import predict, stax
from memwise.nt.batching import batch
from memwise.nt.empirical import (
    NtkImplementation,
    empirical_kernel_fn,
    empirical_nngp_fn,
    empirical_ntk_fn,
    empirical_ntk_vp_fn,
    linearize,
    taylor_expand,
)
from memwise.nt.monte_carlo import monte_carlo_kernel_fn

__all__ = [
    "NtkImplementation",
    "batch",
    "empirical_kernel_fn",
    "empirical_nngp_fn",
    "empirical_ntk_fn",
    "empirical_ntk_vp_fn",
    "linearize",
    "monte_carlo_kernel_fn",
    "predict",
    "stax",
    "taylor_expand",
]

_NOT_IMPLEMENTED = {
    "Kernel": "kernel_fn(x1, x2, get=('nngp', 'ntk')) returns a namedtuple of the arrays",
    "experimental": "neural-tangents' TensorFlow port has no counterpart",
}


def __getattr__(name: str) -> Any:
    if name in _NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"nt.{name} is not supported by memwise.nt: {_NOT_IMPLEMENTED[name]}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
