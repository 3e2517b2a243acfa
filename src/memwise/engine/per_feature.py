"""A pair function's jaxpr evaluated per feature: the values of ``f(x_i, y_j)`` over a
block of pairs without a ``(rows, columns, features)`` array, for the TPU kernels of
:mod:`memwise.engine.tpu_pair_function`.

``f`` is written for one pair of points. Traced once to a jaxpr (and its ``jax.vjp`` to
another), it is evaluated with feature ``k`` of a block of rows as a ``(rows, 1)``
column and of a block of columns as a ``(1, columns)`` row: every value of ``f`` is a
scalar, one ``(rows, columns)`` tile, or a feature vector, a tuple of tiles. Elementwise
operations on vectors become one tile operation per feature, sums over the features
sums of tiles, slices, pads and broadcasts reorderings of the tuple: the formulas of
KeOps (Charlier, Feydy, Glaunès, Collin, Durif, JMLR 22, 2021) with the feature axis
unrolled. Everything is computed in float32. What it cannot evaluate raises
:class:`Unsupported`, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

__all__ = [
    "ELEMENTWISE",
    "Program",
    "Unsupported",
    "constants",
    "evaluate",
    "items",
    "split",
    "tile",
    "trace",
]

_F32 = jnp.float32
_CHECK_TILE = (8, 128)  # the tiles trace() evaluates a program on, to find what it lacks


def _where(p: Any, *cases: Any) -> Any:
    """``lax.select_n`` with broadcasting: ``cases[p]``."""
    if len(cases) == 2:
        return jnp.where(p, cases[1], cases[0])
    out = cases[0]
    for k, case in enumerate(cases[1:], 1):
        out = jnp.where(p == k, case, out)
    return out


def _cast(x: Any, new_dtype: Any, **_: Any) -> Any:
    dtype = jnp.dtype(new_dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(x).astype(_F32)
    return jnp.asarray(x).astype(dtype)


def _round(x: Any, rounding_method: Any = None, **_: Any) -> Any:
    if int(rounding_method or 0) == 1:  # to nearest even
        return jnp.round(x)
    whole = jnp.sign(x) * jnp.floor(jnp.abs(x))  # away from zero: no x + 0.5 rounding
    return jnp.where(jnp.abs(x - whole) >= 0.5, whole + jnp.sign(x), whole)


# The elementwise operations a pair function may use, as functions of broadcasting float32
# tiles (each also takes the equation's parameters).
ELEMENTWISE: dict[str, Callable[..., Any]] = {
    "abs": lambda x, **_: jnp.abs(x),
    "add": lambda x, y, **_: x + y,
    "add_any": lambda x, y, **_: x + y,
    "and": lambda x, y, **_: x & y,
    "ceil": lambda x, **_: jnp.ceil(x),
    "clamp": lambda lo, x, hi, **_: jnp.minimum(jnp.maximum(x, lo), hi),
    "convert_element_type": _cast,
    "copy": lambda x, **_: x,
    "copy_p": lambda x, **_: x,
    "cos": lambda x, **_: jnp.cos(x),
    "div": lambda x, y, **_: x / y,
    "eq": lambda x, y, **_: x == y,
    "exp": lambda x, **_: jnp.exp(x),
    "exp2": lambda x, **_: jnp.exp2(x),
    "expm1": lambda x, **_: jnp.expm1(x),
    "floor": lambda x, **_: jnp.floor(x),
    "ge": lambda x, y, **_: x >= y,
    "gt": lambda x, y, **_: x > y,
    "integer_pow": lambda x, y, **_: lax.integer_pow(jnp.asarray(x, _F32), y),
    "is_finite": lambda x, **_: jnp.isfinite(x),
    "le": lambda x, y, **_: x <= y,
    "log": lambda x, **_: jnp.log(x),
    "log1p": lambda x, **_: jnp.log1p(x),
    "logistic": lambda x, **_: jax.nn.sigmoid(x),
    "lt": lambda x, y, **_: x < y,
    "max": lambda x, y, **_: jnp.maximum(x, y),
    "min": lambda x, y, **_: jnp.minimum(x, y),
    "mul": lambda x, y, **_: x * y,
    "ne": lambda x, y, **_: x != y,
    "neg": lambda x, **_: -x,
    "not": lambda x, **_: ~x,
    "or": lambda x, y, **_: x | y,
    "pow": lambda x, y, **_: jnp.power(x, y),
    "reduce_precision": lambda x, **_: x,
    "round": _round,
    "rsqrt": lambda x, **_: lax.rsqrt(x),
    "select_n": _where,
    "sign": lambda x, **_: jnp.sign(x),
    "sin": lambda x, **_: jnp.sin(x),
    "sqrt": lambda x, **_: jnp.sqrt(x),
    "square": lambda x, **_: x * x,
    "sub": lambda x, y, **_: x - y,
    "tanh": lambda x, **_: jnp.tanh(x),
}

_FOLDS: dict[str, Callable[[Any, Any], Any]] = {
    "reduce_sum": lambda a, b: a + b,
    "reduce_max": jnp.maximum,
    "reduce_min": jnp.minimum,
    "reduce_prod": lambda a, b: a * b,
    "reduce_and": lambda a, b: a & b,
    "reduce_or": lambda a, b: a | b,
}

_CALLS = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "checkpoint",
    "remat",
)


class Unsupported(Exception):
    """What in a pair function the kernel cannot evaluate per feature."""


def _static(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic, int, float, bool))


def items(v: Any, length: int) -> tuple:
    """A value as ``length`` features (0: as many as it has): a tuple of tiles (or static
    scalars); a scalar or a vector of one feature broadcast."""
    if _static(v) and np.ndim(v) == 1:
        v = tuple(np.asarray(v))
    if not isinstance(v, tuple):
        v = (v,)
    if length and len(v) == 1:
        return v * length
    if length and len(v) != length:
        raise Unsupported(f"a vector of {len(v)} features where {length} are expected")
    return v


def tile(v: Any) -> Any:
    """A scalar operand for a tile operation: float32, or its own bool/int dtype."""
    if isinstance(v, (np.ndarray, np.generic, int, float, bool)):
        a = np.asarray(v)
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(a, _F32)
        return jnp.asarray(a)
    return v


def _length(aval: Any) -> int:
    if aval.ndim > 1:
        raise Unsupported(
            f"values of rank {aval.ndim} ({aval.str_short()}: the kernel keeps a pair's "
            "values as scalars and feature vectors)"
        )
    return aval.shape[0] if aval.ndim == 1 else 0


def _sub_jaxpr(eqn: Any) -> tuple[Any, list]:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, core.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, core.Jaxpr):
            return sub, []
    raise Unsupported(f"{eqn.primitive.name} (no jaxpr inside it)")


def _evaluate_eqn(eqn: Any, ins: list) -> list:
    name = eqn.primitive.name
    params = eqn.params
    if name in _CALLS:
        sub, consts = _sub_jaxpr(eqn)
        return evaluate(sub, consts, ins)
    if all(map(_static, ins)):  # no pair in it: evaluate it now
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*map(jnp.asarray, ins), **params)
        outs = out if eqn.primitive.multiple_results else [out]
        return [np.asarray(o) for o in outs]
    rank = max((np.ndim(a) for a in ins if _static(a)), default=0)
    if rank > 1:
        raise Unsupported(
            f"{name} of a closed-over array of rank {rank} (the kernel keeps a pair's values "
            "as scalars and feature vectors)"
        )
    out_aval = eqn.outvars[0].aval
    length = _length(out_aval)
    integer = jnp.issubdtype(out_aval.dtype, jnp.integer)
    if integer and name != "convert_element_type":
        raise Unsupported(f"{name} on integers (the kernel computes in float32)")
    if name in ELEMENTWISE:
        fn = ELEMENTWISE[name]
        if out_aval.ndim == 0:
            return [fn(*map(tile, ins), **params)]
        columns = [items(a, length) for a in ins]
        return [tuple(fn(*map(tile, args), **params) for args in zip(*columns))]
    operand = ins[0]
    if name == "broadcast_in_dim":
        in_ndim = eqn.invars[0].aval.ndim
        if out_aval.ndim == 0 or in_ndim == 1 and eqn.invars[0].aval.shape[0] == length:
            return [operand]
        first = operand[0] if isinstance(operand, tuple) else operand
        return [(first,) * length]
    if name in ("reshape", "squeeze", "transpose"):
        features = items(operand, max(1, length)) if eqn.invars[0].aval.ndim else (operand,)
        return [features[0] if out_aval.ndim == 0 else tuple(features)]
    if name == "slice":
        (start,), (limit,) = params["start_indices"], params["limit_indices"]
        stride = (params["strides"] or (1,))[0]
        return [items(operand, 0)[start:limit:stride]]
    if name == "dynamic_slice":
        if not all(map(_static, ins[1:])):
            raise Unsupported("dynamic_slice at a traced index")
        features = items(operand, 0)
        size = params["slice_sizes"][0]
        start = min(max(int(np.asarray(ins[1])), 0), len(features) - size)
        return [features[start : start + size]]
    if name == "pad":
        elements = list(items(operand, 0))
        value = ins[1]
        ((lo, hi, interior),) = params["padding_config"]
        spaced: list = []
        for k, item in enumerate(elements):
            spaced += [item] + ([value] * interior if k < len(elements) - 1 else [])
        spaced = [value] * max(lo, 0) + spaced[max(-lo, 0) :]
        spaced = spaced[: len(spaced) + min(hi, 0)] + [value] * max(hi, 0)
        return [tuple(spaced)]
    if name == "concatenate":
        parts = [items(a, v.aval.shape[0]) for a, v in zip(ins, eqn.invars)]
        return [tuple(item for part in parts for item in part)]
    if name == "rev":
        return [tuple(reversed(items(operand, length)))]
    if name in _FOLDS:
        if not params["axes"]:
            return [operand]
        return [functools.reduce(_FOLDS[name], map(tile, items(operand, 0)))]
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        a, b = ins
        ra, rb_ = (v.aval.ndim for v in eqn.invars)
        if lc:  # two vectors, contracted
            return [
                functools.reduce(
                    lambda s, t: s + t,
                    (tile(p) * tile(q) for p, q in zip(items(a, 0), items(b, 0))),
                )
            ]
        if out_aval.ndim == 0:
            return [tile(a) * tile(b)]
        n = length
        return [
            tuple(
                tile(p) * tile(q)
                for p, q in zip(items(a, n) if ra else (a,) * n, items(b, n) if rb_ else (b,) * n)
            )
        ]
    raise Unsupported(name)


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], outputs: Any = None) -> list:
    """``jaxpr`` on per-feature values (see the module docstring); ``outputs``: the
    indices of the outputs to compute (the equations no other one needs are skipped)."""
    used = range(len(jaxpr.outvars)) if outputs is None else outputs
    needed = {v for k in used if isinstance(v := jaxpr.outvars[k], core.Var)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, core.Var))
    env: dict = {}

    def read(v: Any) -> Any:
        return np.asarray(v.val) if isinstance(v, core.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = np.asarray(value)
    env.update(zip(jaxpr.invars, args))
    for eqn in reversed(eqns):
        outs = _evaluate_eqn(eqn, [read(v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, outs):
            if not isinstance(var, core.DropVar):
                env[var] = value
    return [read(jaxpr.outvars[k]) for k in used]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A pair function traced for the kernels: ``value`` maps ``(x_i, y_j, *consts)`` to
    ``f``; ``vjp`` to ``(f, df/dx_i, df/dy_j, *df/dconsts)``."""

    value: Any  # ClosedJaxpr
    vjp: Any  # ClosedJaxpr
    x_rank: int
    y_rank: int
    const_sizes: tuple[int, ...]


def trace(fn: Callable, x: Any, y: Any, consts: Sequence[Any]) -> Program:
    """``fn``'s :class:`Program` for points like ``x[0]``, ``y[0]``; raises
    :class:`Unsupported` naming what the kernel cannot evaluate."""
    point_x = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    point_y = jax.ShapeDtypeStruct(y.shape[1:], y.dtype)
    avals = [jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in consts]

    def with_vjp(*args: Any) -> tuple:
        value, pullback = jax.vjp(fn, *args)
        return (value, *pullback(jnp.ones_like(value)))

    value = jax.make_jaxpr(fn)(point_x, point_y, *avals)
    _no_custom_vjp(value.jaxpr)
    vjp = jax.make_jaxpr(with_vjp)(point_x, point_y, *avals)
    program = Program(value, vjp, x.ndim - 1, y.ndim - 1, tuple(int(np.size(c)) for c in consts))
    # Evaluate both on small tiles: what the kernel cannot evaluate raises here.
    rows = split(
        jnp.zeros((_CHECK_TILE[0], max(1, x.shape[1] if x.ndim == 2 else 1)), _F32), 1, x.ndim - 1
    )
    cols = split(
        jnp.zeros((max(1, y.shape[1] if y.ndim == 2 else 1), _CHECK_TILE[1]), _F32), 0, y.ndim - 1
    )
    cvals = constants(program, jnp.zeros((max(1, sum(program.const_sizes)),), _F32))
    for closed in (value, vjp):
        jax.eval_shape(
            lambda r, c, k, closed=closed: evaluate(closed.jaxpr, closed.consts, [r, c, *k]),
            rows,
            cols,
            cvals,
        )
    return program


def _no_custom_vjp(jaxpr: Any) -> None:
    """The kernels scale the pair function's vector-Jacobian product at a cotangent of 1
    by each pair's weight, which holds for JAX's own derivatives (linear in the
    cotangent) but not for a ``jax.custom_vjp`` rule (gradient clipping, say)."""
    for eqn in jaxpr.eqns:
        # JAX_CUSTOM_VJP3 traces a custom_vjp as a hijax primitive's call
        hi = type(eqn.params.get("_prim")).__name__
        if eqn.primitive.name.startswith("custom_vjp") or "VJP" in hi:
            raise Unsupported(
                "custom_vjp (a backward rule need not be linear in the cotangent, which the "
                "kernel scales by each pair's weight)"
            )
        for sub in core.jaxprs_in_params(eqn.params):
            _no_custom_vjp(sub)


def split(block: Any, axis: int, rank: int) -> Any:
    """A block of points as the jaxpr's argument: its features, a tuple of columns
    (``axis=1``) or rows (``axis=0``), or one column or row for points of rank 0."""
    take = (lambda k: block[:, k : k + 1]) if axis == 1 else (lambda k: block[k : k + 1, :])
    if rank == 0:
        return take(0)
    return tuple(take(k) for k in range(block.shape[axis]))


def constants(program: Program, flat: Any) -> list:
    """The closed-over values as the jaxpr's arguments, from one float32 vector (the SMEM
    ref in a kernel): ``(1, 1)`` tiles, a tuple of them for a vector."""
    out, at = [], 0
    for var, size in zip(program.value.jaxpr.invars[2:], program.const_sizes):
        tiles = tuple(jnp.full((1, 1), flat[at + k], _F32) for k in range(size))
        out.append(tiles if var.aval.ndim == 1 else tiles[0])
        at += size
    return out
