"""Neural tangent kernels that fit in memory.

* :mod:`memwise.ntk.kernels`: infinite-width NNGP/NTK of conv, pooling, residual and
  dense networks (``serial`` of the layers of neural-tangents' ``stax`` listed there).
* :func:`empirical`: the empirical NTK of a finite network (Jacobian contraction,
  NTK-vector products, pseudo-NTK), tile by tile.
* :func:`kernel_regression` and :func:`kip_loss`: kernel ridge regression and the KIP
  loss, whose gradients hold one tile of the kernel whatever the number of targets.
* :func:`predict`: mean and covariance of an infinitely wide network trained by
  gradient descent on MSE for a time ``t`` (neural-tangents'
  ``gradient_descent_mse_ensemble``), with the test-by-train kernel in tiles.
"""

from memwise.ntk import kernels
from memwise.ntk.empirical import empirical
from memwise.ntk.predict import predict
from memwise.ntk.regression import kernel_regression, kip_loss

__all__ = ["empirical", "kernel_regression", "kernels", "kip_loss", "predict"]
