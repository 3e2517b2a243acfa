"""mw.linearize: values, exact gradients, no parameters baked into programs, training memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import TOLERANCE, assert_dtype_close

import memwise as mw
from memwise.measure import compiled_memory


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.tanh(h @ params["w2"]) @ params["w3"]


def _params(width, d_in=16, d_out=4, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
    return {
        "w1": normal(d_in, width),
        "b1": jnp.zeros(width),
        "w2": normal(width, width),
        "w3": normal(width, d_out),
    }


def _shift(params, amount=0.1, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda a: a + amount * jnp.asarray(rng.normal(size=a.shape), a.dtype), params
    )


def _reference(f, params):
    """The linearization written the direct way: f(p) + jvp(f, p, q - p)."""

    def lin(new_params, x):
        delta = jax.tree_util.tree_map(jnp.subtract, new_params, params)
        out, tangent = jax.jvp(lambda p: f(p, x), (params,), (delta,))
        return out + tangent

    return lin


@pytest.fixture(scope="module")
def problem():
    params = _params(32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)
    return params, _shift(params), x


def test_values(problem):
    params, new, x = problem
    lin = mw.linearize(_mlp, params)
    np.testing.assert_allclose(lin(params, x), _mlp(params, x), rtol=1e-6)
    np.testing.assert_allclose(lin(new, x), _reference(_mlp, params)(new, x), rtol=1e-5, atol=1e-6)


def test_gradients_match_direct_linearization(problem):
    params, new, x = problem
    lin = mw.linearize(_mlp, params)
    loss = lambda q, lin, x: jnp.sum(lin(q, x) ** 2)
    ours = jax.jit(jax.grad(loss))(new, lin, x)
    reference = jax.jit(jax.grad(lambda q: jnp.sum(_reference(_mlp, params)(q, x) ** 2)))(new)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_gradients_w_r_t_inputs_and_linearization_point(problem):
    params, new, x = problem
    lin = mw.linearize(_mlp, params)
    gx = jax.grad(lambda x: jnp.sum(lin(new, x) ** 2))(x)
    gx_ref = jax.jit(jax.grad(lambda x: jnp.sum(_reference(_mlp, params)(new, x) ** 2)))(x)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-5)
    g_point = jax.grad(lambda lin: jnp.sum(lin(new, x) ** 2))(lin)
    g_point_ref = jax.jit(jax.grad(lambda p: jnp.sum(_reference(_mlp, p)(new, x) ** 2)))(params)
    for a, b in zip(
        jax.tree_util.tree_leaves(g_point.params), jax.tree_util.tree_leaves(g_point_ref)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_is_a_pytree_of_the_parameters(problem):
    params, new, x = problem
    lin = mw.linearize(_mlp, params)
    leaves = jax.tree_util.tree_leaves(lin)
    assert len(leaves) == 4 and all(isinstance(a, jax.Array) for a in leaves)
    traces = []

    @jax.jit
    def step(lin, q, x):
        traces.append(None)
        return lin(q, x)

    step(lin, new, x)
    moved = jax.tree_util.tree_map(lambda a: a + 1.0, lin)  # a new point, same program
    np.testing.assert_allclose(
        step(moved, new, x), _reference(_mlp, moved.params)(new, x), rtol=1e-4, atol=1e-5
    )
    assert len(traces) == 1


def _closure_linearize(f, params):
    # neural-tangents' nt.linearize: a Python closure over the linearization point.
    return _reference(f, params)


def _program(width):
    params = _params(width)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    loss_f = lambda q, x: jnp.sum(_mlp(q, x) ** 2)
    lin = mw.linearize(_mlp, params)
    loss_lin = lambda q, lin, x: jnp.sum(lin(q, x) ** 2)
    closure = _closure_linearize(_mlp, params)
    loss_closure = lambda q, x: jnp.sum(closure(q, x) ** 2)
    return (
        compiled_memory(loss_f, params, x, grad=True),
        compiled_memory(loss_lin, params, lin, x, grad=True),
        compiled_memory(loss_closure, params, x, grad=True),
        sum(a.nbytes for a in jax.tree_util.tree_leaves(params)),
    )


def test_no_parameters_baked_into_the_program():
    small_f, small_lin, small_closure, _ = _program(32)
    big_f, big_lin, big_closure, big_bytes = _program(256)
    for f_mem, lin_mem in ((small_f, small_lin), (big_f, big_lin)):
        assert lin_mem.constant_bytes == 0
        assert lin_mem.program_bytes <= 4 * f_mem.program_bytes
    # The program does not grow with the parameters (64x more of them here) ...
    assert big_lin.program_bytes <= 1.2 * small_lin.program_bytes
    # ... while the closure carries them as constants: program text > parameter bytes.
    assert big_closure.constant_bytes >= big_bytes
    assert big_closure.program_bytes > big_bytes > 10 * big_lin.program_bytes


def _deep_mlp(params, x):
    for w in params[:-1]:
        x = jnp.tanh(x @ w)
    return x @ params[-1]


def test_training_step_memory_is_that_of_training_f():
    # Training f keeps every layer's activations; the linearized step re-runs f under
    # one vjp after a jvp whose buffers are freed layer by layer, so its peak is the
    # backward's plus a constant: on XLA:CPU about two activation-sized buffers (the jvp's
    # output and the cotangent), so the ratio approaches 1 with depth (1.22 at 8 layers).
    rng = np.random.default_rng(5)
    params = [jnp.asarray(rng.normal(size=(64, 64)) / 8.0, jnp.float32) for _ in range(16)]
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    lin = mw.linearize(_deep_mlp, params)
    train_f = compiled_memory(lambda q, x: jnp.sum(_deep_mlp(q, x) ** 2), params, x, grad=True)
    train_lin = compiled_memory(
        lambda q, lin, x: jnp.sum(lin(q, x) ** 2), params, lin, x, grad=True
    )
    assert train_lin.temp_bytes <= 1.2 * train_f.temp_bytes, (train_lin, train_f)


@pytest.mark.slow
def test_flax_model_apply_with_keyword_arguments():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, *, scale: float = 1.0):
            return nn.Dense(3)(scale * jnp.tanh(nn.Dense(8)(x)))

    model = Net()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4)), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), x)
    new = _shift(variables)
    lin = mw.linearize(model.apply, variables)
    f = lambda v, x: model.apply(v, x, scale=2.0)
    np.testing.assert_allclose(
        lin(new, x, scale=2.0), _reference(f, variables)(new, x), rtol=1e-5, atol=1e-6
    )
    grads = jax.jit(jax.grad(lambda v, lin: jnp.sum(lin(v, x, scale=2.0) ** 2)))(new, lin)
    ref = jax.jit(jax.grad(lambda v: jnp.sum(_reference(f, variables)(v, x) ** 2)))(new)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_equinox_module():
    import equinox as eqx

    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.PRNGKey(0))  # has a function leaf
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 4)), jnp.float32)
    apply = lambda m, x: jax.vmap(m)(x)
    lin = mw.linearize(apply, model)
    new = eqx.apply_updates(
        model,
        jax.tree_util.tree_map(lambda a: 0.1 * jnp.ones_like(a), eqx.filter(model, eqx.is_array)),
    )
    params, static = eqx.partition(model, eqx.is_array)
    f = lambda p, x: apply(eqx.combine(p, static), x)
    new_params = eqx.filter(new, eqx.is_array)
    np.testing.assert_allclose(
        lin(new, x), _reference(f, params)(new_params, x), rtol=1e-5, atol=1e-6
    )
    grads = jax.jit(jax.grad(lambda p, lin: jnp.sum(lin(eqx.combine(p, static), x) ** 2)))(
        new_params, lin
    )
    ref = jax.jit(jax.grad(lambda p: jnp.sum(_reference(f, params)(p, x) ** 2)))(new_params)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_vmap_and_forward_mode(problem):
    params, new, x = problem
    lin = mw.linearize(_mlp, params)
    per_example = jax.vmap(lambda xi: lin(new, xi[None])[0])(x)
    np.testing.assert_allclose(per_example, lin(new, x), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: lin(q, x), (new,), (new,))


def test_bad_inputs(problem):
    params, _, x = problem
    lin = mw.linearize(_mlp, params)
    with pytest.raises(ValueError, match="structure of the linearization point"):
        lin({"w1": params["w1"]}, x)
    with pytest.raises(ValueError, match="shape"):
        lin(dict(params, w3=jnp.ones((32, 5))), x)
    with pytest.raises(TypeError, match="float array leaves.*jnp.asarray"):
        mw.linearize(_mlp, {"n": 3})
    with pytest.raises(TypeError, match="callable"):
        mw.linearize("f", params)
    # A Python number where the point has an array said only "expected PyTreeDef(*), got
    # PyTreeDef(*)".
    scalar = mw.linearize(lambda w, x: jnp.sin(w * x), jnp.float32(0.3))
    with pytest.raises(TypeError, match=r"new_params is 0.4 \(a float\).*jnp.asarray"):
        scalar(0.4, x)
    with pytest.raises(TypeError, match=r"new_params\['w1'\] is an array where"):
        mw.linearize(_mlp, dict(params, w1=1.0))(params, x)


def test_closed_over_values_are_differentiated(problem):
    # f closes over a value jax.grad differentiates (the classic custom_vjp closure bug:
    # an UnexpectedTracerError); the gradient is the direct linearization's, for the
    # closed-over value, new_params, and the inputs together.
    params, new, x = problem

    def loss(s, q, x, linearize):
        f = lambda p, x: s * _mlp(p, x) + jnp.sin(s * x[:, :4])
        return jnp.sum(linearize(f, params)(q, x) ** 2)

    ours = jax.jit(jax.grad(lambda s, q, x: loss(s, q, x, mw.linearize), (0, 1, 2)))(2.0, new, x)
    expected = jax.jit(jax.grad(lambda s, q, x: loss(s, q, x, _reference), (0, 1, 2)))(2.0, new, x)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    only_s = jax.grad(lambda s: loss(s, params, x, mw.linearize))(2.0)  # eager, new = point
    np.testing.assert_allclose(
        only_s, jax.grad(lambda s: loss(s, params, x, _reference))(2.0), rtol=1e-5
    )


def test_static_leaves_of_new_params_must_not_change(problem):
    params, new, x = problem
    point = dict(params, scale=2.0, act=jnp.tanh)
    f = lambda p, x: p["act"](p["scale"] * _mlp(p, x))
    lin = mw.linearize(f, point)
    expected = _reference(lambda p, x: f(dict(p, scale=2.0, act=jnp.tanh), x), params)(new, x)
    got = lin(dict(new, scale=2.0, act=jnp.tanh), x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"new_params\['scale'\] is 3.0 .* has 2.0"):
        lin(dict(new, scale=3.0, act=jnp.tanh), x)
    with pytest.raises(ValueError, match=r"new_params\['act'\] is .*sin"):
        lin(dict(new, scale=2.0, act=jnp.sin), x)


@pytest.mark.parametrize("dtype", sorted(TOLERANCE["linearize"]))
@pytest.mark.slow
def test_dtypes(dtype):
    # Values, and gradients w.r.t. new_params (J^T ct), the inputs and the point (the
    # exact vjp of the jvp), in the parameters' dtype.
    cast = lambda t: jax.tree_util.tree_map(lambda a: np.asarray(a).astype(dtype), t)
    params, new = cast(_params(16)), cast(_shift(_params(16)))
    x = cast(np.random.default_rng(6).normal(size=(4, 16)))

    def value_and_grads(linearize):
        def loss(point, q, x):
            out = linearize(_mlp, point)(q, x)
            return jnp.sum(out, dtype=jnp.promote_types(out.dtype, jnp.float32)), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(params, new, x)
        return out, grads

    with jax.enable_x64(dtype == "float64"):
        got = jax.jit(lambda: value_and_grads(lambda f, p: mw.linearize(f, p)))()
    with jax.enable_x64(True):
        wide = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)
        params, new, x = wide((params, new, x))
        expected = value_and_grads(_reference)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        assert a.dtype == jnp.dtype(dtype)
        assert_dtype_close("linearize", a, b, dtype)


# ----------------------------------------------------------------------------------------
# mw.taylor_expand: neural-tangents' taylor_expand with the expansion point as leaves


def _nested_jvp_taylor(f, params, degree):
    """neural-tangents' recursion, written directly: f(p) + sum_k d^k/ds^k f(p + s dp) / k!."""

    def tayl(new_params, x):
        delta = jax.tree_util.tree_map(jnp.subtract, new_params, params)

        def derivative(order):
            fn = lambda p: f(p, x)  # noqa: E731
            for _ in range(order):
                fn = (lambda g: lambda p: jax.jvp(g, (p,), (delta,))[1])(fn)
            return fn(params)

        total = f(params, x)
        for order in range(1, degree + 1):
            total = total + derivative(order) / np.prod(np.arange(1, order + 1))
        return total

    return tayl


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
@pytest.mark.slow
def test_taylor_expand_matches_nested_jvp(problem, degree):
    params, new, x = problem
    with jax.enable_x64(True):
        p64, n64, x64 = (
            jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)
            for t in (params, new, x)
        )
        tayl = mw.taylor_expand(_mlp, p64, degree)
        got = jax.jit(lambda t, q, x: t(q, x))(tayl, n64, x64)
        np.testing.assert_allclose(
            got, _nested_jvp_taylor(_mlp, p64, degree)(n64, x64), rtol=1e-12, atol=1e-12
        )
        if degree == 1:
            np.testing.assert_allclose(got, mw.linearize(_mlp, p64)(n64, x64), rtol=1e-12)
        # The error shrinks with the degree (the shift is small).
        error = float(jnp.max(jnp.abs(got - _mlp(n64, x64))))
        lower = mw.taylor_expand(_mlp, p64, max(degree - 1, 0))(n64, x64)
        assert degree == 0 or error < float(jnp.max(jnp.abs(lower - _mlp(n64, x64))))


def test_taylor_expand_is_exact_on_polynomials():
    # A cubic in its parameters equals its own third-order expansion, anywhere.
    def cubic(p, x):
        return (x @ p["a"]) ** 3 + p["b"] * (x @ p["a"]) + p["c"] ** 2

    params = {"a": jnp.array([0.3, -0.2]), "b": jnp.array(1.5), "c": jnp.array(0.7)}
    new = {"a": jnp.array([-1.1, 2.0]), "b": jnp.array(-0.4), "c": jnp.array(2.5)}
    x = jnp.array([[1.0, 2.0], [-0.5, 0.25]])
    np.testing.assert_allclose(mw.taylor_expand(cubic, params, 3)(new, x), cubic(new, x), rtol=1e-5)
    assert not np.allclose(mw.taylor_expand(cubic, params, 2)(new, x), cubic(new, x))


@pytest.mark.slow
def test_taylor_expand_gradients_and_forward_mode(problem):
    params, new, x = problem
    tayl = mw.taylor_expand(_mlp, params, 2)
    reference = _nested_jvp_taylor(_mlp, params, 2)
    loss = lambda t, q, x: jnp.sum(t(q, x) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(1, 2)))(tayl, new, x)
    expected = jax.jit(jax.grad(lambda q, x: jnp.sum(reference(q, x) ** 2), argnums=(0, 1)))(new, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # The point is differentiable too (a pytree leaf), and jvp works (no custom rule).
    point_grad = jax.grad(loss)(tayl, new, x)
    assert isinstance(point_grad, mw.TaylorExpanded)
    direction = jax.tree_util.tree_map(jnp.ones_like, new)
    _, tangent = jax.jvp(lambda q: tayl(q, x), (new,), (direction,))
    _, expected_tangent = jax.jvp(lambda q: reference(q, x), (new,), (direction,))
    np.testing.assert_allclose(tangent, expected_tangent, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_taylor_expand_bakes_no_parameters_into_the_program():
    # A training step of the second-order expansion: the point is an argument (no
    # constants), and the program stays within a small factor of training f's, whatever
    # the number of parameters; the closure form carries the parameters as constants.
    def programs(width):
        params = _params(width)
        x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        tayl = mw.taylor_expand(_mlp, params, 2)
        closure = _nested_jvp_taylor(_mlp, params, 2)
        return (
            compiled_memory(lambda q, x: jnp.sum(_mlp(q, x) ** 2), params, x, grad=True),
            compiled_memory(lambda q, t, x: jnp.sum(t(q, x) ** 2), params, tayl, x, grad=True),
            compiled_memory(lambda q, x: jnp.sum(closure(q, x) ** 2), params, x, grad=True),
        )

    small_f, small_tayl, _ = programs(32)
    big_f, big_tayl, big_closure = programs(256)
    for f_mem, tayl_mem in ((small_f, small_tayl), (big_f, big_tayl)):
        assert tayl_mem.constant_bytes == 0
        assert tayl_mem.program_bytes <= 8 * f_mem.program_bytes, (tayl_mem, f_mem)
    assert big_tayl.program_bytes <= 1.2 * small_tayl.program_bytes
    assert big_closure.constant_bytes > 0


def test_taylor_expand_bad_inputs(problem):
    params, _, x = problem
    with pytest.raises(ValueError, match="degree"):
        mw.taylor_expand(_mlp, params, -1)
    with pytest.raises(TypeError, match="degree must be an int >= 0"):
        mw.taylor_expand(_mlp, params, 1.5)
    with pytest.raises(TypeError, match="f must be callable"):
        mw.taylor_expand(None, params, 2)
    with pytest.raises(TypeError, match="params"):
        mw.taylor_expand(_mlp, {"n": jnp.arange(3)}, 2)
    with pytest.raises(ValueError, match="structure"):
        mw.taylor_expand(_mlp, params, 2)({"w1": params["w1"]}, x)
