"""neural-tangents' API on memwise: ``from memwise.nt import stax`` for ``from neural_tangents import stax``.

neural-tangents (Novak et al. 2020) is no longer maintained and does not import on
current JAX. This package keeps its names, argument conventions and defaults so that a
program moves over by changing its import; the kernels are memwise's
(:mod:`memwise.ntk.kernels`, equal to neural-tangents 0.6.5's to float64 rounding).

* :mod:`memwise.nt.stax`: the layers, each returning ``(init_fn, apply_fn, kernel_fn)``
  (the finite network in neural-tangents' parameter layout, and the infinite-width
  kernel), with neural-tangents' defaults: ``Conv`` pads ``"VALID"`` here, where
  :class:`memwise.ntk.kernels.Conv` pads ``"SAME"``.

A layer or option neural-tangents has and this package does not raises
``NotImplementedError`` naming it; it never computes something else.
"""

from memwise.nt import stax

__all__ = ["stax"]
