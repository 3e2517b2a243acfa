"""One pass over a network's layers: the covariances between layers, or branches of them.

:class:`memwise.ntk.kernels.KernelFn` evaluates a network twice per kernel: once per input
set (:meth:`~memwise.ntk.kernels.KernelFn.prepare`, each input's own variances) and once
per pair of sets (:meth:`~memwise.ntk.kernels.KernelFn.cross`). Both run the walk here:
single-input layers are stepped through it (reading recorded variances on the cross
pass), combinators (``serial``, ``FanOut``, ``parallel``, ``FanInSum``) pass it on to
their parts. Past the network's last pooling layer the pixel-by-pixel covariance is cut
to its diagonal (nothing downstream mixes pixels).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from memwise.ntk._covariance import (
    Layer,
    _broadcast_variances,
    _Layout,
    _map_ntk,
    _pixel_diagonal,
    _State,
)


class _Flow(NamedTuple):
    """The covariances between the layers: nngp, ntk (None / 0.0 as in _State), layout.

    ``width``: the finite network's channel count there, where known (the input's, and
    what neural-tangents' layers of :mod:`memwise.nt` set), for a concatenation's
    weights. ``gaussian``: False after channels of different covariance are
    concatenated, until an affine layer mixes them (a nonlinearity needs Gaussian
    inputs of one covariance per channel).
    """

    nngp: jax.Array
    ntk: Any
    layout: _Layout
    width: int | None = None
    gaussian: bool = True


def _to_diagonal(flow: _Flow) -> _Flow:
    """Keep only the per-pixel covariances (nothing downstream pools any more)."""
    layout = flow.layout
    if not layout.full or layout.spatial_ndim == 0:
        return flow
    diagonal = lambda a: _pixel_diagonal(a, layout)  # noqa: E731
    return flow._replace(
        nngp=diagonal(flow.nngp), ntk=_map_ntk(flow.ntk, diagonal), layout=layout.diagonal()
    )


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
        if layer.needs_gaussian and not flow.gaussian:
            raise layer.gaussian_error(
                f"{layer!r} after a concatenation of channels (FanInConcat): its input is "
                "not Gaussian (its channels have different covariances); put an affine "
                "layer (Dense, Conv) between them, as neural-tangents requires"
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
        flow = _Flow(
            nngp,
            ntk,
            out_layout,
            layer.out_width(flow.width),
            layer.affine or flow.gaussian,
        )
        index, self.n_steps = self.n_steps, self.n_steps + 1
        return _to_diagonal(flow) if index == self.last_pool else flow
