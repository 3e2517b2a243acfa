"""``dot_product_attention`` on many devices: the split its queries' data declares.

The queries' batch and sequence dims are read from their sharding, as
:func:`memwise.attention` reads them (:func:`memwise._attention_args.attention_sharding`), and
the tiles run under ``shard_map`` (:func:`memwise.sharding.sharded_call`). With the
sequence split, K/V travel on the engine's ring (Liu, Zaharia, Abbeel, *Ring Attention
with Blockwise Transformers*, 2023) or are held whole, as
:func:`memwise.sharding.use_ring` chooses; every array the tiles read is cut by its role:
rows and pairs along the queries, columns along the keys when they travel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._attention_args import attention_sharding
from memwise.engine.ring import Ring
from memwise.sharding import declared_split, devices, ring_step, sharded_call, use_ring

__all__ = ["run_split", "sequence_split"]


def _axes(mesh: Any) -> tuple:
    """A mesh's ``(name, size)`` pairs, in its order: what two meshes must share."""
    return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def sequence_split(
    q4: jax.Array, kv_length: int, kv: tuple, broadcast_cols: bool
) -> tuple[Any, Any, Any, bool] | None:
    """``(mesh, batch axes, sequence axes, ring)`` when the queries are split over their
    batch or sequence dim (``q``'s ``NamedSharding``, an Explicit-axes type under ``jit``,
    or a mesh with Auto axes, as :func:`memwise.attention`), else None.

    Heads split (tensor parallelism) are left to XLA's partitioner, as for ``jax.nn``. A
    split sequence sends K/V around the devices (a ring) when :func:`memwise.sharding.
    use_ring` chooses it, else holds them whole; whole also when a per-head mask meets
    grouped K/V (their columns then broadcast over the group, which a ring cannot carry).
    """
    if any(declared_split(q4, dim) for dim in (2, 3)):
        return None  # heads or features split: XLA partitions it, as jax.nn's
    found = attention_sharding(q4, None, None, 1)
    if found is None or found[1][2] is not None:
        return None
    mesh, (b_axes, t_axes, _, _) = found
    for arr, name in zip(kv, ("key", "value")):
        splits = [split for dim in range(arr.ndim) if (split := declared_split(arr, dim))]
        if splits and _axes(splits[0][0]) != _axes(mesh):
            raise ValueError(
                f"{name} is split over a mesh with axes {dict(_axes(splits[0][0]))} and "
                f"query over {dict(_axes(mesh))}: put query, key and value on one mesh "
                f"(e.g. jax.device_put({name}, query.sharding))"
            )
    ring = (
        t_axes is not None
        and not broadcast_cols
        and use_ring(None, kv, kv_length, mesh, t_axes, "key", beside=q4, dim=1)
    )
    return mesh, b_axes, t_axes, ring


def run_split(
    run: Any, split: tuple, operands: dict, whole: dict, t_axis: int, lengths: tuple
) -> tuple[jax.Array, jax.Array]:
    """``run`` in ``shard_map``: each of ``operands`` (``name: (array, role)``) cut along
    the batch and along its queries (rows, pairs) or, on a ring, its keys (cols);
    ``whole`` on every device."""
    mesh, b_axes, t_axes, ring = split
    B, T, S = lengths

    def spec(arr: jax.Array, role: str) -> P:
        dims: list = [None] * arr.ndim
        if b_axes is not None and arr.shape[0] == B:
            dims[0] = b_axes
        if t_axes is not None and arr.shape[t_axis] != 1 and (role != "cols" or ring):
            dims[t_axis] = t_axes
        return P(*dims)

    # One device's share of the operands: its batch and sequence slice of each.
    share = None
    if t_axes is not None:
        share = ring_step(T, S, devices(mesh, t_axes), [a for a, _ in operands.values()])
        if share is not None and b_axes is not None:
            share = share._replace(nbytes=share.nbytes // devices(mesh, b_axes))

    def local(arrays: dict, whole: dict) -> tuple[jax.Array, jax.Array]:
        if t_axes is None:
            return run(arrays, whole)
        n = devices(mesh, t_axes)
        # Causal masks, windows and lengths compare global positions: this device's first
        # query (and, on a ring, the engine adds each key block's first key).
        offset = lax.axis_index(t_axes).astype(jnp.int32) * (T // n)
        return run(arrays, whole, Ring(t_axes, n) if ring else None, offset, share)

    out_dims = [b_axes] + [None] * 4
    out_dims[t_axis] = t_axes
    in_specs = ({name: spec(a, role) for name, (a, role) in operands.items()}, P())
    return sharded_call(
        local,
        mesh,
        in_specs,
        (P(*out_dims), P(*out_dims[:4])),
        {name: a for name, (a, _) in operands.items()},
        whole,
    )
