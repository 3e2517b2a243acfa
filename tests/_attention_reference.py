"""Dense ``dot_product_attention`` with every memwise option, for tests: the full
``(B, N, T, S)`` score matrix, K/V repeated to the query heads, ``jax.nn``'s masking
(a large negative score, so a fully masked query averages the values), and the same
dropout mask memwise draws (from its per-element hash)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from memwise._attention_tiles import _keep_mask, dropout_rows


def keep_mask(rng, rate, B, K, G, T, S):
    """memwise's dropout keep mask for ``rng`` as a ``(B, N, T, S)`` boolean array."""
    seed = jax.random.bits(rng, (2,), jnp.uint32)
    rows = dropout_rows(seed, (B, K, G), T)
    cols = jnp.arange(S, dtype=jnp.int32)
    keep = jax.vmap(lambda h: _keep_mask(h, cols, seed[1], rate))(rows.reshape(-1, T))
    return keep.reshape(B, K * G, T, S)


def dense_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logit_soft_cap=None,
    sinks=None,
    dropout_rate=0.0,
    dropout_rng=None,
):
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    k = jnp.repeat(key, G, axis=2)
    v = jnp.repeat(value, G, axis=2)
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    s = jnp.einsum("btnh,bsnh->bnts", query, k) * scale
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    if bias is not None:
        s = s + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    keep = jnp.ones((B, N, T, S), bool)
    if mask is not None:
        keep &= mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    t = jnp.arange(T)[:, None]
    j = jnp.arange(S)[None, :]
    if is_causal:
        keep &= j <= t
    if local_window_size is not None:
        w = local_window_size
        left, right = (w, w) if isinstance(w, int) else w
        keep &= (t <= j + left) & (t >= j - right)
    if query_seq_lengths is not None:
        keep &= (jnp.arange(T) < query_seq_lengths[:, None])[:, None, :, None]
    if key_value_seq_lengths is not None:
        keep &= (jnp.arange(S) < key_value_seq_lengths[:, None])[:, None, None, :]
    if q_segment_ids is not None:
        qs = jnp.broadcast_to(q_segment_ids, (B, T))
        ks = jnp.broadcast_to(q_segment_ids if kv_segment_ids is None else kv_segment_ids, (B, S))
        keep &= (qs[:, :, None] == ks[:, None, :])[:, None]
    s = jnp.where(keep, s, -0.7 * float(np.finfo(np.float32).max))
    if sinks is not None:
        sink = jnp.broadcast_to(sinks[None, :, None, None], (B, N, T, 1)).astype(s.dtype)
        p = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[..., :-1]
    else:
        p = jax.nn.softmax(s, -1)
    if dropout_rate:
        kept = keep_mask(dropout_rng, dropout_rate, B, K, G, T, S)
        p = p * kept / (1.0 - dropout_rate)
    out = jnp.einsum("bnts,bsnh->btnh", p, v)
    if query_seq_lengths is not None:
        out = out * (jnp.arange(T) < query_seq_lengths[:, None])[:, :, None, None]
    return out[0] if unbatched else out
