"""The fused cross-entropy kernel (memwise.engine.tpu_cross_entropy) behind
``mw.linear_cross_entropy(implementation="pallas")``.

On CPU it runs in Pallas's interpret mode at small shapes and is held to the XLA tiles
(float32 arithmetic, ``precision="highest"``) and to optax's dense loss; its TPU lowering
(Pallas to Mosaic) is checked by exporting for the TPU, which needs no chip. On a TPU
(``make test-accelerator``) the same cases run compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import ON_CPU, assert_allclose
from jax import export

import memwise as mw
from memwise.engine import kernels, tpu_cross_entropy

RNG = np.random.default_rng(0)

# Each case several options at once; shapes with ragged last blocks (tokens and words
# that no block divides) and a vocabulary smaller than a block.
CASES = {
    "dv, ignore_index, ragged blocks, lse": dict(
        n=300,
        d=16,
        vocab=1000,
        layout="dv",
        chunk=(128, 256),
        kw=dict(ignore_index=-100, return_lse=True),
    ),
    "vd, bias, soft cap, smoothing, z-loss, where, none": dict(
        n=200,
        d=24,
        vocab=500,
        layout="vd",
        chunk="auto",
        kw=dict(
            logit_soft_cap=4.0,
            label_smoothing=0.1,
            z_loss=1e-3,
            reduction="none",
            bias=True,
            where=True,
        ),
    ),
    "dv, bias, soft cap, sum, argmax, one token block": dict(
        n=64,
        d=16,
        vocab=384,
        layout="dv",
        chunk=(64, 128),
        kw=dict(logit_soft_cap=3.0, reduction="sum", bias=True, return_argmax=True),
    ),
}


def _inputs(n, d, vocab, layout, dtype=jnp.float32, bias=False, where=False, ignore=True):
    x = jnp.asarray(RNG.normal(size=(n, d)), dtype)
    shape = (d, vocab) if layout == "dv" else (vocab, d)
    w = jnp.asarray(RNG.normal(size=shape) / np.sqrt(d), dtype)
    b = jnp.asarray(RNG.normal(size=(vocab,)), dtype) if bias else None
    labels = jnp.asarray(RNG.integers(0, vocab, n))
    if ignore:
        labels = labels.at[::7].set(-100)
    mask = jnp.asarray(RNG.random(n) < 0.8) if where else None
    return x, w, b, labels, mask


def _optax(x, w, b, labels, mask, layout, kw):
    logits = x @ (w if layout == "dv" else w.T)
    if b is not None:
        logits = logits + b
    cap = kw.get("logit_soft_cap")
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    safe = jnp.where(labels == kw.get("ignore_index", -1), 0, labels)
    target = jax.nn.one_hot(safe, logits.shape[-1])
    if kw.get("label_smoothing"):
        target = optax.smooth_labels(target, kw["label_smoothing"])
    lse = jax.nn.logsumexp(logits, axis=-1)
    loss = optax.softmax_cross_entropy(logits, target) + kw.get("z_loss", 0.0) * lse**2
    keep = labels != kw.get("ignore_index", -1)
    if mask is not None:
        keep = keep & mask
    loss = jnp.where(keep, loss, 0.0)
    reduction = kw.get("reduction", "mean")
    if reduction == "none":
        return loss
    return jnp.sum(loss) if reduction == "sum" else jnp.sum(loss) / jnp.maximum(keep.sum(), 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_in_interpret_mode_equals_the_xla_tiles_and_optax(case):
    c = CASES[case]
    kw = dict(c["kw"])
    x, w, b, labels, mask = _inputs(
        c["n"], c["d"], c["vocab"], c["layout"], bias=kw.pop("bias", False),
        where=kw.pop("where", False), ignore="ignore_index" in kw,
    )  # fmt: skip
    extras = kw.get("return_lse", False) or kw.get("return_argmax", False)

    def run(x, w, b, implementation):
        out = mw.linear_cross_entropy(
            x, w, labels, bias=b, where=mask, layout=c["layout"], chunk_size=c["chunk"],
            implementation=implementation, **kw,
        )  # fmt: skip
        return out if extras else (out,)

    def loss(x, w, b, implementation):
        out = run(x, w, b, implementation)
        total = jnp.sum(out[0] * jnp.linspace(0.5, 1.5, out[0].size).reshape(out[0].shape))
        if kw.get("return_lse"):
            total = total + 0.3 * jnp.sum(jnp.cos(out[1]))  # the lse's own gradient
        return total

    argnums = (0, 1, 2) if b is not None else (0, 1)
    # compiled (eagerly, each operation of the tiles' loops and of the interpreted
    # kernel compiled on its own: 2-3x the time)
    forward = jax.jit(run, static_argnums=3)
    gradient = jax.jit(jax.grad(loss, argnums), static_argnums=3)
    with jax.default_matmul_precision("highest"):
        fused = forward(x, w, b, "pallas")
        tiles = forward(x, w, b, "xla")
        grads = gradient(x, w, b, "pallas")
        expected = gradient(x, w, b, "xla")
        dense = _optax(x, w, b, labels, mask, c["layout"], kw)
    for got, want in zip(fused, tiles):
        if jnp.issubdtype(want.dtype, jnp.integer):
            np.testing.assert_array_equal(got, want)
        else:
            assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert_allclose(fused[0], dense, rtol=2e-5, atol=1e-6)
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype
        assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_through_the_kernel_is_within_bfloat16_rounding_of_the_tiles():
    # The logit gradient is cast to bfloat16 before the two backward products (the
    # fused kernel's design); dW is summed in float32 and rounded once.
    x, w, b, labels, _ = _inputs(256, 32, 640, "dv", jnp.bfloat16, bias=True)

    def loss(x, w, b, implementation):
        return mw.linear_cross_entropy(
            x, w, labels, bias=b, ignore_index=-100, chunk_size=(64, 256),
            implementation=implementation,
        )  # fmt: skip

    value_and_grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=3)  # compiled
    value, grads = value_and_grad(x, w, b, "pallas")
    ref_value, ref_grads = value_and_grad(x, w, b, "xla")
    assert value.dtype == jnp.bfloat16
    assert_allclose(value.astype(np.float32), ref_value.astype(np.float32), rtol=1e-2)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert error <= 2e-2 * scale, (error, scale)


def test_bfloat16_dx_summed_over_many_word_blocks_is_the_exact_sum_rounded_once():
    # With bfloat16 inputs the backward sums dx over word blocks as two bfloat16 arrays,
    # hi + lo, each addition in float32. Over 32 word blocks the result is the exact sum
    # of the blocks' products rounded once to bfloat16, up to the pair's 2**-18 per
    # addition: within half a unit in the last place plus 2**-14 of the sum of the
    # terms' magnitudes. A running sum kept in bfloat16 alone misses that bound 11-28
    # times over (four seeds).
    rng = np.random.default_rng(0)
    n, d, vocab = 64, 16, 4096
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, vocab)) / np.sqrt(d), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, vocab, n))
    loss = lambda x: mw.linear_cross_entropy(  # noqa: E731
        x, w, labels, chunk_size=(64, 128), implementation="pallas"
    )
    got = np.asarray(jax.jit(jax.grad(loss))(x).astype(jnp.float32), np.float64)
    # the kernel's logit gradient, (p - onehot) / n rounded to bfloat16, in float64
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    ws = np.asarray(w.astype(jnp.float32), np.float64)
    s = xs @ ws
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = (p - np.eye(vocab)[np.asarray(labels)]) / n
    g = np.asarray(jnp.asarray(g, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    want = g @ ws.T
    half_ulp = 2.0 ** (np.floor(np.log2(np.abs(want))) - 8)  # bfloat16 at want
    bound = half_ulp + 2.0**-14 * (np.abs(g) @ np.abs(ws).T)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_pallas_names_what_the_kernel_cannot_serve():
    x, w, _, labels, _ = _inputs(32, 8, 256, "dv", ignore=False)
    for xd, wd, what in (
        (jnp.float16, jnp.float16, "dtype float16"),
        (jnp.bfloat16, jnp.float32, "dtype bfloat16 x and float32 w"),
    ):
        with pytest.raises(ValueError, match=what):
            mw.linear_cross_entropy(x.astype(xd), w.astype(wd), labels, implementation="pallas")
    with pytest.raises(ValueError, match=r"chunk_size \(24, 100\)"):
        mw.linear_cross_entropy(x, w, labels, chunk_size=(24, 100), implementation="pallas")
    with pytest.raises(ValueError, match="implementation must be None"):
        mw.linear_cross_entropy(x, w, labels, implementation="triton")


def test_second_derivatives_through_the_kernel_name_the_fix():
    x, w, _, labels, _ = _inputs(32, 8, 256, "dv", ignore=False)

    def loss(x):
        return mw.linear_cross_entropy(x, w, labels, implementation="pallas")

    with pytest.raises(TypeError, match="implementation='xla'"):
        jax.hessian(loss)(x)


def test_a_first_word_block_of_minus_infinity_stays_finite():
    # Every score of the first word block -inf (a bias masking those words): the running
    # log-sum-exp shifted by -inf there and gave NaN, where the tiles give the loss.
    x, w, _, labels, _ = _inputs(64, 8, 384, "dv", ignore=False)
    labels = labels % 128 + 256  # labels among the words left
    bias = jnp.zeros(384).at[:128].set(-jnp.inf)

    def run(impl):
        loss = lambda x, w: mw.linear_cross_entropy(  # noqa: E731
            x, w, labels, bias=bias, chunk_size=(64, 128), implementation=impl
        )
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)  # compiled: one program

    with jax.default_matmul_precision("highest"):
        (got, dgot), (want, dwant) = run("pallas"), run("xla")
    assert np.isfinite(float(got))
    assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(dgot, dwant):
        assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_vmap_of_grad_through_the_kernel():
    x, w, _, labels, _ = _inputs(64, 8, 256, "vd", ignore=False)
    xs = jnp.stack([x, 2 * x])

    def grad(x, implementation):
        loss = lambda x: mw.linear_cross_entropy(  # noqa: E731
            x, w, labels, layout="vd", implementation=implementation
        )
        return jax.grad(loss)(x)

    with jax.default_matmul_precision("highest"):  # compiled: one program each
        got = jax.jit(jax.vmap(lambda x: grad(x, "pallas")))(xs)
        want = jax.jit(jax.vmap(lambda x: grad(x, "xla")))(xs)
        assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        # both operands batched, and the weights' gradient
        ws = jnp.stack([w, -w])
        both = lambda x, w, impl: jax.grad(  # noqa: E731
            lambda x, w: mw.linear_cross_entropy(x, w, labels, layout="vd", implementation=impl),
            (0, 1),
        )(x, w)
        got = jax.jit(jax.vmap(lambda x, w: both(x, w, "pallas")))(xs, ws)
        want = jax.jit(jax.vmap(lambda x, w: both(x, w, "xla")))(xs, ws)
    for a, b in zip(got, want):
        assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_vmap_over_an_empty_batch_through_the_kernel_returns_empty_results():
    # Pallas batches a call by adding a grid axis; of length 0 its blocks were larger
    # than the arrays (a TypeError from the slice of its interpreter), where the tiles
    # return an empty loss and empty gradients.
    _, w, _, labels, _ = _inputs(64, 8, 256, "vd", ignore=False)
    xs, ws = jnp.zeros((0, 64, 8)), jnp.zeros((0, *w.shape))

    @functools.partial(jax.jit, static_argnums=0)  # compiled: one program each
    def run(impl):
        loss = lambda x, w: mw.linear_cross_entropy(  # noqa: E731
            x, w, labels, layout="vd", implementation=impl
        )
        per_row = lambda x, w: mw.linear_cross_entropy(  # noqa: E731
            x, w, labels, layout="vd", reduction="none", implementation=impl
        )
        return (
            jax.vmap(loss, (0, None))(xs, w),
            jax.vmap(per_row)(xs, ws),
            *jax.vmap(jax.grad(loss, (0, 1)), (0, None))(xs, w),
            jax.grad(lambda xs: jnp.sum(jax.vmap(loss, (0, None))(xs, w)))(xs),
        )

    for got, want in zip(run("pallas"), run("xla")):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_the_default_chooses_the_kernel_where_a_tpu_is_present(monkeypatch):
    # As on a TPU host: implementation=None holds both the kernel and the tiles, and
    # lowering keeps the platform's branch (platform_index); a CPU-only host traces no
    # kernel (test_kernels), and what the kernel declines (float16) runs the tiles.
    assert all(k.default for k in tpu_cross_entropy.KERNELS)
    monkeypatch.setattr(kernels, "_platform_present", lambda platform: True)
    x, w, _, labels, _ = _inputs(32, 8, 256, "dv", ignore=False)
    loss = lambda x, w: mw.linear_cross_entropy(x, w, labels)  # noqa: E731
    text = str(jax.make_jaxpr(jax.value_and_grad(loss))(x, w))
    assert "platform_index" in text
    half = str(
        jax.make_jaxpr(jax.value_and_grad(loss))(x.astype(jnp.float16), w.astype(jnp.float16))
    )
    assert "platform_index" not in half


@pytest.mark.skipif(not ON_CPU, reason="exports for the TPU from a machine without one")
def test_every_kernel_lowers_for_the_tpu_at_real_sizes():
    # Pallas lowers each kernel to Mosaic when the program is lowered for the TPU, which
    # needs no chip: the check CI can make that a kernel's body is one Mosaic accepts.
    def lowered(fn, *shapes):
        module = export.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()
        return module.count("tpu_custom_call")

    n, d, vocab = 8192, 4096, 128_256
    x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32)
    bias = jax.ShapeDtypeStruct((vocab,), jnp.bfloat16)
    for layout, shape in (("dv", (d, vocab)), ("vd", (vocab, d))):
        w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

        def loss(x, w, labels, bias, layout=layout):
            return mw.linear_cross_entropy(
                x, w, labels, bias=bias, layout=layout, logit_soft_cap=30.0,
                label_smoothing=0.1, implementation="pallas",
            )  # fmt: skip

        # forward: the statistics and the capped scores' sum; backward: one each more
        assert lowered(jax.value_and_grad(loss, (0, 1, 3)), x, w, labels, bias) == 4, layout
        argmax = lambda x, w, labels, layout=layout: mw.linear_cross_entropy(  # noqa: E731
            x, w, labels, layout=layout, return_argmax=True, implementation="pallas"
        )[1]
        assert lowered(argmax, x, w, labels) == 1, layout
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    attention = lambda q: jnp.sum(  # noqa: E731
        mw.dot_product_attention(q, q, q, is_causal=True, implementation="pallas")
    )
    assert lowered(jax.value_and_grad(attention), q) >= 2
    # vmap of the gradient: the backward's HBM accumulator cannot take the batch as a
    # grid axis in Mosaic (a batched Pallas call fails to lower); it loops instead.
    xs = jax.ShapeDtypeStruct((2, 1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((1024,), jnp.int32)
    loss = lambda x, w, labels: mw.linear_cross_entropy(  # noqa: E731
        x, w, labels, implementation="pallas"
    )
    per_example = jax.vmap(jax.grad(loss, (0, 1)), (0, None, None))
    assert lowered(per_example, xs, w, labels) == 2
