"""``linear_cross_entropy``: a language model's loss without its (tokens, vocabulary) logits.

The output layer of a language model turns hidden states ``x (tokens, d)`` into logits
``x @ W + b`` over a vocabulary of ``V`` words and takes their softmax cross-entropy
with the next tokens. The logits (and their gradient, of the same size) are usually the
largest buffers of the whole training step: 8,192 tokens x 128,256 words in float32 is
4.2 GB each. Here they are never formed, in either pass.

The loss of token ``i`` needs two numbers per token: the log-sum-exp of its scores over
the vocabulary and the score of its label. Both come from one ``"logsumexp_pick"``
reduction of :func:`memwise.engine.tiled_reduce` (the one tile engine) over tiles of
tokens x vocabulary words: the online log-sum-exp of the scores, and the label's score
picked from the tile that holds it (one gather per token and tile). The backward is the
engine's: each tile's probabilities re-formed from the saved log-sum-exp (the
FlashAttention backward, Dao et al., NeurIPS 2022; for this loss, Wijmans et al., *Cut
Your Losses in Large-Vocabulary Language Models*, arXiv:2411.09009), and the tile's
``jax.vjp`` gives ``dx`` and ``dW`` as one matrix product each. Label smoothing needs
the mean score, in closed form ``x . mean(W) + mean(b)`` (one more tiled sum when the
scores are soft-capped); PaLM's z-loss (Chowdhery et al., 2022) is ``z * lse^2`` of the
kept log-sum-exp.

Memory, both passes: ``x``, ``W``, their gradients and one tile of scores; no buffer
grows with tokens x vocabulary. An argmax (accuracy without logits) is one more tiled
forward pass. On many devices the vocabulary may be split too (Megatron's
vocabulary-parallel cross-entropy, Shoeybi et al., arXiv:1909.08053): each device
reduces its own words, and one log-sum-exp collective per call combines both numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._cross_entropy_inputs import (
    as_arrays,
    check_cap,
    check_fraction,
    check_labels_in_range,
    check_mask,
    check_nonnegative,
    check_shapes,
    float_array,
    label_flags,
    vocabulary_split,
)
from memwise._dtypes import accumulation_dtype
from memwise.engine import REDUCTIONS, kernels, tiled_reduce
from memwise.sharding import check_divisible, sharded_call
from memwise.tiling import ChunkSize, Tiling, item_bytes, tiling

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")
_LAYOUTS = ("dv", "vd")


_FORWARD_MODE = (
    "memwise.linear_cross_entropy supports reverse mode (grad, vjp, jacrev; also "
    "jax.hessian and jacfwd of grad with implementation='xla' on a TPU host) and vmap, "
    "but not forward mode through it (jvp, jacfwd, jax.linearize); for forward mode "
    "compute the logits and use "
    "optax.softmax_cross_entropy_with_integer_labels, or differentiate in reverse mode"
)


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    layout: str = "dv",
    ignore_index: int | None = None,
    where: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    reduction: str = "mean",
    return_lse: bool = False,
    return_argmax: bool = False,
    chunk_size: ChunkSize = "auto",
    mesh: jax.sharding.Mesh | None = None,
    token_axis: str | tuple[str, ...] | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
    implementation: str | None = None,
) -> Any:
    """Softmax cross-entropy of the logits ``x @ w + bias`` with integer ``labels``, tiled.

    The same loss as ``optax.softmax_cross_entropy_with_integer_labels(x @ w + bias,
    labels)`` (with ``optax.smooth_labels`` for ``label_smoothing``), computed over
    tiles of tokens x vocabulary words: the ``(tokens, V)`` logits are never formed, in
    the forward or the backward pass. Per token ``i`` with label ``y``, scores ``s_v``
    (soft-capped: ``cap * tanh(s_v / cap)``) and ``lse = logsumexp_v s_v``::

        loss_i = lse - (1 - a) s_y - a mean_v(s_v) + z lse**2

    with ``a = label_smoothing`` and ``z = z_loss``. Tokens whose label is
    ``ignore_index`` or whose ``where`` is False are ignored: loss 0, no gradient, and
    not counted by ``reduction="mean"``. With every token ignored the mean is 0 (not
    0/0), with zero gradients.

    Out-of-range labels (neither ``ignore_index`` nor in ``[0, V)``): with concrete
    labels (eager) a ``ValueError``; under ``jit`` (traced labels, not checkable) the
    token's loss is NaN, as ``optax`` gives, so the mean is NaN too.

    Memory, forward and backward: the inputs, their gradients and one ``chunk_size``
    tile of float32 scores. Compute: the forward is one pass of tile
    matrix products (``x W``), the backward re-forms each tile's scores and takes ``dx``
    and ``dW`` as one matrix product each, about 3x the forward's products as for the
    dense computation. Label smoothing with a soft cap costs one more forward and
    backward pass (the mean of the capped scores), ``return_argmax`` one more forward
    pass. Both layouts of ``w`` are read in place (each tile slices its words from
    ``w``; no transposed or padded copy, also for a ragged last tile). bfloat16/float16
    inputs: scores, log-sum-exp and gradient sums are float32 and results are cast to
    the inputs' dtype. Summing ``dW`` over token tiles in float32 would need a float32
    buffer the size of ``w``, so in half precision the backward is two passes: one over
    token blocks for ``dx`` and one over vocabulary blocks, each block's ``dW``
    complete after its pass over the tokens and stored in ``w``'s dtype. That is one
    more tile product per tile (about 4x the forward's products, against 3x), for no
    float32 copy of ``w``. (XLA:CPU itself converts a bfloat16 ``w`` to float32 once
    for its products; accelerators with bfloat16 matrix units do not.)

    Args:
      x: hidden states, ``(..., d)``.
      w: output weights, ``(d, V)`` (``layout="dv"``, a ``Dense`` kernel) or ``(V, d)``
        (``layout="vd"``, an embedding table: tied embeddings).
      labels: integer labels, ``x.shape[:-1]``.
      bias: optional ``(V,)`` bias added to the logits.
      layout: ``"dv"`` or ``"vd"``, the axes of ``w``.
      ignore_index: a label value whose tokens are ignored (e.g. ``-100`` for padding).
      where: optional boolean mask, ``labels.shape``; False tokens are ignored.
      label_smoothing: ``a`` in ``[0, 1)``: the target is ``(1 - a) onehot + a / V``.
      z_loss: coefficient of ``lse**2`` (PaLM's auxiliary loss; 1e-4 is common).
      logit_soft_cap: ``cap > 0``: scores ``cap * tanh(logits / cap)`` (Gemma 2).
      reduction: ``"mean"`` (over the tokens not ignored), ``"sum"`` or ``"none"``
        (per-token losses, ``labels.shape``).
      return_lse: also return the per-token log-sum-exp (``labels.shape``,
        differentiable).
      return_argmax: also return the per-token argmax of the scores (int32, the
        predicted word, e.g. for accuracy).
      chunk_size: the tile ``(tokens, words)``, an int, ``"auto"``
        (:func:`memwise.knobs.auto`, so :func:`memwise.fit` can set it) or a
        :class:`memwise.tiling.Tiling`.
      mesh: run on many devices (``shard_map``) with ``x``'s first axis (tokens) split
        over mesh axis ``token_axis`` and ``w``'s vocabulary split over ``vocab_axis``
        (either may be None). Each device reduces its own tokens against its own words;
        the per-token log-sum-exp and label score are combined over ``vocab_axis`` by
        one small collective (Megatron's vocabulary-parallel cross-entropy), a mean or
        sum over ``token_axis`` by one more, and each device's ``dW`` block stays on it.
        Without ``mesh`` the split follows the data, eagerly and under ``jit``: ``x``'s
        and ``w``'s ``NamedSharding`` (or types split over Explicit mesh axes), else,
        on a mesh with Auto axes, the tokens over all of them.
      token_axis: the mesh axis (or axes) splitting the tokens, with ``mesh``.
      vocab_axis: the mesh axis (or axes) splitting the vocabulary, with ``mesh``.
      implementation: ``None`` (the default): the fused Pallas kernel
        (:mod:`memwise.engine.tpu_cross_entropy`) on a TPU where it serves the call, the
        XLA tiles elsewhere; ``"xla"``: the tiles; ``"pallas"``: the kernel, compiled on
        a TPU, in Pallas's interpret mode elsewhere, with a ``ValueError`` naming what
        it cannot serve (float16, ``x`` and ``w`` of different dtypes). The kernel has
        first derivatives only: for second derivatives (``jax.hessian``, ``jacfwd`` of
        ``grad``) pass ``implementation="xla"``. On a host with a TPU the default holds
        the kernel's branch in every program it traces (the platform is chosen at
        lowering), so there they raise a ``TypeError`` naming this fix, whatever the
        program is compiled for.

    Returns:
      The loss (a scalar, or ``labels.shape`` for ``"none"``) in the inputs' dtype;
      with ``return_lse``/``return_argmax`` a tuple ``(loss, lse?, argmax?)`` in that
      order.

    Raises:
      TypeError: non-float ``x``/``w``/``bias``, non-integer ``labels``, non-boolean
        ``where``.
      ValueError: shapes that do not match, an unknown ``layout``/``reduction``, options
        out of range, out-of-range concrete labels, a split that does not divide the
        tokens or the vocabulary evenly, or tokens and vocabulary on the same mesh axis.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> x = jax.random.normal(jax.random.PRNGKey(0), (6, 8))
        >>> w = jax.random.normal(jax.random.PRNGKey(1), (8, 50))
        >>> labels = jnp.array([1, 4, 9, 49, 0, 3])
        >>> loss = mw.linear_cross_entropy(x, w, labels, chunk_size=(4, 16))
        >>> logp = jax.nn.log_softmax(x @ w)  # the dense computation
        >>> dense = -jnp.take_along_axis(logp, labels[:, None], 1).mean()
        >>> bool(jnp.allclose(loss, dense, rtol=1e-6))
        True
    """
    kernels.check_implementation(implementation)
    x, w, labels = as_arrays(x, w, labels)
    bias = None if bias is None else float_array(bias, "bias")
    if layout not in _LAYOUTS:
        raise ValueError(
            f"layout must be 'dv' (w is (d, V)) or 'vd' (w is (V, d), tied embeddings), "
            f"got {layout!r}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    d, vocab = check_shapes(x, w, labels, bias, layout)
    valid = check_mask(where, labels)
    smoothing = check_fraction(label_smoothing)
    z = check_nonnegative(z_loss, "z_loss")
    cap = check_cap(logit_soft_cap)
    for flag, name in ((return_lse, "return_lse"), (return_argmax, "return_argmax")):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if ignore_index is not None:
        if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
            ignore_index, (int, np.integer)
        ):
            raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
        ignore_index = int(ignore_index)
    ignored, in_range = label_flags(labels, vocab, ignore_index)
    valid = valid & ~ignored
    check_labels_in_range(labels, where, vocab, ignore_index)

    dtype = jnp.result_type(x, w, *(() if bias is None else (bias,)))
    shape = labels.shape
    n = math.prod(shape)
    if n == 0:
        if chunk_size != "auto" and not isinstance(chunk_size, Tiling):
            tiling(1, 1, chunk_size)
        loss = jnp.zeros(shape if reduction == "none" else (), dtype)
        extras = [jnp.zeros(shape, dtype)] * return_lse
        extras += [jnp.zeros(shape, jnp.int32)] * return_argmax
        return (loss, *extras) if extras else loss

    valid = jnp.broadcast_to(valid, shape)
    safe_labels = jnp.where(in_range, labels, 0).astype(jnp.int32)  # (< vocab)
    options = _Options(
        layout, cap, smoothing, z, reduction, return_lse, return_argmax, chunk_size, implementation
    )
    split = vocabulary_split(x, w, layout, mesh, token_axis, vocab_axis)
    if split is None:
        out = _local(options, vocab, None, None, x, w, safe_labels, valid, in_range, bias)
    else:
        mesh, token_axes, vocab_axes = split
        if vocab_axes is not None:
            check_divisible(vocab, mesh, vocab_axes, "w's vocabulary")
        if token_axes is not None:
            check_divisible(shape[0], mesh, token_axes, "x's first axis (tokens)")

        def local(*args):
            return _local(options, vocab, token_axes, vocab_axes, *args)

        tokens = P(token_axes)
        w_spec = P(None, vocab_axes) if layout == "dv" else P(vocab_axes, None)
        per_token = [tokens] * (return_lse + return_argmax)
        out_specs = (tokens if reduction == "none" else P(), *per_token)
        in_specs = (tokens, w_spec, tokens, tokens, tokens, P(vocab_axes))
        out = sharded_call(
            local, mesh, in_specs, out_specs, x, w, safe_labels, valid, in_range, bias
        )
    out = tuple(a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in out)
    return out if len(out) > 1 else out[0]


@dataclasses.dataclass(frozen=True)
class _Options:
    """The checked static options of one call."""

    layout: str
    cap: float | None
    smoothing: float
    z: float
    reduction: str
    return_lse: bool
    return_argmax: bool
    chunk_size: Any
    implementation: str | None


def _local(
    opts: _Options,
    vocab: int,
    token_axes: Any,
    vocab_axes: Any,
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    valid: jax.Array,
    in_range: jax.Array,
    bias: jax.Array | None,
) -> tuple:
    """The loss (and the per-token extras) of this device's tokens and words.

    With the vocabulary split over ``vocab_axes`` (inside ``shard_map``), every device
    reduces its own words and the two channels (log-sum-exp, label score) are combined
    over the devices by one log-sum-exp collective per token: the label's score is
    finite on the one device that holds the label (Megatron's vocabulary-parallel
    cross-entropy, Shoeybi et al., arXiv:1909.08053). With the tokens split over
    ``token_axes``, the sum and the count of a mean are summed over them.
    """
    shape = labels.shape
    n = math.prod(shape)
    x2 = x.reshape(n, x.shape[-1])
    local_vocab = w.shape[1 if opts.layout == "dv" else 0]
    offset = 0 if vocab_axes is None else lax.axis_index(vocab_axes) * local_vocab
    labels2 = labels.reshape(n) - offset  # a label is picked on its owner only
    tiles = tiling(
        n,
        local_vocab,
        opts.chunk_size,
        pair_bytes=lambda: _pair_bytes(x2, w, opts.layout, opts.cap),
    )
    # an explicit chunk_size sets a kernel's blocks; "auto" leaves them to the kernel
    explicit = not isinstance(opts.chunk_size, (str, Tiling))
    head = _Head(
        w,
        bias,
        opts.layout,
        opts.cap,
        opts.implementation,
        (tiles.rows.size, tiles.cols.size) if explicit else None,
    )
    both = _lse_and_label(head, x2, labels2, tiles)
    if vocab_axes is not None:
        both = REDUCTIONS["logsumexp"].combine_over_devices(both, vocab_axes, local_vocab)
    lse, label_score = both[:, 0], both[:, 1]
    loss = lse - label_score
    if opts.smoothing:
        total = _score_sum(head, x2, tiles)
        if vocab_axes is not None:
            total = lax.psum(total, vocab_axes)
        loss = loss + opts.smoothing * (label_score - total / vocab)
    if opts.z:
        loss = loss + opts.z * lse**2
    loss = jnp.where(in_range, loss.reshape(shape), jnp.nan)
    loss = jnp.where(valid, loss, 0.0)
    if opts.reduction != "none":
        total, count = jnp.sum(loss), jnp.sum(valid)
        if token_axes is not None:
            total, count = lax.psum((total, count), token_axes)
        loss = total if opts.reduction == "sum" else total / jnp.maximum(count, 1)
    out = [loss]
    if opts.return_lse:
        out.append(lse.reshape(shape))
    if opts.return_argmax:
        value, arg = _argmax(head, x2, tiles)
        if vocab_axes is not None:
            _, arg = REDUCTIONS["max"].combine_over_devices((value, arg), vocab_axes, local_vocab)
        out.append(arg.reshape(shape))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Head:
    """The output layer: ``w`` in either layout, an optional bias, a soft cap.

    ``w`` is the engine's columns, read in place along its vocabulary axis (1 for
    ``"dv"``, 0 for ``"vd"``: ``tiled_reduce(col_axis=)``), so neither layout nor a
    ragged last tile makes a transposed or padded copy; the bias, when given, is a
    second column leaf. In float32 the backward is one pass and ``dW`` is summed in
    place in its own buffer. In bfloat16/float16, summing ``dW`` over token tiles needs
    float32, and a float32 buffer the size of ``w`` would be as large as the logits
    this function avoids: the backward is then the engine's ``"split"`` one, a
    token-major pass for ``dx`` and a vocabulary-major pass in which each block of
    words' ``dW`` is complete after its pass over the tokens and stored once in ``w``'s
    dtype (one more tile product per tile).
    """

    w: jax.Array
    bias: jax.Array | None
    layout: str
    cap: float | None
    implementation: str | None = None
    chunk_size: tuple[int, int] | None = None  # an explicit tile, for a kernel's blocks

    def reduce(self, tile_fn: Callable, rows: Any, tiles: Tiling, reduce: str) -> Any:
        """``tiled_reduce`` over the vocabulary of ``tile_fn(rows_blk, head_blk)``."""
        axis = 1 if self.layout == "dv" else 0
        cols: tuple = (self.w,) if self.bias is None else (self.w, self.bias)
        narrow = any(accumulation_dtype(c.dtype) != c.dtype for c in cols)

        def engine_fn(rb, blk, _pairs, _consts, _row_ids, col_ids):
            return tile_fn(rb, lambda xb: self.scores(xb, *blk), col_ids)

        return tiled_reduce(
            engine_fn,
            rows,
            cols,
            reduce=reduce,
            tiles=tiles,
            col_axis=(axis, 0)[: len(cols)],
            backward="split" if narrow else "rows",
            upcast=True,
            forward_mode_error=_FORWARD_MODE,
            pattern=kernels.Pattern(
                "linear_cross_entropy",
                (("cap", self.cap), ("chunk_size", self.chunk_size), ("layout", self.layout)),
            ),
            implementation=self.implementation,
        )

    def scores(
        self, xb: jax.Array, w_blk: jax.Array, bias_blk: jax.Array | None = None
    ) -> jax.Array:
        """One tile's scores ``x W + b`` (soft-capped), in at least float32."""
        axis = 1 if self.layout == "dv" else 0
        acc = accumulation_dtype(jnp.result_type(xb, w_blk))
        # One matrix product per tile, and so one each for dx and dW in its vjp.
        s = lax.dot_general(xb, w_blk, (((1,), (1 - axis,)), ((), ())), preferred_element_type=acc)
        if bias_blk is not None:
            s = s + bias_blk.astype(acc)[None, :]
        if self.cap is not None:
            s = self.cap * jnp.tanh(s / self.cap)
        return s


def _lse_and_label(head: _Head, x2: jax.Array, labels: jax.Array, tiles: Tiling) -> jax.Array:
    """Per-token ``(log-sum-exp, label score)`` as ``(n, 2)``, float32: one tiled pass.

    The engine's ``"logsumexp_pick"`` reduction picks each token's label score from the
    tile that holds it (one gather per tile; ``-inf`` for a label on another device):
    the label needs no gather of ``W``, no scatter into ``dW`` and no second channel
    of exponentials; in the backward its gradient is the one-hot, added into the
    tile's score cotangent.
    """

    def tile_fn(rb, scores, _col_ids):
        # The barrier keeps XLA:CPU from fusing the product into the reduction's
        # elementwise work (measured: the loss and its gradient 1.1x faster at 2,048 x
        # 512 x 32,000, tile (1,024, 512)).
        return lax.optimization_barrier(scores(rb["x"])), rb["y"]

    return head.reduce(tile_fn, {"x": x2, "y": labels}, tiles, "logsumexp_pick")


def _score_sum(head: _Head, x2: jax.Array, tiles: Tiling) -> jax.Array:
    """Per-token sum of the scores over (this device's) vocabulary, float32."""
    if head.cap is None:
        # Linear in the scores: x . sum(W) + sum(b), no pass over the vocabulary tiles.
        acc = accumulation_dtype(x2.dtype)
        w_sum = jnp.sum(head.w, axis=1 if head.layout == "dv" else 0, dtype=acc)
        # In float32: the sum of W is not representable in bfloat16 (an x-sized copy).
        total = jnp.dot(x2.astype(acc), w_sum)
        if head.bias is not None:
            total = total + jnp.sum(head.bias, dtype=acc)
        return total
    return head.reduce(lambda xb, scores, _ids: scores(xb), x2, tiles, "sum")


def _argmax(head: _Head, x2: jax.Array, tiles: Tiling) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(max score, argmax)`` (int32): one tiled forward pass, no gradient."""
    head = dataclasses.replace(
        head,
        w=lax.stop_gradient(head.w),
        bias=None if head.bias is None else lax.stop_gradient(head.bias),
    )
    x2 = lax.stop_gradient(x2)
    return lax.stop_gradient(head.reduce(lambda xb, scores, _ids: scores(xb), x2, tiles, "max"))


def _pair_bytes(x2: jax.Array, w: jax.Array, layout: str, cap: float | None) -> int:
    """Bytes per (token, word) pair for ``"auto"``: THE rule, on one score."""
    acc = accumulation_dtype(jnp.result_type(x2, w))

    def score(xi, wv):
        s = jnp.dot(xi, wv, preferred_element_type=acc)
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        return s

    d = x2.shape[1]
    return item_bytes(score, jnp.zeros((d,), x2.dtype), jnp.zeros((d,), w.dtype))
