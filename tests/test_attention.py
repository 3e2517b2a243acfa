"""Tests for memwise.attention: values and gradients against dense softmax attention and
jax.nn.dot_product_attention; compiled gradient memory at two sequence lengths."""

import _draw
import _grid
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from _multidevice import run_on_devices
from hypothesis import given, settings
from hypothesis import strategies as st

import memwise as mw
from memwise.measure import compiled_memory

pytestmark = pytest.mark.usefixtures("float64_module")


def dense_attention(q, k, v, mask=None, bias=None, causal=False):
    s = jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape[-2:], bool) if mask is None else mask
    if causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.where(jnp.isnan(p), 0.0, p) @ v


@settings(max_examples=examples(2))
@given(
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    rows=st.integers(1, 4),
    cols=st.integers(1, 4),
    causal=st.booleans(),
    use_mask=st.booleans(),
    use_bias=st.booleans(),
    dtype=st.sampled_from([jnp.float32, jnp.float64]),
    seed=st.integers(0, 999),
)
@pytest.mark.slow
def test_matches_dense(lq, lk, rows, cols, causal, use_mask, use_bias, dtype, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = _draw.normal(keys[0], (2, 2, lq, 3), dtype)
    k = _draw.normal(keys[1], (2, 2, lk, 3), dtype)
    v = _draw.normal(keys[2], (2, 2, lk, 4), dtype)
    mask = _draw.bernoulli(keys[3], 0.7, (lq, lk)) if use_mask else None
    bias = _draw.normal(keys[4], (2, 1, lq, lk), dtype) if use_bias else None
    tol = 1e-10 if dtype == jnp.float64 else 3e-5

    def ours(q, k, v, bias):
        return mw.attention(q, k, v, mask=mask, bias=bias, causal=causal, chunk_size=(rows, cols))

    def dense(q, k, v, bias):
        return dense_attention(q, k, v, mask, bias, causal)

    argnums = (0, 1, 2) + ((3,) if use_bias else ())
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    # One compiled program computing values and gradients (compiling is the cost here).
    both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(loss(f), argnums)(*a)))  # noqa: E731
    (out, grads), (out_d, grads_d) = both(ours)(q, k, v, bias), both(dense)(q, k, v, bias)
    np.testing.assert_allclose(out, out_d, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_d):
        np.testing.assert_allclose(a, b, rtol=tol * 10, atol=tol * 10)


@pytest.mark.slow
def test_matches_jax_dot_product_attention():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (_draw.normal(kk, (2, 4, 37, 8), jnp.float32) for kk in keys)
    # jax.nn.dot_product_attention takes (batch, length, heads, dim)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    # both compiled (eager, each operation of the tile loops was compiled alone)
    ref = jax.jit(lambda q, k, v: t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True)))
    ours = jax.jit(lambda q, k, v: mw.attention(q, k, v, causal=True, chunk_size=(8, 16)))
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_gradient_memory_bounded():
    temps = []
    for length in (16_384, 32_768):
        s = jax.ShapeDtypeStruct((1, 1, length, 64), jnp.float32)
        loss = lambda q, k, v: jnp.sum(mw.attention(q, k, v) ** 2)  # noqa: E731
        fwd = compiled_memory(loss, s, s, s)
        grad = compiled_memory(loss, s, s, s, grad=True, argnums=(0, 1, 2))
        assert grad.temp_bytes < 128 * 2**20  # the score matrix alone is 1,024 MiB
        assert grad.temp_bytes <= 2 * fwd.temp_bytes
        temps.append(grad.temp_bytes)
    # doubling L adds O(L d) vectors (q/k/v-sized), not an L x L tile row
    assert temps[1] - temps[0] < 16 * 16_384 * 64 * 4


def test_bad_shapes():
    q = jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match="feature dim"):
        mw.attention(q, jnp.ones((2, 5, 3)), jnp.ones((2, 5, 3)))
    with pytest.raises(ValueError, match="leading"):
        mw.attention(q, jnp.ones((3, 5, 4)), jnp.ones((3, 5, 4)))
    with pytest.raises(ValueError, match="mask"):
        mw.attention(q, q, q, mask=jnp.ones((4, 4), bool))
    with pytest.raises(ValueError, match="chunk_size"):
        mw.attention(q, q, q, chunk_size=0)


@pytest.mark.slow
def test_causal_skips_tiles_above_the_diagonal():
    # One row block, 4 column tiles: the skipped tiles must not change values or
    # gradients, including a ragged last tile and Lq != Lk.
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q = _draw.normal(keys[0], (2, 13, 4))
    k = _draw.normal(keys[1], (2, 17, 4))
    v = _draw.normal(keys[2], (2, 17, 3))
    f = lambda q, k, v: jnp.sum(
        mw.attention(
            q,
            k,
            v,
            causal=True,  # noqa: E731
            chunk_size=(4, 5),
        )
        ** 2
    )
    g = lambda q, k, v: jnp.sum(dense_attention(q, k, v, causal=True) ** 2)  # noqa: E731
    vg = lambda f: jax.jit(jax.value_and_grad(f, (0, 1, 2)))  # noqa: E731  (the reference too)
    (val, grads), (val_d, grads_d) = vg(f)(q, k, v), vg(g)(q, k, v)
    np.testing.assert_allclose(val, val_d, rtol=1e-10)
    for a, b in zip(grads, grads_d):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    # the tile loops (forward and backward) run over the live tiles alone: no branch
    # around dead ones (test_engine.py counts the tiles each pass visits)
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(f, (0, 1, 2)))(q, k, v))
    assert " cond[" not in jaxpr and jaxpr.count(" while[") >= 2


def test_bad_sharding_options():
    q = jnp.ones((2, 4, 8, 4))
    mesh = jax.make_mesh((1,), ("d",))
    with pytest.raises(ValueError, match="feature dim"):
        mw.attention(q, q, q, mesh=mesh, axis_name="d", shard_dim=-1)
    with pytest.raises(ValueError, match="not an axis"):
        mw.attention(q, q, q, mesh=mesh, axis_name="x")
    with pytest.raises(ValueError, match="axis_name needs mesh"):
        mw.attention(q, q, q, axis_name="d")
    with pytest.raises(TypeError, match="shard_dim"):
        mw.attention(q, q, q, mesh=mesh, axis_name="d", shard_dim=1.0)


@pytest.mark.slow
def test_sharded_matches_single_device_on_4_devices():
    out = run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import memwise as mw
        from memwise.measure import compiled_memory
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        ks = jax.random.split(jax.random.PRNGKey(0), 6)
        B, H, L = 2, 4, 12
        q = jax.random.normal(ks[0], (B, H, L, 8))
        k = jax.random.normal(ks[1], (B, H, L, 8))
        v = jax.random.normal(ks[2], (B, H, L, 5))
        mask = jax.random.bernoulli(ks[3], 0.8, (L, L))
        bias = jax.random.normal(ks[4], (B, 1, L, L))
        def loss(q, k, v, bias, causal, **kw):
            out = mw.attention(q, k, v, mask=mask, bias=bias, causal=causal,
                               chunk_size=(2, 5), **kw)
            return jnp.sum(jnp.sin(out))
        # one device's value and gradients, compiled once for both splits (eager, each
        # call compiled the loops again)
        refs = {causal: jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)), static_argnums=4)(
                    q, k, v, bias, causal) for causal in (False, True)}
        for shard_dim in (-2, 1):          # queries split; heads split
            for causal in (False, True):
                sharded = lambda *a: loss(*a, causal, mesh=mesh, axis_name="d",
                                          shard_dim=shard_dim)
                ref_value, ref_grads = refs[causal]
                # value and gradients in one compiled program
                value, grads = jax.jit(jax.value_and_grad(sharded, (0, 1, 2, 3)))(
                    q, k, v, bias)
                np.testing.assert_allclose(value, ref_value, rtol=1e-5)
                for a, b in zip(grads, ref_grads):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        # detected from a concrete q with a NamedSharding over its heads
        qs = jax.device_put(q, NamedSharding(mesh, P(None, "d")))
        np.testing.assert_allclose(mw.attention(qs, k, v, causal=True, chunk_size=4),
                                   mw.attention(q, k, v, causal=True, chunk_size=4),
                                   rtol=1e-5, atol=1e-6)
        # per-device memory of the gradient
        s = jax.ShapeDtypeStruct((1, 4, 4096, 64), jnp.float32)
        def grad_mem(**kw):
            f = lambda q, k, v: jnp.sum(mw.attention(q, k, v, causal=True,
                                                     chunk_size=(256, 256), **kw) ** 2)
            return compiled_memory(f, s, s, s, grad=True, argnums=(0, 1, 2))
        one = grad_mem()
        heads = grad_mem(mesh=mesh, axis_name="d", shard_dim=1)
        rows = grad_mem(mesh=mesh, axis_name="d")
        print("one", one, "heads", heads, "rows", rows)
        assert heads.argument_bytes * 4 == one.argument_bytes, (one, heads)
        assert heads.peak_bytes < 0.35 * one.peak_bytes, (one, heads)
        # queries split: q, the output and dq shrink 4x; k, v and their gradients do not
        assert rows.peak_bytes < one.peak_bytes, (one, rows)
        print("OK")
        """
    )
    assert "OK" in out


@pytest.mark.slow
def test_ring_carries_masks_and_biases_on_4_devices():
    # mask and bias split like the queries, read at the columns of the block each ring
    # step holds; the bias's gradient written there. Ragged tiles inside a block (3 keys
    # per device, tiles of 2), masks and biases broadcast over rows, heads and batch.
    # The grid: every (mask, bias) pair once, causal alternating (each pair of the three
    # options meets, masks x biases, masks x causal, biases x causal, in 12 of the 24
    # compilations of the full product); a stratified half of it runs, every mask, bias
    # and causal setting among it (tests/_grid.py; MEMWISE_TEST_GRID=full runs all 12).
    masks, biases = ["full", "keys", "shared", None], ["full", "keys", None]
    cases = _grid.sample_product(
        "test_attention::ring_masks_and_biases",
        0.5,
        where=lambda c: (
            c["causal"] == ((masks.index(c["mask"]) + biases.index(c["bias"])) % 2 == 1)
        ),
        mask=masks,
        bias=biases,
        causal=[False, True],
    )
    out = run_on_devices(
        f"""
        CASES = {cases!r}
        """
        + """
        import jax, jax.numpy as jnp, numpy as np
        import memwise as mw
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        ks = jax.random.split(jax.random.PRNGKey(0), 8)
        B, H, L = 2, 3, 12
        q = jax.random.normal(ks[0], (B, H, L, 8))
        k = jax.random.normal(ks[1], (B, H, L, 8))
        v = jax.random.normal(ks[2], (B, H, L, 5))
        masks = {
            "full": jax.random.bernoulli(ks[3], 0.7, (B, H, L, L)),
            "keys": jnp.arange(L)[None, None, None, :] < jnp.array([9, 12])[:, None, None, None],
            "shared": jax.random.bernoulli(ks[4], 0.8, (L, L)),
            None: None,
        }
        biases = {
            "full": jax.random.normal(ks[5], (B, 1, L, L)),
            "keys": jax.random.normal(ks[6], (1, H, 1, L)),
            None: None,
        }
        for case in CASES:
            mname, bname, causal = case["mask"], case["bias"], case["causal"]
            mask, bias = masks[mname], biases[bname]
            def loss(q, k, v, bias, **kw):
                out = mw.attention(q, k, v, mask=mask, bias=bias, causal=causal,
                                   chunk_size=(2, 2), **kw)
                return jnp.sum(jnp.sin(out))
            ringed = lambda *a: loss(*a, mesh=mesh, axis_name="d", ring=True)
            where = (mname, bname, causal)
            args = (q, k, v, bias)
            n = 4 if bias is not None else 3
            # compiled once: run and read (an eager reference compiled per op)
            step = jax.jit(jax.value_and_grad(ringed, tuple(range(n))))
            step = step.lower(*args).compile()
            value, grads = step(*args)
            ref = jax.jit(jax.value_and_grad(loss, tuple(range(n))))
            ref_value, ref_grads = ref(*args)
            np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=str(where))
            for a, b in zip(grads, ref_grads):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5,
                                           err_msg=str(where))
            hlo = step.as_text()
            assert "collective-permute(" in hlo, where
            gathers = [l for l in hlo.splitlines() if "all-gather(" in l]
            assert not gathers, (where, gathers[:2])
        # forward-over-reverse: a ring block a row does not see (causal, masked) gave
        # NaN through the blocks' merge (both Hessians compiled: eager, each operation
        # of the ring's loops compiled alone)
        s = jnp.asarray(0.5)
        for kw in (dict(causal=True), dict(mask=masks["full"], causal=True)):
            f = lambda s, **extra: jnp.sum(jnp.sin(
                mw.attention(q, k, v, scale=s, chunk_size=(2, 2), **kw, **extra)))
            ring_h = jax.jit(jax.hessian(lambda s: f(s, mesh=mesh, axis_name="d",
                                                     ring=True)))(s)
            np.testing.assert_allclose(ring_h, jax.jit(jax.hessian(f))(s), rtol=1e-4,
                                       err_msg=str(kw))
        print("OK")
        """,
        timeout=30 * len(cases) + 300,  # the full grid is 12 cases
    )
    assert "OK" in out


def _striped_inputs():
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q = _draw.normal(ks[0], (2, 3, 12, 8))
    k = _draw.normal(ks[1], (2, 3, 12, 8))
    v = _draw.normal(ks[2], (2, 3, 12, 5))
    mask = _draw.bernoulli(ks[3], 0.8, (12, 12))
    bias = _draw.normal(ks[4], (1, 3, 12, 12))
    return q, k, v, mask, bias


@pytest.mark.grid
@pytest.mark.parametrize("stripes", [1, 3, 4, 12])
@pytest.mark.parametrize("causal", [False, True])
def test_striped_order_gives_the_unstriped_result(stripes, causal):
    q, k, v, mask, bias = _striped_inputs()

    def both_axes(a):
        return mw.stripe(mw.stripe(a, stripes, axis=-1), stripes, axis=-2)

    def plain(q, k, v, bias):
        out = mw.attention(q, k, v, mask=mask, bias=bias, causal=causal, chunk_size=(2, 5))
        return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-2])[:, None])

    def striped(q, k, v, bias):
        out = mw.attention(
            *(mw.stripe(a, stripes) for a in (q, k, v)),
            mask=both_axes(mask),
            bias=both_axes(bias),
            causal=causal,
            chunk_size=(2, 5),
            stripes=stripes,
        )
        out = mw.unstripe(out, stripes)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-2])[:, None])

    # compiled (eager, each operation of the tile loops was compiled alone)
    value, grads = jax.jit(jax.value_and_grad(striped, (0, 1, 2, 3)))(q, k, v, bias)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(plain, (0, 1, 2, 3)))(q, k, v, bias)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    x = jnp.arange(24.0).reshape(2, 12)
    assert (mw.unstripe(mw.stripe(x, stripes, axis=1), stripes, axis=1) == x).all()


def test_stripes_bad_input_names_the_argument():
    q = jnp.ones((2, 12, 4))
    with pytest.raises(ValueError, match="stripes=5 needs q and k of one length divisible"):
        mw.attention(q, q, q, causal=True, stripes=5)
    with pytest.raises(ValueError, match="Lq=12, Lk=6"):
        mw.attention(q, q[:, :6], q[:, :6], stripes=2)
    with pytest.raises(TypeError, match="stripes must be a positive int"):
        mw.attention(q, q, q, stripes=2.0)
    with pytest.raises(ValueError, match="stripe: axis 1 of x has length 12, not divisible by"):
        mw.stripe(q, 5, axis=1)
    with pytest.raises(ValueError, match="unstripe: axis=3 is not an axis"):
        mw.unstripe(q, 2, axis=3)
    with pytest.raises(TypeError, match="stripe: stripes must be a positive int"):
        mw.stripe(q, True)
    with pytest.raises(ValueError, match="stripes must be a positive int.*got 0"):
        mw.attention(q, q, q, stripes=0)
    # an axis a mask broadcasts over (length 1) is left as it is; the keys are permuted
    key_padding = jnp.arange(12)[None, None, None, :] < jnp.array([5, 12])[:, None, None, None]
    np.testing.assert_array_equal(mw.stripe(key_padding, 4, axis=-2), key_padding)
    order = mw.stripe(jnp.arange(12)[:, None], 4)[:, 0]
    np.testing.assert_array_equal(mw.stripe(key_padding, 4, axis=-1), key_padding[..., order])


def _visible_tiles(length, devices, tile, striped):
    """Tiles a causal ring runs, per (device, step): the engine's skip rule (a tile runs
    when its first key position is at most its last query position) on the positions
    :func:`mw.attention` compares."""
    from memwise._attention_tiles import unstriped_position

    n = length // devices
    counts = np.zeros((devices, devices), int)
    local = np.arange(n)
    for d in range(devices):
        for step in range(devices):
            source = (d - step) % devices
            q_pos, k_pos = local + d * n, local + source * n
            if striped:
                q_pos = np.asarray(unstriped_position(q_pos, devices, length))
                k_pos = np.asarray(unstriped_position(k_pos, devices, length))
            counts[d, step] = sum(
                k_pos[c : c + tile].min() <= q_pos[r : r + tile].max()
                for r in range(0, n, tile)
                for c in range(0, n, tile)
            )
    return counts


def test_striped_causal_ring_balances_the_work_at_every_step():
    # L = 65,536 on 8 devices, 512-token tiles: the causal ring's visible tiles per device
    # per step, max over devices / mean
    contiguous = _visible_tiles(65_536, 8, 512, striped=False)
    striped = _visible_tiles(65_536, 8, 512, striped=True)
    assert (contiguous.max(0) / contiguous.mean(0)).max() == 8.0  # the last step: one busy
    assert (striped.max(0) / striped.mean(0)).max() <= 1.1
    # the ring's critical path (the busiest device at each step): 1.77x shorter
    assert contiguous.max(0).sum() / striped.max(0).sum() > 1.7


def test_striped_ring_matches_one_device_on_4_devices():
    out = run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        import memwise as mw
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        ks = jax.random.split(jax.random.PRNGKey(3), 5)
        q = jax.random.normal(ks[0], (2, 3, 16, 8))
        k = jax.random.normal(ks[1], (2, 3, 16, 8))
        v = jax.random.normal(ks[2], (2, 3, 16, 5))
        mask = jax.random.bernoulli(ks[3], 0.8, (16, 16))
        both = lambda a: mw.stripe(mw.stripe(a, 4, axis=-1), 4, axis=-2)
        def plain(q, k, v):
            out = mw.attention(q, k, v, mask=mask, causal=True, chunk_size=(2, 3))
            return jnp.sum(jnp.sin(out) * jnp.arange(16)[:, None])
        def striped(q, k, v):
            out = mw.attention(*(mw.stripe(a, 4) for a in (q, k, v)), mask=both(mask),
                               causal=True, chunk_size=(2, 3), stripes=4, mesh=mesh,
                               axis_name="d", ring=True)
            return jnp.sum(jnp.sin(mw.unstripe(out, 4)) * jnp.arange(16)[:, None])
        # each compiled once: the ring run and read, the reference run
        step = jax.jit(jax.value_and_grad(striped, (0, 1, 2))).lower(q, k, v).compile()
        value, grads = step(q, k, v)
        ref_value, ref_grads = jax.jit(jax.value_and_grad(plain, (0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        for a, b in zip(grads, ref_grads):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        assert "collective-permute(" in step.as_text()
        print("OK")
        """
    )
    assert "OK" in out


# --------------------------------------------------------------------------------------
# Masks and biases from their broadcast shapes, low precision, empty inputs, traced scale


def test_float_mask_is_rejected():
    q = jnp.ones((2, 5, 4))
    additive = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), 0.0, -jnp.inf)
    with pytest.raises(TypeError, match=r"mask must be a boolean.*bias="):
        mw.attention(q, q, q, mask=additive)
    with pytest.raises(TypeError, match="mask must be a boolean"):
        mw.attention(q, q, q, mask=jnp.ones((5, 5), jnp.int32))
    with pytest.raises(TypeError, match="mask="):
        mw.attention(q, q, q, bias=jnp.ones((5, 5), bool))
    # a complex bias was cast to its real part with only JAX's warning
    with pytest.raises(TypeError, match=r"bias must be a real array.*complex64.*jnp.real"):
        mw.attention(q, q, q, bias=jnp.ones((5, 5), jnp.complex64))
    # the additive mask works as a bias
    np.testing.assert_allclose(
        mw.attention(q, q, q, bias=additive, chunk_size=2),
        mw.attention(q, q, q, causal=True, chunk_size=2),
        rtol=1e-12,
    )


B, H, LQ, LK = 2, 3, 7, 9


@pytest.mark.parametrize(
    "mask_shape, bias_shape",
    [
        ((B, 1, 1, LK), (LQ, LK)),  # key padding; one bias for every head
        ((LQ, LK), (B, 1, LQ, LK)),  # shared mask; a bias per batch element
        ((1, H, LQ, 1), (1, H, 1, LK)),  # per-head query mask; per-head key bias
        ((B, H, LQ, LK), (H, 1, 1)),  # full mask; a scalar bias per head
    ],
)
@pytest.mark.slow
def test_mask_and_bias_broadcast_shapes_match_dense(mask_shape, bias_shape):
    keys = jax.random.split(jax.random.PRNGKey(11), 5)
    q = _draw.normal(keys[0], (B, H, LQ, 4))
    k = _draw.normal(keys[1], (B, H, LK, 4))
    v = _draw.normal(keys[2], (B, H, LK, 3))
    mask = _draw.bernoulli(keys[3], 0.7, mask_shape)
    bias = _draw.normal(keys[4], bias_shape)

    def loss(f):
        return lambda q, k, v, bias: jnp.sum(jnp.sin(f(q, k, v, bias)))

    ours = lambda q, k, v, bias: mw.attention(
        q,
        k,
        v,
        mask=mask,
        bias=bias,  # noqa: E731
        chunk_size=(3, 4),
    )
    dense = lambda q, k, v, bias: dense_attention(q, k, v, mask, bias)  # noqa: E731
    both = lambda f: jax.jit(jax.value_and_grad(loss(f), (0, 1, 2, 3)))  # noqa: E731
    (val, grads), (val_d, grads_d) = both(ours)(q, k, v, bias), both(dense)(q, k, v, bias)
    np.testing.assert_allclose(val, val_d, rtol=1e-10)
    assert grads[3].shape == bias_shape
    for a, b in zip(grads, grads_d):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.slow
def test_shared_masks_and_biases_add_at_most_their_own_size():
    # B=2, H=8, L=1024, gradient temp without a mask: 22.3 MiB before, 19.6 now. Before,
    # a (B,1,1,L) mask was expanded to (B*H, L, L) bools (40.3 MiB), and an (L,L) or a
    # (B,1,L,L) bias and its gradient to (B*H, L, L) floats (82.3, 150.3 MiB); now they
    # add at most their own size and their gradient's (19.6, 19.6, 24.6 MiB).
    b, h, length, d = 2, 8, 1024, 64
    s = jax.ShapeDtypeStruct((b, h, length, d), jnp.float32)

    def grad_temp(mask=None, bias=None):
        def loss(q, k, v, *extra):
            m = extra[0] if mask is not None else None
            bi = extra[-1] if bias is not None else None
            return jnp.sum(mw.attention(q, k, v, mask=m, bias=bi) ** 2)

        extra = [a for a in (mask, bias) if a is not None]
        argnums = (0, 1, 2) + ((3 + len(extra) - 1,) if bias is not None else ())
        return compiled_memory(loss, s, s, s, *extra, grad=True, argnums=argnums).temp_bytes

    none = grad_temp()
    for mask, bias in [
        (jax.ShapeDtypeStruct((b, 1, 1, length), bool), None),
        (None, jax.ShapeDtypeStruct((length, length), jnp.float32)),
        (None, jax.ShapeDtypeStruct((b, 1, length, length), jnp.float32)),
    ]:
        own = sum(a.size * a.dtype.itemsize for a in (mask, bias) if a is not None)
        grad_own = 0 if bias is None else bias.size * bias.dtype.itemsize
        temp = grad_temp(mask, bias)
        slack = 16 * 2**10  # buffer alignment and a few index vectors
        assert temp <= none + own + grad_own + slack, (mask, bias, temp / 2**20, none / 2**20)


def _errors(out, grads, ref, ref_grads):
    return [
        float(jnp.max(jnp.abs(a.astype(jnp.float64) - b)))
        for a, b in zip((out, *grads), (ref, *ref_grads))
    ]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.slow
def test_low_precision_error_no_worse_than_jax_nn(dtype, causal):
    # Inputs and cotangent exactly representable in dtype, so the float64 reference is
    # the exact answer to the same problem: the errors are the computation's own.
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (2, 4, 128, 32)
    q, k, v, ct = (_draw.normal(kk, shape).astype(dtype) for kk in keys)
    q = q * 2  # sharper softmax (exact: a power of two)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (jax.nn takes (B, L, H, d))
    fns = {
        "memwise": lambda q, k, v: mw.attention(q, k, v, causal=causal, chunk_size=(32, 32)),
        "jax.nn": lambda q, k, v: t(
            jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal)
        ),
    }
    ct64 = ct.astype(jnp.float64)

    def value_and_grads(f, *args, compiled=True):
        def run(*args):
            out, vjp = jax.vjp(f, *args)
            return out, vjp(ct64.astype(out.dtype))

        # one program (eager, each operation was compiled alone); jax.nn's stays eager:
        # its float16 einsum (an F16_F16_F32 dot) does not compile on XLA:CPU inside a
        # larger program
        return (jax.jit(run) if compiled else run)(*args)

    ref, ref_grads = value_and_grads(
        lambda q, k, v: dense_attention(q, k, v, causal=causal),
        *(a.astype(jnp.float64) for a in (q, k, v)),
    )
    errors = {
        name: _errors(*value_and_grads(f, q, k, v, compiled=name == "memwise"), ref, ref_grads)
        for name, f in fns.items()
    }
    # output, dq, dk, dv: before, memwise's were 2.5x (output) to 6x (gradients) jax.nn's
    for ours, theirs in zip(errors["memwise"], errors["jax.nn"]):
        assert ours <= 1.2 * theirs, errors


def test_empty_queries_or_keys_return_the_dense_result():
    q = jnp.ones((2, 5, 4))
    for lq, lk in [(0, 5), (5, 0), (0, 0)]:
        qe, ke = jnp.ones((2, lq, 4)), jnp.ones((2, lk, 4))
        ve = jnp.ones((2, lk, 3))
        out = mw.attention(
            qe, ke, ve, mask=jnp.ones((lq, lk), bool), bias=jnp.zeros((lq, lk)), chunk_size=4
        )
        assert out.shape == (2, lq, 3)
        np.testing.assert_array_equal(out, 0.0)  # a query that sees no key: zeros
        grads = jax.grad(lambda q, k, v: jnp.sum(mw.attention(q, k, v) ** 2), (0, 1, 2))(qe, ke, ve)
        assert [g.shape for g in grads] == [qe.shape, ke.shape, ve.shape]
        assert all(not jnp.any(g) for g in grads)
    with pytest.raises(ValueError, match="chunk_size"):
        mw.attention(jnp.ones((2, 0, 4)), q, q, chunk_size=0)
    # An empty batch (or head) dim: an empty output and empty gradients, as dense.
    for shape in [(0, 5, 4), (0, 2, 5, 4), (3, 0, 5, 4)]:
        qe = jnp.ones(shape)
        out = mw.attention(qe, qe, qe, causal=True, mask=jnp.ones((5, 5), bool))
        assert out.shape == shape
        grads = jax.grad(lambda q: jnp.sum(mw.attention(q, q, q) ** 2))(qe)
        assert grads.shape == shape


@pytest.mark.slow
def test_traced_scale_gets_a_gradient():
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (_draw.normal(kk, (2, 6, 4)) for kk in keys)

    def ours(q, k, v, temperature):
        return jnp.sum(
            jnp.sin(mw.attention(q, k, v, scale=1.0 / temperature, causal=True, chunk_size=(4, 3)))
        )

    def dense(q, k, v, temperature):
        s = jnp.einsum("...qd,...kd->...qk", q, k) / temperature
        s = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), s, -jnp.inf)
        return jnp.sum(jnp.sin(jax.nn.softmax(s, -1) @ v))

    temperature = jnp.asarray(0.7)
    # each compiled once, values and gradients together
    (value, grads), (ref, ref_grads) = (
        jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(q, k, v, temperature) for f in (ours, dense)
    )
    np.testing.assert_allclose(value, ref, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    with pytest.raises(TypeError, match="scale must be a real scalar"):
        mw.attention(q, k, v, scale=jnp.ones(2))


@pytest.mark.slow
def test_under_checkpoint():
    # Under jax.checkpoint a constant scale reaches the engine as a typed Python float
    # (no .astype); the backward then promoted it and raised AttributeError.
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    q, k, v = (_draw.normal(kk, (2, 8, 4)) for kk in keys)

    def loss(q, k, v):
        return jnp.sum(mw.attention(q, k, v, causal=True, chunk_size=4) ** 2)

    # (compiled: eager, each operation of the tile loops was compiled alone)
    for a, b in zip(
        jax.jit(jax.grad(jax.checkpoint(loss), (0, 1, 2)))(q, k, v),
        jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-12)


# One encoding of visibility: the pairs a tile keeps, the tiles the
# engine skips (live), the engine's band and the TPU kernel's splash mask are derived
# from one Visibility, and each must agree with jax.nn's definition.
_VISIBILITIES = [
    (False, None),
    (True, None),
    (False, (3, 2)),
    (False, (0, 0)),
    (False, (4, 0)),
    (False, (0, 5)),
    (True, (4, 1)),
    (True, (2, 7)),
    (True, (0, 0)),
]


def _visible(causal, window, lq, lk, q_pos=None, k_pos=None):
    """jax.nn's definition: query i sees key j if j <= i (causal), i - left <= j <= i +
    right (window)."""
    i = (np.arange(lq) if q_pos is None else q_pos)[:, None]
    j = (np.arange(lk) if k_pos is None else k_pos)[None, :]
    keep = np.ones((lq, lk), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    return keep


@pytest.mark.parametrize("causal, window", _VISIBILITIES)
def test_every_form_of_a_visibility_agrees(causal, window):
    from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: F401

    from memwise._attention_tiles import Visibility
    from memwise.engine.tpu_attention import _mask

    vis = Visibility(causal, window)
    lq, lk = 13, 11
    want = _visible(causal, window, lq, lk)
    pairs = vis.pair_mask(jnp.arange(lq)[:, None], jnp.arange(lk)[None, :])
    got = np.ones((lq, lk), bool) if pairs is None else np.broadcast_to(pairs, (lq, lk))
    np.testing.assert_array_equal(got, want)
    assert vis.by_position == (causal or window is not None) == (not want.all())
    # The kernel's mask (splash's mask object, as its block tables read it).
    np.testing.assert_array_equal(_mask(lq, lk, vis.offsets)[:, :], want)
    # The band: exactly the pairs with lo <= j - i <= hi, where both ends are bounded.
    offset = np.arange(lk)[None, :] - np.arange(lq)[:, None]
    if vis.band is not None:
        lo, hi = vis.band
        np.testing.assert_array_equal((offset >= lo) & (offset <= hi), want)
    else:
        assert window is None
    # The tiles live: exactly those holding a visible pair, on several grids.
    for rows, cols in ((1, 1), (2, 3), (4, 4), (5, 2), (13, 11)):
        firsts = [(r, c) for r in range(0, lq, rows) for c in range(0, lk, cols)]
        first_q, first_k = (np.array(a) for a in zip(*firsts))
        last_q, last_k = np.minimum(first_q + rows, lq) - 1, np.minimum(first_k + cols, lk) - 1
        live = np.broadcast_to(vis.tile_may_see(first_q, last_q, first_k, last_k), first_q.shape)
        held = [want[r : r + rows, c : c + cols].any() for r, c in firsts]
        np.testing.assert_array_equal(live, held, err_msg=f"tiles {rows} x {cols}")


@pytest.mark.parametrize("causal, window", _VISIBILITIES[1:4] + _VISIBILITIES[6:8])
@pytest.mark.parametrize("extra", ["none", "segments", "lengths", "stripes", "mask"])
def test_the_tiles_skipped_hold_no_visible_pair(causal, window, extra):
    # The engine's live predicate against the scores of each tile: a tile it skips has
    # no finite score for any problem of the batch, and with positions contiguous in a
    # tile and no mask (which it does not read) it skips every tile that has none.
    from memwise._attention_tiles import (
        Visibility,
        _live_predicate,
        _tile_function,
        _tile_operands,
    )

    B, L, H, tile = 2, 12, 4, 3
    x = _draw.normal(jax.random.key(0), (B, L, H))
    ids = jnp.array([[0] * 5 + [1] * 7, [0] * 3 + [1] * 3 + [2] * 6], jnp.int32)
    lengths = jnp.array([7, 10])
    keep = jnp.arange(L)[None] < lengths[:, None]
    stripes = (3, L, L) if extra == "stripes" else None
    kw = dict(
        mask=_draw.bernoulli(jax.random.key(1), 0.3, (B, L, L)) if extra == "mask" else None,
        bias=None,
        q_segments=ids if extra == "segments" else None,
        kv_segments=ids if extra == "segments" else None,
        q_keep=keep if extra == "lengths" else None,
        kv_keep=keep if extra == "lengths" else None,
        live_segments=(ids, ids) if extra == "segments" else None,
        live_lengths=(jnp.max(lengths), jnp.max(lengths)) if extra == "lengths" else (None, None),
        dropout=None,
        row_offset=None,
    )
    rows, cols, pairs, consts = _tile_operands(x, x, x, scale=jnp.asarray(1.0), **kw)
    vis = Visibility(causal, window)
    tile_fn, live = _tile_function(vis, None, stripes), _live_predicate(vis, stripes)
    for r0 in range(0, L, tile):
        for c0 in range(0, L, tile):
            row_ids, col_ids = jnp.arange(r0, r0 + tile), jnp.arange(c0, c0 + tile)
            seen = False
            for b in range(B):
                r = {n: a[b, r0 : r0 + tile] for n, a in rows.items()}
                c = {n: a[b, c0 : c0 + tile] for n, a in cols.items()}
                p = {n: a[b, r0 : r0 + tile, c0 : c0 + tile] for n, a in pairs.items()}
                scores = tile_fn(r, c, p, consts, row_ids, col_ids)[0]
                seen |= bool(jnp.isfinite(scores).any())
            if extra in ("mask", "stripes"):  # live reads no mask; striped positions
                # are not contiguous in a tile, so it tests their range
                assert seen <= bool(live(row_ids, col_ids, consts)), (r0, c0)
            else:
                assert seen == bool(live(row_ids, col_ids, consts)), (r0, c0)
