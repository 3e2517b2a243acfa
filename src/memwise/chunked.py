"""Chunked maps and sums whose backward pass is chunked too.

``jax.lax.map(batch_size=...)`` and hand-written chunked scans bound the memory of the
*forward* pass only: reverse mode keeps every chunk's intermediates. Here
:func:`chunked_map` and :func:`chunked_sum` are ``jax.custom_vjp`` functions whose
backward pass re-evaluates and differentiates one chunk at a time, the KeOps rule ("the
gradient of a reduction is a reduction": Charlier, Feydy, Glaunes, Collin, Durif, JMLR
22, 2021). Memory in both directions: inputs + outputs + one chunk's intermediates, for
about one extra forward pass of compute.

Chunk sizes are resolved by :mod:`memwise.tiling` (a ragged last chunk is slid back
to end at the last item and its repeated items masked, one compiled body); many
devices go through :mod:`memwise.sharding`.
:func:`over_row_chunks` runs a function over blocks of rows with the same machinery,
for callers (``memwise.ntk``) whose per-block work is itself chunked.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._arguments import check_arrays, positive_int
from memwise._dtypes import accumulation_dtype, sum_dtype
from memwise._vjp import (
    Static,
    add,
    cotangents,
    custom_vjp,
    dense,
    fill,
    guard_forward_mode,
    is_zero,
    select,
    unwrap,
)
from memwise.sharding import (
    check_divisible,
    convert,
    first_items,
    psum_replicated,
    row_sharding,
    sharded_call,
    typed_zeros,
    vary,
    varying_over,
)
from memwise.tiling import Chunking, chunking, item_bytes, leading_length

__all__ = ["chunked_map", "chunked_sum", "over_row_chunks"]


_FORWARD_MODE = (
    "memwise.chunked_map and memwise.chunked_sum support reverse mode (grad, vjp, jacrev; "
    "also jax.hessian and jacfwd of grad) and vmap, but not forward mode through them "
    "(jvp, jacfwd, jax.linearize); for forward mode use jax.lax.map(f, xs, "
    "batch_size=chunk_size) (summed for chunked_sum), whose jvp keeps no intermediates"
)


@dataclasses.dataclass(frozen=True, eq=False)
class _MapSpec:
    fn: Callable  # fn(x_item_tree, *consts) -> out tree
    kind: str  # "map" | "sum"
    chunks: Chunking
    xs_tree: Any
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


def _map_forward(spec: _MapSpec, xs_leaves: list, consts: list) -> Any:
    chunks = spec.chunks
    indices = chunks.indices()
    if spec.kind == "map":

        def one_chunk(_, i):
            return None, spec.chunk_fn(_chunk_of(chunks, xs_leaves, i), consts)

        _, ys = lax.scan(one_chunk, None, indices)
        return chunks.merge(ys)

    one = jax.eval_shape(
        lambda x: spec.chunk_fn(x, consts), _chunk_of(chunks, xs_leaves, jnp.int32(0))
    )
    # The running total is kept in at least float32 (a bfloat16 total of 65,536 values
    # in chunks of 8 stalled at 2,048) and returned in jnp.sum's dtype.
    init = jax.tree.map(
        lambda s: jnp.zeros(s.shape[1:], accumulation_dtype(sum_dtype(s.dtype))), one
    )
    init = vary(init, varying_over(xs_leaves, consts))

    def body(acc, i):
        valid = chunks.chunk_ids(i)[1]
        ys = spec.chunk_fn(_chunk_of(chunks, xs_leaves, i), consts)
        ys = jax.tree.map(
            lambda y, a: jnp.sum(
                jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, 0), 0, dtype=a.dtype
            ),
            ys,
            acc,
        )
        return jax.tree.map(jnp.add, acc, ys), None

    total, _ = lax.scan(body, init, indices)
    return jax.tree.map(lambda t, s: t.astype(sum_dtype(s.dtype)), total, one)


@functools.partial(custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda _: _FORWARD_MODE)
def _map_core(spec: _MapSpec, xs_leaves: list, consts: list) -> Any:
    return _map_forward(spec, xs_leaves, consts)


def _map_core_fwd(spec, xs_primals, const_primals):
    xs_leaves, xs_flags = unwrap(xs_primals)
    consts, const_flags = unwrap(const_primals)
    out = _map_forward(spec, xs_leaves, consts)
    return out, (xs_leaves, consts, Static((xs_flags, const_flags)))


def _map_core_bwd(spec, res, ct):
    xs_leaves, consts, flags = res
    xs_flags, const_flags = flags.value
    chunks = spec.chunks
    if any(is_zero(c) for c in jax.tree.leaves(ct, is_leaf=is_zero)):
        ct = dense(ct, jax.eval_shape(lambda: _map_forward(spec, xs_leaves, consts)))
    axes = varying_over(xs_leaves, consts, ct)
    primal_consts = consts
    xs_vary = vary(xs_leaves, axes)
    if spec.vary_consts:
        consts = vary(consts, axes)
    diff_consts = select(consts, const_flags)

    def body(acc, inp):
        i = inp
        valid = chunks.chunk_ids(i)[1]
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
            return spec.chunk_fn(fill(xc, xs_flags, x_d), fill(consts, const_flags, c_d))

        _, vjp = jax.vjp(f, select(xc, xs_flags), diff_consts)
        dx, dc = vjp(ctc)
        return add(acc, dc), dx

    # The gradients of closed-over arrays sum one term per chunk: in at least float32.
    acc0 = [z.astype(accumulation_dtype(z.dtype)) for z in typed_zeros(diff_consts)]
    acc, dxs = lax.scan(body, acc0, chunks.indices())
    dxs = psum_replicated(chunks.merge(dxs), select(xs_leaves, xs_flags))
    const_primals = select(primal_consts, const_flags)
    acc = [a.astype(p.dtype) for a, p in zip(psum_replicated(acc, const_primals), const_primals)]
    return cotangents(xs_flags, dxs), cotangents(const_flags, acc)


_map_core.defvjp(_map_core_fwd, _map_core_bwd)


def _check_chunk_size(chunk_size: Any) -> None:
    """Validate a 1-D ``chunk_size`` here (tiling's message also offers 2-D tiles)."""
    if isinstance(chunk_size, (str, Chunking)):
        return  # chunking() checks the string ("auto") and a resolved Chunking's length
    positive_int(
        chunk_size, "chunk_size", accepts=" or 'auto'", fix="; pass e.g. chunk_size=1024 or 'auto'"
    )


def _items_failed(xs: Any, e: Exception) -> ValueError:
    return ValueError(
        f"f failed on one item of xs (leaf shapes "
        f"{[np.shape(a)[1:] for a in jax.tree.leaves(xs)]}): {e}"
    )


def _empty_result(f, xs, kind):
    """What ``jax.vmap(f)(xs)`` (map) or its sum (sum) gives for zero items: an empty
    stack, or zeros in ``jnp.sum``'s dtype. Gradients are zeros."""
    try:
        one = jax.eval_shape(f, first_items(xs))
    except Exception as e:
        raise _items_failed(xs, e) from e
    if kind == "map":
        return jax.tree.map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), one)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, sum_dtype(s.dtype)), one)


def _prepare_1d(f, xs, chunk_size, kind):
    n = leading_length(xs, "xs")
    try:
        converted, consts, (xs,), vary_consts = convert(f, (xs,), lambda d: (first_items(d[0]),))
    except Exception as e:
        raise _items_failed(xs, e) from e
    chunks = chunking(n, chunk_size, item_bytes=lambda: item_bytes(f, first_items(xs)))
    xs_leaves, xs_tree = jax.tree.flatten(xs)
    spec = _MapSpec(converted, kind, chunks, xs_tree, vary_consts)
    return spec, xs_leaves, consts


def _chunked_1d(f, xs, chunk_size, kind, mesh, axis_name, *, follow_data=True):
    if not callable(f):
        raise TypeError(f"f must be a callable of one item of xs, got {type(f).__name__}")
    _check_chunk_size(chunk_size)
    check_arrays(xs, "xs")
    xs = jax.tree.map(jnp.asarray, xs)
    if leading_length(xs, "xs") == 0:
        return _empty_result(f, xs, kind)
    sharded = row_sharding(xs, mesh, axis_name, "xs") if follow_data else None
    if sharded is None:
        spec, xs_leaves, consts = _prepare_1d(f, xs, chunk_size, kind)
        return _map_core(
            spec,
            guard_forward_mode(xs_leaves, _FORWARD_MODE),
            guard_forward_mode(consts, _FORWARD_MODE),
        )
    mesh, axes = sharded
    check_divisible(leading_length(xs, "xs"), mesh, axes, "xs")

    # f is traced inside the shard_map (see pairwise_reduce): the arrays it closes over
    # enter as replicated values.
    def local(xs_local):
        out = _chunked_1d(f, xs_local, chunk_size, kind, None, None)
        return jax.tree.map(lambda o: lax.psum(o, axes), out) if kind == "sum" else out

    out_spec = P(axes) if kind == "map" else P()
    return sharded_call(local, mesh, (P(axes),), out_spec, xs)


def chunked_map(
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str | Chunking,
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
    slid back to end at the last item, its repeated items masked (one compiled body).

    Args:
      f: function of one item of ``xs``, returning a pytree of arrays.
      xs: pytree of arrays with a common leading length ``n`` (``n = 0`` gives empty
        outputs, as ``jax.vmap`` does).
      chunk_size: items per chunk (int >= 1), ``"auto"``, or a resolved
        :class:`~memwise.tiling.Chunking` of ``n`` items.
      mesh: run sharded on this mesh, the items of ``xs`` split over mesh axis
        ``axis_name`` (see :func:`pairwise_reduce`); detected from ``xs``'s sharding
        when it is a concrete array with a ``NamedSharding`` (pass both under ``jit``).
      axis_name: the mesh axis (or axes) the items of ``xs`` are split over.

    Returns:
      ``f``'s outputs stacked along a new leading axis of length ``n``.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> w = jnp.ones((3, 3))
        >>> ys = mw.chunked_map(
        ...     lambda x: jnp.tanh(w @ x), jnp.ones((10, 3)), chunk_size=4)
        >>> ys.shape
        (10, 3)
    """
    return _chunked_1d(f, xs, chunk_size, "map", mesh, axis_name)


def chunked_sum(
    f: Callable,
    xs: Any,
    *,
    chunk_size: int | str | Chunking,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Any:
    """``sum_i f(x_i)`` over the items of ``xs`` with O(chunk) memory both ways.

    Same contract as :func:`chunked_map` but the per-item outputs (any pytree) are summed
    as they are produced; the backward re-evaluates and differentiates one chunk at a
    time, accumulating gradients of closed-over arrays in the loop carry. Memory: inputs +
    one output + one chunk's intermediates, forward and backward; compute: about one
    extra forward. As ``jnp.sum``, the total (and the gradients of closed-over arrays)
    accumulate in at least float32 and are returned in the outputs' dtype.

    Args:
      f: function of one item of ``xs``, returning a pytree of arrays.
      xs: pytree of arrays with a common leading length ``n`` (``n = 0`` sums to
        zeros).
      chunk_size: items per chunk (int >= 1), ``"auto"``, or a resolved
        :class:`~memwise.tiling.Chunking` of ``n`` items.
      mesh: as for :func:`chunked_map`; each device sums its items, then one ``psum``.
      axis_name: as for :func:`chunked_map`.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> xs = jnp.arange(10.0)
        >>> float(mw.chunked_sum(lambda x: x ** 2, xs, chunk_size=3))
        285.0
    """
    return _chunked_1d(f, xs, chunk_size, "sum", mesh, axis_name)


def sum_over_chunks(fn: Callable, n_chunks: int) -> Any:
    """``sum_i fn(i)`` over chunk indices ``0 .. n_chunks - 1``, one at a time, with the
    memory of :func:`chunked_sum` (the items are indices: the loop never follows a mesh;
    the arrays ``fn`` slices decide that).

    Example::

        >>> sum_over_chunks(lambda i: i * 2.0, 4)
        Array(12., dtype=float32)
    """
    return _chunked_1d(fn, jnp.arange(n_chunks), 1, "sum", None, None, follow_data=False)


def over_row_chunks(fn: Callable, x_rows: Any, row_tiles: Chunking) -> Any:
    """``fn(block)`` for each chunk of rows, stacked back to ``(n, ...)``.

    The loop runs over chunk *indices* and slices each block out of ``x_rows``: handing
    the rows to the loop as its xs makes XLA copy them into the gradient's loop state
    (3 KiB per 28x28 image, 180 MiB at 60,000). ``fn`` sees whole blocks, so no chunked
    primitive inside it is ever vmapped (a vmapped chunked sum would accumulate one
    gradient of the columns per row).

    Example::

        >>> import jax.numpy as jnp
        >>> from memwise.tiling import Chunking
        >>> over_row_chunks(lambda block: block * 2, jnp.arange(5.0),
        ...                 Chunking(5, 2))
        Array([0., 2., 4., 6., 8.], dtype=float32)
    """

    def one(index):
        start = index * row_tiles.size
        return fn(jax.tree.map(lambda a: row_tiles.block(a, start), x_rows))

    # A loop over indices: it never follows a mesh (the rows it slices decide that).
    blocks = _chunked_1d(one, row_tiles.indices(), 1, "map", None, None, follow_data=False)
    return row_tiles.merge(blocks)
