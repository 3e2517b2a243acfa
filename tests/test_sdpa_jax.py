"""JAX's own tests of ``jax.nn.dot_product_attention`` (tests/nn_test.py of jax-v0.10.2,
the installed version), with the function under test swapped for
``mw.dot_product_attention``: every argument combination they exercise must give
``jax.nn``'s values and gradients within their tolerances. The reference stays
``jax.nn.dot_product_attention(implementation=None)``, as in the original; the
``implementation="cudnn"`` variants become memwise's (cuDNN is JAX's to test).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import assert_allclose
from jax import random

import memwise as mw


def _value_and_vjp(fn, primals, ct, compiled=True):
    """``out, vjp = jax.vjp(fn, *primals)`` and ``vjp(ct)`` as one compiled program (eager,
    each operation of the tile loops and of the reference was compiled alone). jax.nn's
    float16 reference stays eager (``compiled=False``): its F16_F16_F32 dot does not
    compile on XLA:CPU inside a larger program."""

    def run(primals, ct):
        out, vjp = jax.vjp(fn, *primals)
        return out, vjp(ct)

    return (jax.jit(run) if compiled else run)(primals, ct)


def _assert_all_close(actual, expected, *, atol=1e-6, rtol=1e-6):
    # jtu.assertAllClose on bfloat16/float16 arrays: compared in float32.
    assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        atol=atol,
        rtol=rtol,
    )


@pytest.mark.grid
@pytest.mark.slow
@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dot_product_attention(dtype, group_num, use_vmap):
    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N // G, H), dtype)
    V = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    lse_grad = random.normal(keys[4], (B, T, N), dtype)
    bias, mask = None, None

    sdpa_ref = partial(jax.nn.dot_product_attention, implementation=None)
    sdpa_ans = partial(mw.dot_product_attention, implementation="xla")
    sdpa_ref_lse = partial(jax.nn.dot_product_attention, implementation=None, return_residual=True)
    sdpa_ans_lse = partial(mw.dot_product_attention, implementation="xla", return_residual=True)
    if use_vmap:
        sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)

    # For testing purposes, the reference is the non-GQA version without vmap.
    K_ref = jnp.repeat(K, G, axis=2)
    V_ref = jnp.repeat(V, G, axis=2)
    ref_compiled = dtype != jnp.float16
    out_ref, d_ref = _value_and_vjp(sdpa_ref, (Q, K_ref, V_ref, bias, mask), grad, ref_compiled)
    out_ans, d_ans = _value_and_vjp(sdpa_ans, (Q, K, V, bias, mask), grad)

    lse_ct = (grad, lse_grad)
    out_ref_lse, d_ref_lse = _value_and_vjp(
        sdpa_ref_lse, (Q, K_ref, V_ref, bias, mask), lse_ct, ref_compiled
    )
    out_ans_lse, d_ans_lse = _value_and_vjp(sdpa_ans_lse, (Q, K, V, bias, mask), lse_ct)

    dQ_ref, dK_ref, dV_ref = d_ref[:3]
    dQ_ans, dK_ans, dV_ans = d_ans[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)

    dQ_ref_lse, dK_ref_lse, dV_ref_lse = d_ref_lse[:3]
    dQ_ans_lse, dK_ans_lse, dV_ans_lse = d_ans_lse[:3]
    dK_ref_lse = dK_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref_lse = dV_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)

    _assert_all_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    _assert_all_close(dQ_ref, dQ_ans, rtol=0.01, atol=0.01)
    _assert_all_close(dK_ref, dK_ans, rtol=0.01, atol=0.01)
    _assert_all_close(dV_ref, dV_ans, rtol=0.01, atol=0.01)

    _assert_all_close(out_ref_lse[0], out_ans_lse[0], atol=0.01, rtol=0.01)
    _assert_all_close(out_ref_lse[1], out_ans_lse[1], atol=0.01, rtol=0.01)
    _assert_all_close(dQ_ref_lse, dQ_ans_lse, rtol=0.01, atol=0.01)
    _assert_all_close(dK_ref_lse, dK_ans_lse, rtol=0.01, atol=0.01)
    _assert_all_close(dV_ref_lse, dV_ans_lse, rtol=0.01, atol=0.01)


@pytest.mark.grid
@pytest.mark.slow
@pytest.mark.parametrize(
    "mask_mode",
    [
        "bias",
        "causal",
        "padding",
        "custom",
        ("causal", "padding"),
        ("custom", "padding"),
        ("bias", "causal"),
        ("causal", "sliding_window"),
    ],
)
def test_dot_product_attention_mask(mask_mode):
    if isinstance(mask_mode, str):
        mask_mode = (mask_mode,)
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 4)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None

    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        # Use a generated causal mask as the custom mask.
        custom_mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))
        mask = custom_mask[None, None, :, :]
    if "bias" in mask_mode:
        # The original reads keys[4] of 4 keys, which JAX's indexing clamps to keys[3].
        bias = random.normal(keys[3], (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    sdpa_ref = partial(jax.nn.dot_product_attention, is_causal=is_causal, implementation=None)
    sdpa_ans = partial(mw.dot_product_attention, is_causal=is_causal, implementation="xla")
    args = (Q, K, V, bias, mask)

    def fn_ref(q, k, v, b, m, qs, kvs):
        return sdpa_ref(
            q,
            k,
            v,
            b,
            m,
            query_seq_lengths=qs,
            key_value_seq_lengths=kvs,
            local_window_size=window_size,
        )

    def fn_ans(q, k, v, b, m, qs, kvs):
        return sdpa_ans(
            q,
            k,
            v,
            b,
            m,
            query_seq_lengths=qs,
            key_value_seq_lengths=kvs,
            local_window_size=window_size,
        )

    out_ref, d_ref = _value_and_vjp(fn_ref, (*args, q_seqlen, kv_seqlen), grad)
    out_ans, d_ans = _value_and_vjp(fn_ans, (*args, q_seqlen, kv_seqlen), grad)
    dQ_ref, dK_ref, dV_ref, dbias_ref = d_ref[:4]
    dQ_ans, dK_ans, dV_ans, dbias_ans = d_ans[:4]

    _assert_all_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    _assert_all_close(dQ_ref, dQ_ans, rtol=0.02, atol=0.02)
    _assert_all_close(dK_ref, dK_ans, rtol=0.02, atol=0.02)
    _assert_all_close(dV_ref, dV_ans, rtol=0.01, atol=0.01)
    if dbias_ref is not None:
        _assert_all_close(dbias_ref, dbias_ans, rtol=0.02, atol=0.02)


def test_dot_product_attention_float64_mask_debug_infs():
    # Regression test for https://github.com/jax-ml/jax/issues/37422
    with jax.enable_x64():
        T, S, K, N, H = 5, 7, 3, 6, 11
        mask = jnp.arange(S) <= S // 2
        with jax.debug_infs(True):
            out = mw.dot_product_attention(
                jnp.zeros((T, N, H), dtype=jnp.float64),
                jnp.zeros((S, K, H), dtype=jnp.float64),
                jnp.zeros((S, K, H), dtype=jnp.float64),
                mask=mask,
            )
            out.block_until_ready()


@pytest.mark.slow
@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_dot_product_attention_bias_gradient(batch_size, use_vmap):
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (B, S, N, H), dtype)
    bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(x, bias, mask, fn):
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    attn_ref = partial(attention, fn=partial(jax.nn.dot_product_attention, implementation=None))
    attn_ans = partial(attention, fn=partial(mw.dot_product_attention, implementation="xla"))
    if use_vmap:
        attn_batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
        attn_batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    else:
        attn_batched_ref = attn_ref
        attn_batched_ans = attn_ans

    y_ref = jax.jit(attn_batched_ref)(x, bias, mask)
    y_ans = jax.jit(attn_batched_ans)(x, bias, mask)
    # jtu's default bfloat16 tolerance.
    _assert_all_close(y_ref, y_ans, atol=1e-2, rtol=1e-2)

    @jax.jit
    def bwd_ref(x, bias, mask):
        _, f_vjp = jax.vjp(attn_ref, x, bias, mask)
        return f_vjp(x)

    @jax.jit
    def bwd_ans(x, bias, mask):
        _, f_vjp = jax.vjp(attn_ans, x, bias, mask)
        return f_vjp(x)

    _, dbias_ref, _ = bwd_ref(x, bias, mask)
    _, dbias_ans, _ = bwd_ans(x, bias, mask)
    _assert_all_close(dbias_ans, dbias_ref, rtol=0.1, atol=0.1)


def test_dot_product_attention_local_window_size_without_mask():
    dtype = jnp.float32
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 3)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)

    # each window's output computed once, compiled (eager, each operation of the tile
    # loops was compiled alone), and held to jax.nn's
    ours, theirs = (
        {
            window: jax.jit(lambda q, k, v, w=window: fn(q, k, v, mask=None, local_window_size=w))(
                Q, K, V
            )
            for window in ((32, 32), (1, 1))
        }
        for fn in (mw.dot_product_attention, jax.nn.dot_product_attention)
    )
    output_large_window, output_small_window = ours[32, 32], ours[1, 1]
    assert not jnp.allclose(output_large_window, output_small_window), (
        "Attention output should differ with different local_window_size, even without a mask."
    )
    # And each is jax.nn's (float32: 1e-5).
    for window in ((32, 32), (1, 1)):
        _assert_all_close(ours[window], theirs[window], atol=1e-5, rtol=1e-5)
