"""neural-tangents' ``nt.batch``: a kernel function computed in (batch_size x batch_size) tiles.

``nt.batch(kernel_fn, batch_size)`` returns a function with ``kernel_fn``'s signature that
evaluates it on blocks of ``batch_size`` rows of ``x1`` and ``batch_size`` rows of ``x2``
and assembles the ``(n1, n2, ...)`` result. Here the blocks run in memwise's tile loop
(:func:`memwise.chunked.over_row_chunks`, nested for rows and columns): one compiled
program whose temporaries are one block's, whatever ``n1`` and ``n2``; the last block is
padded, so neither size must be divisible by ``batch_size`` (neural-tangents requires
it). Memory is bounded by the tile; neural-tangents' ``store_on_device`` and
``device_count`` switches are accepted and change nothing here (the result is one device
array; shard with :mod:`memwise.sharding` for many devices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from memwise._arguments import non_negative_int
from memwise.chunked import over_row_chunks
from memwise.tiling import Chunking, leading_length

__all__ = ["batch"]


def batch(
    kernel_fn: Callable,
    batch_size: int = 0,
    device_count: int = -1,
    store_on_device: bool = True,
) -> Callable:
    """``kernel_fn`` evaluated in (batch_size x batch_size) tiles of its two input sets.

    Args:
      kernel_fn: ``kernel_fn(x1, x2, *args, **kwargs)`` returning a pytree of arrays of
        leading shape ``(n1, n2)`` (a :mod:`memwise.nt.stax` ``kernel_fn``, an
        :func:`memwise.nt.empirical_kernel_fn`, ...).
      batch_size: inputs of ``x1`` and of ``x2`` per tile; ``0`` means no tiling (the
        whole sets at once, as neural-tangents).
      device_count: neural-tangents' device parallelism; ``-1``, ``0`` or ``1`` (one
        device) are accepted.
      store_on_device: accepted for neural-tangents' programs; the result stays on the
        device (memory is bounded by the tile, not by where the result goes).

    Returns:
      ``batched_kernel_fn(x1, x2=None, *args, **kwargs)`` with ``kernel_fn``'s results.

    Raises:
      TypeError, ValueError: ``batch_size`` not an int >= 0. NotImplementedError:
        ``device_count`` above 1.

    Memory/compute: one tile's temporaries plus the result; ``kernel_fn`` is called once
    per tile (each ``x2`` block's per-input work is redone for every ``x1`` block).

    Example::

        >>> import jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> from memwise.nt import stax
        >>> _, _, kernel_fn = stax.serial(
        ...     stax.Dense(512), stax.Relu(), stax.Dense(1))
        >>> batched = nt.batch(kernel_fn, batch_size=2)
        >>> batched(jnp.ones((5, 3)), jnp.ones((3, 3)), "ntk").shape
        (5, 3)
    """
    if not callable(kernel_fn):
        raise TypeError(f"kernel_fn must be callable kernel_fn(x1, x2, ...), got {kernel_fn!r}")
    non_negative_int(batch_size, "batch_size", accepts=" (0: no tiling)")
    if not isinstance(device_count, int) or device_count > 1:
        raise NotImplementedError(
            f"nt.batch(device_count={device_count!r}) is not supported by memwise.nt; use "
            "device_count=-1, 0 or 1, and memwise.sharding to spread a kernel over devices"
        )
    if batch_size == 0:
        return kernel_fn

    def batched_kernel_fn(x1: Any, x2: Any = None, *args: Any, **kwargs: Any) -> Any:
        x2_ = x1 if x2 is None else x2
        n1, n2 = leading_length(x1, "x1"), leading_length(x2_, "x2")
        rows, cols = Chunking(n1, min(batch_size, n1)), Chunking(n2, min(batch_size, n2))

        def row_block(x_rows):
            def col_block(x_cols):
                # Columns first for the loop, back in place after.
                out = kernel_fn(x_rows, x_cols, *args, **kwargs)
                return jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), out)

            return jax.tree.map(
                lambda a: jnp.moveaxis(a, 0, 1), over_row_chunks(col_block, x2_, cols)
            )

        if n1 == 0 or n2 == 0:
            return kernel_fn(x1, x2_, *args, **kwargs)
        return over_row_chunks(row_block, x1, rows)

    return batched_kernel_fn
