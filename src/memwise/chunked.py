"""Chunked maps, sums and pairwise reductions whose backward pass is chunked too.

``jax.lax.map(batch_size=...)`` and hand-written chunked scans (OTT-JAX's online
``PointCloud``) bound the memory of the *forward* pass only: reverse mode keeps every
chunk's intermediates, so the gradient of a 50,000 x 50,000 reduction still materialises
the n x m matrix (seed 002). Here each primitive is a ``jax.custom_vjp`` whose backward
is itself a chunked computation of the same shape, the KeOps rule ("the gradient of a
reduction is a reduction"): Charlier, Feydy, Glaunes, Collin, Durif, *Kernel operations
on the GPU, with autodiff, without memory overflows*, JMLR 22 (2021). For ``logsumexp``
(and the softmax-weighted sum behind :mod:`memwise.attention`) the backward re-forms each
tile's probabilities from the saved per-row result, the FlashAttention pattern (Dao,
Fu, Ermon, Rudra, Re, NeurIPS 2022; Rabe & Staats, arXiv:2112.05682): one more tiled pass,
no stored tiles. Memory in both directions is O(n + m + one tile).

The chunking helper (THE one every memwise primitive uses; ot, ntk, attention and fit
build on it, never on a second loop):

* :func:`chunking` ``(length, chunk_size, *, item_bytes=None) -> Chunking`` resolves a
  ``chunk_size`` (positive int, or ``"auto"`` which asks :func:`memwise.knobs.auto`) for
  one axis, and :func:`tiling` ``(n, m, chunk_size, *, pair_bytes=None)`` does it for a
  2-D tiling (int = square tiles, ``(rows, cols)`` tuple, or ``"auto"``).
* :class:`Chunking` pads a ragged last chunk by repeating the last item (so user functions
  see only valid inputs) and carries the mask; there is never a second compiled body for
  the remainder. ``split`` / ``merge`` / ``mask`` / ``ids`` / ``block`` convert between
  ``(length, ...)`` arrays and ``(n_chunks, size, ...)`` chunks.

Public primitives: :func:`chunked_map`, :func:`chunked_sum`, :func:`pairwise_reduce`.
The 2-D engine (:func:`tiled_reduce`) is also used by :mod:`memwise.attention` and
:mod:`memwise.ot`.

What is not optimal yet: forward-mode (``jax.jvp``) through these primitives raises
JAX's custom_vjp TypeError; second derivatives work (the backward is ordinary JAX code)
but their memory is not bounded by a tile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise import knobs

__all__ = [
    "Chunking",
    "chunking",
    "tiling",
    "tiled_reduce",
    "chunked_map",
    "chunked_sum",
    "pairwise_reduce",
]

# A tile of about this many bytes of intermediates: large enough that the per-tile loop
# overhead is negligible, small enough to be a rounding error next to the inputs.
TILE_BYTES = 8 * 2**20
_MAX_AUTO_CHUNK = 2**16


# ----------------------------------------------------------------------------------------
# The chunking helper.


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How one axis of ``length`` items is cut into ``n_chunks`` chunks of ``size``.

    The last chunk is padded to ``size`` by repeating the last item, so a chunk body sees
    only values the user's function accepts; :meth:`mask` says which slots are real.
    """

    length: int
    size: int

    @property
    def n_chunks(self) -> int:
        return -(-self.length // self.size)

    @property
    def padded(self) -> int:
        return self.n_chunks * self.size

    @property
    def ragged(self) -> bool:
        return self.padded != self.length

    def split(self, tree: Any, *, pad: str = "edge") -> Any:
        """``(length, ...)`` leaves -> ``(n_chunks, size, ...)``; pad ``"edge"`` or ``"zero"``."""

        def one(leaf):
            leaf = jnp.asarray(leaf)
            extra = self.padded - self.length
            if extra:
                if pad == "edge":
                    tail = jnp.broadcast_to(leaf[-1:], (extra,) + leaf.shape[1:])
                else:
                    tail = jnp.zeros((extra,) + leaf.shape[1:], leaf.dtype)
                leaf = jnp.concatenate([leaf, tail], axis=0)
            return leaf.reshape((self.n_chunks, self.size) + leaf.shape[1:])

        return jax.tree.map(one, tree)

    def merge(self, tree: Any) -> Any:
        """``(n_chunks, size, ...)`` leaves -> ``(length, ...)`` (padding dropped)."""
        return jax.tree.map(
            lambda a: a.reshape((self.padded,) + a.shape[2:])[: self.length], tree
        )

    def ids(self) -> np.ndarray:
        """Global index of every slot, ``(n_chunks, size)`` int32 (padding >= length)."""
        return np.arange(self.padded, dtype=np.int32).reshape(self.n_chunks, self.size)

    def mask(self) -> np.ndarray:
        """``(n_chunks, size)`` bool: True for real items, False for padding."""
        return self.ids() < self.length

    def block(self, leaf: jax.Array, start: jax.Array, *, axis: int = 0) -> jax.Array:
        """The ``size`` items from ``start`` along ``axis`` of an unpadded array.

        No padded copy of ``leaf`` is made (it may be a large n x m mask or bias): the
        slice is clamped inside the array and rolled so slot ``k`` holds item
        ``start + k``; slots past the end hold other items, masked by the caller.
        """
        clamped = jnp.minimum(start, self.length - self.size)
        out = lax.dynamic_slice_in_dim(leaf, clamped, self.size, axis=axis)
        if not self.ragged:
            return out
        return jnp.roll(out, clamped - start, axis=axis)


def _check_positive_int(value: Any, arg: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{arg} must be a positive int, a (rows, cols) tuple of them, or 'auto'; "
            f"got {value!r}"
        )
    if value <= 0:
        raise ValueError(f"{arg} must be >= 1, got {value}; pass e.g. {arg}=1024 or 'auto'")
    return int(value)


def _relative_cost(work: Sequence[float]) -> list[float]:
    """Relative compute per candidate, made nondecreasing as knobs.auto expects."""
    base = work[0]
    out, running = [], 1.0
    for w in work:
        running = max(running, w / base)
        out.append(running)
    return out


# Per-chunk loop overhead, in bytes of intermediates processed: a loop iteration costs a
# few microseconds, about as long as streaming 64 KiB of intermediates. The cost of a
# chunk size is then (padded items x bytes per item + chunks x this), so cheap items
# want large chunks and expensive items amortise the loop at any size.
_LOOP_OVERHEAD_BYTES = 64 * 2**10


def chunking(
    length: int,
    chunk_size: int | str,
    *,
    item_bytes: int | None = None,
    arg: str = "chunk_size",
) -> Chunking:
    """Resolve ``chunk_size`` for one axis of ``length`` items.

    Args:
      length: number of items (>= 1).
      chunk_size: a positive int (clipped to ``length``), or ``"auto"``: a
        :func:`memwise.knobs.auto` knob whose candidates run from one chunk (fastest) to
        small chunks, defaulting to about :data:`TILE_BYTES` of intermediates per chunk.
      item_bytes: estimated intermediate bytes per item (for ``"auto"``).
      arg: argument name used in error messages.

    Example::

        c = chunking(10, 4)          # Chunking(length=10, size=4): 3 chunks, last ragged
        chunks = c.split(jnp.arange(10.0))   # shape (3, 4), padded with 9.0
    """
    if length < 1:
        raise ValueError(f"cannot chunk an axis of length {length}: it needs >= 1 item")
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(f"{arg} must be a positive int or 'auto', got {chunk_size!r}")
        per_item = max(int(item_bytes or 64), 1)
        default = _pow2_floor(max(1, TILE_BYTES // per_item))
        candidates = [length] + [
            s for s in (2**k for k in range(16, -1, -1)) if s < length and s >= 1
        ][:12]
        work = [
            Chunking(length, c).padded * per_item + _LOOP_OVERHEAD_BYTES * Chunking(length, c).n_chunks
            for c in candidates
        ]
        size = knobs.auto(
            "chunk_size",
            candidates=candidates,
            cost=_relative_cost(work),
            default=min(default, length),
        )
        return Chunking(length, min(int(size), length))
    return Chunking(length, min(_check_positive_int(chunk_size, arg), length))


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def tiling(
    n: int,
    m: int,
    chunk_size: int | tuple[int, int] | str,
    *,
    pair_bytes: int | None = None,
    arg: str = "chunk_size",
) -> tuple[Chunking, Chunking]:
    """Resolve a 2-D ``chunk_size`` into (row, column) :class:`Chunking` s.

    ``chunk_size`` is an int (square tiles), a ``(rows, cols)`` tuple, or ``"auto"``: a
    :func:`memwise.knobs.auto` knob over square-ish power-of-two tiles, largest first,
    defaulting to about :data:`TILE_BYTES` of intermediates per tile (``pair_bytes`` per
    pair, estimated by the caller). Sizes are clipped to ``n`` and ``m``.

    Example::

        rows, cols = tiling(20_000, 20_000, (1024, 2048))
        rows.n_chunks, cols.n_chunks     # (20, 10)
    """
    if n < 1 or m < 1:
        raise ValueError(f"cannot tile an empty {n} x {m} pairwise computation")
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(
                f"{arg} must be a positive int, a (rows, cols) tuple or 'auto', "
                f"got {chunk_size!r}"
            )
        per_pair = max(int(pair_bytes or 64), 1)

        def fit(pairs: int) -> tuple[int, int]:
            cols = min(m, _pow2_floor(max(1, int(math.isqrt(max(pairs, 1))))))
            rows = min(n, _pow2_floor(max(1, pairs // cols)))
            cols = min(m, _pow2_floor(max(1, pairs // rows)))
            return rows, cols

        default = fit(TILE_BYTES // per_pair)
        # Largest first. Known limit of the cost model (loop overhead and padding only):
        # for cheap, memory-bound pair functions tiles far beyond the caches are slower
        # on CPU (benchmarks/fit.py, pointcloud), while compute-bound ones (kip) are
        # fastest with the largest tile; it does not tell the two apart.
        candidates = []
        for k in range(26, 7, -1):
            tile = fit(2**k)
            if tile not in candidates:
                candidates.append(tile)
        if default not in candidates:
            candidates.append(default)
            candidates.sort(key=lambda t: -t[0] * t[1])

        def work(tile):
            r, c = Chunking(n, tile[0]), Chunking(m, tile[1])
            return r.padded * c.padded * per_pair + _LOOP_OVERHEAD_BYTES * r.n_chunks * c.n_chunks

        rows, cols = knobs.auto(
            "chunk_size",
            candidates=candidates,
            cost=_relative_cost([work(t) for t in candidates]),
            default=default,
        )
        return Chunking(n, min(rows, n)), Chunking(m, min(cols, m))
    if isinstance(chunk_size, (tuple, list)):
        if len(chunk_size) != 2:
            raise ValueError(f"{arg} as a tuple must be (rows, cols), got {chunk_size!r}")
        rows = _check_positive_int(chunk_size[0], f"{arg}[0]")
        cols = _check_positive_int(chunk_size[1], f"{arg}[1]")
    else:
        rows = cols = _check_positive_int(chunk_size, arg)
    return Chunking(n, min(rows, n)), Chunking(m, min(cols, m))


def traced_bytes(fn: Callable, *example_args: Any) -> int:
    """Bytes of all intermediates of ``fn`` on one example (an estimate for ``"auto"``)."""
    try:
        jaxpr = jax.make_jaxpr(fn)(*example_args)
    except Exception:  # the caller reports real errors; this is only an estimate
        return 64
    total = 0
    for eqn in jaxpr.jaxpr.eqns:
        for var in eqn.outvars:
            aval = getattr(var, "aval", None)
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                total += int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    return max(total, 4)


# ----------------------------------------------------------------------------------------
# Small helpers shared by the custom_vjp rules.


def _leading(tree: Any, arg: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{arg} has no arrays: pass an array or a pytree of arrays")
    lengths = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if None in lengths:
        raise ValueError(f"every leaf of {arg} needs a leading axis to chunk over (got a scalar)")
    if len(lengths) != 1:
        raise ValueError(
            f"the leaves of {arg} have different leading lengths {sorted(lengths)}; "
            "they must all index the same items"
        )
    return lengths.pop()


def _unwrap(primals: Sequence[Any]) -> tuple[list, list[bool]]:
    values = [p.value for p in primals]
    perturbed = [bool(p.perturbed) for p in primals]
    return values, perturbed


def _is_zero(ct: Any) -> bool:
    return isinstance(ct, jax.custom_derivatives.SymbolicZero)


def _instantiate(ct: Any, like: Any) -> Any:
    if _is_zero(ct):
        return jnp.zeros(np.shape(like), jnp.result_type(like))
    return ct


def _select(values: Sequence[Any], flags: Sequence[bool]) -> list:
    return [v for v, f in zip(values, flags) if f]


def _fill(values: Sequence[Any], flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    it = iter(chosen)
    return [next(it) if f else v for v, f in zip(values, flags)]


def _cotangents(values: Sequence[Any], flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    """Full cotangent list: computed ones where perturbed, None (a zero) elsewhere."""
    it = iter(chosen)
    return [next(it) if f else None for v, f in zip(values, flags)]


def _add(acc: Sequence[Any], new: Sequence[Any]) -> list:
    return [a + n.astype(a.dtype) for a, n in zip(acc, new)]


def _varying(leaf: Any) -> frozenset:
    """Mesh axes over which one value varies inside ``shard_map`` (empty elsewhere)."""
    aval = jax.typeof(leaf)
    mat = getattr(aval, "mat", None)  # jax >= 0.9; older releases call it .vma
    axes = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(axes or ())


def _vma(*trees: Any) -> frozenset:
    """Mesh axes over which any input varies (inside ``shard_map``; empty elsewhere)."""
    axes: frozenset = frozenset()
    for leaf in jax.tree.leaves(trees):
        axes |= _varying(leaf)
    return axes


def _vary(tree: Any, axes: frozenset) -> Any:
    """Loop-carry initial values typed as varying like the loop's inputs (shard_map)."""
    if not axes:
        return tree

    def one(a):
        missing = tuple(sorted(axes - _varying(a)))
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def _match_vma(cts: Sequence[Any], primals: Sequence[Any]) -> list:
    """Sum cotangents over the mesh axes their primal is replicated on, once, at the end.

    The backward loops run on inputs cast to varying (so the per-tile vjps accumulate
    local partial sums instead of all-reducing every tile); this is the one all-reduce.
    """
    out = []
    for ct, primal in zip(cts, primals):
        extra = tuple(sorted(_varying(ct) - _varying(primal)))
        out.append(lax.psum(ct, extra) if extra else ct)
    return out


def _zeros_typed_like(values: Sequence[Any]) -> list:
    """Zeros with the shape, dtype and shard_map varying axes of each value (loop carries)."""
    return [_vary(z, _varying(v)) for z, v in zip(_zeros_like(values), values)]


def _zeros_like(values: Sequence[Any]) -> list:
    return [jnp.zeros(jnp.shape(v), jnp.result_type(v)) for v in values]


# ----------------------------------------------------------------------------------------
# Many devices: which mesh axis the leading (row) axis is split over.


def _row_sharding(tree: Any, mesh: Any, axis_name: Any, arg: str, *, dim: int = 0):
    """``(mesh, axes)`` when axis ``dim`` (the leading one) of ``tree`` is to be split
    over a mesh.

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
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        for name in names:
            if name not in mesh.axis_names:
                raise ValueError(f"axis_name {name!r} is not an axis of the mesh {mesh.axis_names}")
        return mesh, axis_name
    if axis_name is not None:
        raise ValueError("axis_name needs mesh=: pass the jax.sharding.Mesh it belongs to")
    leaves = jax.tree.leaves(tree)
    if not leaves or _vma(leaves):
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
    names = axes if isinstance(axes, tuple) else (axes,)
    if int(np.prod([mesh.shape[n] for n in names])) == 1:
        return None
    return found


def _sharded_call(local: Callable, mesh: Any, in_specs: tuple, out_specs: Any, *args):
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


def _check_divisible(n: int, mesh: Any, axes: Any, arg: str) -> None:
    names = axes if isinstance(axes, tuple) else (axes,)
    devices = int(np.prod([mesh.shape[name] for name in names]))
    if n % devices:
        raise ValueError(
            f"{arg} has {n} rows, not divisible by the {devices} devices of mesh axis "
            f"{axes!r}; pad {arg} (e.g. with zero weights) to a multiple of {devices}"
        )


# ----------------------------------------------------------------------------------------
# 1-D: chunked_map and chunked_sum.


@dataclasses.dataclass(frozen=True, eq=False)
class _MapSpec:
    fn: Callable  # fn(x_item_tree, *consts) -> out tree
    kind: str  # "map" | "sum"
    chunks: Chunking
    xs_tree: Any
    n_consts: int
    # False when fn was traced inside shard_map with replicated closure constants: its
    # jaxpr then pins their varying-ness, so the backward must keep them replicated.
    vary_consts: bool = True

    def chunk_fn(self, xs_leaves, consts):
        xs = jax.tree.unflatten(self.xs_tree, xs_leaves)
        return jax.vmap(lambda x: self.fn(x, *consts))(xs)


def _chunk_of(chunks: Chunking, leaves: list, index: jax.Array) -> list:
    # Chunks are sliced from the unpadded inputs by index: reshaping (n, ...) into
    # (n_chunks, size, ...) can change XLA's layout (images (n, 28, 28, 1) on CPU) and
    # cost a full copy of xs, which would make the memory grow with n.
    return [chunks.block(a, index * chunks.size) for a in leaves]


def _map_forward(spec: _MapSpec, xs_leaves: list, consts: list):
    chunks = spec.chunks
    indices = jnp.arange(chunks.n_chunks)
    if spec.kind == "map":

        def body(_, i):
            return None, spec.chunk_fn(_chunk_of(chunks, xs_leaves, i), consts)

        _, ys = lax.scan(body, None, indices)
        return chunks.merge(ys)

    mask = jnp.asarray(chunks.mask())
    one = jax.eval_shape(
        lambda x: spec.chunk_fn(x, consts), _chunk_of(chunks, xs_leaves, jnp.int32(0))
    )
    init = jax.tree.map(lambda s: jnp.zeros(s.shape[1:], s.dtype), one)
    init = _vary(init, _vma(xs_leaves, consts))

    def body(acc, inp):
        i, valid = inp
        ys = spec.chunk_fn(_chunk_of(chunks, xs_leaves, i), consts)
        ys = jax.tree.map(
            lambda y: jnp.sum(jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, 0), 0),
            ys,
        )
        return jax.tree.map(jnp.add, acc, ys), None

    total, _ = lax.scan(body, init, (indices, mask))
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map_core(spec: _MapSpec, xs_leaves: list, consts: list):
    return _map_forward(spec, xs_leaves, consts)


def _map_core_fwd(spec, xs_primals, const_primals):
    xs_leaves, xs_flags = _unwrap(xs_primals)
    consts, const_flags = _unwrap(const_primals)
    out = _map_forward(spec, xs_leaves, consts)
    flags = (tuple(xs_flags), tuple(const_flags))
    return out, (xs_leaves, consts, _encode_flags(flags))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    """Static data (which inputs are perturbed) carried through custom_vjp residuals."""

    value: Any


def _encode_flags(flags):
    return _Static(flags)


def _decode_flags(encoded):
    return encoded.value


def _map_core_bwd(spec, res, ct):
    xs_leaves, consts, encoded = res
    xs_flags, const_flags = _decode_flags(encoded)
    chunks = spec.chunks
    out_like = jax.eval_shape(lambda: _map_forward(spec, xs_leaves, consts))
    ct = jax.tree.map(lambda c, o: _instantiate(c, o), ct, out_like,
                      is_leaf=_is_zero)
    mask = jnp.asarray(chunks.mask())
    axes = _vma(xs_leaves, consts, ct)
    primal_consts = consts
    xs_vary = _vary(xs_leaves, axes)
    if spec.vary_consts:
        consts = _vary(consts, axes)
    diff_consts = _select(consts, const_flags)

    def body(acc, inp):
        i, valid = inp
        xc = _chunk_of(chunks, xs_vary, i)
        if spec.kind == "map":
            ctc = jax.tree.map(
                lambda c: jnp.where(
                    valid.reshape((-1,) + (1,) * (c.ndim - 1)), chunks.block(c, i * chunks.size), 0
                ),
                ct,
            )
        else:
            ctc = jax.tree.map(
                lambda c: jnp.where(
                    valid.reshape((-1,) + (1,) * c.ndim),
                    jnp.broadcast_to(c, valid.shape + c.shape),
                    0,
                ),
                ct,
            )

        def f(x_d, c_d):
            return spec.chunk_fn(_fill(xc, xs_flags, x_d), _fill(consts, const_flags, c_d))

        _, vjp = jax.vjp(f, _select(xc, xs_flags), diff_consts)
        dx, dc = vjp(ctc)
        return _add(acc, dc), dx

    acc, dxs = lax.scan(
        body, _zeros_typed_like(diff_consts), (jnp.arange(chunks.n_chunks), mask)
    )
    dxs = _match_vma(chunks.merge(dxs), _select(xs_leaves, xs_flags))
    acc = _match_vma(acc, _select(primal_consts, const_flags))
    return _cotangents(xs_leaves, xs_flags, dxs), _cotangents(consts, const_flags, acc)


_map_core.defvjp(_map_core_fwd, _map_core_bwd, symbolic_zeros=True)


def _first_items(tree: Any) -> Any:
    """Example points for tracing: zeros shaped like one item (slicing one row of an
    explicitly sharded array is not allowed), varying over the same mesh axes."""
    return jax.tree.map(
        lambda a: _vary(jnp.zeros(jnp.shape(a)[1:], jnp.result_type(a)), _varying(a)), tree
    )


def _convert(fn: Callable, data: tuple, examples: Callable[[tuple], tuple]):
    """``jax.closure_convert`` of ``fn`` at example points of ``data``.

    Inside a user's ``shard_map`` the traced jaxpr pins which values are replicated, so
    the data is first cast to vary over every mesh axis any input or closed-over constant
    varies on (the cast is differentiable: its transpose is the one all-reduce the
    gradient of a replicated input needs), and the closure constants are then left as
    they are (``vary_consts=False``). Returns ``(converted, consts, data, vary_consts)``.
    """
    converted, consts = jax.closure_convert(fn, *examples(data))
    axes = _vma(data, consts)
    if axes:
        data = _vary(data, axes)
        converted, consts = jax.closure_convert(fn, *examples(data))
    return converted, list(consts), data, not axes


def _prepare_1d(f, xs, chunk_size, kind):
    if not callable(f):
        raise TypeError(f"f must be a callable of one item of xs, got {type(f).__name__}")
    n = _leading(xs, "xs")
    xs = jax.tree.map(jnp.asarray, xs)
    try:
        converted, consts, (xs,), vary_consts = _convert(
            f, (xs,), lambda d: (_first_items(d[0]),)
        )
    except Exception as e:
        raise ValueError(
            f"f failed on one item of xs (leaf shapes "
            f"{[np.shape(a)[1:] for a in jax.tree.leaves(xs)]}): {e}"
        ) from e
    chunks = chunking(n, chunk_size, item_bytes=traced_bytes(f, _first_items(xs)) * 3)
    xs_leaves, xs_tree = jax.tree.flatten(xs)
    spec = _MapSpec(converted, kind, chunks, xs_tree, len(consts), vary_consts)
    return spec, xs_leaves, consts


def _chunked_1d(f, xs, chunk_size, kind, mesh, axis_name):
    sharded = _row_sharding(xs, mesh, axis_name, "xs")
    if sharded is None:
        spec, xs_leaves, consts = _prepare_1d(f, xs, chunk_size, kind)
        return _map_core(spec, xs_leaves, consts)
    mesh, axes = sharded
    _check_divisible(_leading(xs, "xs"), mesh, axes, "xs")
    # Closure constants become explicit replicated operands of the shard_map.
    converted, consts = jax.closure_convert(f, _first_items(xs))

    def local(xs_local, consts):
        out = _chunked_1d(
            lambda x: converted(x, *consts), xs_local, chunk_size, kind, None, None
        )
        return jax.tree.map(lambda o: lax.psum(o, axes), out) if kind == "sum" else out

    out_spec = P(axes) if kind == "map" else P()
    return _sharded_call(local, mesh, (P(axes), P()), out_spec, xs, list(consts))


def chunked_map(
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Any:
    """``jax.lax.map(f, xs, batch_size=chunk_size)`` whose gradient is chunked too.

    ``f`` is applied to each item of ``xs`` (a pytree of arrays sharing their leading
    axis), vectorised over ``chunk_size`` items at a time. Under reverse mode each chunk is
    recomputed and differentiated in turn, so the backward holds one chunk's
    intermediates, not all of them (``lax.map`` keeps every chunk's). Gradients flow to
    ``xs`` and to any array ``f`` closes over.

    Trade-off: the backward evaluates ``f`` once more (about +1 forward of compute) in
    exchange for peak memory = outputs + one chunk's intermediates. A ragged last chunk is
    padded (one compiled body).

    Args:
      f: function of one item of ``xs``, returning a pytree of arrays.
      xs: pytree of arrays with a common leading length ``n``.
      chunk_size: items per chunk (int >= 1) or ``"auto"``.
      mesh, axis_name: run sharded, the items of ``xs`` split over mesh axis
        ``axis_name`` (see :func:`pairwise_reduce`); detected from ``xs``'s sharding
        when it is a concrete array with a ``NamedSharding`` (pass them under ``jit``).

    Returns:
      ``f``'s outputs stacked along a new leading axis of length ``n``.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> w = jnp.ones((3, 3))
        >>> ys = mw.chunked_map(lambda x: jnp.tanh(w @ x), jnp.ones((10, 3)), chunk_size=4)
        >>> ys.shape
        (10, 3)
    """
    return _chunked_1d(f, xs, chunk_size, "map", mesh, axis_name)


def chunked_sum(
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Any:
    """``sum_i f(x_i)`` over the items of ``xs`` with O(chunk) memory both ways.

    Same contract as :func:`chunked_map` but the per-item outputs (any pytree) are summed
    as they are produced; the backward re-evaluates and differentiates one chunk at a
    time, accumulating gradients of closed-over arrays in the loop carry. Memory: inputs +
    one output + one chunk's intermediates, forward and backward; compute: about one
    extra forward.

    Args:
      f: function of one item of ``xs``, returning a pytree of arrays.
      xs: pytree of arrays with a common leading length ``n``.
      chunk_size: items per chunk (int >= 1) or ``"auto"``.
      mesh, axis_name: as for :func:`chunked_map`; each device sums its items, then one
        ``psum``.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> xs = jnp.arange(10.0)
        >>> float(mw.chunked_sum(lambda x: x ** 2, xs, chunk_size=3))
        285.0
    """
    return _chunked_1d(f, xs, chunk_size, "sum", mesh, axis_name)


# ----------------------------------------------------------------------------------------
# 2-D: the tiled reduction engine.

REDUCTIONS = ("sum", "logsumexp", "max", "softmax")


@dataclasses.dataclass(frozen=True, eq=False)
class _TileSpec:
    """Static description of one tiled reduction (a nondiff argument of the custom_vjp).

    ``tile_fn(rows, cols, pairs, consts, row_ids, col_ids)`` returns the scores of one
    tile, shape ``(R, C) + trailing``; for ``"softmax"`` it returns ``(scores (R, C),
    values (C, dv))`` and the reduction is ``sum_j softmax_j(scores) values_j``.
    Scores equal to -inf are excluded (masking).
    """

    tile_fn: Callable
    reduce: str
    rows: Chunking
    cols: Chunking
    trees: tuple  # treedefs of (rows, cols, pairs, consts)
    vary_consts: bool = True  # see _MapSpec.vary_consts
    # live(row_ids, col_ids, consts) -> bool scalar: False when every score of the tile is
    # -inf (e.g. above a causal diagonal); such tiles are skipped with lax.cond.
    live: Callable | None = None

    def tile(self, leaves: Sequence[list], row_ids, col_ids):
        rows, cols, pairs, consts = (
            jax.tree.unflatten(t, l) for t, l in zip(self.trees, leaves)
        )
        return self.tile_fn(rows, cols, pairs, consts, row_ids, col_ids)

    def is_live(self, row_ids, col_ids, const_leaves) -> jax.Array:
        return self.live(row_ids, col_ids, jax.tree.unflatten(self.trees[3], const_leaves))


def _expand(a: jax.Array, ndim: int) -> jax.Array:
    """Append singleton axes so a per-row ``(R,)`` array broadcasts against ``ndim`` dims."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _pair_blocks(spec: _TileSpec, pairs: list, i_start, j_start) -> list:
    return [
        spec.cols.block(spec.rows.block(p, i_start, axis=0), j_start, axis=1) for p in pairs
    ]


def _safe_max(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _row_pass(spec: _TileSpec, rows, cols_c, col_ids, col_valid, pairs, consts, row_ids):
    """Reduce one row block over all column tiles (the forward pass of one row block)."""
    reduce = spec.reduce

    def scores_of(col_blk, c_ids):
        pblk = _pair_blocks(spec, pairs, row_ids[0], c_ids[0])
        return spec.tile((rows, col_blk, pblk, consts), row_ids, c_ids)

    first = jax.eval_shape(scores_of, [a[0] for a in cols_c], col_ids[0])
    if reduce == "softmax":
        s_shape, v_shape = first
        dtype = jnp.result_type(s_shape.dtype, v_shape.dtype)
        R = s_shape.shape[0]
        init = (
            jnp.full((R,), -jnp.inf, dtype),
            jnp.zeros((R,), dtype),
            jnp.zeros((R,) + v_shape.shape[1:], dtype),
        )
    else:
        R, trailing, dtype = first.shape[0], first.shape[2:], first.dtype
        if reduce == "sum":
            init = jnp.zeros((R,) + trailing, dtype)
        elif reduce == "logsumexp":
            init = (jnp.full((R,) + trailing, -jnp.inf, dtype), jnp.zeros((R,) + trailing, dtype))
        else:  # max
            init = (
                jnp.full((R,) + trailing, -jnp.inf, dtype),
                jnp.zeros((R,) + trailing, jnp.int32),
            )

    init = _vary(init, _vma(rows, cols_c, pairs, consts))

    def body(state, inp):
        if spec.live is None:
            return step(state, inp), None
        # The predicate depends on tile indices only (never on vmapped data), so under
        # vmap this stays a real branch and a dead tile costs nothing.
        keep = spec.is_live(row_ids, inp[1], consts)
        return lax.cond(keep, step, lambda s, _: s, state, inp), None

    def step(state, inp):
        col_blk, c_ids, c_valid = inp
        out = scores_of(col_blk, c_ids)
        if reduce == "softmax":
            s, vals = out
            s = jnp.where(c_valid[None, :], s, -jnp.inf)
            m, l, acc = state
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _safe_max(m_new)
            p = jnp.exp(s - shift[:, None])
            scale = jnp.exp(m - shift)
            l = l * scale + jnp.sum(p, axis=1)
            acc = acc * _expand(scale, acc.ndim) + jnp.tensordot(p, vals.astype(p.dtype), 1)
            return (m_new, l, acc)
        s = out
        valid = _expand(c_valid[None, :], s.ndim)
        if reduce == "sum":
            return state + jnp.sum(jnp.where(valid, s, 0), axis=1)
        if reduce == "logsumexp":
            m, l = state
            s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _safe_max(m_new)
            l = l * jnp.exp(m - shift) + jnp.sum(jnp.exp(s - shift[:, None]), axis=1)
            return (m_new, l)
        m, arg = state
        s = jnp.where(valid, s, -jnp.inf)
        tile_arg = jnp.argmax(s, axis=1)
        tile_max = jnp.max(s, axis=1)
        better = tile_max > m
        arg = jnp.where(better, c_ids[tile_arg].astype(jnp.int32), arg)
        return (jnp.maximum(m, tile_max), arg)

    state, _ = lax.scan(body, init, (cols_c, col_ids, col_valid))
    if reduce == "sum":
        return state
    if reduce == "logsumexp":
        m, l = state
        return _safe_max(m) + jnp.log(l)
    if reduce == "max":
        return state
    m, l, acc = state
    lse = _safe_max(m) + jnp.log(l)
    out = acc / _expand(jnp.where(l > 0, l, 1.0), acc.ndim)
    return out, lse


def _tiled_forward(spec: _TileSpec, rows, cols, pairs, consts):
    R, C = spec.rows, spec.cols
    rows_c = R.split(rows)
    cols_c = C.split(cols)
    col_ids = jnp.asarray(C.ids())
    col_valid = jnp.asarray(C.mask())

    def one_row_block(inp):
        row_blk, r_ids = inp
        return _row_pass(spec, row_blk, cols_c, col_ids, col_valid, pairs, consts, r_ids)

    out = lax.map(one_row_block, (rows_c, jnp.asarray(R.ids())))
    return R.merge(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled_core(spec: _TileSpec, rows, cols, pairs, consts):
    return _tiled_forward(spec, rows, cols, pairs, consts)


def _tiled_core_fwd(spec, *primals):
    values, flags = zip(*(_unwrap(p) for p in primals))
    out = _tiled_forward(spec, *values)
    saved = out if spec.reduce != "sum" else None
    return out, (values, saved, _encode_flags(tuple(tuple(f) for f in flags)))


def _tiled_core_bwd(spec, res, ct):
    values, saved, encoded = res
    flags = _decode_flags(encoded)
    rows, cols, pairs, consts = values
    # A tile's vjp holds its scores, their cotangent and fn's residuals: about twice a
    # forward tile's live set. Halving the rows keeps the gradient's peak near the
    # forward's for the same chunk_size.
    spec = dataclasses.replace(
        spec, rows=Chunking(spec.rows.length, max(1, spec.rows.size // 2))
    )
    R, C = spec.rows, spec.cols
    reduce = spec.reduce

    # Per-row quantities the backward needs: the cotangent and the saved result.
    if reduce == "sum":
        per_row = (ct,)
    elif reduce == "logsumexp":
        per_row = (ct, saved)
    elif reduce == "max":
        value_ct = ct[0]
        per_row = (value_ct, saved[1])
    else:
        out, lse = saved
        ct_out = _instantiate(ct[0], out)
        ct_lse = _instantiate(ct[1], lse)
        delta = jnp.sum((ct_out * out).reshape(out.shape[0], -1), axis=1)
        per_row = (ct_out, ct_lse - delta, lse)
    per_row = list(per_row)
    if reduce != "softmax":
        like = saved[0] if reduce == "max" else (saved if saved is not None else None)
        if _is_zero(per_row[0]):
            shape_src = jax.eval_shape(lambda: _tiled_forward(spec, *values))
            shape_src = shape_src[0] if reduce == "max" else shape_src
            per_row[0] = jnp.zeros(shape_src.shape, shape_src.dtype)
        del like

    row_f, col_f, pair_f, const_f = flags
    axes = _vma(values, per_row)
    primals = values
    # Replicated inputs enter the loops as varying copies so that each tile's vjp yields
    # a local partial cotangent; _match_vma all-reduces once at the end.
    rows, cols, pairs = _vary(values[:3], axes)
    consts = _vary(values[3], axes) if spec.vary_consts else values[3]
    per_row_c = R.split(per_row, pad="zero")
    rows_c = R.split(rows)
    cols_c = C.split(cols)
    row_ids, col_ids = jnp.asarray(R.ids()), jnp.asarray(C.ids())
    col_valid = jnp.asarray(C.mask())
    d_consts0 = _zeros_typed_like(_select(consts, const_f))
    d_cols0 = _zeros_typed_like(_select(cols_c, col_f))
    pad_pairs = [
        _vary(jnp.zeros((R.padded, C.padded) + jnp.shape(p)[2:], jnp.result_type(p)), axes)
        for p in _select(pairs, pair_f)
    ]

    def row_body(carry, inp):
        d_cols, d_pairs, d_consts = carry
        row_blk, r_ids, row_data = inp

        def col_body(carry2, inp2):
            d_row, d_cols, d_pairs, d_consts = carry2
            col_blk, c_ids, c_valid, j = inp2
            pblk = _pair_blocks(spec, pairs, r_ids[0], c_ids[0])

            def f(r_d, c_d, p_d, k_d):
                return spec.tile(
                    (
                        _fill(row_blk, row_f, r_d),
                        _fill(col_blk, col_f, c_d),
                        _fill(pblk, pair_f, p_d),
                        _fill(consts, const_f, k_d),
                    ),
                    r_ids,
                    c_ids,
                )

            primal_in = (
                _select(row_blk, row_f),
                _select(col_blk, col_f),
                _select(pblk, pair_f),
                _select(consts, const_f),
            )
            def tile_grads():
                out, vjp = jax.vjp(f, *primal_in)
                return vjp(_score_cotangent(reduce, out, row_data, c_valid, c_ids))

            if spec.live is None:
                dr, dc, dp, dk = tile_grads()
            else:
                # Only the tile's cotangents are branched (not the carried accumulators),
                # so the cond never copies an O(n) or O(n m) buffer.
                dr, dc, dp, dk = lax.cond(
                    spec.is_live(r_ids, c_ids, consts),
                    tile_grads,
                    lambda: tuple(_zeros_typed_like(group) for group in primal_in),
                )
            d_row = _add(d_row, dr)
            d_cols = [acc.at[j].add(g.astype(acc.dtype)) for acc, g in zip(d_cols, dc)]
            d_pairs = [_add_block(acc, g, r_ids[0], c_ids[0]) for acc, g in zip(d_pairs, dp)]
            return (d_row, d_cols, d_pairs, _add(d_consts, dk)), None

        d_row0 = _zeros_typed_like(_select(row_blk, row_f))
        (d_row, d_cols, d_pairs, d_consts), _ = lax.scan(
            col_body,
            (d_row0, d_cols, d_pairs, d_consts),
            (cols_c, col_ids, col_valid, jnp.arange(C.n_chunks)),
        )
        return (d_cols, d_pairs, d_consts), d_row

    (d_cols, d_pairs, d_consts), d_rows = lax.scan(
        row_body, (d_cols0, pad_pairs, d_consts0), (rows_c, row_ids, per_row_c)
    )
    d_rows = _match_vma(R.merge(d_rows), _select(primals[0], row_f))
    d_cols = _match_vma(C.merge(d_cols), _select(primals[1], col_f))
    d_pairs = _match_vma(
        [a[: R.length, : C.length] for a in d_pairs], _select(primals[2], pair_f)
    )
    d_consts = _match_vma(d_consts, _select(primals[3], const_f))
    return (
        _cotangents(rows, row_f, d_rows),
        _cotangents(cols, col_f, d_cols),
        _cotangents(pairs, pair_f, d_pairs),
        _cotangents(consts, const_f, d_consts),
    )


def _add_block(acc, g, i0, j0):
    r, c = g.shape[0], g.shape[1]
    cur = lax.dynamic_slice(acc, (i0, j0) + (0,) * (acc.ndim - 2), (r, c) + acc.shape[2:])
    return lax.dynamic_update_slice(acc, cur + g.astype(acc.dtype), (i0, j0) + (0,) * (acc.ndim - 2))


def _score_cotangent(reduce, out, row_data, c_valid, c_ids):
    """d(result)/d(tile scores) contracted with the per-row cotangent: one tile's worth."""
    if reduce == "softmax":
        s, vals = out
        ct_out, ct_lse_minus_delta, lse = row_data
        valid = c_valid[None, :] & jnp.isfinite(lse)[:, None]
        p = jnp.where(valid, jnp.exp(s - _safe_max(lse)[:, None]), 0.0)
        ct2 = ct_out.reshape(ct_out.shape[0], -1).astype(p.dtype)
        v2 = vals.reshape(vals.shape[0], -1).astype(p.dtype)
        dp = ct2 @ v2.T
        ds = p * (dp + ct_lse_minus_delta[:, None])
        d_vals = (p.T @ ct2).reshape(vals.shape).astype(vals.dtype)
        return ds.astype(s.dtype), d_vals
    s = out
    ct_row = row_data[0]
    valid = _expand(c_valid[None, :], s.ndim)
    ct_b = jnp.expand_dims(ct_row, 1).astype(s.dtype)
    if reduce == "sum":
        return jnp.where(valid, jnp.broadcast_to(ct_b, s.shape), 0)
    if reduce == "logsumexp":
        lse = jnp.expand_dims(row_data[1], 1)
        live = valid & jnp.isfinite(lse)
        return jnp.where(live, ct_b * jnp.exp(s - _safe_max(lse)), 0)
    arg = jnp.expand_dims(row_data[1], 1)
    hit = _expand(c_ids[None, :], s.ndim) == arg
    return jnp.where(valid & hit, jnp.broadcast_to(ct_b, s.shape), 0)


_tiled_core.defvjp(_tiled_core_fwd, _tiled_core_bwd, symbolic_zeros=True)


def tiled_reduce(
    tile_fn: Callable,
    rows: Any,
    cols: Any,
    *,
    reduce: str,
    chunk_size: int | tuple[int, int] | str,
    pairs: Any = (),
    consts: Any = (),
    pair_bytes: int | None = None,
    vary_consts: bool = True,
    live: Callable | None = None,
) -> Any:
    """The engine: reduce tile scores over columns, for every row, tile by tile.

    ``tile_fn(rows_blk, cols_blk, pairs_blk, consts, row_ids, col_ids)`` returns the
    scores of one ``(R, C)`` tile (trailing dims allowed; ``-inf`` = excluded), or for
    ``reduce="softmax"`` a pair ``(scores (R, C), values (C, ...))``. ``rows`` and
    ``cols`` are pytrees with leading lengths n and m; ``pairs`` have leading ``(n, m)``
    and are sliced tile by tile without a padded copy; ``consts`` are passed whole.
    Gradients flow to all four (``tile_fn`` must not close over traced arrays; pass them
    in ``consts``). Results: ``"sum"``/``"logsumexp"``: ``(n,) + trailing``; ``"max"``:
    ``(values, argmax)``; ``"softmax"``: ``(out (n, ...), lse (n,))``.

    Inside ``shard_map``, pass ``vary_consts=False`` when ``tile_fn`` evaluates a jaxpr
    traced with replicated ``consts`` (e.g. from ``jax.closure_convert``).

    ``live(row_ids, col_ids, consts) -> bool scalar`` (optional) marks tiles that can
    hold a finite score; the others are skipped (``lax.cond`` in the one loop body,
    forward and backward). It must depend on the indices and ``consts`` only: a causal
    mask halves the work this way.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    n = _leading(rows, "rows")
    m = _leading(cols, "cols")
    row_tiles, col_tiles = tiling(n, m, chunk_size, pair_bytes=pair_bytes)
    flat = [jax.tree.flatten(t) for t in (rows, cols, pairs, consts)]
    spec = _TileSpec(
        tile_fn, reduce, row_tiles, col_tiles, tuple(tree for _, tree in flat), vary_consts,
        live,
    )
    leaves = [[jnp.asarray(a) for a in lv] for lv, _ in flat]
    return _tiled_core(spec, *leaves)


# ----------------------------------------------------------------------------------------
# pairwise_reduce: the user-facing reduction of fn(x_i, y_j).

_PAIRWISE = ("sum", "logsumexp", "max", "min", "argmax", "argmin")


def pairwise_reduce(
    fn: Callable,
    x: Any,
    y: Any,
    *,
    reduce: str = "sum",
    weights: jax.Array | None = None,
    chunk_size: int | tuple[int, int] | str = "auto",
    axis: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``reduce_j fn(x_i, y_j) [* or + weights_j]`` without ever holding an n x m array.

    For every row ``i`` (``axis=1``; ``axis=0`` reduces over rows instead, giving one
    result per column) the values ``fn(x_i, y_j)`` are reduced over ``j``, tile by
    tile. ``fn`` is any JAX function of two points (pytrees allowed; ``x`` and ``y`` are
    pytrees whose leaves share a leading axis of n and m points) returning a scalar or
    an array. ``weights`` (shape ``(m,) + w``, broadcast against ``fn``'s output)
    multiply the values for ``"sum"`` (``K @ w`` for a kernel ``fn``) and are added as
    log-weights for ``"logsumexp"``. ``"max"``/``"min"`` return the extreme value (gradient
    flows to the arg-extreme pair: a subgradient), ``"argmax"``/``"argmin"`` its index
    (int32, no gradient).

    Memory, forward and backward: inputs + outputs + one ``chunk_size`` tile of ``fn``'s
    intermediates. The backward is one more tiled pass that re-evaluates ``fn`` under
    ``jax.vjp`` (KeOps: the gradient of a reduction is a reduction); ``logsumexp``
    re-forms each tile's probabilities from the saved per-row result. Compute: the
    gradient costs about 2-3 forward passes. Gradients reach ``x``, ``y``, ``weights``
    and every array ``fn`` closes over.

    Args:
      fn: ``fn(x_i, y_j) -> scalar or array``.
      x: pytree of arrays, leading axis n.
      y: pytree of arrays, leading axis m.
      reduce: ``"sum"``, ``"logsumexp"``, ``"max"``, ``"min"``, ``"argmax"``, ``"argmin"``.
      weights: optional ``(m,) + w`` array (``(n,) + w`` when ``axis=0``).
      chunk_size: tile ``(rows, cols)``, an int for square tiles, or ``"auto"``
        (:func:`memwise.knobs.auto`; default tile ~8 MiB of intermediates).
      axis: 1 to reduce over ``y`` (one result per x), 0 to reduce over ``x``.
      mesh, axis_name: run on many devices with the points of ``x`` split over mesh axis
        ``axis_name`` and ``y`` replicated (``shard_map``): each device tiles its own
        rows, forward and backward, and the gradient of ``y`` is all-reduced once. With
        ``axis=0`` (reducing over the split points) the per-device partial results are
        combined with ``psum`` (sum, logsumexp) or ``all_gather`` (max/min). Detected
        without these arguments when ``x`` (else ``y``) is a concrete array with a
        ``NamedSharding`` over its first axis; under ``jit`` pass them explicitly.

    Returns:
      Array of shape ``(n,) + out`` (``(m,) + out`` for ``axis=0``).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> x, y = jnp.ones((5, 2)), jnp.zeros((7, 2))
        >>> cost = lambda a, b: jnp.sum((a - b) ** 2)
        >>> mw.pairwise_reduce(lambda a, b: -cost(a, b), x, y, reduce="logsumexp",
        ...                    chunk_size=(2, 3)).shape
        (5,)
    """
    if reduce not in _PAIRWISE:
        raise ValueError(f"reduce must be one of {_PAIRWISE}, got {reduce!r}")
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"axis must be 1 (reduce over y) or 0 (reduce over x), got {axis!r}")
    if not callable(fn):
        raise TypeError(f"fn must be a callable of two points, got {type(fn).__name__}")
    if weights is not None:
        weights = jnp.asarray(weights)
    # Which side is split over devices: x's rows (mesh= always means x), else y's.
    x_shard = _row_sharding(x, mesh, axis_name, "x")
    y_shard = None if x_shard is not None or mesh is not None else _row_sharding(y, None, None, "y")
    if axis in (0, -2):
        x_shard, y_shard = y_shard, x_shard
        x, y = y, x  # reduce over the points of x: the engine always reduces columns
        fn = _swapped(fn)
        chunk_size = _swap(chunk_size)
    reduced, kept = ("x", "y") if axis in (0, -2) else ("y", "x")
    n = _leading(x, kept)
    m = _leading(y, reduced)
    x = jax.tree.map(jnp.asarray, x)
    y = jax.tree.map(jnp.asarray, y)
    if weights is not None:
        if reduce not in ("sum", "logsumexp"):
            raise ValueError(
                f"weights are not supported with reduce={reduce!r}; fold them into fn"
            )
        if weights.ndim < 1 or weights.shape[0] != m:
            raise ValueError(
                f"weights must have shape ({m},) + trailing (one per point of {reduced}), "
                f"got {weights.shape}"
            )
    try:
        out0 = jax.eval_shape(fn, _first_items(x), _first_items(y))
    except Exception as e:
        raise ValueError(
            "fn(x[i], y[j]) failed on one pair of points; check that the trailing shapes "
            f"of {kept} {[np.shape(a)[1:] for a in jax.tree.leaves(x)]} and {reduced} "
            f"{[np.shape(a)[1:] for a in jax.tree.leaves(y)]} are what fn expects: {e}"
        ) from e
    if not isinstance(out0, jax.ShapeDtypeStruct):
        raise TypeError(f"fn must return one array (a scalar per pair), got {out0}")
    if reduce != "sum" and not jnp.issubdtype(out0.dtype, jnp.floating):
        raise TypeError(f"reduce={reduce!r} needs a real float fn, but fn returns {out0.dtype}")
    w_trailing = () if weights is None else weights.shape[1:]
    try:
        out_ndim = len(jnp.broadcast_shapes(out0.shape, w_trailing))
    except ValueError as e:
        raise ValueError(
            f"weights' trailing shape {w_trailing} does not broadcast with fn's output "
            f"shape {out0.shape}"
        ) from e

    row_shard, col_shard = x_shard, y_shard
    if row_shard is None and col_shard is None:
        return _pairwise_local(fn, x, y, weights, reduce, chunk_size, out_ndim)
    if row_shard is not None:
        mesh, axes = row_shard
        _check_divisible(n, mesh, axes, kept)
    else:
        mesh, axes = col_shard
        _check_divisible(m, mesh, axes, reduced)
    # Closure constants become explicit replicated operands of the shard_map.
    converted, consts = jax.closure_convert(fn, _first_items(x), _first_items(y))

    def local(x_l, y_l, w_l, consts):
        f = lambda a, b: converted(a, b, *consts)  # noqa: E731
        out = _pairwise_local(f, x_l, y_l, w_l, reduce, chunk_size, out_ndim)
        if row_shard is not None:
            return out
        return _combine_over_devices(out, reduce, axes)

    if row_shard is not None:
        in_specs, out_specs = (P(axes), P(), P(), P()), P(axes)
    else:
        in_specs, out_specs = (P(), P(axes), P(axes), P()), P()
    return _sharded_call(local, mesh, in_specs, out_specs, x, y, weights, list(consts))


def _combine_over_devices(local: jax.Array, reduce: str, axes: Any):
    """Combine per-device partial reductions (columns split over ``axes``)."""
    if reduce == "sum":
        return lax.psum(local, axes)
    if reduce == "logsumexp":
        top = lax.pmax(lax.stop_gradient(local), axes)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        return top + jnp.log(lax.psum(jnp.exp(local - top), axes))
    gathered = lax.all_gather(local, axes)  # (devices, n, ...): O(n) per device
    if reduce in ("max", "min"):
        return jnp.max(gathered, 0) if reduce == "max" else jnp.min(gathered, 0)
    raise AssertionError(reduce)


def _pairwise_local(fn, x, y, weights, reduce, chunk_size, out_ndim):
    """pairwise_reduce on one device (or per device inside shard_map)."""
    if reduce in ("argmax", "argmin") and _vma(x, y):
        raise NotImplementedError(
            f"reduce={reduce!r} with the reduced points split over devices is not supported; "
            "shard the kept points instead (axis=1: rows of x)"
        )
    data = (x, y, weights)
    converted, consts, (x, y, weights), vary_consts = _convert(
        fn, data, lambda d: (_first_items(d[0]), _first_items(d[1]))
    )
    sign = -1.0 if reduce in ("min", "argmin") else 1.0
    engine = {"sum": "sum", "logsumexp": "logsumexp"}.get(reduce, "max")
    cols: dict = {"y": y}
    if weights is not None:
        cols["w"] = weights

    def tile_fn(xb, cb, _pairs, k, _rids, _cids):
        s = jax.vmap(jax.vmap(lambda a, b: converted(a, b, *k), (None, 0)), (0, None))(
            xb, cb["y"]
        )
        s = s.reshape(s.shape[:2] + (1,) * (out_ndim - (s.ndim - 2)) + s.shape[2:])
        if "w" in cb:
            w = cb["w"]
            w = w.reshape((1, w.shape[0]) + (1,) * (out_ndim - (w.ndim - 1)) + w.shape[1:])
            s = s * w if engine == "sum" else s + w
        return -s if sign < 0 else s

    pair_bytes = traced_bytes(converted, _first_items(x), _first_items(y), *consts) * 3
    out = tiled_reduce(
        tile_fn, x, cols, reduce=engine, chunk_size=chunk_size, consts=consts,
        pair_bytes=pair_bytes, vary_consts=vary_consts,
    )
    if engine != "max":
        return out
    value, arg = out
    if reduce in ("argmax", "argmin"):
        return lax.stop_gradient(arg)
    return -value if sign < 0 else value


def _swapped(fn: Callable) -> Callable:
    return lambda b, a: fn(a, b)


def _swap(chunk_size):
    if isinstance(chunk_size, (tuple, list)) and len(chunk_size) == 2:
        return (chunk_size[1], chunk_size[0])
    return chunk_size
