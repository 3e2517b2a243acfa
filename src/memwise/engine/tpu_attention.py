"""Softmax attention on a TPU: JAX's Pallas splash attention kernels behind the engine's
backend seam (:mod:`memwise.engine.kernels`).

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is the tuned
FlashAttention (Dao et al., NeurIPS 2022) of JAX's TPU kernels: an online-softmax forward
and a backward that re-forms each block's probabilities from the saved log-sum-exp, with
block sparsity from a static mask (causal, local window) and segment ids. This module
serves the engine's ``"dot_product_attention"`` pattern (reduction ``"softmax"``: the
output and the per-row log-sum-exp) with it, for the options it has: causal, a local
window, segment ids, a logit soft cap, grouped-query K/V (each K/V head read by its
``N/K`` query heads, never repeated) and any scale (folded into the queries). Anything
else (bias or mask arrays, padding lengths, dropout, rings, stripes, lengths that are
not multiples of 128) it declines, and the engine's XLA loops run.

Two things differ from calling splash attention directly:

* The log-sum-exp is an output with a derivative. The backward is splash's own dK/dV and
  dQ kernels with the log-sum-exp's cotangent folded into their per-row term:
  ``d lse_i / d s_ij = p_ij``, so ``ds = p (dp - (D - dlse))`` with
  ``D_i = sum(o_i * do_i)``.
* The layout. Splash takes heads first, ``(N, T, H)`` per batch element; the engine's
  operands are ``jax.nn``'s ``(B, T, N, H)``. Each pass moves q, k, v (and the output
  and its cotangent) to heads first and back: four array copies per pass, about 1% of
  the time at T = 16,384 on a v5e, but memory the caller sees.

Block sizes: :func:`block_sizes`, a table measured on one TPU v5e chip
(``benchmarks/tpu.py``); an explicit ``chunk_size`` overrides it. The backward runs
splash's separate dQ and dK/dV kernels: its fused backward writes a float32 dQ per K/V
block (``S / block`` times q's size in float32), which does not fit at 65,536 tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from memwise import _jax_private
from memwise.engine import kernels

__all__ = ["block_sizes"]

_LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes
_SUPPORTED_ROWS = {"q", "seg"}
_SUPPORTED_COLS = {"k", "v", "seg"}
_SUPPORTED_CONSTS = {"scale", "live_segments"}
_MEANING = {  # an operand it lacks, named as the caller passed it
    ("rows", "keep"): "query_seq_lengths",
    ("cols", "keep"): "key_value_seq_lengths",
    ("rows", "hash"): "dropout",
    ("pairs", "mask"): "a mask array",
    ("pairs", "bias"): "a bias array",
    ("consts", "offset"): "a query offset (a sequence split over devices)",
    ("consts", "seed"): "dropout",
    ("consts", "live_q_length"): "query_seq_lengths",
    ("consts", "live_kv_length"): "key_value_seq_lengths",
}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Splash's block sizes for one call: the forward's query and key blocks, the
    backward's (its dQ and dK/dV kernels'), and whether the backward is splash's fused
    kernel (one pass, dQ accumulated as a float32 partial per key block) or its
    separate dQ and dK/dV kernels (two passes, no partials)."""

    q: int
    kv: int
    q_bwd: int
    kv_bwd: int
    fused: bool = False


# The fused backward's dQ partials, (S / key block) times q's size, are bounded
# by this many bytes; beyond it the separate kernels run (at 65,536 tokens and 8 heads
# the partials would be 8 GiB, and splash's fused backward does not fit a 16 GiB chip).
FUSED_BACKWARD_BYTES = 512 * 2**20


def _fit(block: int, length: int) -> int:
    """The largest multiple of 128 that is at most ``block`` and divides ``length``."""
    b = min(block, length) // _LANES * _LANES
    while b > _LANES and length % b:
        b -= _LANES
    return b


def block_sizes(
    q_length: int, kv_length: int, heads: int, head_dim: int, itemsize: int = 2
) -> Blocks:
    """Splash attention's block sizes for ``q_length`` queries of ``heads`` heads against
    ``kv_length`` keys (both lengths multiples of 128), ``head_dim`` features of
    ``itemsize`` bytes.

    Measured on one TPU v5e chip (bfloat16, causal, 8 heads, head dim 128, T = 4,096 and
    16,384; ``benchmarks/tpu.py``): 512-query by 1,024-key blocks forward; backward, the
    fused kernel at 512 x 1,024 while its dQ partials take at most
    :data:`FUSED_BACKWARD_BYTES` (15.3 against 17.4 ms at T = 16,384,
    8 heads: 512 MiB of partials), else the separate
    kernels at 1,024 x 1,024 (the fastest of the memory-lean ones). Smaller blocks only
    where a length is not a multiple.
    """
    fq, fkv = _fit(512, q_length), _fit(1024, kv_length)
    partials = (kv_length // fkv) * heads * q_length * head_dim * itemsize
    if partials <= FUSED_BACKWARD_BYTES:
        return Blocks(fq, fkv, fq, fkv, fused=True)
    return Blocks(fq, fkv, _fit(1024, q_length), _fit(1024, kv_length))


def _explicit_blocks(chunk: Any) -> Blocks | None:
    """Blocks from the pattern's ``chunk_size`` option: the caller's resolved tiling
    ``(rows, cols, backward rows, backward cols)``, or None for ``"auto"``. An explicit
    tile runs the separate backward kernels (the lean ones)."""
    if chunk is None:
        return None
    return Blocks(*chunk)


def _declines(
    call: kernels.KernelCall, rows: dict, cols: dict, pairs: dict, consts: dict
) -> str | None:
    pattern = call.pattern
    if call.ring is not None:
        return "a ring (attention split over devices along the sequence)"
    if pattern.option("stripes") is not None:
        return "stripes (memwise.stripe's order)"
    if pattern.option("visibility").dropout_rate:
        return "dropout"
    for name, tree, supported in (
        ("pairs", pairs, set()),
        ("cols", cols, _SUPPORTED_COLS),
        ("rows", rows, _SUPPORTED_ROWS),
        ("consts", consts, _SUPPORTED_CONSTS),
    ):
        extra = sorted(set(tree) - supported)
        if extra:
            return _MEANING.get((name, extra[0]), f"the {name} operand {extra[0]!r}")
    q, k, v = rows["q"], cols["k"], cols["v"]
    v_dtype = jnp.dtype(pattern.option("value_dtype") or v.dtype)
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k.dtype), v_dtype}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {q.dtype}/{k.dtype}/{v_dtype} (it takes bfloat16 or float32 q, k, v alike)"
    nb = len(call.batch)
    if pattern.option("groups") is None and (
        k.shape[:nb] != call.batch or v.shape[:nb] != call.batch
    ):
        return "keys and values shared over batch dims (give them the queries' batch dims)"
    if "seg" in rows and (
        rows["seg"].shape[:nb] != call.batch or cols["seg"].shape[:nb] != call.batch
    ):
        return "segment ids shared over batch dims"
    t, s = q.shape[nb], k.shape[nb]
    if t % _LANES or s % _LANES:
        return f"sequence lengths that are not multiples of {_LANES} (query {t}, key {s})"
    blocks = _explicit_blocks(pattern.option("chunk_size"))
    if blocks is not None:
        sizes = dataclasses.astuple(blocks)[:4]
        lengths = (t, s) * 2
        if any(b % _LANES or n % b for b, n in zip(sizes, lengths)):
            return (
                f"chunk_size {pattern.option('chunk_size')} (its blocks must be multiples "
                f"of {_LANES} that divide the lengths {t} and {s})"
            )
    return None


def _mask(t: int, s: int, offsets: tuple[int | None, int | None]) -> Any:
    """Splash's mask object for the visibility's ``offsets``: key ``j`` visible to query
    ``i`` where ``lo <= j - i <= hi`` (``Visibility.offsets``; ``None``: unbounded)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    lo, hi = offsets
    if lo is None and hi is None:
        return sa.FullMask((t, s))
    if lo is None and hi == 0:
        return sa.CausalMask((t, s))
    return sa.LocalMask((t, s), (None if lo is None else -lo, hi), offset=0)


@functools.lru_cache(maxsize=64)
def _splash(
    heads: int,
    t: int,
    s: int,
    offsets: tuple[int | None, int | None],
    softcap: Any,
    blocks: Blocks,
    interpret: bool,
) -> Any:
    """Splash's kernel object for one shape (its mask's block tables are built once)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    sizes = sa.BlockSizes(
        block_q=blocks.q,
        block_kv=blocks.kv,
        block_kv_compute=blocks.kv,
        block_q_dkv=blocks.q_bwd,
        block_kv_dkv=blocks.kv_bwd,
        block_kv_dkv_compute=blocks.kv_bwd,
        block_q_dq=None if blocks.fused else blocks.q_bwd,
        block_kv_dq=None if blocks.fused else blocks.kv_bwd,
        use_fused_bwd_kernel=blocks.fused,
    )
    mask = sa.MultiHeadMask([_mask(t, s, offsets)] * heads)
    # Concrete block tables even when first asked for inside a trace (they are cached).
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha_single_device(
            mask, block_sizes=sizes, attn_logits_soft_cap=softcap, interpret=interpret
        )


def _infos(kernel: Any) -> tuple:
    def collapse(info):  # as splash's own entry point does for its mask blocks
        if info is None or info.partial_mask_blocks is None:
            return info
        blocks = info.partial_mask_blocks
        return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    return tuple(
        collapse(i) for i in (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
    )


# The custom_vjp below takes the batch (``(B, N, T, H)``) and maps splash's per-example
# kernels over it inside its rules: batching a custom_vjp from outside (``vmap`` of it)
# fails to linearize inside ``platform_dependent``'s conditional on jax 0.10.2.


SECOND_ORDER = (
    "memwise's TPU attention kernel (splash attention) has no second derivatives "
    "(jax.hessian, jacfwd of grad, grad of grad): pass implementation='xla' for them"
)


def _first_order(fn, *args):
    return kernels.first_order(SECOND_ORDER, fn, *args)


def _forward(kernel, q, k, v, seg, save_residuals):
    forward, _, _ = _jax_private.splash_attention_parts()
    kw = kernel.kwargs
    fwd_info, _, _ = _infos(kernel)
    one = functools.partial(
        forward,
        fwd_info,
        mask_value=kw["mask_value"],
        is_mqa=False,
        block_sizes=kw["block_sizes"],
        residual_checkpoint_name=None,
        save_residuals=save_residuals,
        mask_function=kw["mask_function"],
        attn_logits_soft_cap=kw["attn_logits_soft_cap"],
        interpret=kw["interpret"],
    )

    def batched(q, k, v, seg):
        with kernels.trace_config(q.dtype):
            return jax.vmap(lambda q, k, v, seg: one(q, k, v, seg, None))(q, k, v, seg)

    return _first_order(batched, q, k, v, seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(kernel, lse_unused, q, k, v, seg):
    if lse_unused:  # outside differentiation: splash's forward without its lse output
        out = _forward(kernel, q, k, v, seg, False)
        # Zeros that carry out's batch dims (an empty sum, nothing read): under vmap a
        # plain jnp.zeros is unbatched while _attend_fwd's lse is batched, and
        # jit(grad(vmap(...))) then linearized the conditional of dispatch with the
        # unbatched shape (a TypeError in the moveaxis of _apply).
        return out, jnp.sum(out[..., :0], axis=-1, dtype=jnp.float32)
    return _attend_fwd(kernel, lse_unused, q, k, v, seg)[0]


def _attend_fwd(kernel, lse_unused, q, k, v, seg):
    kw = kernel.kwargs
    out, (lse,) = _forward(kernel, q, k, v, seg, True)
    # A query that sees no key: splash leaves the mean of the masked values (its masked
    # score is finite) or, where it skipped every block, NaN and -inf. The engine's
    # contract is out 0 and lse -inf there; the saved lse is 0 so that the backward's
    # exp(s - lse) stays 0 on those rows.
    seen = lse > 0.5 * kw["mask_value"]
    out = jnp.where(seen[..., None], out, jnp.zeros((), out.dtype))
    saved = jnp.where(seen, lse, 0.0)
    return (out, jnp.where(seen, lse, -jnp.inf)), (q, k, v, seg, out, saved)


def _attend_bwd(kernel, lse_unused, residuals, cotangents):
    _, backward_dkv, backward_dq = _jax_private.splash_attention_parts()
    q, k, v, seg, out, lse = residuals
    dout, dlse = cotangents
    kw = kernel.kwargs
    sizes = kw["block_sizes"]
    _, dq_info, dkv_info = _infos(kernel)
    dout = dout.astype(out.dtype)
    # d lse_i / d s_ij = p_ij: the lse's cotangent joins the row term D_i.
    di = jnp.einsum("bhsd,bhsd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    di = di - dlse.astype(jnp.float32)
    common = dict(
        is_mqa=False,
        mask_value=kw["mask_value"],
        attn_logits_soft_cap=kw["attn_logits_soft_cap"],
        q_layout=sizes.q_layout,
        k_layout=sizes.k_layout,
        v_layout=sizes.v_layout,
        mask_function=kw["mask_function"],
        interpret=kw["interpret"],
    )
    dkv = functools.partial(
        backward_dkv,
        bq=sizes.block_q_dkv,
        bkv=sizes.block_kv_dkv,
        bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=dkv_info,
        use_fused_bwd_kernel=sizes.use_fused_bwd_kernel,
        **common,
    )
    one_dq = functools.partial(
        backward_dq,
        bq=sizes.block_q_dq,
        bkv=sizes.block_kv_dq,
        mask_info=dq_info,
        **common,
    )

    def backward(q, k, v, seg, lse, dout, di):
        dq, dk, dv = dkv(q, k, v, seg, None, lse, dout, di)
        if not sizes.use_fused_bwd_kernel:
            dq = one_dq(q, k, v, seg, None, lse, dout, di)
        return dq, dk, dv

    def batched(*args):
        with kernels.trace_config(q.dtype):
            return jax.vmap(backward)(*args)

    dq, dk, dv = _first_order(batched, q, k, v, seg, lse, dout, di)
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _apply(
    call: kernels.KernelCall, rows: dict, cols: dict, pairs: dict, consts: dict, *, interpret: bool
) -> tuple[jax.Array, jax.Array]:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    del pairs
    pattern = call.pattern
    groups = pattern.option("groups")
    nb = len(call.batch)
    count = math.prod(call.batch)
    q, k, v = rows["q"], cols["k"], cols["v"]
    # Values the caller upcast (bfloat16 to float32 for its per-row corrections) are
    # read in their own dtype: the cast back is exact, and splash takes q, k, v alike.
    v = v.astype(pattern.option("value_dtype") or v.dtype)
    t, s = q.shape[nb], k.shape[nb]
    # Heads first, (count, N, T, H) and (count, K, S, H), the scale folded into q.
    if groups is None:
        kh = heads = 1
        qh = q.reshape(count, 1, t, q.shape[-1])
        kh_, vh = (a.reshape(count, 1, s, a.shape[-1]) for a in (k, v))
    else:
        kh, g = groups
        heads = kh * g
        qh = jnp.moveaxis(q.reshape(count, t, heads, q.shape[-1]), 1, 2)
        kh_, vh = (jnp.moveaxis(a.reshape(count, s, kh, a.shape[-1]), 1, 2) for a in (k, v))
    # The scale multiplies in float32 and rounds once: a bfloat16 scale (3.3 -> 3.297)
    # shifted every score, and the traced scale's gradient, a sum over all of q, was
    # accumulated in bfloat16 (8% off at 128 tokens).
    qh = (qh.astype(jnp.float32) * consts["scale"].astype(jnp.float32)).astype(q.dtype)
    seg = None
    if "seg" in rows:
        seg = sa.SegmentIds(
            q=rows["seg"].reshape(count, t).astype(jnp.int32),
            kv=cols["seg"].reshape(count, s).astype(jnp.int32),
        )
    blocks = _explicit_blocks(pattern.option("chunk_size")) or block_sizes(
        t, s, heads, q.shape[-1], q.dtype.itemsize
    )
    visibility = pattern.option("visibility")
    kernel = _splash(heads, t, s, visibility.offsets, visibility.softcap, blocks, interpret)
    lse_unused = bool(pattern.option("lse_unused")) and seg is None
    out, lse = _attend(kernel, lse_unused, qh, kh_, vh, seg)
    del kh
    out = out.astype(cols["v"].dtype)  # the loops' dtype (both branches of dispatch)
    if groups is None:
        return out.reshape(*call.batch, t, out.shape[-1]), lse.reshape(*call.batch, t)
    out = jnp.moveaxis(out, 1, 2).reshape(*call.batch, t, *groups, out.shape[-1])
    lse = jnp.moveaxis(lse, 1, 2).reshape(*call.batch, t, *groups)
    return out, lse


SPLASH = kernels.register(
    kernels.Kernel(
        "splash attention (Pallas, TPU)",
        "dot_product_attention",
        "softmax",
        ("tpu",),
        apply=_apply,
        declines=_declines,
    )
)
