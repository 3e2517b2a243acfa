"""The backend seam (memwise.engine.kernels) and the kernels behind it.

Every kernel is held to the engine's XLA loops: on CPU in Pallas's interpret mode at
small shapes (``implementation="pallas"``), on a TPU compiled at real sizes (the
accelerator lane, ``make test-accelerator``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import ON_CPU, assert_allclose
from jax.experimental import pallas as pl

import memwise as mw
from memwise.engine import kernels

RNG = np.random.default_rng(0)


def _normal(shape, dtype=jnp.float32):
    return jnp.asarray(RNG.normal(size=shape), dtype)


def test_a_registered_kernel_replaces_the_loops_and_matches_them():
    # A kernel registered for attention's pattern on this platform runs instead of the
    # loops (here a dense reference standing in for a Pallas kernel); one that declines,
    # or none, leaves the loops to run.
    calls = []

    def dense_attention(call, rows, cols, pairs, consts, *, interpret):
        calls.append(call)
        s = jnp.einsum("...qd,...kd->...qk", rows["q"], cols["k"]) * consts["scale"]
        lse = jax.nn.logsumexp(s, axis=-1)
        return jnp.einsum("...qk,...kd->...qd", jnp.exp(s - lse[..., None]), cols["v"]), lse

    q = _normal((2, 9, 4))
    loss = lambda q: jnp.sum(jnp.sin(mw.attention(q, q, q, chunk_size=4)))  # noqa: E731
    # compiled, each call traced afresh (eagerly, each operation of the loops compiled
    # on its own); the registry is read at trace time
    plain, plain_grad = jax.jit(jax.value_and_grad(loss))(q)
    kernel = kernels.register(
        kernels.Kernel(
            "dense reference",
            "dot_product_attention",
            "softmax",
            (jax.default_backend(),),
            apply=dense_attention,
            declines=lambda call, *_: (
                "causal" if call.pattern.option("visibility").causal else None
            ),
        )
    )
    try:
        fused, fused_grad = jax.jit(jax.value_and_grad(loss))(q)
        assert len(calls) == 1 and calls[0].pattern.option("rows") == ("q",)
        assert_allclose(fused, plain, rtol=1e-5)
        assert_allclose(fused_grad, plain_grad, rtol=1e-4, atol=1e-6)
        jax.jit(lambda q: mw.attention(q, q, q, causal=True, chunk_size=4))(q)  # declined
        jax.jit(lambda q: mw.attention(q, q, q, chunk_size=4, implementation="xla"))(q)
        assert len(calls) == 1  # the loops ran: the kernel declined, or was not asked
    finally:
        kernels.unregister(kernel)
    jax.jit(lambda q: mw.attention(q, q, q, chunk_size=4))(q)
    assert len(calls) == 1 and kernel not in kernels.registered()


@pytest.mark.parametrize("bad", ["triton", "XLA", 1])
def test_an_unknown_implementation_is_one_line_naming_the_accepted_values(bad):
    q = _normal((1, 128, 2, 8))
    for call in (
        lambda: mw.dot_product_attention(q, q, q, implementation=bad),
        lambda: mw.attention(q, q, q, implementation=bad),
    ):
        with pytest.raises(ValueError, match=r"None .*'xla' or 'pallas'; got") as info:
            call()
        assert "\n" not in str(info.value)


def test_pallas_names_the_option_its_kernel_lacks():
    q = _normal((1, 128, 2, 8))
    cases = {
        "a bias array": dict(bias=jnp.zeros((1, 2, 128, 128))),
        "a mask array": dict(mask=jnp.ones((1, 1, 128, 128), bool)),
        "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
        "key_value_seq_lengths": dict(key_value_seq_lengths=jnp.array([100])),
    }
    for option, kwargs in cases.items():
        with pytest.raises(ValueError, match=f"does not support {option}"):
            mw.dot_product_attention(q, q, q, implementation="pallas", **kwargs)
    with pytest.raises(ValueError, match="not multiples of 128 .query 100, key 128"):
        mw.dot_product_attention(q[:, :100], q, q, implementation="pallas")
    with pytest.raises(ValueError, match="chunk_size .*multiples of 128"):
        mw.dot_product_attention(q, q, q, implementation="pallas", chunk_size=64)
    with pytest.raises(ValueError, match="cudnn.*jax.nn.dot_product_attention"):
        mw.dot_product_attention(q, q, q, implementation="cudnn")


@pytest.mark.skipif(not ON_CPU, reason="the CPU program of the default dispatch")
def test_the_default_on_a_cpu_only_machine_traces_no_kernel(monkeypatch):
    # Nothing the kernel needs exists here: the program is the loops' alone, as before
    # the seam (the memory benchmark's CPU programs are unchanged). The kernel's calls are
    # counted where they are made: a jaxpr's text does not show what a custom_vjp traces
    # under every JAX (not under jax_custom_vjp3).
    calls = []
    pallas_call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: calls.append(1) or pallas_call(*a, **k))
    q = _normal((1, 256, 2, 16))
    loss = lambda q: jnp.sum(mw.dot_product_attention(q, q, q, is_causal=True))  # noqa: E731
    text = str(jax.make_jaxpr(jax.value_and_grad(loss))(q))
    assert not calls and "platform_index" not in text
    jax.make_jaxpr(
        lambda q: mw.dot_product_attention(q, q, q, is_causal=True, implementation="pallas")
    )(q)
    assert calls


# The option grid in interpret mode: few cases, each several options at once, two blocks
# per axis (chunk 128 on 256 tokens) so that block skipping and the online softmax's
# merge across blocks are exercised.
SPLASH_CASES = {
    "grouped, causal, soft cap, sinks, residual": dict(
        shapes=(256, 256, 4, 2, 32),
        kwargs=dict(
            is_causal=True,
            logit_soft_cap=4.0,
            chunk_size=128,
            sinks=jnp.array([0.5, -1.0, 0.0, 2.0]),
        ),
    ),
    "segments with unseen rows, S != T": dict(
        shapes=(256, 384, 2, 2, 16),
        kwargs=dict(
            q_segment_ids=jnp.asarray(RNG.integers(0, 3, (1, 256))).at[:, :5].set(7),
            kv_segment_ids=jnp.asarray(RNG.integers(0, 3, (1, 384))),
        ),
    ),
    "window, multi-query": dict(
        shapes=(256, 256, 4, 1, 16),
        kwargs=dict(local_window_size=(40, 20), chunk_size=128),
    ),
    "causal window": dict(
        shapes=(256, 256, 2, 2, 16),
        kwargs=dict(is_causal=True, local_window_size=(100, 0), chunk_size=128),
    ),
}


@pytest.mark.parametrize("case", sorted(SPLASH_CASES))
def test_splash_attention_in_interpret_mode_equals_the_xla_tiles(case):
    t, s, n, k, h = SPLASH_CASES[case]["shapes"]
    kwargs = SPLASH_CASES[case]["kwargs"]
    q, key, v = _normal((1, t, n, h)), _normal((1, s, k, h)), _normal((1, s, k, h))
    scale = jnp.float32(0.3)

    def loss(q, key, v, scale, implementation):
        out, lse = mw.dot_product_attention(
            q,
            key,
            v,
            scale=scale,
            implementation=implementation,
            return_residual=True,
            differentiable_residual=True,
            **kwargs,
        )
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse)), (out, lse)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
    (want, want_aux), want_grads = grad(q, key, v, scale, "xla")
    (got, got_aux), got_grads = grad(q, key, v, scale, "pallas")
    for a, b in zip((got, *got_aux, *got_grads), (want, *want_aux, *want_grads)):
        assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))


def test_splash_attention_in_interpret_mode_bfloat16_and_heads_first():
    q, key, v = (_normal((1, 256, 8, 32), jnp.bfloat16) for _ in range(3))
    key, v = key[:, :, :1], v[:, :, :1]  # 8 query heads on one K/V head
    loss = lambda impl: (
        lambda q, k, v: jnp.sum(  # noqa: E731
            mw.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(
                jnp.float32
            )
            ** 2
        )
    )
    # compiled (eager, each operation of the loops and of the interpreted kernel was
    # compiled alone)
    want = jax.jit(jax.value_and_grad(loss("xla"), (0, 1, 2)))(q, key, v)
    got = jax.jit(jax.value_and_grad(loss("pallas"), (0, 1, 2)))(q, key, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        assert_allclose(
            np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(b)))
        )
    x = _normal((2, 3, 256, 32))  # memwise.attention: (..., L, d), heads as batch dims
    want = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(mw.attention(x, x, x, causal=True)))))(x)
    got = jax.jit(
        jax.grad(
            lambda x: jnp.sum(jnp.sin(mw.attention(x, x, x, causal=True, implementation="pallas")))
        )
    )(x)
    assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    # outside differentiation the kernel's forward skips its log-sum-exp output
    want = jax.jit(lambda x: mw.attention(x, x, x, causal=True))(x)
    got = jax.jit(lambda x: mw.attention(x, x, x, causal=True, implementation="pallas"))(x)
    assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_the_default_where_a_kernel_platform_exists_chooses_at_lowering(monkeypatch):
    # As on a TPU host: the program holds both the kernel and the loops, and lowering
    # keeps the branch of the platform it is compiled for (here the CPU's: the loops).
    monkeypatch.setattr(kernels, "_platform_present", lambda platform: True)
    q = _normal((1, 256, 2, 16))
    loss = lambda q: jnp.sum(jnp.sin(mw.dot_product_attention(q, q, q, is_causal=True)))  # noqa: E731
    grad = jax.jit(jax.value_and_grad(loss))
    assert "platform_index" in str(jax.make_jaxpr(grad)(q))
    loops = jax.jit(
        jax.value_and_grad(
            lambda q: jnp.sum(
                jnp.sin(mw.dot_product_attention(q, q, q, is_causal=True, implementation="xla"))
            )
        )
    )
    for a, b in zip(grad(q), loops(q)):
        assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the compiled kernel needs a TPU")
@pytest.mark.parametrize("kv_heads", [8, 1])
def test_on_a_tpu_the_default_runs_splash_and_equals_the_xla_tiles(kv_heads):
    t = 2048
    q = _normal((2, t, 8, 128), jnp.bfloat16)
    k, v = (_normal((2, t, kv_heads, 128), jnp.bfloat16) for _ in range(2))

    def loss(impl):
        return lambda q, k, v: jnp.sum(
            mw.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(
                jnp.float32
            )
            ** 2
        )

    default = jax.jit(jax.value_and_grad(loss(None), (0, 1, 2)))
    assert "tpu_custom_call" in default.lower(q, k, v).as_text()
    xla = jax.jit(jax.value_and_grad(loss("xla"), (0, 1, 2)))
    assert "tpu_custom_call" not in xla.lower(q, k, v).as_text()
    for a, b in zip(jax.tree.leaves(default(q, k, v)), jax.tree.leaves(xla(q, k, v))):
        a, b = np.float32(a), np.float32(b)
        assert_allclose(a, b, rtol=3e-2, atol=3e-2 * float(np.max(np.abs(b))))


def test_second_derivatives_through_the_kernel_name_the_fix():
    q = _normal((1, 128, 1, 8))
    loss = lambda q, impl: jnp.sum(  # noqa: E731
        mw.dot_product_attention(q, q, q, is_causal=True, implementation=impl) ** 2
    )
    for second in (
        lambda: jax.hessian(loss)(q, "pallas"),
        lambda: jax.grad(lambda q: jnp.sum(jax.grad(loss)(q, "pallas") ** 2))(q),
    ):
        with pytest.raises(TypeError, match="no second derivatives .*implementation='xla'"):
            second()


def _close_to_the_loops(got, want, rtol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.float32(a), np.float32(b)
        assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b))))


def test_grad_of_vmap_through_the_kernel_when_its_lse_is_unused():
    # The kernel's lse-free forward (the caller reads no lse) under vmap, then jit(grad):
    # its zero lse was unbatched while the forward rule's was batched, and the
    # conditional of dispatch was linearized at the wrong shape (a TypeError from the
    # moveaxis of the heads: "transpose permutation isn't a permutation").
    q, kv = _normal((2, 128, 2, 8)), _normal((2, 128, 1, 8))

    def grad(impl):
        one = lambda q, kv: mw.dot_product_attention(q, kv, kv, implementation=impl)  # noqa: E731
        loss = lambda q, kv: jnp.sum(jnp.sin(jax.vmap(one)(q, kv)))  # noqa: E731
        return jax.jit(jax.grad(loss, (0, 1)))(q, kv)

    _close_to_the_loops(grad("pallas"), grad("xla"), 2e-5)


def test_vmap_over_an_empty_batch_through_the_kernel_returns_empty_results():
    # Pallas batches a call by adding a grid axis; of length 0 its blocks were larger
    # than the arrays (a TypeError from the slice of its interpreter). The loops return
    # empty values and gradients; so does the kernel, under vmap of vmap too.
    q = _normal((0, 2, 128, 2, 128))

    def value_and_grad(impl):
        one = lambda q: mw.dot_product_attention(q, q, q, is_causal=True, implementation=impl)  # noqa: E731
        loss = lambda q: jnp.sum(jax.vmap(one)(q))  # noqa: E731
        return jax.vmap(one)(q), jax.grad(loss)(q), jax.vmap(jax.vmap(one))(q[:, :0])

    for got, want in zip(value_and_grad("pallas"), value_and_grad("xla")):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_bfloat16_with_sinks_and_unseen_rows_runs_the_kernel():
    # dot_product_attention upcasts bfloat16 values to float32 for its per-row
    # corrections (sinks, rows that see no key): the kernel declined the call as mixed
    # dtypes "bfloat16/bfloat16/float32" the caller never passed.
    b = jnp.bfloat16
    q, kv = _normal((1, 128, 2, 16), b), _normal((1, 128, 1, 16), b)
    kwargs = dict(
        sinks=jnp.array([0.5, -1.0]),
        q_segment_ids=jnp.zeros((1, 128), jnp.int32).at[:, :3].set(5),  # 3 rows see none
        kv_segment_ids=jnp.zeros((1, 128), jnp.int32),
    )

    def value_and_grad(impl):
        def loss(q, kv):
            out = mw.dot_product_attention(q, kv, kv, implementation=impl, **kwargs)
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        return jax.jit(jax.value_and_grad(loss, (0, 1)))(q, kv)  # compiled: one program

    got, want = value_and_grad("pallas"), value_and_grad("xla")
    assert [a.dtype for a in got[1]] == [b, b]
    _close_to_the_loops(got, want, 2e-2)
    with pytest.raises(ValueError, match="does not support dtype float16/float16/float16"):
        mw.dot_product_attention(
            *(a.astype(jnp.float16) for a in (q, kv, kv)), implementation="pallas"
        )


def test_a_traced_scale_in_bfloat16_gets_the_loops_gradient():
    # The scale is folded into q: rounded to bfloat16 and multiplied there, its gradient
    # (a sum over all of q) was accumulated in bfloat16, 8% off at 128 tokens.
    q, k, v = (_normal((1, 128, 2, 16), jnp.bfloat16) for _ in range(3))

    def grad(impl):
        def loss(scale):
            out = mw.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, implementation=impl
            )
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss))(jnp.float32(0.25))  # compiled: one program

    assert_allclose(grad("pallas"), grad("xla"), rtol=1e-2)


def test_grouped_query_heads_through_the_kernel_under_enable_x64():
    # Splash's grouped-query index maps divide an int32 head id by an int64 when
    # jax_enable_x64 is on: a bare TypeError from lax.div instead of attention.
    q, kv = _normal((1, 128, 4, 8)), _normal((1, 128, 2, 8))
    with jax.enable_x64(True):

        def value_and_grad(impl):
            loss = lambda q, kv: jnp.sum(  # noqa: E731
                jnp.sin(mw.dot_product_attention(q, kv, kv, is_causal=True, implementation=impl))
            )
            return jax.jit(jax.value_and_grad(loss, (0, 1)))(q, kv)  # compiled: one program

        _close_to_the_loops(value_and_grad("pallas"), value_and_grad("xla"), 2e-5)
