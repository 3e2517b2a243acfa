"""A user's pair function reduced on a TPU: ``sum_j f(x_i, y_j) [w_j]`` and ``log sum_j
exp(f(x_i, y_j) [+ w_j])`` in fused Pallas kernels, behind the engine's backend seam
(:mod:`memwise.engine.kernels`), for :func:`memwise.pairwise_reduce` and the OT passes
of costs that are not inner products in disguise.

``f`` is written for one pair of points; a kernel needs it over a block of pairs without
a ``(rows, columns, features)`` array, which a TPU's vector registers cannot hold. So
``f`` is traced once to a jaxpr and that jaxpr evaluated *per feature*: feature ``k`` of
the row block is a ``(rows, 1)`` column, of the column block a ``(1, columns)`` row, and
every value of ``f`` is either a scalar, one ``(rows, columns)`` tile, or a feature
vector, a tuple of tiles. Elementwise operations on vectors become one tile operation per
feature, sums over the features (``jnp.sum``, ``jnp.dot``, a norm) sums of tiles, slices,
pads and broadcasts reorderings of the tuple: the formulas of KeOps (Charlier, Feydy,
Glaunès, Collin, Durif, *Kernel Operations on the GPU, with Autodiff, without Memory
Overflows*, JMLR 22, 2021) with the feature axis unrolled, which is why the kernel serves
points of at most :data:`MAX_FEATURES` features. Everything is computed in float32.

* **Forward**: one kernel over (row blocks, column blocks), the columns innermost, each
  step one tile of ``f`` (plus the log-weights, or times the weights) folded into a
  running sum or an online log-sum-exp per row.
* **Backward**: the pair function's vector-Jacobian product (``jax.vjp`` of ``f``,
  traced and evaluated the same way) in two kernels, as FlashAttention's backward splits
  dQ from dK/dV (Dao, *FlashAttention-2*, 2023): one over row blocks sums ``dx`` over the
  columns, one over column blocks sums ``dy``, the weights' gradient and the closed-over
  values' over the rows. Each re-forms its tile's weights ``g_i p_ij`` (``p`` the
  softmax from the saved log-sum-exp; for a sum, the weights themselves).

Measured on a TPU v5e (the L1 cost's log-sum-exp over 20,000 x 20,000 points, d = 3,
``BENCHMARKS.md``): 2.1 ms forward and 9.3 ms with the gradient, against 7.7 and 15.3 ms
for the dense program and 19.1 and 71.8 ms for the XLA tiles. Memory: the kernels keep
per-row statistics as ``(rows, 128)`` float32 arrays (lane-replicated, as the
cross-entropy's), about 1-1.5 KiB a point in the gradient, nothing of size ``n x m``.

Declined (the XLA loops run instead with ``implementation=None``; with ``"pallas"`` the
reason is the error): an operation outside :data:`ELEMENTWISE` and the structural ones
(values of rank 2 or more inside ``f``, sorting, gathers at traced indices), points that
are not one ``(n,)`` or ``(n, d)`` array a side, more than :data:`MAX_FEATURES`
features, a value per pair that is not a scalar, weights other than ``(m,)``, closed-over
arrays that are not float scalars or vectors, integer arithmetic, a ``jax.custom_vjp``
inside ``f`` (its rule need not be linear in the cotangent, which the kernels scale by
each pair's weight), batch dims and rings. Its code paths run on
CPU in interpret mode and its Mosaic lowering is checked by exporting for the TPU
(``tests/test_pair_function_kernel.py``).
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

from memwise.engine import kernels
from memwise.engine.tpu_cross_entropy import LANES, fit_block

__all__ = ["ELEMENTWISE", "MAX_FEATURES", "PAIR_KERNELS", "Blocks", "block_sizes"]

MAX_FEATURES = 32
_MAX_CONSTANTS = 1024  # float32 words of closed-over values, read from SMEM
_VMEM_LIMIT = 100 * 2**20

SECOND_ORDER = (
    "memwise's TPU kernel for pair functions has no second derivatives (jax.hessian, "
    "jacfwd of grad, grad of grad): pass implementation='xla' for them"
)

_F32 = jnp.float32


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


# -- evaluating a pair function's jaxpr per feature -------------------------------------


def _static(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic, int, float, bool))


def _items(v: Any, length: int) -> tuple:
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


def _tile(v: Any) -> Any:
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
            return [fn(*map(_tile, ins), **params)]
        columns = [_items(a, length) for a in ins]
        return [tuple(fn(*map(_tile, args), **params) for args in zip(*columns))]
    operand = ins[0]
    if name == "broadcast_in_dim":
        in_ndim = eqn.invars[0].aval.ndim
        if out_aval.ndim == 0 or in_ndim == 1 and eqn.invars[0].aval.shape[0] == length:
            return [operand]
        first = operand[0] if isinstance(operand, tuple) else operand
        return [(first,) * length]
    if name in ("reshape", "squeeze", "transpose"):
        items = _items(operand, max(1, length)) if eqn.invars[0].aval.ndim else (operand,)
        return [items[0] if out_aval.ndim == 0 else tuple(items)]
    if name == "slice":
        (start,), (limit,) = params["start_indices"], params["limit_indices"]
        stride = (params["strides"] or (1,))[0]
        return [_items(operand, 0)[start:limit:stride]]
    if name == "dynamic_slice":
        if not all(map(_static, ins[1:])):
            raise Unsupported("dynamic_slice at a traced index")
        items = _items(operand, 0)
        size = params["slice_sizes"][0]
        start = min(max(int(np.asarray(ins[1])), 0), len(items) - size)
        return [items[start : start + size]]
    if name == "pad":
        features = list(_items(operand, 0))
        value = ins[1]
        ((lo, hi, interior),) = params["padding_config"]
        spaced: list = []
        for k, item in enumerate(features):
            spaced += [item] + ([value] * interior if k < len(features) - 1 else [])
        spaced = [value] * max(lo, 0) + spaced[max(-lo, 0) :]
        spaced = spaced[: len(spaced) + min(hi, 0)] + [value] * max(hi, 0)
        return [tuple(spaced)]
    if name == "concatenate":
        parts = [_items(a, v.aval.shape[0]) for a, v in zip(ins, eqn.invars)]
        return [tuple(item for part in parts for item in part)]
    if name == "rev":
        return [tuple(reversed(_items(operand, length)))]
    if name in _FOLDS:
        if not params["axes"]:
            return [operand]
        return [functools.reduce(_FOLDS[name], map(_tile, _items(operand, 0)))]
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        a, b = ins
        ra, rb_ = (v.aval.ndim for v in eqn.invars)
        if lc:  # two vectors, contracted
            return [
                functools.reduce(
                    lambda s, t: s + t,
                    (_tile(p) * _tile(q) for p, q in zip(_items(a, 0), _items(b, 0))),
                )
            ]
        if out_aval.ndim == 0:
            return [_tile(a) * _tile(b)]
        n = length
        return [
            tuple(
                _tile(p) * _tile(q)
                for p, q in zip(_items(a, n) if ra else (a,) * n, _items(b, n) if rb_ else (b,) * n)
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
    rows = _split(jnp.zeros((8, max(1, x.shape[1] if x.ndim == 2 else 1)), _F32), 1, x.ndim - 1)
    cols = _split(jnp.zeros((max(1, y.shape[1] if y.ndim == 2 else 1), LANES), _F32), 0, y.ndim - 1)
    cvals = _consts(program, jnp.zeros((max(1, sum(program.const_sizes)),), _F32))
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


def _split(block: Any, axis: int, rank: int) -> Any:
    """A block of points as the jaxpr's argument: its features, a tuple of columns
    (``axis=1``) or rows (``axis=0``), or one column or row for points of rank 0."""
    take = (lambda k: block[:, k : k + 1]) if axis == 1 else (lambda k: block[k : k + 1, :])
    if rank == 0:
        return take(0)
    return tuple(take(k) for k in range(block.shape[axis]))


def _consts(program: Program, flat: Any) -> list:
    """The closed-over values as the jaxpr's arguments, from one float32 vector (the SMEM
    ref in a kernel): ``(1, 1)`` tiles, a tuple of them for a vector."""
    out, at = [], 0
    for var, size in zip(program.value.jaxpr.invars[2:], program.const_sizes):
        tiles = tuple(jnp.full((1, 1), flat[at + k], _F32) for k in range(size))
        out.append(tiles if var.aval.ndim == 1 else tiles[0])
        at += size
    return out


# -- the kernels ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Row and column block sizes of the forward and the backward kernels."""

    rows: int
    cols: int
    rows_bwd: int
    cols_bwd: int


def block_sizes(n: int, m: int, d: int) -> Blocks:
    """Blocks for ``n x m`` pairs of ``d`` features: 256 x 2,048 forward and 512 x 1,024
    backward for a few features, half the columns beyond 8 (each feature keeps tiles
    live). Measured on a TPU v5e (the L1 cost's log-sum-exp at 20,000 x 20,000, d = 3,
    forward / value_and_grad): 256 x 2,048 2.0 / 12.4 ms, 512 x 1,024 2.3 / 9.7 ms,
    256 x 1,024 2.4 / 10.0 ms, 128 x 1,024 2.7 / 10.8 ms, 512 x 512 2.8 / 10.8 ms.

    Example::

        >>> block_sizes(20_000, 20_000, 3)
        Blocks(rows=200, cols=2048, rows_bwd=400, cols_bwd=1024)
    """
    wide = 1 if d <= 8 else 2
    return Blocks(
        fit_block(n, 256, 8),
        fit_block(m, 2048 // wide, LANES),
        fit_block(n, 512, 8),
        fit_block(m, 1024 // wide, LANES),
    )


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str  # "sum" or "logsumexp"
    weights: str | None  # "times", "plus" or None
    program: Program
    n: int
    m: int
    d: int
    blocks: Blocks
    interpret: bool


def _lanes(v: Any, width: int) -> Any:
    return jnp.broadcast_to(v[:, :1], (v.shape[0], width))


def _pairs_tile(cfg: Config, x_ref: Any, yt_ref: Any, c_ref: Any, outputs: Any) -> list:
    """The program's ``outputs`` on this step's tile of pairs."""
    closed = cfg.program.vjp if outputs is not None else cfg.program.value
    rows = _split(x_ref[...].astype(_F32), 1, cfg.program.x_rank)
    cols = _split(yt_ref[...].astype(_F32), 0, cfg.program.y_rank)
    cvals = _consts(cfg.program, c_ref) if c_ref is not None else []
    return evaluate(closed.jaxpr, closed.consts, [rows, cols, *cvals], outputs)


def _full(v: Any, shape: tuple[int, int]) -> Any:
    return jnp.broadcast_to(jnp.asarray(_tile(v), _F32), shape)


def _scores(cfg: Config, f: Any, w_ref: Any, shape: tuple[int, int]) -> Any:
    s = _full(f, shape)
    if w_ref is not None:
        w = w_ref[...].astype(_F32)
        s = s + w if cfg.weights == "plus" else s * w
    return s


def _forward_kernel(cfg: Config, *refs: Any) -> None:
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, yt_ref = next(it), next(it)
    w_ref = next(it) if cfg.weights else None
    c_ref = next(it) if cfg.program.const_sizes else None
    out_ref, m_ref, l_ref = next(it), next(it), next(it)
    bn, bm = cfg.blocks.rows, cfg.blocks.cols
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)

    (f,) = _pairs_tile(cfg, x_ref, yt_ref, c_ref, None)
    s = _scores(cfg, f, w_ref, (bn, bm))
    if cfg.m % bm:
        col = j * bm + lax.broadcasted_iota(jnp.int32, (bn, bm), 1)
        s = jnp.where(col < cfg.m, s, -jnp.inf if cfg.mode == "logsumexp" else 0.0)
    if cfg.mode == "sum":
        l_ref[...] += jnp.sum(s, axis=1, keepdims=True)
    else:
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        shift = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # rows of -inf (or +inf)
        e = jnp.exp(s - _lanes(shift, bm))
        l_ref[...] = jnp.exp(m_prev - shift) * l_ref[...] + jnp.sum(e, axis=1, keepdims=True)
        m_ref[...] = m_next

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        if cfg.mode == "sum":
            out_ref[...] = l_ref[...]
        else:
            out_ref[...] = m_ref[...] + jnp.log(l_ref[...])


def _specs(cfg: Config, rows: int, cols: int, row: Callable, col: Callable) -> tuple:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    d = cfg.d
    specs = [
        pl.BlockSpec((rows, d), lambda *g: (row(*g), 0)),
        pl.BlockSpec((d, cols), lambda *g: (0, col(*g))),
    ]
    if cfg.weights:
        specs.append(pl.BlockSpec((1, cols), lambda *g: (0, col(*g))))
    if cfg.program.const_sizes:
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    per_row = pl.BlockSpec((rows, LANES), lambda *g: (row(*g), 0))
    return specs, per_row


def _inputs(cfg: Config, x: Any, yt: Any, w: Any, c: Any) -> list:
    args = [x, yt]
    if cfg.weights:
        args.append(w.reshape(1, -1))
    if cfg.program.const_sizes:
        args.append(c)
    return args


def _params(semantics: Any) -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT)


def _forward(cfg: Config, x: Any, yt: Any, w: Any, c: Any) -> Any:
    """``(n, 128)`` float32, the sums or log-sum-exps replicated over the lanes."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    bn, bm = cfg.blocks.rows, cfg.blocks.cols
    specs, per_row = _specs(cfg, bn, bm, lambda i, j: i, lambda i, j: j)
    with kernels.trace_config(x.dtype):
        return pl.pallas_call(
            functools.partial(_forward_kernel, cfg),
            grid=(pl.cdiv(cfg.n, bn), pl.cdiv(cfg.m, bm)),
            in_specs=specs,
            out_specs=per_row,
            out_shape=jax.ShapeDtypeStruct((cfg.n, LANES), _F32),
            scratch_shapes=[pltpu.VMEM((bn, LANES), _F32)] * 2,
            compiler_params=_params(("parallel", "arbitrary")),
            interpret=cfg.interpret,
            name=f"memwise_pair_function_{cfg.mode}_fwd",
        )(*_inputs(cfg, x, yt, w, c))


def _coefficients(
    cfg: Config, f: Any, w_ref: Any, stat_ref: Any, g_ref: Any, keep: Any, shape: tuple[int, int]
) -> Any:
    """``g_i p_ij`` (log-sum-exp: ``p`` the softmax) or ``g_i w_j`` (sum) over the tile,
    0 outside the arrays."""
    g = _lanes(g_ref[...], shape[1])
    if cfg.mode == "logsumexp":
        s = _scores(cfg, f, w_ref, shape)
        lse = _lanes(stat_ref[...], shape[1])
        finite = jnp.isfinite(lse)
        coef = jnp.where(finite, g * jnp.exp(s - jnp.where(finite, lse, 0.0)), 0.0)
    elif w_ref is not None:
        coef = g * w_ref[...].astype(_F32)
    else:
        coef = g
    return coef if keep is None else jnp.where(keep, coef, 0.0)


def _weighted(coef: Any, part: Any, keep: Any, shape: tuple[int, int]) -> Any:
    t = coef * _full(part, shape)
    return t if keep is None else jnp.where(keep, t, 0.0)


def _dx_kernel(cfg: Config, *refs: Any) -> None:
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, yt_ref = next(it), next(it)
    w_ref = next(it) if cfg.weights else None
    c_ref = next(it) if cfg.program.const_sizes else None
    stat_ref, g_ref, dx_ref, acc = next(it), next(it), next(it), next(it)
    bn, bm = cfg.blocks.rows_bwd, cfg.blocks.cols_bwd
    j = pl.program_id(1)
    shape = (bn, bm)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, _F32)

    f, dfx = _pairs_tile(cfg, x_ref, yt_ref, c_ref, [0, 1])
    keep = None
    if cfg.m % bm:
        keep = j * bm + lax.broadcasted_iota(jnp.int32, shape, 1) < cfg.m
    coef = _coefficients(cfg, f, w_ref, stat_ref, g_ref, keep, shape)
    parts = _items(dfx, cfg.d) if cfg.program.x_rank else (dfx,)
    lane = lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    total = jnp.zeros(acc.shape, _F32)
    for k, part in enumerate(parts):
        col = jnp.sum(_weighted(coef, part, keep, shape), axis=1, keepdims=True)
        total = total + jnp.where(lane == k, col, 0.0)
    acc[...] += total

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        dx_ref[...] = acc[...]


def _dy_kernel(cfg: Config, *refs: Any) -> None:
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, yt_ref = next(it), next(it)
    w_ref = next(it) if cfg.weights else None
    c_ref = next(it) if cfg.program.const_sizes else None
    stat_ref, g_ref = next(it), next(it)
    dyt_ref = next(it)
    dw_ref = next(it) if cfg.weights else None
    dc_ref = next(it) if cfg.program.const_sizes else None
    dy_acc, dw_acc, dc_acc = next(it), next(it), next(it)
    bn, bm = cfg.blocks.rows_bwd, cfg.blocks.cols_bwd
    j, i = pl.program_id(0), pl.program_id(1)
    shape = (bn, bm)

    @pl.when(i == 0)
    def _():
        dy_acc[...] = jnp.zeros(dy_acc.shape, _F32)
        dw_acc[...] = jnp.zeros(dw_acc.shape, _F32)
        dc_acc[...] = jnp.zeros(dc_acc.shape, _F32)

    n_consts = len(cfg.program.const_sizes)
    f, dfy, *dfc = _pairs_tile(cfg, x_ref, yt_ref, c_ref, [0, 2, *range(3, 3 + n_consts)])
    keep = None
    if cfg.n % bn:
        keep = i * bn + lax.broadcasted_iota(jnp.int32, shape, 0) < cfg.n
    if cfg.m % bm:
        cols_in = j * bm + lax.broadcasted_iota(jnp.int32, shape, 1) < cfg.m
        keep = cols_in if keep is None else keep & cols_in
    coef = _coefficients(cfg, f, w_ref, stat_ref, g_ref, keep, shape)

    def rows_of(parts: Sequence[Any], ref: Any) -> Any:
        sub = lax.broadcasted_iota(jnp.int32, ref.shape, 0)
        total = jnp.zeros(ref.shape, _F32)
        for k, part in enumerate(parts):
            row = jnp.sum(_weighted(coef, part, keep, shape), axis=0, keepdims=True)
            total = total + jnp.where(sub == k, row, 0.0)
        return total

    dy_acc[...] += rows_of(_items(dfy, cfg.d) if cfg.program.y_rank else (dfy,), dy_acc)
    if cfg.weights:
        if cfg.mode == "logsumexp":
            dw = jnp.sum(coef, axis=0, keepdims=True)
        else:
            g = _lanes(g_ref[...], bm)
            dw = jnp.sum(_weighted(g, f, keep, shape), axis=0, keepdims=True)
        dw_acc[...] += dw
    if n_consts:
        ranks = [v.aval.ndim for v in cfg.program.value.jaxpr.invars[2:]]
        sizes = cfg.program.const_sizes
        flat = [
            t for part, r, k in zip(dfc, ranks, sizes) for t in (_items(part, k) if r else (part,))
        ]
        dc_acc[...] += rows_of(flat, dc_acc)

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        dyt_ref[...] = dy_acc[...]
        if dw_ref is not None:
            dw_ref[...] = dw_acc[...]
        if dc_ref is not None:
            dc_ref[...] = dc_acc[...]


def _backward(cfg: Config, x: Any, yt: Any, w: Any, c: Any, stats: Any, g: Any) -> tuple:
    """``(dx, dyt, dw, dc)`` in float32: ``dyt`` is ``(d, m)``, ``dc`` the closed-over
    values' gradient flattened."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    bn, bm = cfg.blocks.rows_bwd, cfg.blocks.cols_bwd
    d = cfg.d
    per = [
        jnp.broadcast_to(stats[:, :1], (cfg.n, LANES)),
        jnp.broadcast_to(g.astype(_F32)[:, None], (cfg.n, LANES)),
    ]
    args = _inputs(cfg, x, yt, w, c) + per
    with kernels.trace_config(x.dtype):
        specs, per_row = _specs(cfg, bn, bm, lambda i, j: i, lambda i, j: j)
        dx = pl.pallas_call(
            functools.partial(_dx_kernel, cfg),
            grid=(pl.cdiv(cfg.n, bn), pl.cdiv(cfg.m, bm)),
            in_specs=specs + [per_row] * 2,
            out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((cfg.n, d), _F32),
            scratch_shapes=[pltpu.VMEM((bn, d), _F32)],
            compiler_params=_params(("parallel", "arbitrary")),
            interpret=cfg.interpret,
            name=f"memwise_pair_function_{cfg.mode}_dx",
        )(*args)
        specs, per_row = _specs(cfg, bn, bm, lambda j, i: i, lambda j, i: j)
        n_c = max(1, sum(cfg.program.const_sizes))
        by_col = [pl.BlockSpec((d, bm), lambda j, i: (0, j))]
        shapes = [jax.ShapeDtypeStruct((d, cfg.m), _F32)]
        if cfg.weights:
            by_col.append(pl.BlockSpec((1, bm), lambda j, i: (0, j)))
            shapes.append(jax.ShapeDtypeStruct((1, cfg.m), _F32))
        if cfg.program.const_sizes:
            by_col.append(pl.BlockSpec((n_c, bm), lambda j, i: (0, j)))
            shapes.append(jax.ShapeDtypeStruct((n_c, cfg.m), _F32))
        out = pl.pallas_call(
            functools.partial(_dy_kernel, cfg),
            grid=(pl.cdiv(cfg.m, bm), pl.cdiv(cfg.n, bn)),
            in_specs=specs + [per_row] * 2,
            out_specs=by_col,
            out_shape=shapes,
            scratch_shapes=[
                pltpu.VMEM((d, bm), _F32),
                pltpu.VMEM((1, bm), _F32),
                pltpu.VMEM((n_c, bm), _F32),
            ],
            compiler_params=_params(("parallel", "arbitrary")),
            interpret=cfg.interpret,
            name=f"memwise_pair_function_{cfg.mode}_dy",
        )(*args)
    it = iter(out)
    dyt = next(it)
    dw = next(it)[0] if cfg.weights else None
    dc = jnp.sum(next(it), axis=1) if cfg.program.const_sizes else None
    return dx, dyt, dw, dc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduce(cfg: Config, x: Any, yt: Any, w: Any, c: Any) -> Any:
    return _reduce_fwd(cfg, x, yt, w, c)[0]


def _consts_batched(in_batched: tuple) -> bool:
    """Whether a vmap batches the closed-over values, which the kernels read whole from
    SMEM (Mosaic cannot block them by a batch axis): then a loop over the batch."""
    return bool(in_batched[3])


def _reduce_fwd(cfg, x, yt, w, c):
    forward = kernels.one_at_a_time(functools.partial(_forward, cfg), _consts_batched)
    stats = kernels.first_order(SECOND_ORDER, forward, x, yt, w, c)
    return stats[:, 0], (x, yt, w, c, stats)


def _reduce_bwd(cfg, residual, g):
    x, yt, w, c, stats = residual
    backward = kernels.one_at_a_time(functools.partial(_backward, cfg), _consts_batched)
    dx, dyt, dw, dc = kernels.first_order(SECOND_ORDER, backward, x, yt, w, c, stats, g)
    return (
        dx.astype(x.dtype),
        dyt.astype(yt.dtype),
        None if w is None else dw.astype(w.dtype),
        None if c is None else dc.astype(c.dtype),
    )


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


# -- the seam ---------------------------------------------------------------------------


def _operands(cols: Any) -> tuple[Any, Any]:
    return cols["y"], cols.get("w")


def _declines(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any
) -> str | None:
    why = kernels.points_on_one_device(call)
    if why is not None:
        return why
    if pairs:
        return "pair operands"
    y, w = _operands(cols) if isinstance(cols, dict) else (None, None)
    x = rows
    if not isinstance(x, jax.Array) or not isinstance(y, jax.Array):
        return "points that are pytrees (one (n,) or (n, d) array a side)"
    if x.ndim not in (1, 2) or y.ndim != x.ndim or x.shape[1:] != y.shape[1:]:
        return (
            f"points of shapes {x.shape} and {y.shape} (one (n,) or (n, d) array a side, "
            "the same d)"
        )
    if x.ndim == 2 and not 0 < x.shape[1] <= MAX_FEATURES:
        return f"points of {x.shape[1]} features (it unrolls 1 to {MAX_FEATURES} features)"
    floats = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    if x.dtype not in floats or y.dtype not in floats:
        return f"{x.dtype} and {y.dtype} points (it takes bfloat16 or float32)"
    if w is not None and w.ndim != 1:
        return "weights with trailing dims"
    consts = list(consts)
    if any(np.ndim(c) > 1 or not jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in consts):
        return "closed-over arrays other than float scalars and vectors"
    if sum(int(np.size(c)) for c in consts) > _MAX_CONSTANTS:
        return f"more than {_MAX_CONSTANTS} closed-over numbers"
    fn = call.pattern.option("fn")
    try:
        out = jax.eval_shape(
            fn,
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
            jax.ShapeDtypeStruct(y.shape[1:], y.dtype),
            *consts,
        )
        if out.ndim or not jnp.issubdtype(out.dtype, jnp.floating):
            return (
                f"a pair function returning {out.dtype}{list(out.shape)} (it takes a float "
                "scalar per pair)"
            )
        trace(fn, x, y, consts)
    except Unsupported as why:
        return f"the operation {why} in the pair function"
    except (TypeError, ValueError) as error:  # what the evaluation could not take
        return f"the pair function as traced ({type(error).__name__}: {error})"
    return None


def _apply(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any, *, interpret: bool
) -> Any:
    del pairs
    x, (y, w) = rows, _operands(cols)
    consts = list(consts)
    fn = call.pattern.option("fn")
    program = trace(fn, x, y, consts)
    out_dtype = jax.eval_shape(fn, x[0], y[0], *consts).dtype
    if w is not None:
        out_dtype = jnp.result_type(out_dtype, w.dtype)
    x2 = x if x.ndim == 2 else x[:, None]
    yt = (y if y.ndim == 2 else y[:, None]).T
    n, d = x2.shape
    m = yt.shape[1]
    c = jnp.concatenate([jnp.ravel(k).astype(_F32) for k in consts]) if consts else None
    cfg = Config(
        call.reduce,
        call.pattern.option("weights") if w is not None else None,
        program,
        n,
        m,
        d,
        block_sizes(n, m, d),
        interpret,
    )
    out = _reduce(cfg, x2, yt, w, c).astype(out_dtype)
    return out


PAIR_KERNELS = tuple(
    kernels.register(
        kernels.Kernel(
            "a pair function's reduction (Pallas, TPU)",
            "pair_function",
            reduce,
            ("tpu",),
            apply=_apply,
            declines=_declines,
        )
    )
    for reduce in ("sum", "logsumexp")
)
