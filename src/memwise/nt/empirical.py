"""neural-tangents' empirical kernels, linearization and Taylor expansion, on memwise.

``nt.empirical_ntk_fn(f, trace_axes, diagonal_axes, vmap_axes, implementation)`` and its
NNGP and joint versions, with neural-tangents 0.6.5's conventions (Novak et al. 2022,
"Fast finite width neural tangent kernel"): the kernel of an output array of shape
``(N, *O)`` is "nearly" ``zip(f(x1).shape, f(x2).shape)``: each output axis appears
twice (axes of ``x1``'s output and of ``x2``'s interleaved), ``trace_axes`` are
averaged out (the trace divided by their size), ``diagonal_axes`` appear once.

How the NTK is computed:

* ``vmap_axes`` given (the batch axis of inputs and outputs, e.g. ``0``): each output
  depends on its own input only, and :func:`memwise.ntk.empirical` computes the per-pair
  blocks tile by tile (memory: one tile's Jacobians, not the batch's). ``implementation``
  picks its method: ``JACOBIAN_CONTRACTION`` (and ``AUTO``) -> ``"jacobian"``,
  ``NTK_VECTOR_PRODUCTS`` -> ``"vjp"``. ``STRUCTURED_DERIVATIVES`` (neural-tangents'
  rewriting of the Jacobian's structure) is not implemented here; it computes the same
  kernel, so it maps onto ``"jacobian"`` (same values, jacobian contraction's cost).
* ``vmap_axes=None`` (neural-tangents' default): outputs may depend on the whole batch
  (batch statistics), so each set's Jacobian is formed whole and contracted, as
  neural-tangents does: memory of both Jacobians.

``linearize`` and ``taylor_expand`` are :func:`memwise.linearize` and
:func:`memwise.taylor_expand`: the same values as neural-tangents' closures, but the
expansion point is a pytree leaf, an argument of a compiled program, never a constant.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise.linearize import linearize, taylor_expand
from memwise.nt._triple import named_tuple
from memwise.ntk._jacobians import contract_jacobians
from memwise.ntk.empirical import empirical
from memwise.tiling import ChunkSize

__all__ = [
    "NtkImplementation",
    "empirical_kernel_fn",
    "empirical_nngp_fn",
    "empirical_ntk_fn",
    "empirical_ntk_vp_fn",
    "linearize",
    "taylor_expand",
]

Axes = int | Sequence[int]


class NtkImplementation(enum.IntEnum):
    """neural-tangents' NTK implementations (the values it accepts as ints too)."""

    AUTO = 0
    JACOBIAN_CONTRACTION = 1
    NTK_VECTOR_PRODUCTS = 2
    STRUCTURED_DERIVATIVES = 3


# STRUCTURED_DERIVATIVES computes J1 J2^T exactly as the others do; memwise has no
# structured rules, so it contracts Jacobians (same values, that method's cost).
_METHOD = {0: "jacobian", 1: "jacobian", 2: "vjp", 3: "jacobian"}


# ----------------------------------------------------------------------------------------
# neural-tangents' axis conventions


def _canonical(axes: Axes, ndim: int, name: str) -> list[int]:
    listed = [axes] if isinstance(axes, int) else list(axes)
    for a in listed:
        if not isinstance(a, (int, np.integer)) or not -ndim <= a < ndim:
            raise ValueError(
                f"{name} must be output axes of f (ints in [-{ndim}, {ndim})), got {axes!r}"
            )
    return sorted({int(a) % ndim for a in listed})


def _zip_axes(x: jax.Array, start: int = 0, end: int | None = None) -> jax.Array:
    """``[..., X, Y, ..., X, Y, ...]`` -> ``[..., X, X, Y, Y, ...]`` on axes ``start:end``."""
    end = x.ndim if end is None else end
    half = (end - start) // 2
    return jnp.moveaxis(x, range(end - half, end), range(start + 1, end, 2))


def _res_batch_dims(contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
    dims = [2 * b - i for i, b in enumerate(batch)]
    for i, b in enumerate(batch):
        for c in contracting:
            if b > c:
                dims[i] -= 2
    return dims


def _dot_general(lhs: jax.Array, rhs: jax.Array, trace: Axes, diagonal: Axes) -> jax.Array:
    """``lhs . rhs`` over ``trace``, batched over ``diagonal``, axes kept in order, zipped."""
    trace_axes = _canonical(trace, lhs.ndim, "trace_axes")
    diagonal_axes = _canonical(diagonal, lhs.ndim, "diagonal_axes")
    numbers = ((trace_axes, trace_axes), (diagonal_axes, diagonal_axes))
    prod = lax.dot_general(lhs, rhs, numbers)
    prod = _zip_axes(prod, len(diagonal_axes))
    return jnp.moveaxis(prod, range(len(diagonal_axes)), _res_batch_dims(trace_axes, diagonal_axes))


def _trace_and_diagonal(kernel: jax.Array, trace: Axes, diagonal: Axes) -> jax.Array:
    """``(*O1, *O2)`` -> neural-tangents' layout: traced axes averaged out, diagonal
    axes once, the rest zipped."""
    ndim = kernel.ndim // 2
    trace_axes = _canonical(trace, ndim, "trace_axes")
    diagonal_axes = _canonical(diagonal, ndim, "diagonal_axes")
    if set(trace_axes) & set(diagonal_axes):
        raise ValueError(
            f"trace_axes {trace_axes} and diagonal_axes {diagonal_axes} must not share an axis"
        )
    size = math.prod(kernel.shape[a] for a in trace_axes)
    for i, c in enumerate(reversed(trace_axes)):
        kernel = jnp.trace(kernel, axis1=c, axis2=ndim + c - i)
    n_trace = len(trace_axes)
    for i, d in enumerate(diagonal_axes):
        axis1, axis2 = d - i, ndim + d - 2 * i - n_trace
        for c in trace_axes:
            if c < d:
                axis1, axis2 = axis1 - 1, axis2 - 1
        kernel = jnp.diagonal(kernel, axis1=axis1, axis2=axis2)
    n_diag = len(diagonal_axes)
    kernel = _zip_axes(kernel, 0, kernel.ndim - n_diag)
    kernel = jnp.moveaxis(
        kernel, range(kernel.ndim - n_diag, kernel.ndim), _res_batch_dims(trace_axes, diagonal_axes)
    )
    return kernel / size


# ----------------------------------------------------------------------------------------
# Shared checks


def _bind_kwargs(f: Callable, kwargs: dict) -> Callable:
    """``f`` with neural-tangents' ``apply_fn_kwargs`` bound (the same for x1 and x2)."""
    if not kwargs:
        return f
    per_input = sorted(k for k, v in kwargs.items() if k == "rng" or isinstance(v, tuple))
    if per_input:
        raise NotImplementedError(
            f"empirical kernel keyword arguments {per_input} (an rng split between x1 and x2, "
            "or (x1, x2) pairs) are not supported by memwise.nt; pass keywords shared by both "
            "input sets, or close over them in f"
        )
    return lambda params, x: f(params, x, **kwargs)


def _leaf_fns(f: Callable, params: Any, x: Any) -> tuple[list[Callable], Any]:
    """One function per output leaf of ``f`` (neural-tangents treats each separately)."""
    out = jax.eval_shape(f, params, x)
    leaves, treedef = jax.tree_util.tree_flatten(out)

    def leaf(i: int) -> Callable:
        return lambda p, xi: jax.tree_util.tree_leaves(f(p, xi))[i]

    return [leaf(i) for i in range(len(leaves))], treedef


def _vmap_axes(vmap_axes: Any) -> tuple[int, int] | None:
    """``(in_axis, out_axis)`` ints from neural-tangents' ``vmap_axes``, or None."""
    if vmap_axes is None:
        return None
    if isinstance(vmap_axes, tuple) and len(vmap_axes) == 3:
        in_axes, out_axes, kwargs_axes = vmap_axes
        if kwargs_axes:
            raise NotImplementedError(
                "vmap_axes with keyword-argument axes is not supported by memwise.nt (f takes "
                "no keyword arguments here); pass vmap_axes=(in_axes, out_axes, {})"
            )
    else:
        in_axes = out_axes = vmap_axes
    axes = []
    for name, value in (("in_axes", in_axes), ("out_axes", out_axes)):
        leaves = jax.tree_util.tree_leaves(value)
        if not leaves or any(not isinstance(a, int) for a in leaves) or len(set(leaves)) != 1:
            raise NotImplementedError(
                f"vmap_axes {name}={value!r}: memwise.nt supports one int axis shared by every "
                "input (and output) leaf, or vmap_axes=None"
            )
        axes.append(leaves[0])
    return axes[0], axes[1]


# ----------------------------------------------------------------------------------------
# NNGP


def empirical_nngp_fn(f: Callable, trace_axes: Axes = (-1,), diagonal_axes: Axes = ()) -> Callable:
    """``nngp_fn(x1, x2, params)``: ``f(x1) f(x2)^T`` per output leaf, as neural-tangents.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> f = lambda p, x: x @ p
        >>> nt.empirical_nngp_fn(f)(jnp.ones((3, 2)), None, jnp.ones((2, 4))).shape
        (3, 3)
    """

    def nngp_fn(x1: Any, x2: Any, params: Any, **apply_fn_kwargs: Any) -> Any:
        g = _bind_kwargs(f, apply_fn_kwargs)
        out1 = g(params, x1)
        out2 = out1 if x2 is None else g(params, x2)

        def contract(a, b):
            ndim = jnp.ndim(a)
            size = math.prod(jnp.shape(a)[i] for i in _canonical(trace_axes, ndim, "trace_axes"))
            return _dot_general(a, b, trace_axes, diagonal_axes) / size

        return jax.tree_util.tree_map(contract, out1, out2)

    return nngp_fn


# ----------------------------------------------------------------------------------------
# NTK


def _ntk_vector_products(g: Callable, params: Any, x1: Any, x2: Any) -> jax.Array:
    """``J(x1) J(x2)^T`` as ``(*out1, *out2)`` by one vjp per output of ``x2`` and a jvp."""
    out1 = jax.eval_shape(g, params, x1)
    out2 = jax.eval_shape(g, params, x2)
    _, vjp = jax.vjp(lambda p: g(p, x2), params)
    n_out2 = math.prod(out2.shape)
    basis = jnp.eye(n_out2, dtype=out2.dtype).reshape((n_out2,) + out2.shape)

    def column(e):
        return jax.jvp(lambda p: g(p, x1), (params,), vjp(e))[1]

    columns = jax.vmap(column)(basis)  # (O2, *out1)
    return jnp.moveaxis(columns, 0, -1).reshape(out1.shape + out2.shape)


def _ntk_of_leaf(
    g: Callable,
    params: Any,
    x1: Any,
    x2: Any,
    trace_axes: Axes,
    diagonal_axes: Axes,
    axes: tuple[int, int] | None,
    method: str,
    chunk_size: ChunkSize,
) -> jax.Array:
    if axes is None:
        # Outputs may depend on the whole batch: each input set is one input.
        ndim = len(jax.eval_shape(g, params, x1).shape)
        if method == "vjp":
            blocks = _ntk_vector_products(g, params, x1, x2)
        else:
            j1 = jax.jacrev(g)(params, x1)
            j2 = j1 if x2 is x1 else jax.jacrev(g)(params, x2)
            blocks = contract_jacobians(j1, j2, ndim)
        return _trace_and_diagonal(blocks, trace_axes, diagonal_axes)

    in_axis, out_axis = axes
    x1m = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, in_axis, 0), x1)
    x2m = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, in_axis, 0), x2)
    full = jax.eval_shape(g, params, x1).shape
    out_axis %= len(full)

    def per_batch(p, xb):
        return jnp.moveaxis(
            g(p, jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 0, in_axis), xb)), out_axis, 0
        )

    ndim = len(full)
    traced = _canonical(trace_axes, ndim, "trace_axes")
    diagonal = _canonical(diagonal_axes, ndim, "diagonal_axes")
    if not diagonal and set(traced) == set(range(ndim)) - {out_axis}:
        # Every output axis but the batch traced: memwise's trace, no (O x O) block held.
        size = math.prod(full[a] for a in traced)
        blocks = empirical(
            per_batch, params, x1m, x2m, method=method, chunk_size=chunk_size, trace=True
        )
        return blocks / size
    blocks = empirical(per_batch, params, x1m, x2m, method=method, chunk_size=chunk_size)
    k = ndim - 1  # per-input output axes
    first = list(range(2, 2 + k))
    second = list(range(2 + k, 2 + 2 * k))
    order = first[:out_axis] + [0] + first[out_axis:] + second[:out_axis] + [1] + second[out_axis:]
    return _trace_and_diagonal(jnp.transpose(blocks, order), trace_axes, diagonal_axes)


def empirical_ntk_fn(
    f: Callable,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: Any = None,
    implementation: NtkImplementation | int = NtkImplementation.JACOBIAN_CONTRACTION,
    _j_rules: bool = True,
    _s_rules: bool = True,
    _fwd: bool | None = None,
    *,
    chunk_size: ChunkSize = "auto",
) -> Callable:
    """``ntk_fn(x1, x2, params)``: the empirical NTK ``J(x1) J(x2)^T``, as neural-tangents.

    Args:
      f: ``f(params, x)``, returning an array or a pytree of arrays (each leaf its own
        kernel).
      trace_axes: output axes averaged out of the kernel (neural-tangents' default, the
        last).
      diagonal_axes: output axes kept once (the diagonal of their pair).
      vmap_axes: the batch axis of inputs and outputs (an int, or ``(in_axes, out_axes,
        {})``): then the kernel is computed tile by tile by :func:`memwise.ntk.empirical`.
        ``None`` forms each input set's whole Jacobian (outputs may mix the batch).
      implementation: :class:`NtkImplementation` or its int (see the module docstring).
      _j_rules: neural-tangents' debugging switch of its structured derivatives;
        accepted and without effect (the kernel is the same).
      _s_rules: as ``_j_rules``.
      _fwd: as ``_j_rules``.
      chunk_size: memwise's ``(rows, cols)`` inputs per tile (with ``vmap_axes``).

    Returns:
      ``ntk_fn(x1, x2, params)``; ``x2=None`` means ``x1``.

    Raises:
      ValueError: an unknown ``implementation`` or bad axes. NotImplementedError:
        keyword arguments to ``ntk_fn`` or ``vmap_axes`` that are not one int.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> from memwise.nt import stax
        >>> init_fn, f, _ = stax.serial(stax.Dense(8), stax.Relu(), stax.Dense(3))
        >>> _, params = init_fn(jax.random.PRNGKey(0), (-1, 2))
        >>> ntk_fn = nt.empirical_ntk_fn(f, vmap_axes=0, trace_axes=())
        >>> ntk_fn(jnp.ones((4, 2)), None, params).shape
        (4, 4, 3, 3)
    """
    if implementation not in _METHOD:
        raise ValueError(
            f"implementation must be an NtkImplementation or 0, 1, 2, 3, got {implementation!r}"
        )
    method = _METHOD[int(implementation)]
    axes = _vmap_axes(vmap_axes)

    def ntk_fn(x1: Any, x2: Any, params: Any, **apply_fn_kwargs: Any) -> Any:
        x2_ = x1 if x2 is None else x2
        fns, treedef = _leaf_fns(_bind_kwargs(f, apply_fn_kwargs), params, x1)
        kernels = [
            _ntk_of_leaf(g, params, x1, x2_, trace_axes, diagonal_axes, axes, method, chunk_size)
            for g in fns
        ]
        return jax.tree_util.tree_unflatten(treedef, kernels)

    return ntk_fn


def empirical_kernel_fn(
    f: Callable,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: Any = None,
    implementation: NtkImplementation | int = NtkImplementation.JACOBIAN_CONTRACTION,
    _j_rules: bool = True,
    _s_rules: bool = True,
    _fwd: bool | None = None,
    *,
    chunk_size: ChunkSize = "auto",
) -> Callable:
    """``kernel_fn(x1, x2, get, params)``: the empirical NNGP and/or NTK, as neural-tangents.

    ``get`` a string gives that kernel, a tuple (or ``None``: ``("nngp", "ntk")``) an
    ``EmpiricalKernel`` namedtuple of them (per output leaf for pytree outputs). Arguments
    as :func:`empirical_ntk_fn`.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> f = lambda p, x: jnp.tanh(x @ p)
        >>> kernel_fn = nt.empirical_kernel_fn(f, vmap_axes=0)
        >>> kernel_fn(jnp.ones((3, 2)), None, None, jnp.ones((2, 4)))._fields
        ('nngp', 'ntk')
    """
    fns = {
        "nngp": empirical_nngp_fn(f, trace_axes, diagonal_axes),
        "ntk": empirical_ntk_fn(
            f, trace_axes, diagonal_axes, vmap_axes, implementation, chunk_size=chunk_size
        ),
    }

    def kernel_fn(x1: Any, x2: Any, get: Any, params: Any, **apply_fn_kwargs: Any) -> Any:
        gets = ("nngp", "ntk") if get is None else (get,) if isinstance(get, str) else tuple(get)
        if not gets or any(g not in fns for g in gets):
            raise ValueError(f"get must be 'nngp', 'ntk', a tuple of them or None, got {get!r}")
        values = {g: fns[g](x1, x2, params, **apply_fn_kwargs) for g in gets}
        if isinstance(get, str):
            return values[get]
        kernel = named_tuple("EmpiricalKernel", gets)
        return jax.tree_util.tree_map(lambda *v: kernel(*v), *(values[g] for g in gets))

    return kernel_fn


def empirical_ntk_vp_fn(
    f: Callable, x1: Any, x2: Any, params: Any, **apply_fn_kwargs: Any
) -> Callable:
    """``ntk_vp_fn(cotangents) = J(x1) J(x2)^T cotangents`` without the NTK, as neural-tangents.

    One vjp at ``x2`` and one jvp at ``x1``: the memory of a vjp of ``f``.

    Example::

        >>> import jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> f = lambda p, x: jnp.tanh(x @ p)
        >>> vp = nt.empirical_ntk_vp_fn(f, jnp.ones((3, 2)), None, jnp.ones((2, 4)))
        >>> vp(jnp.ones((3, 4))).shape
        (3, 4)
    """
    g = _bind_kwargs(f, apply_fn_kwargs)
    x2_ = x1 if x2 is None else x2

    def ntk_vp_fn(cotangents: Any) -> Any:
        _, vjp = jax.vjp(lambda p: g(p, x2_), params)
        (tangent,) = vjp(cotangents)
        return jax.jvp(lambda p: g(p, x1), (params,), (tangent,))[1]

    return ntk_vp_fn
