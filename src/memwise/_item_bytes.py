"""The one rule for the memory of an item or a pair of a chunked computation.

``"auto"`` chunk sizes and tiles (:mod:`memwise.tiling`, which exports these names) are
sized by it: :func:`item_bytes` is three times the bytes of the intermediates of one
item, as traced (the forward's live values, the vjp's residuals and their cotangents);
:func:`pair_bytes` traces a tile of 1 and 2 rows by 1 and 2 columns, so that what vmap
computes once per row or per column is not counted once per pair. Tracing compiles
nothing; the :class:`ItemBytes` it returns also carries the function and the example's
shapes, for the time model (:func:`memwise.costmodel.tile_cost`). :func:`value_bytes`
is the bytes of one value, the count every byte rule here and elsewhere is made of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise import costmodel

__all__ = ["ItemBytes", "item_bytes", "pair_bytes", "value_bytes"]


def value_bytes(value: Any) -> int:
    """Bytes of an array, tracer, aval or shape-dtype struct, read off its shape and its
    own dtype (a typed PRNG key's ``key<fry>`` is no NumPy dtype, but has an itemsize);
    a leaf with no dtype (a Python scalar) counts as NumPy would hold it."""
    dtype = getattr(value, "dtype", None)
    itemsize = (np.asarray(value).dtype if dtype is None else dtype).itemsize
    return int(np.prod(np.shape(value), dtype=np.int64)) * itemsize


# Bytes per item when nothing better is known (or tracing the function failed).
_FALLBACK_ITEM_BYTES = 64


class ItemBytes(int):
    """Bytes per item or pair (the int), and the function and example it was measured on.

    The function lets the cost model compile one tile of it (:func:`_tile_costs`);
    ``key`` identifies the function and shapes for caching those compilations. From
    :func:`pair_bytes`, ``per_row`` and ``per_col`` are the bytes a tile spends once per
    row and once per column (0 from :func:`item_bytes`).
    """

    fn: Callable | None
    examples: tuple
    key: str
    per_row: int
    per_col: int

    def __new__(
        cls,
        nbytes: int,
        fn: Callable | None = None,
        examples: tuple = (),
        key: str = "",
        per_row: int = 0,
        per_col: int = 0,
    ) -> ItemBytes:
        out = super().__new__(cls, nbytes)
        out.fn, out.examples, out.key = fn, examples, key
        out.per_row, out.per_col = per_row, per_col
        return out


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _traced_bytes(fn: Callable, *args: Any) -> tuple[int, Any]:
    """The bytes of every intermediate of ``fn`` on ``args``, as traced, and the jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    total = 0
    for eqn in jaxpr.jaxpr.eqns:
        for var in eqn.outvars:
            aval: Any = getattr(var, "aval", None)
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                total += value_bytes(aval)
    return total, jaxpr


def item_bytes(fn: Callable, *example_args: Any) -> int:
    """Estimated bytes one item costs inside a chunk: THE rule for ``"auto"``.

    Three times the bytes of all intermediates of ``fn`` on one example, as traced: the
    forward's live values, the vjp's residuals and their cotangents. XLA fuses many of
    them, so the estimate errs on the lean side. The result is an :class:`ItemBytes`,
    which also carries ``fn`` and the example's shapes for the time model. Pairs use
    :func:`pair_bytes`, the same rule applied to a tile.
    """
    try:
        total, jaxpr = _traced_bytes(fn, *example_args)
    except Exception:  # the caller reports real errors; this is only an estimate
        return _FALLBACK_ITEM_BYTES
    examples = _abstract(example_args)
    return ItemBytes(3 * max(total, 4), fn, examples, f"{jaxpr}|{examples}")


def pair_bytes(fn: Callable, first: Any, second: Any, *consts: Any) -> int:
    """:func:`item_bytes` for ``fn(first, second, *consts)`` computed over a tile of pairs.

    A tile is ``fn`` vmapped over rows and columns, and vmap computes what depends on one
    point once per row (or column), not once per pair: the squared norms of a
    squared-Euclidean cost, a network's Jacobian at one input. So the tile's
    intermediates are traced at 1 and 2 rows by 1 and 2 columns and split into the
    bytes per pair (the int), per row and per column (``per_row``, ``per_col``); a tile
    of ``r x c`` costs ``pair * r * c + per_row * r + per_col * c``. Counted per pair, a
    squared-Euclidean cost in 64 dimensions was 1,608 bytes a pair instead of 48, and its
    "auto" tile 64 x 64. Falls back to :func:`item_bytes` of one pair where the tile does
    not trace.

    Example::

        >>> b = pair_bytes(lambda a, b: jnp.sum(a * a) - 2.0 * jnp.dot(a, b),
        ...                jnp.ones(64), jnp.ones(64))
        >>> int(b) < 64 < b.per_row, b.per_col
        (True, 0)
    """

    def tile(rows: Any, cols: Any, *consts: Any) -> Any:
        def row(a: Any, cols: Any) -> Any:
            return jax.vmap(lambda b: fn(a, b, *consts))(cols)

        return jax.vmap(row, (0, None))(rows, cols)

    abstract = _abstract(consts)
    try:
        traced = {
            (r, c): _traced_bytes(
                tile,
                costmodel.batched(_abstract(first), r),
                costmodel.batched(_abstract(second), c),
                *abstract,
            )
            for r in (1, 2)
            for c in (1, 2)
        }
    except Exception:  # noqa: BLE001 - a function that only runs per pair: count it so
        return item_bytes(fn, first, second, *consts)
    t = {key: total for key, (total, _) in traced.items()}
    per_pair = t[2, 2] - t[2, 1] - t[1, 2] + t[1, 1]
    examples = _abstract((first, second) + consts)
    return ItemBytes(
        3 * max(per_pair, 4),
        fn,
        examples,
        f"{traced[1, 1][1]}|{examples}",
        per_row=3 * max(t[2, 1] - t[1, 1] - per_pair, 0),
        per_col=3 * max(t[1, 2] - t[1, 1] - per_pair, 0),
    )
