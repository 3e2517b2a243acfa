"""A user's pair function reduced on a TPU: ``sum_j f(x_i, y_j) [w_j]`` and ``log sum_j
exp(f(x_i, y_j) [+ w_j])`` in fused Pallas kernels, behind the engine's backend seam
(:mod:`memwise.engine.kernels`), for :func:`memwise.pairwise_reduce` and the OT passes
of costs that are not inner products in disguise.

``f`` is written for one pair of points; a kernel needs it over a block of pairs without
a ``(rows, columns, features)`` array, which a TPU's vector registers cannot hold. So
``f`` is traced once and its jaxpr evaluated per feature over tiles of pairs
(:mod:`memwise.engine.per_feature`: KeOps's formulas with the feature axis unrolled,
which is why the kernel serves points of at most :data:`MAX_FEATURES` features).
Everything is computed in float32.

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
reason is the error): an operation outside :data:`memwise.engine.per_feature.ELEMENTWISE` and the structural ones
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

from memwise.engine import kernels, per_feature
from memwise.engine.tpu_cross_entropy import LANES, fit_block

__all__ = ["MAX_FEATURES", "PAIR_KERNELS", "Blocks", "block_sizes"]

MAX_FEATURES = 32
_MAX_CONSTANTS = 1024  # float32 words of closed-over values, read from SMEM
_VMEM_LIMIT = 100 * 2**20

SECOND_ORDER = (
    "memwise's TPU kernel for pair functions has no second derivatives (jax.hessian, "
    "jacfwd of grad, grad of grad): pass implementation='xla' for them"
)

_F32 = jnp.float32


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
    program: per_feature.Program
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
    rows = per_feature.split(x_ref[...].astype(_F32), 1, cfg.program.x_rank)
    cols = per_feature.split(yt_ref[...].astype(_F32), 0, cfg.program.y_rank)
    cvals = per_feature.constants(cfg.program, c_ref) if c_ref is not None else []
    return per_feature.evaluate(closed.jaxpr, closed.consts, [rows, cols, *cvals], outputs)


def _full(v: Any, shape: tuple[int, int]) -> Any:
    return jnp.broadcast_to(jnp.asarray(per_feature.tile(v), _F32), shape)


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
    parts = per_feature.items(dfx, cfg.d) if cfg.program.x_rank else (dfx,)
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

    dy_acc[...] += rows_of(per_feature.items(dfy, cfg.d) if cfg.program.y_rank else (dfy,), dy_acc)
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
            t
            for part, r, k in zip(dfc, ranks, sizes)
            for t in (per_feature.items(part, k) if r else (part,))
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
    why = kernels.points_on_one_device(call, pairs)
    if why is not None:
        return why
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
        per_feature.trace(fn, x, y, consts)
    except per_feature.Unsupported as why:
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
    program = per_feature.trace(fn, x, y, consts)
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
