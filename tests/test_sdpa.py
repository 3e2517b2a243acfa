"""mw.dot_product_attention: the options beyond jax.nn against a dense float64 reference
(tests/_attention_reference.py), grouped-query attention's memory, packed sequences
against each sequence alone, and dropout's mask. jax.nn's own tests are in
test_sdpa_jax.py; dtypes, transformations and edge shapes are rows of test_matrix.py."""

from __future__ import annotations

import functools

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import dense_attention, keep_mask
from _multidevice import run_on_devices

import memwise as mw
from memwise.measure import compiled_memory

pytestmark = pytest.mark.usefixtures("float64_module")


def _qkv(B=2, T=13, S=11, N=4, K=2, H=8, dtype=jnp.float64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        _draw.normal(ks[0], (B, T, N, H), dtype),
        _draw.normal(ks[1], (B, S, K, H), dtype),
        _draw.normal(ks[2], (B, S, K, H), dtype),
    )


def _check(kw, *, B=2, T=13, S=11, N=4, K=2, chunk=(4, 3), extra=None):
    """Value and every float gradient (q, k, v and ``extra`` keyword arrays) against the
    dense reference, in float64."""
    q, k, v = _qkv(B, T, S, N, K)
    extra = extra or {}
    names = list(extra)

    def loss_of(fn, **more):
        def loss(q, k, v, *xs):
            out = fn(q, k, v, **kw, **dict(zip(names, xs)), **more)
            return jnp.sum(jnp.sin(out)), out

        return loss

    xs = [kw_extra for kw_extra in extra.values()]
    argnums = tuple(range(3 + len(xs)))
    # both compiled, values and gradients in one program (eager, each operation of the
    # tile loops and of the dense reference was compiled alone)
    (_, out), grads = jax.jit(
        jax.value_and_grad(
            loss_of(mw.dot_product_attention, chunk_size=chunk), argnums, has_aux=True
        )
    )(q, k, v, *xs)
    (_, ref), ref_grads = jax.jit(
        jax.value_and_grad(loss_of(dense_attention), argnums, has_aux=True)
    )(q, k, v, *xs)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-11, err_msg=f"gradient {i}")
    return out


def test_segment_ids_with_causal_window_and_empty_segments():
    q_seg = jnp.array([[0] * 5 + [1] * 6 + [2] * 2, [3] * 13])  # segment 2 has no keys
    kv_seg = jnp.array([[0] * 4 + [1] * 7, [3] * 11])
    for kw in ({}, {"is_causal": True}, {"local_window_size": (2, 1), "is_causal": True}):
        _check({"q_segment_ids": q_seg, "kv_segment_ids": kv_seg, **kw})


@pytest.mark.slow  # memory at two lengths, up to 4,096 tokens: six compilations, 17-24 s
def test_one_array_of_segment_ids_adds_no_buffer_of_the_queries_size():
    # Packed self-attention (one segment-id array for queries and keys, or only one of
    # them given): every query sees its own key, so the output needs no correction for
    # rows that see nothing, which cost a float32 copy of the output in the forward and
    # two in the backward (2.9 MiB more than without segments at T = 4,096). Compiled
    # at two lengths, against no segments at all.
    for T in (1024, 4096):
        q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, 1, 64), jnp.float32)
        seg = jax.ShapeDtypeStruct((1, T), jnp.int32)
        q_bytes = T * 8 * 64 * 4

        def temp(*kw):
            def loss(q, k, v, s):
                out = mw.dot_product_attention(q, k, v, is_causal=True, **{n: s for n in kw})
                return jnp.sum(out**2)

            return compiled_memory(loss, q, kv, kv, seg, grad=True, argnums=(0, 1, 2)).temp_bytes

        none = temp()
        for one in (("q_segment_ids",), ("q_segment_ids", "kv_segment_ids")):
            assert temp(*one) - none < q_bytes / 8, (T, one)


def test_soft_cap_with_bias_and_mask():
    bias = _draw.normal(jax.random.PRNGKey(3), (1, 4, 13, 11))
    mask = _draw.bernoulli(jax.random.PRNGKey(4), 0.7, (2, 1, 13, 11))
    _check({"logit_soft_cap": 0.7, "mask": mask}, extra={"bias": bias})


def test_sinks_get_their_gradient_also_on_fully_masked_rows():
    sinks = jnp.array([0.3, -1.0, 2.0, 0.0])
    lengths = jnp.array([11, 0], jnp.int32)  # batch 1: no key at all, the sink takes all
    out = _check({"key_value_seq_lengths": lengths, "is_causal": True}, extra={"sinks": sinks})
    assert jnp.all(out[1] == 0)


def test_fully_masked_queries_average_the_values_as_jax_nn():
    q, k, v = _qkv(K=4)
    lengths = jnp.array([0, 5], jnp.int32)
    # compiled (eager, each operation of the tile loops was compiled alone)
    out = jax.jit(functools.partial(mw.dot_product_attention, chunk_size=4))(
        q, k, v, key_value_seq_lengths=lengths
    )
    np.testing.assert_allclose(out[0], jnp.broadcast_to(v[0].mean(0), out[0].shape), atol=1e-12)
    ref = jax.jit(jax.nn.dot_product_attention)(q, k, v, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(out, ref, atol=1e-6)  # jax.nn's softmax is float32


def test_dropout_same_mask_both_passes_any_tile():
    rng = jax.random.key(7)
    kw = {"dropout_rate": 0.25, "dropout_rng": rng, "is_causal": True}
    out = _check(kw)
    # The mask depends on the key only, not on the tiles. (Compiled: eagerly, each
    # operation of the tile loops compiled on its own.)
    q, k, v = _qkv()
    attention = jax.jit(
        mw.dot_product_attention, static_argnames=("is_causal", "dropout_rate", "chunk_size")
    )
    other = attention(q, k, v, **kw, chunk_size=(5, 7))
    np.testing.assert_allclose(other, out, atol=1e-12)
    # About a quarter of the weights dropped, and another key drops others.
    kept = keep_mask(rng, 0.25, 2, 2, 2, 13, 11)
    assert 0.2 < 1 - float(kept.mean()) < 0.3
    assert not jnp.array_equal(kept, keep_mask(jax.random.key(8), 0.25, 2, 2, 2, 13, 11))
    assert not jnp.allclose(
        attention(q, k, v, **{**kw, "dropout_rng": rng}), attention(q, k, v, is_causal=True)
    )


def test_striped_inputs_give_the_unstriped_result_striped():
    # Every option that compares positions (causal, window, lengths, dropout) reads the
    # positions before striping; segment ids, masks and biases are striped with the rest.
    s, T = 4, 16
    q, k, v = _qkv(T=T, S=T)
    seg = jnp.array([[0] * 6 + [1] * 10, [2] * 16])
    bias = _draw.normal(jax.random.PRNGKey(5), (2, 1, T, T))
    kw = dict(
        is_causal=True,
        local_window_size=(5, 0),
        query_seq_lengths=jnp.array([16, 11]),
        key_value_seq_lengths=jnp.array([13, 16]),
        dropout_rate=0.3,
        dropout_rng=jax.random.key(2),
    )

    def striped(x, *axes):
        for axis in axes:
            x = mw.stripe(x, s, axis=axis)
        return x

    def loss(q, k, v, bias, seg, stripes=None):  # (a sum: the same in either order)
        out = mw.dot_product_attention(
            q, k, v, bias, **kw, q_segment_ids=seg, stripes=stripes, chunk_size=(4, 8)
        )
        return jnp.sum(jnp.sin(out)), out

    # compiled (eager, each operation of the tile loops was compiled alone)
    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True), static_argnames="stripes")
    (_, ref), ref_grads = grad(q, k, v, bias, seg)
    args = [striped(a, 1) for a in (q, k, v)] + [striped(bias, 2, 3), striped(seg, 1)]
    (_, out), grads = grad(*args, stripes=s)
    np.testing.assert_allclose(mw.unstripe(out, s, axis=1), ref, atol=1e-12)
    for g, r, axes in zip(grads, ref_grads, [(1,), (1,), (1,), (2, 3)]):
        np.testing.assert_allclose(g, striped(r, *axes), atol=1e-11)
    with pytest.raises(ValueError, match="stripes=3"):
        mw.dot_product_attention(*args[:3], stripes=3)


def test_residual_is_the_log_sum_exp_and_optionally_differentiable():
    q, k, v = _qkv()
    sinks = jnp.array([0.3, -1.0, 2.0, 0.0])

    def lse_sum(q, sinks, differentiable):
        _, lse = mw.dot_product_attention(
            q,
            k,
            v,
            sinks=sinks,
            return_residual=True,
            differentiable_residual=differentiable,
            chunk_size=4,
        )
        return jnp.sum(lse)

    def ref(q, sinks):
        s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) / np.sqrt(8)
        s = jnp.concatenate(
            [s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1
        )
        return jnp.sum(jax.nn.logsumexp(s, -1))

    # compiled (eager, each operation of the tile loops was compiled alone)
    value_and_grad = functools.partial(jax.jit, static_argnums=2)(
        jax.value_and_grad(lse_sum, (0, 1))
    )
    value, (dq, _) = value_and_grad(q, sinks, False)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref, (0, 1)))(q, sinks)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for g, r in zip(value_and_grad(q, sinks, True)[1], ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-11)
    assert not jnp.any(dq)


def test_unbatched_layout_and_broadcast_mask():
    q, k, v = _qkv(B=1)
    mask = _draw.bernoulli(jax.random.PRNGKey(5), 0.6, (13, 11))  # 2-D: (T, S)
    # compiled (eager, each operation of the tile loops was compiled alone)
    out = jax.jit(functools.partial(mw.dot_product_attention, chunk_size=3))(
        q[0], k[0], v[0], mask=mask
    )
    ref = jax.jit(jax.nn.dot_product_attention)(q[0], k[0], v[0], mask=mask)
    assert out.shape == (13, 4, 8)
    np.testing.assert_allclose(out, ref, atol=1e-6)  # jax.nn's softmax is float32


@pytest.mark.slow
def test_packed_sequences_match_each_sequence_alone():
    lengths = [5, 9, 3, 7]
    T = sum(lengths)
    seg = jnp.repeat(jnp.arange(4), jnp.array(lengths), total_repeat_length=T)[None]
    q, k, v = _qkv(B=1, T=T, S=T, N=4, K=1)

    def packed(q, k, v):
        return mw.dot_product_attention(
            q, k, v, is_causal=True, q_segment_ids=seg, chunk_size=(8, 4)
        )

    @jax.jit  # one program (eager, each operation of the tile loops was compiled alone)
    def packed_grads(q, k, v):
        out, vjp = jax.vjp(packed, q, k, v)
        cot = jnp.cos(out)
        return out, cot, vjp(cot)

    out, cot, grads = packed_grads(q, k, v)

    @jax.jit  # one program per sequence length (eager, every operation was compiled alone)
    def alone(a, b, c, cot):
        out, vjp = jax.vjp(
            lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True), a, b, c
        )
        return out, vjp(cot)

    start = 0
    for n in lengths:
        part = slice(start, start + n)
        out1, grads1 = alone(q[:, part], k[:, part], v[:, part], cot[:, part])
        np.testing.assert_allclose(out[:, part], out1, atol=1e-6)  # jax.nn: float32 softmax
        for g, g1 in zip(grads, grads1):
            np.testing.assert_allclose(g[:, part], g1, atol=1e-5)
        start += n


@pytest.mark.slow
def test_grouped_query_gradient_has_no_repeated_kv():
    # 8 query heads on 1 K/V head: the gradient holds no copy of K or V repeated to the
    # 8 heads (what jnp.repeat before the call costs, in both passes), and its
    # temporaries grow linearly with T.
    def temp(T, K, repeat=False):
        q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, K, 64), jnp.float32)

        def loss(q, k, v):
            if repeat:
                k, v = jnp.repeat(k, 8 // K, axis=2), jnp.repeat(v, 8 // K, axis=2)
            return jnp.sum(mw.dot_product_attention(q, k, v, is_causal=True, chunk_size=512))

        return compiled_memory(loss, q, kv, kv, grad=True, argnums=(0, 1, 2)).temp_bytes

    T = 8192
    kv_bytes = T * 64 * 4
    gqa = temp(T, 1)
    assert gqa + 2 * 7 * kv_bytes <= temp(T, 1, repeat=True), gqa
    assert gqa < 2.2 * temp(T // 2, 1), gqa


@pytest.mark.slow
def test_grouped_query_gradient_reuses_the_output_buffer():
    # With a loss that makes its own cotangent (sum(out ** 2)), the gradient holds the
    # cotangent, not the output besides it: the output dies into the query gradient's
    # buffer. K/V's small gradient buffers cannot hide it, as MHA's do: its temporaries
    # grew by two query sizes per query size, now by one.
    def temp(T):
        q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, 1, 64), jnp.float32)

        def loss(q, k, v):
            return jnp.sum(mw.dot_product_attention(q, k, v) ** 2)

        return compiled_memory(loss, q, kv, kv, grad=True, argnums=(0, 1, 2)).temp_bytes

    q_bytes = lambda T: T * 8 * 64 * 4  # noqa: E731
    growth = (temp(8192) - temp(4096)) / (q_bytes(8192) - q_bytes(4096))
    assert growth < 1.3, growth


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, limit",
    [
        ({}, 1.2),
        ({"is_causal": True, "local_window_size": (256, 0)}, 1.2),
        # A query might see no key: its output and cotangent are corrected (one copy).
        ({"q_segment_ids": jnp.arange(4096) // 1000}, 2.2),
        ({"bias": jnp.ones((1, 1, 1, 4096))}, 2.2),
    ],
)
def test_heads_are_read_in_place(options, limit):
    # (B, T, N, H) inputs are read where they are, every head inside each tile: the
    # gradient's temporaries are the output kept for the backward (one q-sized buffer)
    # and the tiles, where moving q, k, v, the output and their gradients to a
    # heads-first layout held about four more q-sized copies. The cotangent is an
    # argument here (a loss like sum(out ** 2) makes its own, one more buffer).
    T = 4096
    q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)

    def loss(q, k, v, c):
        return jnp.sum(mw.dot_product_attention(q, k, v, **options) * c)

    temp = compiled_memory(loss, q, q, q, q, grad=True, argnums=(0, 1, 2)).temp_bytes
    assert temp < limit * (T * 8 * 64 * 4), temp


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_error_no_worse_than_jax_nn(dtype):
    # GQA 4:1 with a bias, a window and padding lengths; inputs and cotangent exactly
    # representable in dtype, so the float64 reference is the exact answer.
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = (_draw.normal(keys[0], (2, 128, 4, 32)) * 2).astype(dtype)
    k, v = (_draw.normal(kk, (2, 128, 1, 32)).astype(dtype) for kk in keys[1:3])
    ct = _draw.normal(keys[3], (2, 128, 4, 32)).astype(dtype)
    bias = _draw.normal(keys[4], (1, 4, 128, 128)).astype(dtype)
    kw = {
        "is_causal": True,
        "local_window_size": (48, 0),
        "key_value_seq_lengths": jnp.array([128, 70], jnp.int32),
    }

    def value_and_grads(f, *args, compiled=True):
        def run(*args):
            out, vjp = jax.vjp(f, *args)
            return out, vjp(ct.astype(out.dtype))

        # one program (eager, each operation was compiled alone); jax.nn's stays eager:
        # its float16 einsum (an F16_F16_F32 dot) does not compile on XLA:CPU inside a
        # larger program
        return (jax.jit(run) if compiled else run)(*args)

    fns = {
        "memwise": lambda q, k, v, b: mw.dot_product_attention(q, k, v, b, **kw, chunk_size=32),
        "jax.nn": lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, **kw),
    }
    ref, ref_grads = value_and_grads(
        lambda q, k, v, b: dense_attention(q, k, v, b, **kw),
        *(a.astype(jnp.float64) for a in (q, k, v, bias)),
    )
    errors = {}
    for name, f in fns.items():
        out, grads = value_and_grads(f, q, k, v, bias, compiled=name == "memwise")
        errors[name] = [
            float(jnp.max(jnp.abs(a.astype(jnp.float64) - b)))
            for a, b in zip((out, *grads), (ref, *ref_grads))
        ]
    for ours, theirs in zip(errors["memwise"], errors["jax.nn"]):
        assert ours <= 1.2 * theirs, errors


def test_a_row_hidden_by_the_bias_is_a_masked_row():
    # A bias of -inf over a whole row: the values' mean, as for a row the mask hides,
    # whether or not a (no-op) mask is passed; an empty key set's log-sum-exp is -inf.
    q = _draw.normal(jax.random.PRNGKey(1), (1, 4, 2, 8))
    k, v = _draw.normal(jax.random.PRNGKey(2), (2, 1, 5, 1, 8))
    bias = jnp.zeros((4, 5)).at[1].set(-jnp.inf)
    # compiled (eagerly, each operation of the tile loops compiled on its own)
    attention = jax.jit(mw.dot_product_attention, static_argnames="return_residual")
    alone = attention(q, k, v, bias)
    masked = attention(q, k, v, bias, jnp.ones((4, 5), bool))
    np.testing.assert_allclose(alone, masked, atol=1e-6)
    np.testing.assert_allclose(alone[0, 1, 0], jnp.mean(v[0, :, 0], axis=0), atol=1e-6)
    empty = jnp.ones((2, 0, 1, 8))
    _, lse = attention(q, empty[:1], empty[:1], return_residual=True)
    _, ref = jax.nn.dot_product_attention(
        q, empty[:1], empty[:1], return_residual=True, implementation="xla"
    )
    np.testing.assert_array_equal(lse, ref)


def test_where_it_differs_from_jax_nn_a_minus_inf_bias_and_mixed_dtypes():
    # Decided (the module's notes): a row that a -inf bias hides where the mask leaves
    # keys averages all values, as a masked row; jax.nn averages the values the mask
    # hides (its finite mask score beats -inf). A finite bias gives the same in both.
    q, k, v = (a.astype(jnp.float32) for a in _qkv(B=1, T=2, S=6, N=2, K=2))
    mask = jnp.ones((2, 6), bool).at[0, :3].set(False)
    hidden = jnp.zeros((2, 6), bool).at[0, 3:].set(True)
    # compiled, one program for both biases (eagerly, each operation of the tile loops
    # compiled on its own)
    attention = jax.jit(mw.dot_product_attention)
    ours = attention(q, k, v, jnp.where(hidden, -jnp.inf, 0.0), mask)
    theirs = jax.nn.dot_product_attention(q, k, v, jnp.where(hidden, -jnp.inf, 0.0), mask)
    np.testing.assert_allclose(ours[0, 0], v[0].mean(0), atol=1e-6)
    np.testing.assert_allclose(theirs[0, 0], v[0, :3].mean(0), atol=1e-6)
    np.testing.assert_allclose(ours[0, 1], theirs[0, 1], atol=1e-6)
    finite = jnp.where(hidden, -1e9, 0.0)
    np.testing.assert_allclose(
        attention(q, k, v, finite, mask),
        jax.nn.dot_product_attention(q, k, v, finite, mask),
        atol=1e-6,
    )
    # Mixed dtypes: jax.nn raises, and so does memwise (it promoted them).
    with pytest.raises(ValueError, match="one dtype"):
        mw.dot_product_attention(q.astype(jnp.bfloat16), k, v)


def _attention_in_sdpa_layout(query, key, value, bias, mask, *, chunk_size):
    """mw.attention, heads before the sequence, with jax.nn's arguments and layout; a row
    that sees no key is zeros there (jax.nn, as mw.dot_product_attention: the mean of
    the values)."""
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    out = mw.attention(t(query), t(key), t(value), mask=mask, bias=bias, chunk_size=chunk_size)
    return t(out)


def _jax_nn_as_attention(query, key, value, bias, mask):
    """jax.nn's attention with mw.attention's zeros for a row that sees no key."""
    out = jax.nn.dot_product_attention(query, key, value, bias, mask)
    return jnp.where(jnp.any(mask, -1).swapaxes(1, 2)[..., None], out, 0.0)


# A function x dtype x size grid (12 cases, two compilations each): a stratified half
# runs, every function, dtype and size among them (MEMWISE_TEST_GRID=full runs all).
@pytest.mark.grid(fraction=0.5)
@pytest.mark.parametrize("size", [4, 10, 100])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fn", ["dot_product_attention", "attention"])
def test_a_row_hidden_by_a_large_negative_bias_has_jax_nn_gradients(fn, dtype, size):
    # An additive mask of -1e9 (or -1e30, or finfo.min / 2) over every key of a row: the
    # scores all round to the bias, and the backward's probabilities must still sum to
    # one (a log-sum-exp of -1e9 + log(S) rounds to -1e9 in float32: they summed to S,
    # and dq, dk, dv were S times jax.nn's). Rows: hidden by the bias, half hidden, seen,
    # hidden by the mask, half by the mask and half by the bias; two column tiles or more.
    q, k, v = (a.astype(dtype) for a in _qkv(B=1, T=5, S=size, N=2, K=2))
    half = size // 2
    hide = jnp.zeros((5, size), jnp.float32).at[0].set(1).at[1, :half].set(1).at[4, half:].set(1)
    mask = jnp.ones((5, size), bool).at[3].set(False).at[4, :half].set(False)[None, None]
    if fn == "attention":
        ours_fn = functools.partial(_attention_in_sdpa_layout, chunk_size=(2, 3))
        ref_fn = _jax_nn_as_attention
    else:
        ours_fn = functools.partial(mw.dot_product_attention, chunk_size=(2, 3))
        ref_fn = jax.nn.dot_product_attention

    @jax.jit
    def grads(bias):
        def loss(fn, *qkv):
            return jnp.sum(jnp.sin(fn(*qkv, bias.astype(dtype), mask).astype(jnp.float32)))

        ours = jax.grad(lambda *a: loss(ours_fn, *a), (0, 1, 2))(q, k, v)
        # The reference in float32 from the same inputs (jax.nn rounds bfloat16's
        # probabilities to bfloat16).
        up = [a.astype(jnp.float32) for a in (q, k, v)]
        ref = jax.grad(lambda *a: loss(ref_fn, *a), (0, 1, 2))(*up)
        return ours, ref

    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    for value in (-1e5, -1e9, -1e30, float(jnp.finfo(jnp.float32).min) / 2):
        ours, ref = grads(hide * jnp.float32(value))
        for name, g, r in zip("qkv", ours, ref):
            np.testing.assert_allclose(
                g.astype(jnp.float32), r, atol=tol, rtol=tol, err_msg=f"d{name}, bias {value}"
            )


@pytest.mark.slow
def test_every_option_on_8_devices_matches_one_device():
    """Queries split over their sequence (and batch) dim: K/V, their key-side masks and
    segment ids travel on a ring (no all-gather), and every option gives one device's
    values and gradients (sinks' and the bias' too). A per-head mask with grouped K/V
    holds K/V whole instead (their columns broadcast over the group)."""
    out = run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import memwise as mw
        mesh = jax.make_mesh((8,), ("d",))
        mesh24 = jax.make_mesh((2, 4), ("b", "s"))
        batch_and_sequence = NamedSharding(mesh24, P("b", "s"))
        # the sequence over both axes, not in the mesh's order (the ring follows the data)
        both_reversed = NamedSharding(mesh24, P(None, ("s", "b")))
        B, T, N, K, H = 2, 128, 4, 2, 8
        ks = jax.random.split(jax.random.key(0), 6)
        q = jax.random.normal(ks[0], (B, T, N, H))
        k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in ks[1:3])
        seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 4, (B, T)), 1), jnp.int32)
        cases = {
            "causal": dict(is_causal=True),
            "window": dict(is_causal=True, local_window_size=(20, 0)),
            "segments": dict(q_segment_ids=seg, kv_segment_ids=seg, is_causal=True),
            "lengths": dict(query_seq_lengths=jnp.array([100, 128]),
                            key_value_seq_lengths=jnp.array([50, 128])),
            "cap+sinks": dict(logit_soft_cap=5.0, sinks=jnp.linspace(-1.0, 1.0, N)),
            "dropout": dict(dropout_rate=0.2, dropout_rng=jax.random.key(3)),
            "mask+bias": dict(mask=jax.random.bernoulli(ks[3], 0.8, (B, 1, T, T)),
                              bias=jax.random.normal(ks[4], (1, 1, T, T))),
            "per-head mask": dict(mask=jax.random.bernoulli(ks[5], 0.8, (B, N, T, T))),
            # rows a -1e9 bias hides, wholly and on some devices' blocks only (the merge)
            "hidden rows": dict(bias=jnp.zeros((1, 1, T, T)).at[..., 0, :].set(-1e9)
                                .at[..., 1, 40:].set(-1e9).at[..., 2, :70].set(-1e9)),
        }
        for name, kw in cases.items():
            floats = {n: a for n, a in kw.items() if n in ("sinks", "bias")}
            def loss(q, k, v, floats):
                out = mw.dot_product_attention(q, k, v, **{**kw, **floats}, chunk_size=(8, 8))
                return jnp.sum(jnp.sin(out))
            grad = jax.value_and_grad(loss, (0, 1, 2, 3))
            ref = jax.jit(grad)(q, k, v, floats)
            sequence = NamedSharding(mesh, P(None, "d"))
            extra = (batch_and_sequence, both_reversed) if name == "causal" else ()
            for where in (sequence, *extra):
                split = [jax.device_put(a, where) for a in (q, k, v)]
                compiled = jax.jit(grad).lower(*split, floats).compile()
                got = compiled(*split, floats)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
                    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=name)
                hlo = compiled.as_text()
                ring = name != "per-head mask"
                assert ("collective-permute" in hlo) == ring, (name, where)
                assert ("all-gather" in hlo) == (not ring), (name, where)
                print(name, where.spec, "ok")
        # The striped order: one device's unstriped values and gradients, striped.
        kw = dict(is_causal=True, local_window_size=(40, 0), dropout_rate=0.2,
                  dropout_rng=jax.random.key(3), key_value_seq_lengths=jnp.array([90, 128]))
        def loss_with(seg, stripes):  # the segment ids closed over, as in the cases above
            def loss(q, k, v):
                out = mw.dot_product_attention(q, k, v, **kw, q_segment_ids=seg,
                                               stripes=stripes, chunk_size=(8, 8))
                return jnp.sum(jnp.sin(out))
            return jax.value_and_grad(loss, (0, 1, 2))
        value, grads = jax.jit(loss_with(seg, None))(q, k, v)
        sequence = NamedSharding(mesh, P(None, "d"))
        striped = [jax.device_put(mw.stripe(a, 8, axis=1), sequence) for a in (q, k, v)]
        grad = loss_with(mw.stripe(seg, 8, axis=1), 8)
        compiled = jax.jit(grad).lower(*striped).compile()
        got_value, got = compiled(*striped)
        np.testing.assert_allclose(got_value, value, rtol=2e-5)
        for a, b in zip(got, grads):
            np.testing.assert_allclose(a, mw.stripe(b, 8, axis=1), rtol=2e-5, atol=2e-6)
        hlo = compiled.as_text()
        assert "collective-permute" in hlo and "all-gather" not in hlo
        print("striped ok")
        # key on another mesh than query: a memwise error naming the fix
        elsewhere = NamedSharding(mesh24, P("b"))
        try:
            jax.jit(mw.dot_product_attention)(
                jax.device_put(q, NamedSharding(mesh, P(None, "d"))),
                jax.device_put(k, elsewhere),
                jax.device_put(v, elsewhere),
            )
        except ValueError as err:
            assert "put query, key and value on one mesh" in str(err), err
            print("meshes ok")
        """,
        n_devices=8,
    )
    assert out.count("ok") == 13


# The attention path's functions, each short enough to hold in one's head:
# dot_product_attention is its stages in order, the engine's backward one
# function per loop order around a shared per-tile step.
_ATTENTION_PATH = ("sdpa", "_sdpa_args", "_attention_tiles", "engine/backward")
_LONGEST_BODY = 80  # lines, docstring excluded


def _functions(module):
    import ast
    import pathlib

    path = pathlib.Path(mw.__file__).parent / f"{module}.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_attention_path_functions_fit_in_one_screen():
    import ast

    too_long = []
    for module in _ATTENTION_PATH:
        for fn in _functions(module):
            body = fn.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
            if lines > _LONGEST_BODY:
                too_long.append(f"{module}.{fn.name}: {lines} lines")
    assert not too_long, too_long


def test_dot_product_attention_reads_as_its_stages():
    import ast

    (public,) = (f for f in _functions("sdpa") if f.name == "dot_product_attention")
    called = [
        node.func.id
        for node in ast.walk(public)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    stages = ["check_options", "validate", "_layout", "_operands", "_dispatch", "_corrections"]
    assert [name for name in called if name in stages] == stages
