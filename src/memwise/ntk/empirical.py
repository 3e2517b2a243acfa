"""The empirical neural tangent kernel of a finite network, tile by tile.

For a network ``f(params, x)`` with Jacobian ``J(x) = df(params, x)/dparams`` the
empirical NTK is ``Theta(x1, x2) = J(x1) J(x2)^T``, an (O x O) block per pair of inputs
(Jacot et al. 2018). Three ways to compute it, as in Novak, Sohl-Dickstein, Schoenholz,
"Fast finite width neural tangent kernel" (ICML 2022) and Mohamadi, Bae, Sutherland,
"A fast, well-founded approximation to the empirical neural tangent kernel" (ICML 2023):

* ``"jacobian"``: Jacobian contraction; per-input Jacobians (O x P) are formed and
  contracted. Memory O x P per input of a tile; fastest when P is moderate.
* ``"vjp"``: NTK-vector products; for each x2 and output k, ``v = J(x2)^T e_k`` (one
  vjp), then ``J(x1) v`` (one jvp). Never forms J(x1); memory of P-vectors and of jvps.
* ``"pseudo"``: the pseudo-NTK, ``g(x1) . g(x2)`` with ``g(x) = grad_params sum_k
  f(x)_k / sqrt(O)``: one gradient per input, an (n1, n2) kernel, O times cheaper. It
  approximates the trace-normalised NTK well for trained networks.

All three run over (rows, cols) tiles of the two input sets with
:func:`memwise.chunked_map`: each tile forms the Jacobians (or vectors) of its
own inputs only, so memory is one tile's worth plus the (n1, n2, O, O) result. The
column inputs' Jacobians are recomputed for every row chunk (as neural-tangents'
``nt.batch`` does); larger row chunks mean fewer recomputations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from memwise._dtypes import accumulation_dtype
from memwise.chunked import chunked_map, over_row_chunks
from memwise.ntk._jacobians import contract_jacobians
from memwise.tiling import ChunkSize, pair_bytes, tiling

__all__ = ["empirical"]

_METHODS = ("jacobian", "vjp", "pseudo")


def _tree_dot(a: Any, b: Any) -> jax.Array:
    """sum over leaves of <a_leaf, b_leaf> over all axes of the parameter leaves.

    In at least float32, cast back: a bfloat16 sum over thousands of parameters keeps
    about two digits.
    """
    pairs = list(zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    dtype = jnp.result_type(*(x for pair in pairs for x in pair))
    acc = accumulation_dtype(dtype)
    terms = [jnp.sum(x.astype(acc) * y.astype(acc)) for x, y in pairs]
    return sum(terms[1:], terms[0]).astype(dtype)


def empirical(
    f: Callable,
    params: Any,
    x1: Any,
    x2: Any = None,
    *,
    method: str = "jacobian",
    chunk_size: ChunkSize = "auto",
    trace: bool = False,
) -> jax.Array:
    """The empirical NTK of ``f`` at ``params`` between ``x1`` and ``x2``.

    Args:
      f: ``f(params, x) -> (batch, *out)`` for a batch ``x`` (a Flax ``model.apply``,
        ``lambda m, x: jax.vmap(m)(x)`` for an Equinox module, ...). Each input must be
        processed independently of the others in its batch (no batch statistics).
      params: the parameter pytree.
      x1: (n1, ...) inputs (a pytree of arrays sharing the leading axis is fine).
      x2: (n2, ...) inputs; ``None`` means ``x1``.
      method: ``"jacobian"``, ``"vjp"`` or ``"pseudo"`` (see the module docstring).
      chunk_size: ``(rows, cols)`` inputs of x1 and x2 per tile, an int for both, or
        ``"auto"``.
      trace: return the trace over outputs, (n1, n2), instead of the (n1, n2, O, O)
        blocks. The pseudo-NTK is always (n1, n2).

    Returns:
      (n1, n2, *out, *out) for ``"jacobian"``/``"vjp"`` (``(n1, n2)`` when the output
      per input is a scalar or ``trace=True``); (n1, n2) for ``"pseudo"``. All methods
      agree with ``jax.jacobian`` contracted densely, also for empty ``x1`` or ``x2``
      (an empty result). Sums over the parameters run in at least float32 and are cast
      back to the Jacobians' dtype.

    Memory: one tile's Jacobians ((rows + cols) x O x P floats for ``"jacobian"``,
    cols x O x P for ``"vjp"``, (rows + cols) x P for ``"pseudo"``) plus the result.
    Compute: each column chunk's Jacobians are recomputed once per row chunk.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise import ntk
        >>> f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
        >>> params = {"w": jnp.ones((3, 8)) / 3, "v": jnp.ones((8, 2)) / 8}
        >>> ntk.empirical(
        ...     f, params, jnp.ones((5, 3)), method="vjp", chunk_size=2).shape
        (5, 5, 2, 2)
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if not callable(f):
        raise TypeError(f"f must be callable f(params, x), got {type(f).__name__}")
    if not jax.tree_util.tree_leaves(params):
        raise ValueError(
            "params has no arrays, so f has no parameters and its NTK is zero; pass the "
            "parameter pytree f(params, x) differentiates"
        )
    if x2 is None:
        x2 = x1
    leaves1, leaves2 = jax.tree_util.tree_leaves(x1), jax.tree_util.tree_leaves(x2)
    if not leaves1 or not leaves2:
        raise ValueError("x1 and x2 must be arrays (or pytrees of arrays) of inputs")
    shapes1 = [jnp.shape(a)[1:] for a in leaves1]
    shapes2 = [jnp.shape(a)[1:] for a in leaves2]
    if shapes1 != shapes2:
        raise ValueError(
            f"x1 and x2 must have the same shape per input, got {shapes1} and {shapes2}"
        )
    n1, n2 = jnp.shape(leaves1[0])[0], jnp.shape(leaves2[0])[0]

    def one(p, x):
        return f(p, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    # One input's shape, not x1[0]: x1 may be empty.
    x_first = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), x1
    )
    out = jax.eval_shape(one, params, x_first)
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(f"f must return one array per batch, got {out}")
    out_ndim = len(out.shape)
    n_out = math.prod(out.shape)

    def rows_against_columns(block_fn):
        # block_fn(rows_block) -> function of one x2 input giving that column (R, ...)
        def one_pair(xi, xj):
            return block_fn(jax.tree_util.tree_map(lambda a: a[None], xi))(xj)

        if n1 == 0 or n2 == 0:  # no tile to run: the dense result, empty
            pair = jax.eval_shape(one_pair, x_first, x_first)  # (1, *block)
            return jnp.zeros((n1, n2) + pair.shape[1:], pair.dtype)
        tiles = tiling(
            n1, n2, chunk_size, pair_bytes=lambda: pair_bytes(one_pair, x_first, x_first)
        )

        def block(x_rows):
            column = block_fn(x_rows)
            out = chunked_map(column, x2, chunk_size=tiles.cols)  # (n2, R, ...)
            return jnp.moveaxis(out, 0, 1)

        return over_row_chunks(block, x1, tiles.rows)

    if method == "pseudo":

        def gradient(x):
            return jax.grad(lambda p: jnp.sum(one(p, x)) / math.sqrt(n_out))(params)

        def block_fn(x_rows):
            g_rows = jax.vmap(gradient)(x_rows)
            return lambda xj: jax.vmap(lambda gi: _tree_dot(gi, gradient(xj)))(g_rows)

    elif method == "jacobian":

        def jacobian(x):
            return jax.jacrev(one)(params, x)

        def block_fn(x_rows):
            j_rows = jax.vmap(jacobian)(x_rows)

            def column(xj):
                jj = jacobian(xj)

                def pair(ji):
                    k = contract_jacobians(ji, jj, out_ndim)
                    return _trace(k, out_ndim) if trace else k

                return jax.vmap(pair)(j_rows)

            return column

    else:  # "vjp": NTK-vector products

        def pair(xi, vjp_j, basis):
            if trace:
                # tr J_i J_j^T = sum_k <J_i^T e_k, J_j^T e_k>: O vjps on each side.
                _, vjp_i = jax.vjp(lambda p: one(p, xi), params)
                return jnp.sum(jax.vmap(lambda e: _tree_dot(vjp_i(e)[0], vjp_j(e)[0]))(basis))
            columns = jax.vmap(lambda e: jax.jvp(lambda p: one(p, xi), (params,), vjp_j(e))[1])(
                basis
            )  # (O_k, *out): column k of the block J_i J_j^T
            k = jnp.moveaxis(columns.reshape((n_out,) + out.shape), 0, -1)
            return k.reshape(out.shape + out.shape)

        def block_fn(x_rows):
            def column(xj):
                # One vjp per output of x_j, shared by every row of the block.
                _, vjp_j = jax.vjp(lambda p: one(p, xj), params)
                basis = jnp.eye(n_out, dtype=out.dtype).reshape((n_out,) + out.shape)
                return jax.vmap(lambda xi: pair(xi, vjp_j, basis))(x_rows)

            return column

    return rows_against_columns(block_fn)


def _trace(block: jax.Array, out_ndim: int) -> jax.Array:
    if out_ndim == 0:
        return block
    n_out = math.prod(block.shape[:out_ndim])
    return jnp.trace(block.reshape(n_out, n_out))
