"""The arguments both attention functions read alike: the score scale and the split over
devices.

Why a module of its own: :func:`memwise.attention` and its ``jax.nn`` drop-in
:func:`memwise.dot_product_attention` (:mod:`memwise.sdpa`, split over devices by
:mod:`memwise._sdpa_split`) check ``scale`` the same way and read a sharded query the same
way; kept here, below the public modules, so that neither imports private helpers from
the other.

Contents: :func:`check_scale` (the score scale as a scalar array, default
``1 / sqrt(d)``) and :func:`attention_sharding` (the mesh and per-dim mesh axes of q when
attention runs sharded).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import as_array
from memwise.sharding import auto_split, check_divisible, declared_split, row_sharding

__all__ = ["attention_sharding", "check_scale"]


def attention_sharding(
    q: jax.Array, mesh: Any, axis_name: Any, shard_dim: int
) -> tuple[Any, list] | None:
    """``(mesh, per-dim mesh axes of q)`` when attention is to run sharded, else None.

    Explicit ``mesh=``/``axis_name=`` split dim ``shard_dim``; otherwise the split is read
    from a concrete ``q``'s ``NamedSharding`` (any of its batch/head dims and the query
    dim) through the helper ``pairwise_reduce`` uses.
    """
    nd = q.ndim
    if isinstance(shard_dim, bool) or not isinstance(shard_dim, (int, np.integer)):
        raise TypeError(f"shard_dim must be an int (an axis of q), got {shard_dim!r}")
    if not -nd <= shard_dim < nd or shard_dim % nd == nd - 1:
        raise ValueError(
            f"shard_dim={shard_dim} must name a batch/head dim or the query dim (-2) of q "
            f"with shape {q.shape}; the feature dim cannot be split"
        )
    if mesh is not None or axis_name is not None:
        split = row_sharding(q, mesh, axis_name, "q")
        assert split is not None  # an explicit mesh= or axis_name= decides (or raises)
        mesh, axes = split
        spec: list = [None] * nd
        spec[shard_dim % nd] = axes
    else:
        found = [declared_split(q, dim=i) for i in range(nd)]
        if not any(found):
            inferred = auto_split(q, dim=shard_dim)
            if inferred is None:
                return None
            found[shard_dim % nd] = inferred
        if found[-1] is not None:
            raise ValueError(
                "q's feature dim is sharded; attention splits queries or batch/head dims "
                "only: reshard q (e.g. NamedSharding(mesh, P(None, None, 'data', None)))"
            )
        mesh = next(f[0] for f in found if f is not None)
        spec = [f[1] if f is not None else None for f in found]
    for i, axes in enumerate(spec):
        if axes is not None:
            check_divisible(q.shape[i], mesh, axes, f"q (axis {i})")
    return mesh, spec


def check_scale(scale: Any, d: int) -> jax.Array:
    """The score scale as a scalar array (a traced one gets a gradient); default
    ``1 / sqrt(d)``."""
    if scale is None:
        return jnp.asarray(1.0 / math.sqrt(d))
    if isinstance(scale, (bool, np.bool_, str, bytes)):
        raise TypeError(f"scale must be a real scalar (a float or a 0-d array), got {scale!r}")
    scale = as_array(scale, "scale")
    if (
        scale.ndim != 0
        or not jnp.issubdtype(scale.dtype, jnp.number)
        or jnp.issubdtype(scale.dtype, jnp.complexfloating)
    ):
        raise TypeError(
            f"scale must be a real scalar (a float or a 0-d array), got shape {scale.shape} "
            f"and dtype {scale.dtype}"
        )
    return scale if jnp.issubdtype(scale.dtype, jnp.floating) else scale.astype(float)
