"""The fused log-sum-exp of inner products (memwise.engine.tpu_dot_scores: the
cross-entropy's kernels on the ``"dot_scores"`` pattern) behind ``mw.ot.sinkhorn(implementation="pallas")``.

On CPU the kernel runs in Pallas's interpret mode at small shapes, with blocks small
enough that both axes have a ragged last block, and is held to the XLA tiles and to the
dense computation (float32, ``precision="highest"``); its TPU lowering is checked by
exporting for the TPU. On a TPU (``make test-accelerator``) the same cases run compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import ON_CPU, assert_allclose
from jax import export

import memwise as mw
from memwise.engine import kernels, tpu_cross_entropy, tpu_dot_scores
from memwise.ot import passes

RNG = np.random.default_rng(0)


@pytest.fixture
def small_blocks(monkeypatch):
    """64 x 128 blocks: 150 x 260 points have a ragged last block on both axes."""
    blocks = tpu_cross_entropy.Blocks(64, 128, 64, 128)
    monkeypatch.setattr(tpu_dot_scores, "pair_block_sizes", lambda *a: blocks)


def _clouds(n=150, m=260, d=5):
    x = jnp.asarray(RNG.normal(size=(n, d)), jnp.float32)
    y = jnp.asarray(RNG.normal(size=(m, d)) + 0.5, jnp.float32)
    return x, y


def test_softmin_through_the_kernel_equals_the_dense_pass(small_blocks):
    # Both directions, with log-weights, and the gradient in every input (epsilon too).
    x, y = _clouds()
    lw_y = jnp.asarray(RNG.normal(size=y.shape[0]), jnp.float32)
    lw_x = jnp.asarray(RNG.normal(size=x.shape[0]), jnp.float32)
    where = passes.Placed(mw.tiling.tiling(150, 260, (64, 128)), implementation="pallas")
    cost, consts = mw.ot.costs.resolve_cost("sqeuclidean", x, y)

    def kernel(x, y, lw_y, lw_x, eps):
        f = passes.softmin(cost, consts, x, y, lw_y, eps, where)
        g = passes.softmin(cost, consts, x, y, lw_x, eps, where, axis=0)
        return jnp.sum(jnp.sin(f)) + jnp.sum(jnp.cos(g)), (f, g)

    def dense(x, y, lw_y, lw_x, eps):
        # the expansion the kernel computes, so that both round alike (on a TPU the
        # difference form's cancellation differs from it by ~1e-4 at HIGHEST)
        c = jnp.sum(x * x, 1)[:, None] + jnp.sum(y * y, 1)[None] - 2 * x @ y.T
        f = -eps * jax.nn.logsumexp(lw_y[None] - c / eps, axis=1)
        g = -eps * jax.nn.logsumexp(lw_x[:, None] - c / eps, axis=0)
        return jnp.sum(jnp.sin(f)) + jnp.sum(jnp.cos(g)), (f, g)

    args = (x, y, lw_y, lw_x, jnp.float32(0.7))
    with jax.default_matmul_precision("highest"):
        (_, got), dgot = jax.value_and_grad(kernel, range(5), has_aux=True)(*args)
        (_, want), dwant = jax.value_and_grad(dense, range(5), has_aux=True)(*args)
    # On a TPU, HIGHEST's float32 products and the vector unit's exponential differ
    # from XLA:CPU's by ~1e-4 after the expansion's cancellation (|x|^2 / eps terms of
    # ~10 cancel to values of ~0.1): an absolute floor of 1e-3 there.
    atol = 2e-5 if ON_CPU else 1e-3
    for a, b in zip(got, want):
        assert_allclose(a, b, rtol=2e-5, atol=atol)
    for a, b in zip(dgot, dwant):
        assert_allclose(a, b, rtol=2e-4, atol=atol)


def test_sinkhorn_through_the_kernel_equals_the_tiles(small_blocks):
    x, y = _clouds()

    def solve(x, y, eps, implementation):
        out = mw.ot.sinkhorn(x, y, epsilon=eps, chunk_size=(64, 128), implementation=implementation)
        return out.reg_ot_cost, (out.f, out.g, out.n_iterations)

    def divergence(x, y, implementation):
        return mw.ot.sinkhorn_divergence(
            x, y, epsilon=0.5, chunk_size=(64, 128), implementation=implementation
        )

    results = {}
    with jax.default_matmul_precision("highest"):
        for impl in ("xla", "pallas"):
            grad = jax.value_and_grad(solve, (0, 1, 2), has_aux=True)
            (value, aux), d = jax.jit(grad, static_argnums=3)(x, y, jnp.float32(0.5), impl)
            div, ddiv = jax.jit(jax.value_and_grad(divergence), static_argnums=2)(x, y, impl)
            results[impl] = (value, aux, d, div, ddiv)
    (v1, (f1, g1, n1), d1, s1, ds1), (v2, (f2, g2, n2), d2, s2, ds2) = (
        results["xla"],
        results["pallas"],
    )
    assert int(n1) == int(n2)
    assert_allclose(v2, v1, rtol=1e-5)
    assert_allclose(f2, f1, rtol=1e-5, atol=1e-5)
    assert_allclose(g2, g1, rtol=1e-5, atol=1e-5)
    for a, b in zip(d2, d1):
        assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert_allclose(s2, s1, rtol=1e-4, atol=1e-6)
    assert_allclose(ds2, ds1, rtol=1e-4, atol=1e-6)


def test_gromov_wasserstein_through_the_kernel_equals_the_tiles(small_blocks, monkeypatch):
    # Each linear solve's cost is an inner product of augmented points: the kernel
    # serves its passes (the default on a TPU; asked for here), fused GW's too.
    x, y = _clouds(150, 260, 3)
    fx, fy = _clouds(150, 260, 2)
    threshold = 1e-6 if ON_CPU else 1e-4

    def cost(x, y, fx, fy, implementation):
        out = mw.ot.gromov_wasserstein(
            x,
            y,
            epsilon=2.0,
            x_features=fx,
            y_features=fy,
            # a TPU's exponential leaves the marginals about 1e-5 off
            sinkhorn_options=dict(implementation=implementation, threshold=threshold),
        )
        return out.reg_gw_cost, (out.plan.apply(jnp.arange(150.0), axis=0), out.converged)

    from jax.experimental import pallas as pl

    calls = {"xla": 0, "pallas": 0}  # the kernels each traces (pallas_call at trace time)
    pallas_call, impl = pl.pallas_call, None

    def counted(*args, **kwargs):
        calls[impl] += 1
        return pallas_call(*args, **kwargs)

    monkeypatch.setattr(pl, "pallas_call", counted)
    results = {}
    with jax.default_matmul_precision("highest"):
        for impl in ("xla", "pallas"):
            grad = jax.value_and_grad(cost, (0, 1, 2, 3), has_aux=True)
            results[impl] = jax.jit(grad, static_argnums=4)(x, y, fx, fy, impl)
    assert calls["xla"] == 0 and calls["pallas"] > 0, calls
    (v1, (p1, converged1)), d1 = results["xla"]
    (v2, (p2, converged2)), d2 = results["pallas"]
    assert converged1 and converged2
    assert_allclose(v2, v1, rtol=1e-5)
    assert_allclose(p2, p1, rtol=1e-4, atol=1e-6)
    for a, b in zip(d2, d1):
        assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_zero_weights_on_a_whole_first_block_stay_finite(small_blocks):
    # A first column block of zero weights is a block of -inf scores: the kernel's
    # running log-sum-exp shifted by -inf there (NaN), on either side of the problem.
    x, y = _clouds(40, 300, 2)
    b = jnp.ones(300).at[:128].set(0.0)
    b = b / jnp.sum(b)
    for args in ((x, y, None, b), (y, x, b, None)):
        out = {  # compiled (eagerly, each step around the loop compiled on its own)
            impl: jax.jit(functools.partial(mw.ot.sinkhorn, epsilon=0.5, implementation=impl))(
                *args
            )
            for impl in ("xla", "pallas")
        }
        assert bool(out["pallas"].converged)
        assert_allclose(out["pallas"].reg_ot_cost, out["xla"].reg_ot_cost, rtol=1e-5)
        assert_allclose(out["pallas"].f, out["xla"].f, rtol=1e-5, atol=1e-5)


def test_clouds_far_from_the_origin_keep_the_potentials_precision():
    # About the origin, |y|^2 / eps ~ 6e6 in float32 left the potentials only their high
    # bits in the kernel's weights (a solve that did not converge, 3.5% off) and the
    # tiles' expansion 1.3% off; the squared Euclidean cost is now expanded about the
    # clouds' middle, on both paths.
    x = jnp.asarray(RNG.normal(size=(77, 3)) + 1000.0, jnp.float32)
    y = jnp.asarray(RNG.normal(size=(93, 3)) + 1000.0, jnp.float32)
    # compiled (eagerly, each step around the loop compiled on its own)
    solve = functools.partial(mw.ot.sinkhorn, epsilon=0.5, max_iterations=500)
    centred = jax.jit(functools.partial(solve, implementation="xla"))(x - 1000.0, y - 1000.0)
    for impl in ("pallas", "xla"):
        out = jax.jit(functools.partial(solve, implementation=impl))(x, y)
        assert bool(out.converged), impl
        assert_allclose(out.reg_ot_cost, centred.reg_ot_cost, rtol=1e-4, err_msg=impl)


def test_vmap_of_grad_through_the_kernel(small_blocks):
    x, y = _clouds(150, 140, 3)
    xs = jnp.stack([x, 0.5 * x])

    def grad(x, implementation):
        def cost(x):
            return mw.ot.sinkhorn(
                x, y, epsilon=0.5, chunk_size=(64, 128), implementation=implementation
            ).reg_ot_cost

        return jax.grad(cost)(x)

    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.vmap(lambda x: grad(x, "pallas")))(xs)
        want = jax.jit(jax.vmap(lambda x: grad(x, "xla")))(xs)
    assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_pallas_names_what_the_kernel_cannot_serve():
    x, y = _clouds(20, 30, 2)
    with pytest.raises(ValueError, match="implementation must be None"):
        mw.ot.sinkhorn(x, y, implementation="triton")
    with pytest.raises(ValueError, match="operation sort in the pair function"):
        mw.ot.sinkhorn(x, y, cost=lambda a, b: jnp.sort(a - b)[0] ** 2, implementation="pallas")
    with pytest.raises(ValueError, match="held cost matrix"):
        mw.ot.sinkhorn(x, y, chunk_size=None, implementation="pallas")
    with jax.enable_x64(True), pytest.raises(ValueError, match="dtype float64"):
        mw.ot.sinkhorn(
            x.astype(jnp.float64), y.astype(jnp.float64), epsilon=1.0, implementation="pallas"
        )
    with jax.enable_x64(True), pytest.raises(ValueError, match="dtype float64"):
        mw.ot.gromov_wasserstein(
            x.astype(jnp.float64), y, sinkhorn_options=dict(implementation="pallas")
        )


@pytest.mark.skipif(not ON_CPU, reason="a CPU-only machine's program")
def test_the_default_on_a_cpu_only_machine_traces_no_kernel(monkeypatch):
    # The default keeps the tiles' own program where no TPU is present (the squared
    # Euclidean score per tile, as before the kernel); "pallas" traces the kernel.
    from jax.experimental import pallas as pl

    calls = []
    pallas_call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: calls.append(1) or pallas_call(*a, **k))
    x, y = _clouds(40, 30, 2)
    cost = lambda x: mw.ot.sinkhorn(x, y, epsilon=1.0).reg_ot_cost  # noqa: E731
    text = str(jax.make_jaxpr(jax.value_and_grad(cost))(x))
    assert not calls and "platform_index" not in text
    jax.make_jaxpr(lambda x: mw.ot.sinkhorn(x, y, epsilon=1.0, implementation="pallas").f)(x)
    assert calls


def test_the_default_chooses_the_kernel_where_a_tpu_is_present(monkeypatch):
    # As on a TPU host: the squared Euclidean passes (the inner products' kernel) and the
    # Euclidean ones (the pair function's) hold both a kernel and the tiles, and lowering
    # keeps the platform's branch; a cost no kernel evaluates runs the tiles alone.
    monkeypatch.setattr(kernels, "_platform_present", lambda platform: True)
    x, y = _clouds(40, 30, 2)
    sort = lambda a, b: jnp.sort(a - b)[0] ** 2  # noqa: E731
    for cost, kernel in (("sqeuclidean", True), ("euclidean", True), (sort, False)):
        loss = lambda x, cost=cost: mw.ot.sinkhorn(x, y, epsilon=1.0, cost=cost).reg_ot_cost  # noqa: E731
        text = str(jax.make_jaxpr(jax.value_and_grad(loss))(x))
        assert ("platform_index" in text) == kernel, cost


@pytest.mark.skipif(not ON_CPU, reason="exports for the TPU from a machine without one")
def test_the_kernel_lowers_for_the_tpu_at_real_sizes():
    x = jax.ShapeDtypeStruct((50_000, 64), jnp.float32)

    def cost(x, y):
        return mw.ot.sinkhorn(
            x, y, epsilon=0.1, max_iterations=5, implementation="pallas"
        ).reg_ot_cost

    fn = jax.jit(jax.value_and_grad(cost, (0, 1)))
    module = export.export(fn, platforms=["tpu"])(x, x).mlir_module()
    assert module.count("tpu_custom_call") >= 2
