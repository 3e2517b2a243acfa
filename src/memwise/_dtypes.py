"""The dtype policy every memwise reduction follows: accumulate in at least float32,
return the inputs' own dtype.

Why at least float32: summing 65,536 bfloat16 values in bfloat16 stalls at 2,048 (with
8-value tiles); every running quantity (a sum, the log-sum-exp statistics, the softmax
accumulators, a backward's accumulated cotangents) is therefore widened, and only the
result is rounded back, as ``jnp.sum`` does. A module of the ground floor: the tile
engine, the chunked maps, the NTK kernels and the losses all read it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["accumulation_dtype", "promote", "sum_dtype"]


def accumulation_dtype(dtype: Any) -> np.dtype:
    """The dtype a reduction of ``dtype`` values accumulates in: at least float32 for
    floating dtypes (float64 stays float64), ``dtype`` itself otherwise.

    Example::

        >>> accumulation_dtype(jnp.bfloat16), accumulation_dtype(jnp.int32)
        (dtype('float32'), dtype('int32'))
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def sum_dtype(dtype: Any) -> np.dtype:
    """The dtype ``jnp.sum`` returns for ``dtype`` values (floats keep theirs; bool and
    narrow integers widen to the default integer).

    Example::

        >>> sum_dtype(jnp.bool_) == jnp.sum(jnp.ones(2, bool)).dtype
        True
    """
    return jax.eval_shape(jnp.sum, jax.ShapeDtypeStruct((0,), dtype)).dtype


def promote(tree: Any) -> Any:
    """``tree`` with its floating leaves cast to their :func:`accumulation_dtype`."""
    # jnp.asarray: a const may be a Python scalar (or JAX's typed float under checkpoint).
    return jax.tree.map(
        lambda a: jnp.asarray(a).astype(accumulation_dtype(jnp.result_type(a))), tree
    )
