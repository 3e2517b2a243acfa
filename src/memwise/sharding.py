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
from jax.sharding import PartitionSpec

from memwise import knobs
from memwise._item_bytes import value_bytes
from memwise._jax_private import varying_axes
from memwise._vjp import closure_convert
from memwise.tiling import DeviceShare

# Where an axis is split: a mesh (concrete, or abstract under jit) and its axis name(s).
Split = tuple[Any, Any]

__all__ = [
    "row_sharding",
    "declared_split",
    "auto_split",
    "declared_replicated",
    "devices",
    "has_explicit_axes",
    "use_ring",
    "ring_pays",
    "ring_step",
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
    return [vary(jnp.zeros(jnp.shape(v), jnp.result_type(v)), varying_axes(v)) for v in values]


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


def convert(
    fn: Callable, data: tuple, examples: Callable[[tuple], tuple]
) -> tuple[Callable, list, tuple, bool]:
    """:func:`memwise._vjp.closure_convert` of ``fn`` at example points of ``data``.

    Inside a user's ``shard_map`` the traced jaxpr pins which values are replicated, so
    the data is first cast to vary over every mesh axis any input or closed-over constant
    varies on (the cast is differentiable: its transpose is the one all-reduce the
    gradient of a replicated input needs), and the closure constants are then left as
    they are (``vary_consts=False``). Returns ``(converted, consts, data, vary_consts)``.
    """
    converted, consts = closure_convert(fn, *examples(data))
    axes = varying_over(data, consts)
    if axes:
        data = vary(data, axes)
        converted, consts = closure_convert(fn, *examples(data))
    return converted, list(consts), data, not axes


def _axis_names(axes: Any) -> tuple:
    return axes if isinstance(axes, tuple) else (axes,)


def row_sharding(tree: Any, mesh: Any, axis_name: Any, arg: str, *, dim: int = 0) -> Split | None:
    """``(mesh, axes)`` when axis ``dim`` of ``tree`` is to be split over a mesh, else None.

    In order: explicit ``mesh=``/``axis_name=``; the split the data declares
    (:func:`declared_split`: a concrete array's ``NamedSharding``, or, under ``jit``, a
    type sharded over Explicit mesh axes); else, when the data lives on a mesh with Auto
    axes (its type's mesh, or the mesh set with ``jax.set_mesh``), a split over all of
    them (:func:`auto_split`). Inside ``shard_map`` (manual axes) nothing is detected:
    the caller already works per device.
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
    return declared_split(tree, dim) or auto_split(tree, dim)


def _first_leaf(tree: Any) -> Any:
    leaves = jax.tree.leaves(tree)
    if not leaves or varying_over(leaves):
        return None
    return leaves[0]


def declared_split(tree: Any, dim: int = 0) -> Split | None:
    """``(mesh, axes)`` that axis ``dim`` of ``tree``'s first leaf is declared split over.

    A concrete array says it with its ``NamedSharding``; under ``jit`` a value's type
    says it when the mesh axis is Explicit (``jax.typeof(x).sharding``). Axes of size 1
    split nothing: None.
    """
    leaf = _first_leaf(tree)
    if leaf is None:
        return None
    dim = dim % max(np.ndim(leaf), 1)
    sharding: Any = None
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) <= dim or spec[dim] is None:
        return None
    mesh, axes = sharding.mesh, spec[dim]
    if devices(mesh, axes) == 1:
        return None
    return mesh, axes


def declared_replicated(tree: Any, dim: int = 0) -> bool:
    """True when ``tree``'s first leaf says it is whole on every device of a mesh: a
    concrete array whose ``NamedSharding`` does not split axis ``dim``, or a traced one
    whose type has Explicit mesh axes and does not split it (Auto axes say nothing)."""
    leaf = _first_leaf(tree)
    if leaf is None:
        return False
    dim = dim % max(np.ndim(leaf), 1)
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            split = sharding.spec
            return sharding.mesh.size > 1 and (len(split) <= dim or split[dim] is None)
        return False
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not mesh.axis_names:
        return False
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    return explicit and (len(spec) <= dim or spec[dim] is None)


def auto_split(tree: Any, dim: int = 0) -> Split | None:
    """``(mesh, axes)``: axis ``dim`` of ``tree`` split over every Auto axis of the mesh
    its first leaf lives on (under ``jit``, the type's mesh; else the mesh set with
    ``jax.set_mesh``), when its length divides evenly; else None.

    Auto axes do not say how an array is laid out, only where: splitting the points
    over all of the mesh's devices is what makes every device share the work (data
    already split that way moves nothing). A length that does not divide runs on one
    program, as without a mesh; pass ``mesh=`` to be told instead.
    """
    leaf = _first_leaf(tree)
    if leaf is None or np.ndim(leaf) == 0:
        return None
    mesh: Any = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is None or not mesh.axis_names:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
        return None
    auto = tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == jax.sharding.AxisType.Auto and mesh.shape[name] > 1
    )
    if not auto:
        return None
    axes = auto[0] if len(auto) == 1 else auto
    n_devices = devices(mesh, axes)
    if np.shape(leaf)[dim % np.ndim(leaf)] % n_devices:
        return None
    return mesh, axes


def has_explicit_axes(mesh: Any) -> bool:
    """True when any axis of ``mesh`` is Explicit (shardings are part of the types)."""
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def devices(mesh: Any, axes: Any) -> int:
    """The number of devices along mesh axis (or axes) ``axes``."""
    return int(np.prod([mesh.shape[name] for name in _axis_names(axes)]))


def sharded_call(local: Callable, mesh: Any, in_specs: tuple, out_specs: Any, *args: Any) -> Any:
    """``shard_map`` of ``local`` (jitted: eager shard_map lacks custom_vjp symbolic zeros).

    ``mesh`` may be a ``Mesh`` or, under ``jit``, the ``AbstractMesh`` of the data's type.
    check_vma=False: the per-device function does its own varying-axis typing (the
    engine's loop carries) and shard_map's transpose all-reduces the cotangents of the
    replicated operands once, after the tiled backward. On Explicit axes the operands
    are first resharded to the specs (inside the jit, so that an abstract mesh will do).
    """
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    explicit = has_explicit_axes(mesh)

    def to_spec(spec: Any, arg: Any) -> Any:  # every array of ``arg`` laid out as ``spec``
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.tree.map(lambda a: jax.sharding.reshard(a, sharding), arg)

    def call(*args):
        if explicit:  # in_specs is a prefix of args: one spec may cover a subtree
            args = jax.tree.map(
                to_spec, in_specs, args, is_leaf=lambda s: isinstance(s, PartitionSpec)
            )
        return mapped(*args)

    try:
        return jax.jit(call)(*args)
    except NotImplementedError as e:
        if "Closing over inputs to shard_map" not in str(e):
            raise
        raise ValueError(
            "the function closes over an array whose type is sharded over Explicit mesh "
            "axes, which JAX's shard_map cannot capture: pass that array as data (part "
            "of the points, weights or consts) or use a mesh with Auto axes "
            "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,)))"
        ) from None


# A ring's predicted time relative to holding the second operand whole: the same tiles
# and the same bytes moved, but in D - 1 steps that each wait for their block (one
# collective for the whole operand otherwise). A coarse order for ``mw.fit`` only: a
# plan takes the ring for its memory, never for speed.
RING_COST = 1.05


def use_ring(
    ring: Any,
    tree: Any,
    n: int,
    mesh: Any,
    axes: Any,
    arg: str,
    *,
    beside: Any = (),
    dim: int = 0,
) -> bool:
    """Whether the second operand ``tree`` (``n`` points) is split over ``axes`` as well
    and passed around the devices (a ring), rather than held whole on every device (one
    all-gather when it arrives split).

    ``ring=None`` (the default): never when ``tree`` is declared whole on every device
    (:func:`declared_replicated`) or ``n`` does not divide evenly; otherwise a
    ``"ring"`` knob (:func:`memwise.knobs.auto`: candidates whole, then ring) that
    :func:`memwise.fit` sets under a budget, and that is :func:`ring_pays` outside it.
    ``beside`` is the first operand, split over the same devices; ``dim`` the axis of
    ``tree``'s first leaf that holds its ``n`` points. ``True``
    insists (``n`` must divide), ``False`` holds it whole.
    """
    if ring is None:
        n_devices = devices(mesh, axes)
        if declared_replicated(tree, dim) or n % n_devices:
            return False
        return knobs.auto(
            "ring",
            candidates=(False, True),
            cost=(1.0, RING_COST),
            default=ring_pays(_nbytes(tree), _nbytes(beside) // n_devices, n_devices),
            label=arg,
        )
    if not isinstance(ring, bool):
        raise TypeError(f"ring must be True, False or None (automatic), got {ring!r}")
    if ring:
        check_divisible(n, mesh, axes, arg)
    return ring


def ring_pays(whole: int, block: int, n_devices: int) -> bool:
    """The cost model's choice between a ring and holding the second operand whole.

    Both move the same bytes ((D - 1) / D of the operand per device) and run the same
    tiles; the whole operand moves in one collective, a ring in D - 1 overlapped steps
    that each wait for their slice. What differs is the bytes held: a ring holds its
    own block of the operand and of its gradient (and a few tile-wide slices in
    flight) where the other holds all of them, ``whole * (1 - 1 / D)`` more. The ring is
    chosen when that is more than the device holds of the first operand (``block``):
    holding the operand whole may at most about double the device's share. So two
    devices with operands of equal size hold it whole (1.31x a ring's per-device peak
    at 200,000 points, measured), and so does a second operand small beside the first
    (grouped-query K/V at a few devices: MaxText's all-gather case).

    Example::

        >>> from memwise.sharding import ring_pays
        >>> ring_pays(whole=100, block=50, n_devices=2)  # equal operands, D = 2
        False
        >>> ring_pays(whole=100, block=25, n_devices=4)  # equal operands, D = 4
        True
        >>> ring_pays(whole=25, block=25, n_devices=4)  # 8:1 grouped-query K/V
        False
    """
    return whole * (1 - 1 / n_devices) > block


def ring_step(n: int, m: int, n_devices: int, operands: Any) -> DeviceShare | None:
    """One device's share of a ring step, ``(n / D, m / D)`` and ``1 / D`` of the bytes
    of ``operands``, when both lengths divide (else None): what ``chunk_size="auto"``
    tiles for on D devices whether the second operand travels or is held whole, so
    :func:`memwise.fit` sees one tile knob under either choice of ``ring``
    (:func:`memwise.tiling.tiling`'s ``auto_shape``)."""
    if n % n_devices or m % n_devices:
        return None
    return DeviceShare(n // n_devices, m // n_devices, _nbytes(operands) // n_devices)


def _nbytes(tree: Any) -> int:
    """Bytes of a pytree of arrays (or shape-dtype structs), read off shapes only."""
    return sum(value_bytes(a) for a in jax.tree.leaves(tree))


def check_divisible(n: int, mesh: Any, axes: Any, arg: str) -> None:
    """Raise unless ``n`` rows split evenly over the devices of mesh axis ``axes``."""
    n_devices = devices(mesh, axes)
    if n % n_devices:
        raise ValueError(
            f"{arg} has {n} rows, not divisible by the {n_devices} devices of mesh axis "
            f"{axes!r}; pad {arg} (e.g. with zero weights) to a multiple of {n_devices}"
        )
