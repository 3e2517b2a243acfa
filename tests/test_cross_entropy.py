"""Tests for memwise.cross_entropy: linear_cross_entropy against optax on dense logits
across the option grid (values and gradients of x, w, bias), half precision against
float64, ignored tokens and out-of-range labels, the extra outputs, the backward's
matrix products in the compiled program, and the gradient's memory at two sizes."""

import re

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import ON_CPU, assert_close
from _multidevice import run_on_devices

import memwise as mw
from memwise.cross_entropy import _pair_bytes
from memwise.measure import compile_measured, compiled_memory
from memwise.tiling import tiling

T, D, V = 13, 8, 37  # V = 37 is ragged for every column tile used here
TILE = (4, 8)


def _data(dtype=jnp.float32, seed=0, tokens=T, vocab=V):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = _draw.normal(k[0], (tokens, D), jnp.float32).astype(dtype)
    w = (_draw.normal(k[1], (D, vocab), jnp.float32) * 0.7).astype(dtype)
    b = _draw.normal(k[2], (vocab,), jnp.float32).astype(dtype)
    y = jax.random.randint(k[3], (tokens,), 0, vocab)
    return x, w, b, y


def dense_loss(x, w, b, y, *, ignore_index=None, smoothing=0.0, z=0.0, cap=None, reduction="mean"):
    """The loss the way users write it today: optax on the full logits."""
    logits = x @ w + (0.0 if b is None else b)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    valid = jnp.ones(y.shape, bool) if ignore_index is None else y != ignore_index
    safe = jnp.where(valid, y, 0)
    if smoothing:
        targets = optax.smooth_labels(
            jax.nn.one_hot(safe, w.shape[1], dtype=logits.dtype), smoothing
        )
        loss = optax.softmax_cross_entropy(logits, targets)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    if z:
        loss = loss + z * jax.nn.logsumexp(logits, -1) ** 2
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / jnp.maximum(jnp.sum(valid), 1)


# A covering set of the option grid: every option on and off, each with others.
GRID = [
    dict(),
    dict(bias=True),
    dict(layout="vd", bias=True),
    dict(ignore_index=-100, reduction="sum"),
    dict(ignore_index=-100, smoothing=0.1, bias=True),
    dict(smoothing=0.2, layout="vd", reduction="none"),
    dict(z=1e-2, bias=True, reduction="none"),
    dict(cap=3.0, bias=True),
    dict(cap=2.0, smoothing=0.1, layout="vd", bias=True),
    dict(cap=5.0, z=1e-3, ignore_index=-100, smoothing=0.3, reduction="sum", bias=True),
]


@pytest.mark.parametrize(
    "opts", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain"
)
def test_matches_optax_values_and_gradients(opts):
    opts = dict(opts)
    layout = opts.pop("layout", "dv")
    use_bias = opts.pop("bias", False)
    x, w, b, y = _data()
    if "ignore_index" in opts:
        y = y.at[jnp.array([0, 5, 6])].set(opts["ignore_index"])
    reduction = opts.get("reduction", "mean")

    def ours(x, w, b):
        return mw.linear_cross_entropy(
            x,
            w.T if layout == "vd" else w,
            y,
            bias=b if use_bias else None,
            layout=layout,
            ignore_index=opts.get("ignore_index"),
            label_smoothing=opts.get("smoothing", 0.0),
            z_loss=opts.get("z", 0.0),
            logit_soft_cap=opts.get("cap"),
            reduction=reduction,
            chunk_size=TILE,
        )

    def dense(x, w, b):
        return dense_loss(x, w, b if use_bias else None, y, **opts)

    def scalar(fn):  # per-token losses get a cotangent that differs per token
        return lambda *a: jnp.sum(
            fn(*a) * (jnp.linspace(0.5, 1.5, T) if reduction == "none" else 1)
        )

    def everything(fn):  # the loss, its value and gradients: one compiled program
        return jax.jit(lambda *a: (fn(*a), jax.value_and_grad(scalar(fn), (0, 1, 2))(*a)))

    loss, (got, got_g) = everything(ours)(x, w, b)
    want_loss, (want, want_g) = everything(dense)(x, w, b)
    assert_close(loss, want_loss, 1e-6, "loss")
    assert_close(got, want, 1e-6, "value")
    names = ("x", "w", "bias") if use_bias else ("x", "w")
    for name, g, e in zip(names, got_g, want_g):
        assert g.dtype == e.dtype
        assert_close(g, e, 1e-6, f"gradient of {name}")
    if not use_bias:
        assert not np.any(np.asarray(got_g[2]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_no_worse_than_dense(dtype):
    x, w, b, y = _data(dtype, seed=1)

    def ours(x, w, b):
        return mw.linear_cross_entropy(x, w, y, bias=b, reduction="none", chunk_size=TILE)

    def dense(x, w, b):
        return dense_loss(x, w, b, y, reduction="none")

    def loss(fn):
        # Per-token weights exact in every dtype: the cotangents are the same for all.
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * (0.5 + 0.25 * (jnp.arange(T) % 4)))

    def everything(fn):  # values and gradients, one compiled program (eager, each
        # operation of the tile loops was compiled alone)
        return jax.jit(lambda *a: (fn(*a), jax.grad(loss(fn), (0, 1, 2))(*a)))

    with jax.enable_x64(True):
        ref_args = [a.astype(jnp.float64) for a in (x, w, b)]
        ref, ref_g = everything(dense)(*ref_args)

        def err(a, e):
            return float(jnp.max(jnp.abs(a.astype(jnp.float64) - e)) / jnp.max(jnp.abs(e)))

        (got, got_g), (want, want_g) = everything(ours)(x, w, b), everything(dense)(x, w, b)
        assert got.dtype == dtype
        assert err(got, ref) <= max(err(want, ref), 2**-8)
        for g, h, e in zip(got_g, want_g, ref_g):
            assert g.dtype == dtype
            assert err(g, e) <= max(err(h, e), 2**-8)


def test_where_mask_and_leading_dims():
    x, w, b, y = _data()
    x3, y3 = x[:12].reshape(3, 4, D), y[:12].reshape(3, 4)
    mask = jnp.arange(12).reshape(3, 4) % 3 != 0
    got = mw.linear_cross_entropy(x3, w, y3, bias=b, where=mask, reduction="none", chunk_size=TILE)
    per_token = dense_loss(x[:12], w, b, y[:12], reduction="none").reshape(3, 4)
    assert got.shape == (3, 4)
    assert_close(got, jnp.where(mask, per_token, 0.0), 1e-6, "per-token")
    mean = mw.linear_cross_entropy(x3, w, y3, bias=b, where=mask, chunk_size=TILE)
    assert_close(mean, jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask), 1e-6, "mean")


def test_every_token_ignored_gives_zero_loss_and_gradients():
    x, w, _, y = _data()
    y = jnp.full_like(y, -1)
    loss, grads = jax.value_and_grad(
        lambda x, w: mw.linear_cross_entropy(x, w, y, ignore_index=-1, chunk_size=TILE), (0, 1)
    )(x, w)
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in grads)


def test_out_of_range_labels_raise_eagerly_and_are_nan_under_jit():
    x, w, _, y = _data()
    bad = y.at[3].set(V)
    with pytest.raises(ValueError, match="labels must be in"):
        mw.linear_cross_entropy(x, w, bad, chunk_size=TILE)
    with pytest.raises(ValueError, match="labels must be in"):
        mw.linear_cross_entropy(x, w, bad.at[3].set(-5), ignore_index=-100, chunk_size=TILE)
    per_token = jax.jit(
        lambda y: mw.linear_cross_entropy(x, w, y, reduction="none", chunk_size=TILE)
    )(bad)
    assert np.isnan(per_token[3]) and np.all(np.isfinite(np.delete(np.asarray(per_token), 3)))
    assert np.isnan(jax.jit(lambda y: mw.linear_cross_entropy(x, w, y, chunk_size=TILE))(bad))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16])
def test_unsigned_labels_meet_ignore_index_and_the_vocabulary_exactly(dtype):
    # In uint8 -100 is 156 (in uint16 65436) and 300 is 44: neither ignore_index nor V
    # may be converted to the labels' dtype before comparing.
    x, w, b, _ = _data(tokens=6, vocab=300)
    labels = jnp.array([1, 156, 3, 250, 44, 255], dtype)
    got = mw.linear_cross_entropy(
        x, w, labels, bias=b, ignore_index=-100, reduction="none", chunk_size=TILE
    )
    ref = optax.softmax_cross_entropy_with_integer_labels(x @ w + b, labels.astype(jnp.int32))
    assert_close(got, ref, 1e-6, "per-token")
    x, w, _, y = _data()
    wrapped = y.astype(dtype).at[3].set(jnp.iinfo(dtype).max - 99)  # -100 wrapped, >= V
    with pytest.raises(ValueError, match="labels must be in"):
        mw.linear_cross_entropy(x, w, wrapped, ignore_index=-100, chunk_size=TILE)


def test_concrete_labels_and_where_closed_over_under_jit():
    x, w, b, y = _data()
    where = jnp.arange(T) % 4 != 0
    got = jax.jit(lambda x: mw.linear_cross_entropy(x, w, y, where=where, chunk_size=TILE))(x)
    per_token = dense_loss(x, w, None, y, reduction="none")
    assert_close(got, jnp.sum(jnp.where(where, per_token, 0.0)) / jnp.sum(where), 1e-6, "mean")
    bad = y.at[3].set(V)  # concrete, counted by where: still checked under jit
    with pytest.raises(ValueError, match="labels must be in"):
        jax.jit(lambda x: mw.linear_cross_entropy(x, w, bad, where=where, chunk_size=TILE))(x)


@pytest.mark.slow
def test_lse_and_argmax_outputs():
    x, w, b, y = _data()
    logits = x @ w + b
    loss, lse, arg = mw.linear_cross_entropy(
        x, w, y, bias=b, return_lse=True, return_argmax=True, chunk_size=TILE
    )
    assert_close(loss, dense_loss(x, w, b, y), 1e-6, "loss")
    assert_close(lse, jax.nn.logsumexp(logits, -1), 1e-6, "lse")
    assert arg.dtype == jnp.int32
    np.testing.assert_array_equal(arg, jnp.argmax(logits, -1))
    # lse is differentiable (e.g. a z-loss written by the user).
    g = jax.grad(
        lambda x: mw.linear_cross_entropy(x, w, y, bias=b, return_lse=True, chunk_size=TILE)[
            1
        ].sum()
    )(x)
    assert_close(g, jax.grad(lambda x: jax.nn.logsumexp(x @ w + b, -1).sum())(x), 1e-6, "d lse")


@pytest.mark.slow
def test_result_does_not_depend_on_chunk_size():
    x, w, b, y = _data()
    losses = [
        mw.linear_cross_entropy(
            x, w, y, bias=b, label_smoothing=0.1, reduction="none", chunk_size=c
        )
        for c in ((1, 1), (13, 37), (5, 16), "auto")
    ]
    for other in losses[1:]:
        assert_close(other, losses[0], 1e-6, "chunk_size")


@pytest.mark.skipif(not ON_CPU, reason="reads XLA:CPU's optimized HLO (a TPU fuses dots)")
@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_backward_is_one_matrix_product_each_for_dx_and_dw_per_tile(layout):
    """The compiled gradient holds four dots: the forward's scores, and in the backward
    the re-formed scores, dx and dW, each a whole-tile matrix product (no per-token
    loop)."""
    rows, cols, d, vocab = 64, 128, 32, 1000  # a ragged last vocabulary tile
    x = jax.ShapeDtypeStruct((256, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, vocab) if layout == "dv" else (vocab, d), jnp.float32)
    b = jax.ShapeDtypeStruct((vocab,), jnp.float32)
    y = jax.ShapeDtypeStruct((256,), jnp.int32)

    def f(x, w, b, y):
        return mw.linear_cross_entropy(x, w, y, bias=b, layout=layout, chunk_size=(rows, cols))

    hlo = jax.jit(jax.grad(f, (0, 1, 2))).lower(x, w, b, y).compile().as_text()
    dots = re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", hlo)
    shapes = sorted(tuple(int(s) for s in dot.split(",")) for dot in dots)
    back = rows // 2  # the backward tile's rows
    dw = (d, cols) if layout == "dv" else (cols, d)
    assert shapes == sorted([(rows, cols), (back, cols), (back, d), dw]), shapes


@pytest.mark.slow
def test_gradient_memory_is_one_tile_and_flat_in_vocabulary():
    """Temporaries of the gradient (beyond the outputs dx, dW) at two vocabulary sizes:
    the same, and under 2% of the dense logits."""
    tokens, d, tile = 2048, 64, (256, 512)

    def temp(vocab, layout):
        x = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
        w = jax.ShapeDtypeStruct((d, vocab) if layout == "dv" else (vocab, d), jnp.float32)
        y = jax.ShapeDtypeStruct((tokens,), jnp.int32)

        def f(x, w, y):
            return mw.linear_cross_entropy(x, w, y, layout=layout, chunk_size=tile)

        return compiled_memory(f, x, w, y, grad=True, argnums=(0, 1)).temp_bytes

    # 16,000 is ragged for the tile: no padded copy of w either.
    for layout in ("dv", "vd"):
        small, large = temp(16_000, layout), temp(32_768, layout)
        assert large <= small * 1.05 + 2**16, (layout, small, large)
        assert small <= 0.02 * tokens * 16_000 * 4, (layout, small)


@pytest.mark.slow
def test_half_precision_gradient_holds_no_float32_dw_accumulator():
    """In bfloat16 each vocabulary block's dW is complete after its pass over the tokens
    and stored in bfloat16 (the split backward): no float32 buffer the size of w is
    summed into. What is left at w's size is XLA:CPU's own float32 conversion of w for
    its products (a CPU artifact; one copy, where there were two)."""
    tokens, d = 2048, 64

    def temp(vocab):
        x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16)
        y = jax.ShapeDtypeStruct((tokens,), jnp.int32)

        def f(x, w, y):
            return mw.linear_cross_entropy(x, w, y, chunk_size=(256, 512))

        return compiled_memory(f, x, w, y, grad=True, argnums=(0, 1)).temp_bytes

    for vocab in (16_000, 32_768):  # ragged for the tile, and not
        assert temp(vocab) < 1.4 * d * vocab * 4, vocab


BAD = {
    "float labels": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y.astype(float)),
        TypeError,
        "labels",
    ),
    "int x": (lambda x, w, y: mw.linear_cross_entropy(y, w, y), TypeError, "x must"),
    "labels shape": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y[:-1]),
        ValueError,
        "labels must have shape",
    ),
    "d mismatch": (
        lambda x, w, y: mw.linear_cross_entropy(x[:, :-1], w, y),
        ValueError,
        "x's last dim",
    ),
    "layout hint": (lambda x, w, y: mw.linear_cross_entropy(x, w.T, y), ValueError, "layout='vd'"),
    "w 3-D": (
        lambda x, w, y: mw.linear_cross_entropy(x, w[None], y),
        ValueError,
        "w must be a 2-D",
    ),
    "bias shape": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, bias=jnp.ones(3)),
        ValueError,
        "bias must have shape",
    ),
    "reduction": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, reduction="avg"),
        ValueError,
        "reduction",
    ),
    "layout": (lambda x, w, y: mw.linear_cross_entropy(x, w, y, layout="VD"), ValueError, "layout"),
    "smoothing": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, label_smoothing=1.0),
        ValueError,
        "label_smoothing",
    ),
    "z_loss": (lambda x, w, y: mw.linear_cross_entropy(x, w, y, z_loss=-1.0), ValueError, "z_loss"),
    "cap": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, logit_soft_cap=0.0),
        ValueError,
        "logit_soft_cap",
    ),
    "x None": (lambda x, w, y: mw.linear_cross_entropy(None, w, y), TypeError, "x must be an"),
    "x str": (lambda x, w, y: mw.linear_cross_entropy("abc", w, y), TypeError, "x must be an"),
    "w None": (lambda x, w, y: mw.linear_cross_entropy(x, None, y), TypeError, "w must be an"),
    "labels None": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, None),
        TypeError,
        "labels must be an",
    ),
    "where dtype": (lambda x, w, y: mw.linear_cross_entropy(x, w, y, where=y), TypeError, "where"),
    "where shape": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, where=jnp.ones(3, bool)),
        ValueError,
        "where",
    ),
    "ignore_index": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, ignore_index=1.5),
        TypeError,
        "ignore_index",
    ),
    "chunk_size": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, chunk_size=0),
        ValueError,
        "chunk_size",
    ),
    # one bound in both messages (a negative cap said ">= 0", zero "> 0")
    "negative soft cap": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, logit_soft_cap=-1.0),
        ValueError,
        "logit_soft_cap must be a finite float > 0",
    ),
    # a tile's rows named as such (was the whole argument's message with [0] pasted in)
    "chunk_size rows": (
        lambda x, w, y: mw.linear_cross_entropy(x, w, y, chunk_size=(0, 3)),
        ValueError,
        "chunk_size's rows (chunk_size=(rows, cols)) must be a positive int, got 0",
    ),
}


_MESH = jax.make_mesh((1,), ("data",))
BAD["token_axis without mesh"] = (
    lambda x, w, y: mw.linear_cross_entropy(x, w, y, token_axis="data"),
    ValueError,
    "need mesh=",
)
BAD["mesh without axes"] = (
    lambda x, w, y: mw.linear_cross_entropy(x, w, y, mesh=_MESH),
    ValueError,
    "token_axis=",
)
BAD["unknown mesh axis"] = (
    lambda x, w, y: mw.linear_cross_entropy(x, w, y, mesh=_MESH, vocab_axis="model"),
    ValueError,
    "'model' is not an axis",
)
BAD["same axis"] = (
    lambda x, w, y: mw.linear_cross_entropy(
        x, w, y, mesh=_MESH, token_axis="data", vocab_axis="data"
    ),
    ValueError,
    "different axes",
)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_names_the_argument(name):
    call, error, words = BAD[name]
    x, w, _, y = _data()
    with pytest.raises(error) as info:
        call(x, w, y)
    assert words in str(info.value), str(info.value)
    assert "jax._src" not in str(info.value)


@pytest.mark.slow
def test_fit_chooses_the_tile_for_a_budget():
    x, w, _, y = _data(tokens=512, vocab=4096)

    def loss(x, w):
        return mw.linear_cross_entropy(x, w, y, chunk_size="auto")

    def fixed(x, w):
        return mw.linear_cross_entropy(x, w, y, chunk_size=(64, 128))

    # each gradient compiled once: measured, then run
    fixed_grad, fixed_memory = compile_measured(fixed, x, w, grad=True, argnums=(0, 1))
    budget = int(1.02 * fixed_memory.peak_bytes)
    fitted = mw.fit(loss, budget=budget, argnums=(0, 1), policies=False)
    fitted_grad, fitted_memory = compile_measured(fitted, x, w, grad=True, argnums=(0, 1))
    assert fitted_memory.peak_bytes <= budget
    tile = fitted.plan_for(x, w).entries[-1]
    assert tile.kind == "chunk_size"
    assert compiled_memory(loss, x, w, grad=True, argnums=(0, 1)).peak_bytes > budget
    for got, want in zip(fitted_grad(x, w), fixed_grad(x, w)):
        assert_close(got, want, 1e-5, "fitted gradient")


@pytest.mark.slow
def test_demo_scenario_agrees_and_is_leaner():
    from memwise import scenarios
    from memwise.scenarios import lmhead

    assert "lmhead" in scenarios.available()
    small = lmhead.make(tokens=64, d=16, vocab=1001)
    assert small.agree(jax.jit(small.naive)(*small.args), jax.jit(small.memwise)(*small.args))
    scenario = scenarios.load("lmhead")
    naive = compile_measured(scenario.naive, *scenario.args)[1]
    tiled = compile_measured(scenario.memwise, *scenario.args)[1]
    # The naive program holds the logits and their gradient; memwise a few float32 tiles
    # (the scores, their probabilities, their cotangent) of the tile "auto" chooses.
    tokens, vocab = scenario.args[0].shape[0], scenario.args[1].shape[0]
    h, table = scenario.args[:2]
    tile = tiling(tokens, vocab, "auto", pair_bytes=_pair_bytes(h, table, "vd", None))
    tile_bytes = tile.rows.size * tile.cols.size * 4
    assert naive.temp_bytes >= tokens * vocab * 4
    assert tile_bytes <= 0.02 * tokens * vocab * 4
    assert tiled.temp_bytes <= 3 * tile_bytes


@pytest.mark.slow
def test_vocabulary_parallel_matches_one_device():
    """Tokens split over one mesh axis and the vocabulary over another (Megatron's
    vocabulary-parallel cross-entropy), from the data's sharding and from mesh=, on 8
    CPU devices: the same loss, extras and gradients as on one device."""
    run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
        import memwise as mw

        k = jax.random.split(jax.random.PRNGKey(0), 4)
        x = jax.random.normal(k[0], (16, 8))
        w = jax.random.normal(k[1], (8, 40)) * 0.5
        b = jax.random.normal(k[2], (40,))
        y = jax.random.randint(k[3], (16,), 0, 40).at[3].set(-100)
        opts = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=4.0,
                    chunk_size=(4, 3), return_lse=True, return_argmax=True)

        def f(x, w, b, **kw):
            loss, lse, arg = mw.linear_cross_entropy(x, w, y, bias=b, **opts, **kw)
            return loss, (lse, arg)

        def both(fn):  # the loss, its extras and gradients: one compiled program
            return jax.jit(jax.value_and_grad(fn, (0, 1, 2), has_aux=True))

        ref, ref_g = both(f)(x, w, b)

        def check(out, g, fn, *args):
            assert "shard_map" in str(jax.make_jaxpr(fn)(*args)), "not split"
            np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
            np.testing.assert_allclose(out[1][0], ref[1][0], rtol=1e-5)
            np.testing.assert_array_equal(out[1][1], ref[1][1])
            for a, e in zip(g, ref_g):
                np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)

        for kind in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
            xs = jax.device_put(x, NamedSharding(mesh, P("data")))
            ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
            bs = jax.device_put(b, NamedSharding(mesh, P("model")))
            if kind == AxisType.Auto:  # concrete arrays declare both splits
                eager = jax.grad(lambda *a: f(*a)[0], (0, 1, 2))(xs, ws, bs)
                check(f(xs, ws, bs), eager, f, xs, ws, bs)
            # Under jit, Explicit types declare both splits; on Auto axes the tokens are
            # split over all of them.
            with jax.set_mesh(mesh):
                check(*both(f)(xs, ws, bs), jax.jit(f), xs, ws, bs)
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        for kw in (dict(token_axis="data", vocab_axis="model"), dict(vocab_axis=("data", "model"))):
            fn = lambda x, w, b, kw=kw: f(x, w, b, mesh=mesh, **kw)
            check(*both(fn)(x, w, b), fn, x, w, b)
        # The tied layout, tokens with leading (batch, length) dims.
        tied = lambda x, w: mw.linear_cross_entropy(
            x.reshape(4, 4, 8), w.T, y.reshape(4, 4), layout="vd", ignore_index=-100,
            mesh=mesh, token_axis="data", vocab_axis="model")
        np.testing.assert_allclose(
            jax.jit(tied)(x, w),
            jax.jit(lambda x, w: mw.linear_cross_entropy(x, w, y, ignore_index=-100))(x, w),
            rtol=1e-5)
        print("ok")
        """,
        n_devices=8,
    )


def test_a_2d_mesh_gradient_gathers_no_weights():
    """Tokens over one axis, the vocabulary over the other, of 2 x 4 and 4 x 2 meshes (the
    layout of tensor-parallel language-model training): the compiled gradient has no
    all-gather (not of w, not of the logits), and equals optax's dense loss on one
    device. The split read from the data (Explicit axes, jax.make_mesh's default) and
    named (mesh=, token_axis=, vocab_axis=)."""
    run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np, optax
        from jax.sharding import NamedSharding, PartitionSpec as P
        import memwise as mw

        k = jax.random.split(jax.random.PRNGKey(1), 3)
        x = jax.random.normal(k[0], (16, 8))
        w = jax.random.normal(k[1], (8, 64)) * 0.5
        y = jax.random.randint(k[2], (16,), 0, 64)

        def dense(x, w):
            return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

        ref, ref_g = jax.jit(jax.value_and_grad(dense, (0, 1)))(x, w)
        for shape in ((2, 4), (4, 2)):
            mesh = jax.make_mesh(shape, ("data", "vocab"))
            xs = jax.device_put(x, NamedSharding(mesh, P("data")))
            ws = jax.device_put(w, NamedSharding(mesh, P(None, "vocab")))
            ys = jax.device_put(y, NamedSharding(mesh, P("data")))
            for named in (False, True):
                kw = dict(mesh=mesh, token_axis="data", vocab_axis="vocab") if named else {}
                loss = lambda x, w, y, kw=kw: mw.linear_cross_entropy(x, w, y, chunk_size=(4, 8), **kw)
                step = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(xs, ws, ys).compile()
                gathers = [l for l in step.as_text().splitlines() if "all-gather" in l]
                assert not gathers, (shape, named, gathers[:2])
                value, grads = step(xs, ws, ys)
                np.testing.assert_allclose(value, ref, rtol=1e-5)
                for a, e in zip(grads, ref_g):
                    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)
        print("ok")
        """,
        n_devices=8,
    )
