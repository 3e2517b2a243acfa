"""Running a chunked primitive on many devices: row sharding and ``shard_map`` plumbing.

memwise's chunked primitives scale out the way JAX's multi-controller runtime does: the
points (rows) are split over a mesh axis and every device runs the same tiled loop on
its own rows under ``jax.shard_map``, forward and backward; the gradient of an operand
that every device holds whole is all-reduced once, after the loop, not once per tile.

This module holds what ``chunked_map``/``chunked_sum``, ``pairwise_reduce`` and
``attention`` share for that:

* :func:`row_sharding` decides whether, and over which mesh axis, the leading axis of
  an input is split (explicit ``mesh=``/``axis_name=``, or read from a concrete array's
  ``NamedSharding``);
* :func:`sharded_call` runs a per-device function under ``shard_map``;
* inside ``shard_map``, loop carries must be typed as varying over the same mesh axes
  as the loop's inputs: :func:`varying_over`, :func:`vary`, :func:`typed_zeros` and
  :func:`psum_replicated` (the one all-reduce of a replicated operand's cotangent);
* :func:`convert` closure-converts a user function so its closed-over arrays become
  explicit operands (they get gradients and the right varying type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise._jax_private import varying_axes

__all__ = [
    "row_sharding",
    "sharded_call",
    "check_divisible",
    "varying_over",
    "vary",
    "typed_zeros",
    "psum_replicated",
    "first_items",
    "convert",
]


def varying_over(*trees: Any) -> frozenset:
    """Mesh axes over which any leaf of ``trees`` varies (inside ``shard_map``; else empty)."""
    axes: frozenset = frozenset()
    for leaf in jax.tree.leaves(trees):
        axes |= varying_axes(leaf)
    return axes


def vary(tree: Any, axes: frozenset) -> Any:
    """``tree`` cast to vary over ``axes`` (loop-carry initial values inside shard_map)."""
    if not axes:
        return tree

    def one(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def typed_zeros(values: Sequence[Any]) -> list:
    """Zeros with the shape, dtype and varying mesh axes of each value (loop carries)."""
    return [
        vary(jnp.zeros(jnp.shape(v), jnp.result_type(v)), varying_axes(v)) for v in values
    ]


def psum_replicated(cts: Sequence[Any], primals: Sequence[Any]) -> list:
    """Sum cotangents over the mesh axes their primal is replicated on, once, at the end.

    The backward loops run on inputs cast to varying (so the per-tile vjps accumulate
    local partial sums instead of all-reducing every tile); this is the one all-reduce.
    """
    out = []
    for ct, primal in zip(cts, primals):
        extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
        out.append(lax.psum(ct, extra) if extra else ct)
    return out


def first_items(tree: Any) -> Any:
    """Example points for tracing: zeros shaped like one item (slicing one row of an
    explicitly sharded array is not allowed), varying over the same mesh axes."""
    return jax.tree.map(
        lambda a: vary(jnp.zeros(jnp.shape(a)[1:], jnp.result_type(a)), varying_axes(a)), tree
    )


def convert(fn: Callable, data: tuple, examples: Callable[[tuple], tuple]):
    """``jax.closure_convert`` of ``fn`` at example points of ``data``.

    Inside a user's ``shard_map`` the traced jaxpr pins which values are replicated, so
    the data is first cast to vary over every mesh axis any input or closed-over constant
    varies on (the cast is differentiable: its transpose is the one all-reduce the
    gradient of a replicated input needs), and the closure constants are then left as
    they are (``vary_consts=False``). Returns ``(converted, consts, data, vary_consts)``.
    """
    converted, consts = jax.closure_convert(fn, *examples(data))
    axes = varying_over(data, consts)
    if axes:
        data = vary(data, axes)
        converted, consts = jax.closure_convert(fn, *examples(data))
    return converted, list(consts), data, not axes


def _axis_names(axes: Any) -> tuple:
    return axes if isinstance(axes, tuple) else (axes,)


def row_sharding(tree: Any, mesh: Any, axis_name: Any, arg: str, *, dim: int = 0):
    """``(mesh, axes)`` when axis ``dim`` of ``tree`` is to be split over a mesh, else None.

    Explicit ``mesh=``/``axis_name=`` win; otherwise the sharding is read from the first
    leaf when it is a concrete array with a ``NamedSharding``. A traced value whose type
    is split over an explicit mesh axis raises (pass ``mesh=``). Inside ``shard_map``
    (manual axes) nothing is detected: the caller already works per device.
    """
    if mesh is not None:
        if axis_name is None:
            if len(mesh.axis_names) != 1:
                raise ValueError(
                    f"axis_name is required with a mesh of axes {mesh.axis_names}: name "
                    f"the axis the rows of {arg} are split over"
                )
            axis_name = mesh.axis_names[0]
        for name in _axis_names(axis_name):
            if name not in mesh.axis_names:
                raise ValueError(f"axis_name {name!r} is not an axis of the mesh {mesh.axis_names}")
        return mesh, axis_name
    if axis_name is not None:
        raise ValueError("axis_name needs mesh=: pass the jax.sharding.Mesh it belongs to")
    leaves = jax.tree.leaves(tree)
    if not leaves or varying_over(leaves):
        return None
    leaf = leaves[0]
    dim = dim % max(np.ndim(leaf), 1)
    found = None
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = sharding.spec
            if len(spec) > dim and spec[dim] is not None:
                found = (sharding.mesh, spec[dim])
    if found is None:
        typed = getattr(jax.typeof(leaf), "sharding", None)
        spec = getattr(typed, "spec", None)
        if spec is not None and len(spec) > dim and spec[dim] is not None:
            raise ValueError(
                f"axis {dim} of {arg} is sharded over explicit mesh axis {spec[dim]!r}; "
                f"pass mesh=<that jax.sharding.Mesh> and axis_name={spec[dim]!r} so "
                "memwise can run one tiled loop per device"
            )
        return None
    mesh, axes = found
    if int(np.prod([mesh.shape[n] for n in _axis_names(axes)])) == 1:
        return None
    return found


def sharded_call(local: Callable, mesh: Any, in_specs: tuple, out_specs: Any, *args):
    """``shard_map`` of ``local`` (jitted: eager shard_map lacks custom_vjp symbolic zeros).

    check_vma=False: the user's fn was traced (closure-converted) outside the shard_map,
    so its jaxpr cannot carry varying-axis annotations; shard_map's transpose then
    all-reduces the cotangents of the replicated operands once, after the tiled backward.
    On explicit-axes meshes the operands are first resharded to the specs.
    """
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        def to(spec, tree):
            target = jax.sharding.NamedSharding(mesh, spec) if isinstance(
                mesh, jax.sharding.Mesh) else spec
            return jax.tree.map(lambda a: jax.sharding.reshard(a, target), tree)

        args = tuple(to(spec, a) for spec, a in zip(in_specs, args))
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    return jax.jit(mapped)(*args)


def check_divisible(n: int, mesh: Any, axes: Any, arg: str) -> None:
    """Raise unless ``n`` rows split evenly over the devices of mesh axis ``axes``."""
    devices = int(np.prod([mesh.shape[name] for name in _axis_names(axes)]))
    if n % devices:
        raise ValueError(
            f"{arg} has {n} rows, not divisible by the {devices} devices of mesh axis "
            f"{axes!r}; pad {arg} (e.g. with zero weights) to a multiple of {devices}"
        )
