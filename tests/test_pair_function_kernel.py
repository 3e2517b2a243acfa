"""A user's pair function in the TPU kernel (memwise.engine.tpu_pair_function) behind
``mw.pairwise_reduce(implementation=...)`` and the OT passes of costs that are not inner
products.

On CPU the kernel runs in Pallas's interpret mode at small shapes with blocks small
enough that both axes have a ragged last block, and is held to the XLA tiles: values and
gradients in the points, the weights and a closed-over traced value. Its TPU lowering is
checked by exporting for the TPU; on a TPU (``make test-accelerator``) the same cases run
compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import ON_CPU, assert_allclose
from jax import export

import memwise as mw
from memwise.engine import kernels, tpu_pair_function

RNG = np.random.default_rng(0)


@pytest.fixture
def small_blocks(monkeypatch):
    """64 x 128 blocks: 150 x 260 points have a ragged last block on both axes."""
    blocks = tpu_pair_function.Blocks(64, 128, 64, 128)
    monkeypatch.setattr(tpu_pair_function, "block_sizes", lambda *a: blocks)


def _points(n=150, m=260, d=3, dtype=jnp.float32):
    shape = lambda k: (k,) if d == 0 else (k, d)  # noqa: E731
    x = jnp.asarray(RNG.normal(size=shape(n)), dtype)
    y = jnp.asarray(RNG.normal(size=shape(m)) + 0.3, dtype)
    return x, y


# Each a function of two points and a traced scale s (closed over: its gradient too).
FUNCTIONS = {
    "squared": lambda a, b, s: -jnp.sum((a - b) ** 2) / s,
    "laplace": lambda a, b, s: jnp.exp(-jnp.sum(jnp.abs(a - b)) * s),
    "norm": lambda a, b, s: -jnp.linalg.norm(a - b + 1e-2) * s,
    "features": lambda a, b, s: a[0] * b[1] + jnp.dot(a, b) * s - jnp.max(a * b),
    "where": lambda a, b, s: jnp.where(a[0] > b[0], jnp.tanh(a - b), s * (a + b) ** 2).sum(),
}


def _loss(fn, reduce, implementation):
    def loss(x, y, w, s):
        out = mw.pairwise_reduce(
            lambda a, b: fn(a, b, s),
            x,
            y,
            reduce=reduce,
            weights=w,
            implementation=implementation,
        )
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[0]))), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))


@pytest.mark.grid
@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("reduce", ["sum", "logsumexp"])
def test_the_kernel_equals_the_tiles(small_blocks, name, reduce):
    x, y = _points()
    w = jnp.asarray(RNG.uniform(0.5, 1.5, size=y.shape[0]), jnp.float32)
    if reduce == "logsumexp":
        w = jnp.log(w)
    s = jnp.float32(0.7)
    with jax.default_matmul_precision("highest"):
        (_, got), dgot = _loss(FUNCTIONS[name], reduce, "pallas")(x, y, w, s)
        (_, want), dwant = _loss(FUNCTIONS[name], reduce, "xla")(x, y, w, s)
    assert got.dtype == want.dtype
    assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    for a, b in zip(dgot, dwant):
        assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))


@pytest.mark.grid
@pytest.mark.parametrize("d", [0, 1, 7, 32])
def test_points_of_rank_0_and_without_weights(small_blocks, d):
    x, y = _points(d=d)
    fn = lambda a, b, s: jnp.exp(-s * jnp.sum((a - b) ** 2))  # noqa: E731
    loss = lambda impl: jax.jit(  # noqa: E731
        jax.grad(
            lambda x, y, s: jnp.sum(
                mw.pairwise_reduce(lambda a, b: fn(a, b, s), x, y, implementation=impl) ** 2
            ),
            (0, 1, 2),
        )
    )
    with jax.default_matmul_precision("highest"):
        for a, b in zip(loss("pallas")(x, y, 0.3), loss("xla")(x, y, 0.3)):
            assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_points(small_blocks):
    # The kernel computes in float32 and returns the pair function's dtype.
    x, y = _points(60, 140, dtype=jnp.bfloat16)
    fn = lambda a, b: -jnp.sum(jnp.abs(a - b))  # noqa: E731
    got = mw.pairwise_reduce(fn, x, y, reduce="logsumexp", implementation="pallas")
    want = mw.pairwise_reduce(fn, x.astype(jnp.float32), y.astype(jnp.float32), reduce="logsumexp")
    assert got.dtype == jnp.bfloat16
    assert_allclose(got.astype(jnp.float32), want, rtol=1e-2)
    dx = jax.grad(lambda x: jnp.sum(mw.pairwise_reduce(fn, x, y, implementation="pallas")))(x)
    assert dx.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32))))


def test_what_the_kernel_cannot_evaluate_runs_the_tiles_or_is_named(small_blocks):
    x, y = _points(40, 30, 4)
    sort = lambda a, b: jnp.sort(a - b)[0]  # noqa: E731
    outer = lambda a, b: jnp.sum(jnp.outer(a, b))  # noqa: E731
    want = mw.pairwise_reduce(sort, x, y, implementation="xla")
    assert_allclose(mw.pairwise_reduce(sort, x, y), want, rtol=1e-6)
    with pytest.raises(ValueError, match="operation sort in the pair function"):
        mw.pairwise_reduce(sort, x, y, implementation="pallas")
    with pytest.raises(ValueError, match="values of rank 2"):
        mw.pairwise_reduce(outer, x, y, implementation="pallas")
    with pytest.raises(ValueError, match="serves reduce='sum' and 'logsumexp', not 'max'"):
        mw.pairwise_reduce(outer, x, y, reduce="max", implementation="pallas")
    with pytest.raises(ValueError, match="33 features"):
        wide = jnp.ones((4, 33))
        mw.pairwise_reduce(lambda a, b: a @ b, wide, wide, implementation="pallas")
    with pytest.raises(ValueError, match="implementation must be None"):
        mw.pairwise_reduce(outer, x, y, implementation="cuda")


@jax.custom_vjp
def _clip_gradient(u):
    return u


_clip_gradient.defvjp(lambda u: (u, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def test_what_the_kernel_would_get_wrong_is_declined(small_blocks):
    # Each ran the kernel and gave a wrong value, a wrong gradient or a raw error.
    x, y = _points(20, 30, 3)
    matrix = np.eye(3, dtype=np.float32)
    cases = [
        # a backward rule not linear in the cotangent: the kernel scales the pair's VJP
        (lambda a, b: -jnp.sum(_clip_gradient(a - b) ** 2), x, y, "custom_vjp"),
        (lambda a, b: jnp.dot(a, b[2:]), x, jnp.ones((30, 5)), "the same d"),
        (lambda a, b: jax.lax.div((a[0] - b[0]).astype(jnp.int32), 4) * 1.0, x, y, "integers"),
        (lambda a, b: a[0] > b[0], x, y, "float scalar"),
        (lambda a, b: jnp.sum((a @ matrix) * b), x, y, "closed-over array of rank 2"),
        (lambda a, b: -jnp.sum((a - b["p"]) ** 2), x, {"p": y}, "pytrees"),
        (lambda a, b: 1.0, jnp.ones((20, 0)), jnp.ones((30, 0)), "0 features"),
    ]
    for fn, xs, ys, match in cases:
        with pytest.raises(ValueError, match=match):
            mw.pairwise_reduce(fn, xs, ys, implementation="pallas")


def test_infinite_scores_and_rounding_as_the_tiles(small_blocks):
    x = jnp.asarray([[0.0], [1.0], [0.49999997], [-2.5]], jnp.float32)
    y = jnp.asarray([[0.0], [2.0]], jnp.float32)
    infinite = lambda a, b: jnp.where(b[0] > 1.5, jnp.inf, -((a[0] - b[0]) ** 2))  # noqa: E731
    rounded = lambda a, b: jax.lax.round(a[0] + b[0])  # noqa: E731
    for fn, reduce in ((infinite, "logsumexp"), (rounded, "sum")):

        def f(x, impl, fn=fn, reduce=reduce):
            return mw.pairwise_reduce(fn, x, y, reduce=reduce, implementation=impl)

        np.testing.assert_array_equal(f(x, "pallas"), f(x, "xla"))
        g = [
            jax.grad(lambda x, i=i: jnp.sum(jnp.where(jnp.isinf(f(x, i)), 0.0, f(x, i))))(x)
            for i in ("pallas", "xla")
        ]
        np.testing.assert_array_equal(*g)


def test_second_derivatives_name_the_kernel(small_blocks):
    x, y = _points(40, 30, 2)

    def loss(x):
        return jnp.sum(
            mw.pairwise_reduce(
                lambda a, b: -jnp.sum((a - b) ** 2),
                x,
                y,
                reduce="logsumexp",
                implementation="pallas",
            )
        )

    with pytest.raises(TypeError, match="no second derivatives"):
        jax.hessian(loss)(x)


def test_vmap_over_the_points(small_blocks):
    x, y = _points(150, 140, 2)
    xs = jnp.stack([x, 0.5 * x])
    fn = lambda a, b: -jnp.sum(jnp.abs(a - b))  # noqa: E731

    def grad(impl):
        f = lambda x: jnp.sum(
            jnp.sin(
                mw.pairwise_reduce(  # noqa: E731
                    fn, x, y, reduce="logsumexp", implementation=impl
                )
            )
        )
        return jax.jit(jax.vmap(jax.grad(f)))(xs)

    assert_allclose(grad("pallas"), grad("xla"), rtol=1e-5, atol=1e-6)


def test_vmap_over_a_closed_over_value(small_blocks):
    # The kernels read closed-over values whole from SMEM: a batch of them is a loop.
    x, y = _points(150, 140, 2)

    def value_and_grad(impl):
        def f(s):
            fn = lambda a, b: -jnp.sum(jnp.abs(a - b)) * s  # noqa: E731
            return jnp.sum(mw.pairwise_reduce(fn, x, y, reduce="logsumexp", implementation=impl))

        return jax.jit(jax.vmap(jax.value_and_grad(f)))

    scales = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    for a, b in zip(value_and_grad("pallas")(scales), value_and_grad("xla")(scales)):
        assert_allclose(a, b, rtol=1e-5)
    if ON_CPU:
        module = export.export(value_and_grad("pallas"), platforms=["tpu"])(scales)
        assert "tpu_custom_call" in module.mlir_module()


def test_sinkhorn_of_another_cost_through_the_kernel(small_blocks):
    # The Euclidean cost's soft c-transforms (and their gradients) in the pair kernel.
    x, y = _points(150, 260, 3)

    def solve(impl):
        def cost(x, y):
            out = mw.ot.sinkhorn(
                x, y, cost="euclidean", epsilon=0.5, chunk_size=(64, 128), implementation=impl
            )
            return out.reg_ot_cost, out.n_iterations

        return jax.jit(jax.value_and_grad(cost, (0, 1), has_aux=True))(x, y)

    (got, iters), dgot = solve("pallas")
    (want, iters_want), dwant = solve("xla")
    assert int(iters) == int(iters_want)
    assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(dgot, dwant):
        assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not ON_CPU, reason="exports for the TPU from a machine without one")
def test_the_kernels_lower_for_the_tpu():
    x = jax.ShapeDtypeStruct((20_000, 3), jnp.float32)

    def loss(x, y, s):
        return sum(
            jnp.sum(
                mw.pairwise_reduce(
                    lambda a, b, f=f: f(a, b, s),
                    x,
                    y,
                    weights=y[:, 0],
                    reduce="sum" if name == "features" else "logsumexp",
                    implementation="pallas",
                )
            )
            for name, f in FUNCTIONS.items()
        )

    fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    module = export.export(fn, platforms=["tpu"])(x, x, jax.ShapeDtypeStruct((), jnp.float32))
    assert module.mlir_module().count("tpu_custom_call") == 3 * len(FUNCTIONS)


def test_the_default_chooses_the_kernel_where_a_tpu_is_present(monkeypatch):
    monkeypatch.setattr(kernels, "_platform_present", lambda platform: True)
    x, y = _points(40, 30, 2)
    for fn, kernel in (
        (lambda a, b: -jnp.sum(jnp.abs(a - b)), True),
        (lambda a, b: jnp.sort(a - b)[0], False),
    ):
        loss = lambda x, fn=fn: jnp.sum(mw.pairwise_reduce(fn, x, y, reduce="logsumexp"))  # noqa: E731
        text = str(jax.make_jaxpr(jax.value_and_grad(loss))(x))
        assert ("platform_index" in text) == kernel


@pytest.mark.skipif(ON_CPU, reason="the kernel's own blocks, compiled for the chip")
@pytest.mark.parametrize("d", [3, 32])
def test_the_kernels_own_blocks_on_the_chip(d):
    x, y = _points(4000, 5000, d)
    w = jnp.asarray(RNG.normal(size=y.shape[0]), jnp.float32)
    with jax.default_matmul_precision("highest"):
        (_, got), dgot = _loss(FUNCTIONS["laplace"], "logsumexp", "pallas")(x, y, w, 0.5)
        (_, want), dwant = _loss(FUNCTIONS["laplace"], "logsumexp", "xla")(x, y, w, 0.5)
    assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    for a, b in zip(dgot, dwant):
        assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))


@pytest.mark.skipif(ON_CPU, reason="the compiled kernels' memory on the chip")
def test_the_gradients_memory_is_row_statistics_not_tiles():
    # Per row the kernels keep (rows, 128) float32 statistics (measured on a v5e: 1.0 KiB
    # a point at 20,000 points, 1.5 KiB at 40,000), never a tile row: a 20k x 20k matrix
    # would be 1.5 GiB.
    from memwise.measure import compiled_memory

    def loss(x, y):
        fn = lambda a, b: -jnp.sum(jnp.abs(a - b))  # noqa: E731
        return jnp.sum(mw.pairwise_reduce(fn, x, y, reduce="logsumexp"))

    for n in (20_000, 40_000):
        pts = jax.ShapeDtypeStruct((n, 2), jnp.float32)
        temp = compiled_memory(loss, pts, pts, grad=True, argnums=(0, 1)).temp_bytes
        assert temp <= 2048 * n
