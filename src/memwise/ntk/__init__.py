"""Neural tangent kernels that fit in memory (seeds 000 and 001).

* :mod:`memwise.ntk.kernels`: infinite-width NNGP/NTK of conv and dense networks
  (``serial`` of ``Dense``, ``Conv``, ``Relu``, ``Erf``, ``Flatten``, ``GlobalAvgPool``).
* :func:`empirical`: the empirical NTK of a finite network (Jacobian contraction,
  NTK-vector products, pseudo-NTK), tile by tile.
* :func:`kernel_regression` and :func:`kip_loss`: kernel ridge regression and the KIP
  loss, whose gradients hold one tile of the kernel whatever the number of targets.
"""

from memwise.ntk import kernels
from memwise.ntk.empirical import empirical
from memwise.ntk.regression import kernel_regression, kip_loss

__all__ = ["empirical", "kernel_regression", "kernels", "kip_loss"]
