"""The vocabulary cross-entropy on a TPU: fused Pallas kernels for the per-token
statistics of ``x @ W`` over the vocabulary, behind the engine's backend seam
(:mod:`memwise.engine.kernels`).

:func:`memwise.linear_cross_entropy` needs, per token, the log-sum-exp of its scores over
the vocabulary and its label's score (reduction ``"logsumexp_pick"``), with a soft cap
and label smoothing the sum of its scores (``"sum"``), and for ``return_argmax`` the best
word (``"max"``). This module serves the three reductions of the engine's
``"linear_cross_entropy"`` pattern, in the manner of Wijmans et al., *Cut Your Losses in
Large-Vocabulary Language Models* (arXiv:2411.09009):

* **Forward**: one kernel over (token blocks, vocabulary blocks), the vocabulary
  innermost: each step one matrix product ``x_blk W_blk`` on the MXU (bias and soft cap
  added in VMEM) folded into an online log-sum-exp, the label's score picked by column
  id; one ``(tokens, 128)`` float32 row of statistics per token block written at the
  end. Nothing of size tokens x vocabulary leaves VMEM.
* **Backward** (the FlashAttention backward, Dao et al., NeurIPS 2022): one kernel over
  (vocabulary blocks, token blocks), the tokens innermost. Each step re-forms its
  scores, the logit gradient ``g = dlse p + dpick onehot + dsum`` (times the soft cap's
  derivative) cast to the inputs' dtype, and takes two products: ``dW_blk += x_blk^T g``
  in a float32 VMEM accumulator, written once in ``W``'s dtype when its pass over the
  tokens ends (no float32 buffer of ``W``'s size), and ``dx_blk += g W_blk^T``, summed
  over vocabulary blocks in HBM (each block read and written back by explicit copies
  that overlap the products), each addition in float32: for float32 inputs in a float32
  ``(tokens, d)`` buffer, for bfloat16 inputs as two bfloat16 buffers ``hi + lo`` (a
  double-bfloat16 sum, as in double-double arithmetic: ``hi`` is the sum rounded and, after
  the last block, ``dx`` itself; ``lo`` the rounding's remainder), which holds the sum to
  2**-18 of itself, 64 times float32's rounding and 2**9 times below the result's own,
  in half a float32 buffer's bytes (at 8,192 tokens and d = 4,096: 64 MiB of
  temporaries, not 128). Four matrix products in all against the dense program's three:
  the floor is 4/3 of its time.

The default on a TPU (``implementation=None``): measured on a TPU v5e at 8,192 x 4,096 x
128,256 in bfloat16 it is 2x faster than the XLA tiles, forward and backward (the
figures: ``BENCHMARKS.md``). Its code paths are checked on CPU in interpret mode and its
Mosaic lowering by exporting for the TPU (``tests/test_cross_entropy_kernel.py``).

The same kernels serve the engine's ``"dot_scores"`` pattern
(:mod:`memwise.engine.tpu_dot_scores`), through :class:`Config` and :func:`statistics`.

Blocks: :func:`block_sizes`, sized for the v5e's 128 MiB of VMEM; a ragged last block
(tokens or words that no block size divides) is masked by row and column id, never
padded (no copy of ``W``). An explicit ``chunk_size`` sets both passes' blocks.
Declined (the XLA loops run instead): dtypes other than bfloat16 or float32, ``x`` and
``W`` of different dtypes, batch dims, rings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise.engine import kernels

__all__ = ["LANES", "Blocks", "Config", "block_sizes", "fit_block", "statistics"]

LANES = 128
_VMEM_LIMIT = 100 * 2**20  # of the v5e's 128 MiB per core
_VMEM_TARGET = 72 * 2**20  # what a block choice may use, double buffers included

SECOND_ORDER = (
    "memwise's TPU cross-entropy kernel has no second derivatives (jax.hessian, jacfwd "
    "of grad, grad of grad): pass implementation='xla' for them"
)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Token and word block sizes of the forward and the backward kernel."""

    tokens: int
    words: int
    tokens_bwd: int
    words_bwd: int


def fit_block(total: int, target: int, unit: int, least: float = 0.5) -> int:
    """The block for an axis of ``total``: the whole axis when it is at most ``target``,
    else the largest multiple of ``unit`` at most ``target`` dividing ``total`` (no
    ragged block) and at least ``least * target``, else ``target`` rounded to ``unit``
    (a masked ragged last block)."""
    if total <= target:
        return total
    for b in range(target - target % unit, unit - 1, -unit):
        if total % b == 0 and b >= least * target:
            return b
    return max(unit, target - target % unit)


def block_sizes(tokens: int, words: int, d: int, itemsize: int) -> Blocks:
    """Blocks for ``tokens`` x ``words`` with hidden size ``d``: the largest the VMEM
    target holds, tokens first (each word block is read once per token block).

    The backward's word blocks hold 8 MiB of weights (in bfloat16 1,024 words at d = 4,096,
    2,048 at d = 2,048): every word block reads and writes ``dx``'s running sum once, so
    wider blocks cut that traffic until the block's ``dW`` accumulator crowds VMEM. Its
    token blocks are 256: measured on a TPU v5e at 8,192 x 4,096 x 128,256 (bfloat16),
    256 x 1,024 (a ragged last word block) took 161 ms, 512 x 768 193 ms, 512 x 1,024
    180 ms; at 8,192 x 2,048 x 256,000, 256 x 2,048 148 ms against 160 at 512 x 1,024.

    Example::

        >>> block_sizes(8192, 128256, 4096, 2)
        Blocks(tokens=1024, words=768, tokens_bwd=256, words_bwd=1024)
    """
    words_fwd = fit_block(words, 1024 if d <= 2048 else 768, LANES)
    weights = 2**23 // (d * itemsize)  # 8 MiB of w per backward word block
    words_bwd = fit_block(words, min(2048, max(LANES, weights // LANES * LANES)), LANES, 0.875)
    unit = 16 if itemsize == 2 else 8

    def forward_bytes(t):
        return 2 * (t * d + d * words_fwd) * itemsize + 6 * t * words_fwd * 4

    def backward_bytes(t):
        return (
            2 * (t * d + 2 * d * words_bwd) * itemsize
            + 2 * t * d * 4
            + d * words_bwd * 4
            + 6 * t * words_bwd * 4
        )

    t_fwd = 1024
    while t_fwd > unit and forward_bytes(t_fwd) > _VMEM_TARGET:
        t_fwd //= 2
    t_bwd = 256
    while t_bwd > unit and backward_bytes(t_bwd) > _VMEM_TARGET:
        t_bwd //= 2
    return Blocks(
        fit_block(tokens, t_fwd, unit), words_fwd, fit_block(tokens, t_bwd, unit), words_bwd
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """The static description of one kernel: the mode, the layout, the options."""

    mode: str  # "logsumexp_pick", "logsumexp", "sum" or "max"
    layout: str  # "dv": w is (d, V); "vd": w is (V, d)
    cap: float | None
    has_bias: bool
    tokens: int
    words: int
    blocks: Blocks
    interpret: bool


def _w_spec(cfg: Config, d: int, words: int, word_index: Any) -> Any:
    from jax.experimental import pallas as pl

    if cfg.layout == "dv":
        return pl.BlockSpec((d, words), lambda *ids: (0, word_index(*ids)))
    return pl.BlockSpec((words, d), lambda *ids: (word_index(*ids), 0))


def _scores(cfg: Config, x: Any, w: Any, b: Any) -> Any:
    """One block's float32 scores ``x W + b``, soft-capped."""
    dims = (((1,), (0,)), ((), ())) if cfg.layout == "dv" else (((1,), (1,)), ((), ()))
    s = lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    if b is not None:
        s = s + b.astype(jnp.float32)
    if cfg.cap is not None:
        s = cfg.cap * jnp.tanh(s / cfg.cap)
    return s


def _lanes(v: Any, width: int) -> Any:
    """A ``(rows, 128)`` lane-replicated column as ``(rows, width)``: whole vregs tiled
    where ``width`` is a multiple of the lanes (as Pallas's flash attention), else one
    lane broadcast (a vocabulary smaller than a block, not a multiple of 128)."""
    if width % LANES == 0:
        return jnp.tile(v, (1, width // LANES))
    return jnp.broadcast_to(v[:, :1], (v.shape[0], width))


def _forward_kernel(cfg: Config, *refs: Any) -> None:
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if cfg.has_bias else None
    y_ref: Any = next(it) if cfg.mode == "logsumexp_pick" else None
    out_ref = next(it)
    m_ref, l_ref, p_ref = next(it), next(it), next(it)

    bt, bv = cfg.blocks.tokens, cfg.blocks.words
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        # the label's score starts at -inf (a label on another device's words stays
        # there); the argmax at word 0, jnp.argmax's answer for a row of -inf
        start = 0.0 if cfg.mode == "max" else -jnp.inf
        p_ref[...] = jnp.full(p_ref.shape, start, jnp.float32)

    s = _scores(cfg, x_ref[...], w_ref[...], None if b_ref is None else b_ref[...])
    col = j * bv + lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
    ragged = cfg.words % bv != 0
    if ragged:
        s = jnp.where(col < cfg.words, s, -jnp.inf if cfg.mode != "sum" else 0.0)
    if cfg.mode == "sum":
        l_ref[...] += jnp.sum(s, axis=1, keepdims=True)
    elif cfg.mode == "max":
        # jnp.max / jnp.argmax: the first index wins ties, the first NaN wins
        nan = jnp.isnan(s)
        big = jnp.iinfo(jnp.int32).max
        top = jnp.max(jnp.where(nan, -jnp.inf, s), axis=1, keepdims=True)
        at_nan = jnp.min(jnp.where(nan, col, big), axis=1, keepdims=True)
        at_top = jnp.min(jnp.where(s == top, col, big), axis=1, keepdims=True)
        has_nan = at_nan < big
        arg = jnp.where(has_nan, at_nan, at_top)
        value = jnp.where(has_nan, jnp.nan, top)
        m = m_ref[...]
        better = (value > m) | (jnp.isnan(value) & ~jnp.isnan(m))
        m_ref[...] = jnp.where(better, value, m)
        p_ref[...] = jnp.where(better, arg.astype(jnp.float32), p_ref[...])
    else:
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with no finite score yet (a first block of -inf: zero weights, a bias of
        # -inf) shifts by 0, not by -inf: exp(-inf - -inf) would be NaN.
        shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        e = jnp.exp(s - _lanes(shift, bv))
        l_ref[...] = jnp.exp(m_prev - shift) * l_ref[...] + jnp.sum(e, axis=1, keepdims=True)
        m_ref[...] = m_next
        if y_ref is not None:
            hit = col == _lanes(y_ref[...], bv)
            picked = jnp.max(jnp.where(hit, s, -jnp.inf), axis=1, keepdims=True)
            p_ref[...] = jnp.maximum(p_ref[...], picked)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lane = lax.broadcasted_iota(jnp.int32, (bt, LANES), 1)
        if cfg.mode == "sum":
            out_ref[...] = l_ref[...]
        elif cfg.mode == "max":
            out_ref[...] = jnp.where(lane == 0, m_ref[...], p_ref[...])
        else:
            lse = m_ref[...] + jnp.log(l_ref[...])
            out_ref[...] = jnp.where(lane == 0, lse, p_ref[...])


def _forward(cfg: Config, x: Any, w: Any, bias: Any, labels: Any) -> Any:
    """``(tokens, 128)`` float32: lane 0 the log-sum-exp (the sum, the max), lane 1 the
    label's score (the argmax)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, d = x.shape
    bt, bv = cfg.blocks.tokens, cfg.blocks.words
    grid = (pl.cdiv(n, bt), pl.cdiv(cfg.words, bv))
    per_token = pl.BlockSpec((bt, LANES), lambda i, j: (i, 0))
    in_specs = [pl.BlockSpec((bt, d), lambda i, j: (i, 0)), _w_spec(cfg, d, bv, lambda i, j: j)]
    args = [x, w]
    if cfg.has_bias:
        in_specs.append(pl.BlockSpec((1, bv), lambda i, j: (0, j)))
        args.append(bias.reshape(1, -1))
    if cfg.mode == "logsumexp_pick":
        in_specs.append(per_token)
        args.append(jnp.broadcast_to(labels.astype(jnp.int32)[:, None], (n, LANES)))
    with kernels.trace_config(x.dtype):
        return pl.pallas_call(
            functools.partial(_forward_kernel, cfg),
            grid=grid,
            in_specs=in_specs,
            out_specs=per_token,
            out_shape=jax.ShapeDtypeStruct((n, LANES), jnp.float32),
            scratch_shapes=[pltpu.VMEM((bt, LANES), jnp.float32)] * 3,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary"),
                vmem_limit_bytes=_VMEM_LIMIT,
            ),
            interpret=cfg.interpret,
            name=f"memwise_cross_entropy_{cfg.mode}_fwd",
        )(*args)


def _dx_parts(dtype: Any) -> tuple:
    """The dtypes of the backward's running sum of ``dx``: float32 for float32 inputs,
    else ``hi`` and ``lo`` in the inputs' dtype (see the module's docstring)."""
    return (jnp.float32,) if dtype == jnp.float32 else (dtype, dtype)


class _Together:
    """DMA copies started and waited for together: one per part of ``dx``'s running sum."""

    def __init__(self, copies: list) -> None:
        self.copies = copies

    def start(self) -> None:
        for copy in self.copies:
            copy.start()

    def wait(self) -> None:
        for copy in self.copies:
            copy.wait()


def _backward_kernel(cfg: Config, *refs: Any) -> None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if cfg.has_bias else None
    pick = cfg.mode == "logsumexp_pick"
    softmax = cfg.mode in ("logsumexp", "logsumexp_pick")
    y_ref: Any = next(it) if pick else None
    lse_ref: Any = next(it) if softmax else None
    dlse_ref: Any = next(it) if softmax else None
    dpick_ref: Any = next(it) if pick else None
    dsum_ref: Any = None if softmax else next(it)
    parts = len(_dx_parts(x_ref.dtype))  # dx's running sum: one float32 array, or hi + lo
    dx_hbm = [next(it) for _ in range(parts)]
    dw_ref = next(it)
    db_ref = next(it) if cfg.has_bias else None
    dw_acc, db_acc = next(it), next(it)
    dx_buf = [next(it) for _ in range(parts)]
    reads, writes = next(it), next(it)

    bt, bv = cfg.blocks.tokens_bwd, cfg.blocks.words_bwd
    j, i = pl.program_id(0), pl.program_id(1)
    nt = pl.num_programs(1)
    step = j * nt + i
    slot = step % 2

    def copies(block, slot, sems, to_hbm):
        pairs = [(hbm.at[pl.ds(block * bt, bt)], buf.at[slot]) for hbm, buf in zip(dx_hbm, dx_buf)]
        return _Together(
            [
                pltpu.make_async_copy(*(pair[::-1] if to_hbm else pair), sems.at[k, slot])
                for k, pair in enumerate(pairs)
            ]
        )

    def read(block, slot):
        return copies(block, slot, reads, to_hbm=False)

    def write(block, slot):
        return copies(block, slot, writes, to_hbm=True)

    def store(total):
        """The running sum into this step's slot: in float32, or (bfloat16 inputs) as
        ``hi + lo``, two bfloat16 arrays: ``hi`` the sum rounded (the result, once the
        last word block is added), ``lo`` what rounding left out, rounded in turn. The
        pair holds the sum to 2**-18 of itself (float32: 2**-24); each block's addition
        is in float32."""
        if parts == 1:
            dx_buf[0][slot] = total
            return
        hi = total.astype(dx_buf[0].dtype)
        dx_buf[0][slot] = hi
        dx_buf[1][slot] = (total - hi.astype(jnp.float32)).astype(dx_buf[1].dtype)

    def running():
        total = dx_buf[0][slot].astype(jnp.float32)
        return total if parts == 1 else total + dx_buf[1][slot].astype(jnp.float32)

    # dx's block for this step. Each step's write is waited for two steps later (its
    # slot is reused then), so at this step every write up to two steps back is done:
    # the running sum of block i, written nt steps back, may be read when nt >= 2. With
    # one token block (nt = 1) it was written by the previous step: that write is
    # waited for here instead. The read is in flight while the products run.
    single = -(-cfg.tokens // bt) == 1

    @pl.when(step >= (1 if single else 2))
    def _():
        write(0, 1 - slot if single else slot).wait()

    @pl.when(j > 0)
    def _():
        read(i, slot).start()

    x = x_ref[...]
    w = w_ref[...]
    s = _scores(cfg, x, w, None if b_ref is None else b_ref[...])
    row = i * bt + lax.broadcasted_iota(jnp.int32, (bt, bv), 0)
    col = j * bv + lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
    if softmax:
        lse = lse_ref[...]
        p = jnp.exp(s - _lanes(jnp.where(lse == -jnp.inf, 0.0, lse), bv))  # as forward
        g = _lanes(dlse_ref[...], bv) * p
        if pick:
            g = g + jnp.where(col == _lanes(y_ref[...], bv), _lanes(dpick_ref[...], bv), 0.0)
    else:
        g = _lanes(dsum_ref[...], bv)
    if cfg.cap is not None:
        g = g * (1.0 - jnp.square(s / cfg.cap))
    # A ragged last block reads past the arrays' ends: unspecified values (NaN, inf) that
    # must not reach a product, where 0 * NaN is NaN.
    keep = None
    if cfg.words % bv:
        keep = col < cfg.words
        axis = 1 if cfg.layout == "dv" else 0
        word = j * bv + lax.broadcasted_iota(jnp.int32, w.shape, axis)
        w = jnp.where(word < cfg.words, w, 0)
    if cfg.tokens % bt:
        rows_in = row < cfg.tokens
        keep = rows_in if keep is None else keep & rows_in
        x = jnp.where(row[:, :1] < cfg.tokens, x, 0)
    if keep is not None:
        g = jnp.where(keep, g, 0.0)
    gc = g.astype(x.dtype)
    if cfg.layout == "dv":
        dw = lax.dot(x.T, gc, preferred_element_type=jnp.float32)
        dx = lax.dot_general(gc, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        dw = lax.dot(gc.T, x, preferred_element_type=jnp.float32)
        dx = lax.dot(gc, w, preferred_element_type=jnp.float32)

    @pl.when(i == 0)
    def _():
        dw_acc[...] = jnp.zeros(dw_acc.shape, jnp.float32)
        db_acc[...] = jnp.zeros(db_acc.shape, jnp.float32)

    dw_acc[...] += dw
    if cfg.has_bias:
        db_acc[...] += jnp.sum(g, axis=0, keepdims=True)

    @pl.when(j == 0)
    def _():
        store(dx)

    @pl.when(j > 0)
    def _():
        read(i, slot).wait()
        store(running() + dx)

    write(i, slot).start()

    @pl.when(i == nt - 1)
    def _():
        dw_ref[...] = dw_acc[...].astype(dw_ref.dtype)
        if db_ref is not None:
            db_ref[...] = db_acc[...]

    @pl.when(step == pl.num_programs(0) * nt - 1)
    def _():  # the writes not yet waited for land before the kernel ends
        write(0, slot).wait()
        if not single:

            @pl.when(step >= 1)
            def _():
                write(0, 1 - slot).wait()


def _backward(
    cfg: Config, x: Any, w: Any, bias: Any, labels: Any, stats: Any, cots: Any
) -> tuple[Any, Any, Any]:
    """``(dx, dW, db)``: one pass over word blocks, each over every token block.

    ``dx`` is summed over word blocks in HBM (float32, or bfloat16 ``hi + lo``: see
    the module's docstring), one token block at a time through two VMEM slots by explicit copies: a block's running
    sum is read while the step's products run and written back while the next step's
    run. The pipeline's own blocks cannot carry it: an aliased input is prefetched a step
    ahead of the previous write, and interpret mode reads such an input unchanged.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, d = x.shape
    parts = _dx_parts(x.dtype)
    bt, bv = cfg.blocks.tokens_bwd, cfg.blocks.words_bwd
    nt = pl.cdiv(n, bt)
    grid = (pl.cdiv(cfg.words, bv), nt)
    per_token = pl.BlockSpec((bt, LANES), lambda j, i: (i, 0))
    x_spec = pl.BlockSpec((bt, d), lambda j, i: (i, 0))
    in_specs = [x_spec, _w_spec(cfg, d, bv, lambda j, i: j)]
    args = [x, w]
    if cfg.has_bias:
        in_specs.append(pl.BlockSpec((1, bv), lambda j, i: (0, j)))
        args.append(bias.reshape(1, -1))

    def lanes(v, dtype=jnp.float32):
        return jnp.broadcast_to(v.astype(dtype)[:, None], (n, LANES))

    if cfg.mode == "logsumexp_pick":
        dlse, dpick = cots
        per = [lanes(labels, jnp.int32), lanes(stats[:, 0]), lanes(dlse), lanes(dpick)]
    elif cfg.mode == "logsumexp":
        per = [lanes(stats[:, 0]), lanes(cots)]
    else:
        per = [lanes(cots)]
    in_specs += [per_token] * len(per)
    args += per
    out_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(parts)
    out_specs.append(_w_spec(cfg, d, bv, lambda j, i: j))
    out_shape = [  # whole blocks: every copy alike
        jax.ShapeDtypeStruct((nt * bt, d), dtype) for dtype in parts
    ]
    out_shape.append(jax.ShapeDtypeStruct(w.shape, w.dtype))
    if cfg.has_bias:
        out_specs.append(pl.BlockSpec((1, bv), lambda j, i: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((1, cfg.words), jnp.float32))
    dw_shape = (d, bv) if cfg.layout == "dv" else (bv, d)
    with kernels.trace_config(x.dtype):
        out = pl.pallas_call(
            functools.partial(_backward_kernel, cfg),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=[
                pltpu.VMEM(dw_shape, jnp.float32),
                pltpu.VMEM((1, bv), jnp.float32),
                *[pltpu.VMEM((2, bt, d), dtype) for dtype in parts],
                pltpu.SemaphoreType.DMA((len(parts), 2)),
                pltpu.SemaphoreType.DMA((len(parts), 2)),
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"),
                vmem_limit_bytes=_VMEM_LIMIT,
            ),
            interpret=cfg.interpret,
            name=f"memwise_cross_entropy_{cfg.mode}_bwd",
        )(*args)
    dx, dw = out[0], out[len(parts)]
    db = out[len(parts) + 1].reshape(cfg.words).astype(bias.dtype) if cfg.has_bias else None
    return dx[:n].astype(x.dtype), dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def statistics(cfg: Config, x: Any, w: Any, bias: Any, labels: Any) -> Any:
    return _statistics_fwd(cfg, x, w, bias, labels)[0]


def _statistics_fwd(cfg, x, w, bias, labels):
    stats = kernels.first_order(SECOND_ORDER, functools.partial(_forward, cfg), x, w, bias, labels)
    out = stats[:, :2] if cfg.mode == "logsumexp_pick" else stats[:, 0]
    return out, (x, w, bias, labels, stats)


def _statistics_bwd(cfg, residual, ct):
    x, w, bias, labels, stats = residual
    cots = (ct[:, 0], ct[:, 1]) if cfg.mode == "logsumexp_pick" else ct
    backward = kernels.one_at_a_time(functools.partial(_backward, cfg))
    dx, dw, db = kernels.first_order(SECOND_ORDER, backward, x, w, bias, labels, stats, cots)
    return dx, dw, db, None


statistics.defvjp(_statistics_fwd, _statistics_bwd)


def _operands(call: kernels.KernelCall, rows: Any, cols: Any) -> tuple[Any, Any, Any, Any]:
    x, labels = (rows["x"], rows["y"]) if isinstance(rows, dict) else (rows, None)
    w, bias = (cols[0], cols[1] if len(cols) > 1 else None)
    return x, labels, w, bias


def _explicit_blocks(call: kernels.KernelCall) -> Blocks | None:
    chunk = call.pattern.option("chunk_size")
    if chunk is None:
        return None
    t, v = chunk
    return Blocks(t, v, t, v)


def _declines(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any
) -> str | None:
    if call.ring is not None:
        return "a ring"
    if call.batch:
        return "batch dims (give the tokens as one axis)"
    if pairs or consts:
        return "pair or constant operands"
    x, _, w, bias = _operands(call, rows, cols)
    if x.dtype != w.dtype or x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {x.dtype} x and {w.dtype} w (it takes bfloat16 or float32, both alike)"
    blocks = _explicit_blocks(call)
    if blocks is not None:
        n, words = x.shape[0], w.shape[1 if call.pattern.option("layout") == "dv" else 0]
        unit = 16 if x.dtype.itemsize == 2 else 8
        t, v = blocks.tokens, blocks.words
        if not ((t % unit == 0 or t == n) and (v % LANES == 0 or v == words)):
            return (
                f"chunk_size {(t, v)} (its token block must be a multiple of {unit} and its "
                f"word block a multiple of {LANES}, or the whole axis)"
            )
    return None


def _apply(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any, *, interpret: bool
) -> Any:
    del pairs, consts
    x, labels, w, bias = _operands(call, rows, cols)
    layout = call.pattern.option("layout")
    n, d = x.shape
    words = w.shape[1 if layout == "dv" else 0]
    blocks = _explicit_blocks(call)
    if blocks is None:
        blocks = block_sizes(n, words, d, x.dtype.itemsize)
    else:  # an explicit tile larger than an axis is that axis
        t, v = min(blocks.tokens, n), min(blocks.words, words)
        blocks = Blocks(t, v, t, v)
    cfg = Config(
        call.reduce,
        layout,
        call.pattern.option("cap"),
        bias is not None,
        n,
        words,
        blocks,
        interpret,
    )
    if call.reduce == "max":
        stats = _forward(cfg, lax.stop_gradient(x), lax.stop_gradient(w), bias, labels)
        return stats[:, 0], stats[:, 1].astype(jnp.int32)
    return statistics(cfg, x, w, bias, labels)


KERNELS = tuple(
    kernels.register(
        kernels.Kernel(
            "fused cross-entropy (Pallas, TPU)",
            "linear_cross_entropy",
            reduce,
            ("tpu",),
            apply=_apply,
            declines=_declines,
        )
    )
    for reduce in ("logsumexp_pick", "sum", "max")
)
