"""Diffrax's own adjoint tests with ``memwise.diffrax.CheckpointAdjoint`` swapped in.

Ported from Diffrax v0.7.2 (``test/test_adjoint.py``, and ``test_subsaveat`` of
``test/test_saveat_solution.py``, the tests that parametrize over adjoints): each test
that runs ``RecursiveCheckpointAdjoint`` (explicitly, or as ``diffeqsolve``'s default)
runs here with the memwise adjoint, against the same references (finite differences,
``DirectAdjoint``; ``test_against``'s vmapped gradients against the finite differences
and memwise's own gradient) and against ``RecursiveCheckpointAdjoint`` itself. Tests of
the other adjoints alone (``BacksolveAdjoint``'s seminorm and closure errors,
``ImplicitAdjoint``, ``ForwardMode``) do not apply. Diffrax's test configuration holds here too: float64,
rank promotion and implicit dtype promotion are errors.

The remaining tests check what Diffrax's file leaves implicit for this adjoint: dense
output, events and ``SaveAt(steps=True)`` (buffers written under a predicate) give
RecursiveCheckpointAdjoint's gradients; forward mode and ``UnsafeBrownianPath`` raise
memwise's errors, naming what to use.
"""

from __future__ import annotations

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import lineax as lx
import optimistix as optx
import pytest

import memwise.diffrax

MEMWISE = memwise.diffrax.CheckpointAdjoint


@pytest.fixture(autouse=True, scope="module")
def _diffrax_test_configuration():
    with (
        jax.enable_x64(True),
        jax.numpy_rank_promotion("raise"),
        jax.numpy_dtype_promotion("strict"),
    ):
        yield


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------
# test_adjoint.py: test_against


class _VectorField(eqx.Module):
    nondiff_arg: int
    diff_arg: float

    def __call__(self, t, y, args):
        del t
        assert y.shape == (2,)
        diff_arg, nondiff_arg = args
        dya = diff_arg * y[0] + nondiff_arg * y[1]
        dyb = self.nondiff_arg * y[0] + self.diff_arg * y[1]
        return jnp.stack([dya, dyb])


_AGAINST_ARGS = (0.1, -1)
_AGAINST_TERM = diffrax.ODETerm(_VectorField(nondiff_arg=1, diff_arg=-0.1))
# The non-array part of (y0, args, term): y0 is the one inexact array (made in the test,
# under the module's float64).
_STATIC = eqx.partition((None, _AGAINST_ARGS, _AGAINST_TERM), eqx.is_inexact_array)[1]


def _run(y0__args__term, saveat, adjoint):
    y0, args, term = y0__args__term
    ys = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        0.3,
        9.5,
        None,
        y0,
        args,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
        saveat=saveat,
        adjoint=adjoint,
    ).ys
    return jnp.sum(ys)


def _run_finite_diff(y0__args__term, saveat, adjoint):
    y0, args, term = y0__args__term
    val = _run((y0, args, term), saveat, adjoint)
    val_a = _run((y0 + jnp.array([1e-5, 0]), args, term), saveat, adjoint)
    val_b = _run((y0 + jnp.array([0, 1e-5]), args, term), saveat, adjoint)
    return jnp.stack([(val_a - val) / 1e-5, (val_b - val) / 1e-5])


def _run_inexact(inexact, saveat, adjoint):
    return _run(eqx.combine(inexact, _STATIC), saveat, adjoint)


# As in Diffrax's test, the save times are an argument of the compiled functions, so save
# times of one length share one compilation (of each function, for each adjoint).
_run_grad = eqx.filter_jit(jax.grad(_run_inexact))
_run_grad_int = eqx.filter_jit(jax.grad(_run, allow_int=True))


@eqx.filter_jit
def _run_vmap_grad(twice_inexact, saveat, adjoint):
    return jax.vmap(jax.grad(_run_inexact), in_axes=(0, None, None))(twice_inexact, saveat, adjoint)


@eqx.filter_jit
def _run_grad_vmap(twice_inexact, saveat, adjoint):
    @jax.grad
    def _run_impl(twice_inexact):
        out = jax.vmap(_run_inexact, in_axes=(0, None, None))(twice_inexact, saveat, adjoint)
        assert out.shape == (2,)
        return jnp.sum(out)

    return _run_impl(twice_inexact)


def _convert_float0(x):
    if x.dtype in (jax.dtypes.float0, jnp.dtype("bool")):
        return 0
    return x


# Diffrax's loop over t0, t1 and ts, every one of its 23 combinations. Save times of one
# length share a compilation, so a test is one (t0, t1) and one length, and the tests
# spread over the workers. The comparisons with the other adjoints (BacksolveAdjoint,
# ForwardMode) test Diffrax itself and are left out; RecursiveCheckpointAdjoint's place
# is taken by memwise's, which is also compared with RecursiveCheckpointAdjoint directly.
# DirectAdjoint is the reference for the plain and the integer gradients, as upstream;
# the two vmapped gradients are held to the finite differences and to memwise's own
# gradient, stacked (what upstream's DirectAdjoint rows assert of DirectAdjoint; its
# vmapped compilations took about a sixth of this file's time).
_TS = {
    "none": (None,),
    "one": ([0.3], [2.0], [9.5]),
    "two": ([1.0, 7.0],),
    "three": ([0.3, 7.0, 9.5],),
}
_AGAINST = [
    pytest.param(t0, t1, ts, id=f"{t0}-{t1}-{ts}")
    for t0, t1 in [(True, True), (True, False), (False, True), (False, False)]
    for ts in _TS
    if (t0, t1, ts) != (False, False, "none")
]


@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize("t0, t1, ts_length", _AGAINST)
def test_against(t0, t1, ts_length):
    y0__args__term = (jnp.array([0.9, 5.4]), _AGAINST_ARGS, _AGAINST_TERM)
    inexact = eqx.partition(y0__args__term, eqx.is_inexact_array)[0]
    twice_inexact = jtu.tree_map(lambda *x: jnp.stack(x), inexact, inexact)
    for ts in _TS[ts_length]:
        saveat = diffrax.SaveAt(t0=t0, t1=t1, ts=ts)

        fd_grads = _run_finite_diff(y0__args__term, saveat, MEMWISE())
        direct_grads = _run_grad(inexact, saveat, diffrax.DirectAdjoint())
        memwise_grads = _run_grad(inexact, saveat, MEMWISE())
        recursive_grads = _run_grad(inexact, saveat, diffrax.RecursiveCheckpointAdjoint())
        assert tree_allclose(fd_grads, direct_grads[0])
        assert tree_allclose(direct_grads, memwise_grads, atol=1e-5)
        assert tree_allclose(memwise_grads, recursive_grads)

        direct_grads = _run_grad_int(y0__args__term, saveat, diffrax.DirectAdjoint())
        memwise_int_grads = _run_grad_int(y0__args__term, saveat, MEMWISE())
        direct_grads = jtu.tree_map(_convert_float0, direct_grads)
        memwise_int_grads = jtu.tree_map(_convert_float0, memwise_int_grads)
        assert tree_allclose(fd_grads, direct_grads[0])
        assert tree_allclose(direct_grads, memwise_int_grads, atol=1e-5)

        fd_grads = jtu.tree_map(lambda *x: jnp.stack(x), fd_grads, fd_grads)
        stacked = jtu.tree_map(lambda *x: jnp.stack(x), memwise_grads, memwise_grads)
        for run in (_run_vmap_grad, _run_grad_vmap):
            vmapped_grads = run(twice_inexact, saveat, MEMWISE())
            assert tree_allclose(fd_grads, vmapped_grads[0], atol=1e-5)
            assert tree_allclose(stacked, vmapped_grads)


# --------------------------------------------------------------------------------------
# test_adjoint.py: test_backprop_ts, test_sde_against


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", [MEMWISE(), MEMWISE(checkpoints=2)], ids=["default", "c=2"])
def test_backprop_ts(adjoint):
    mlp = eqx.nn.MLP(1, 1, 8, 2, key=jr.PRNGKey(0))

    def run(model, adjoint):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: model(y)),
            diffrax.Euler(),
            0,
            1,
            0.1,
            jnp.array([1.0]),
            saveat=diffrax.SaveAt(ts=jnp.linspace(0, 1, 5)),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(run))(mlp, adjoint)
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(run))(
        mlp, diffrax.RecursiveCheckpointAdjoint()
    )
    assert tree_allclose(value, ref_value)
    assert tree_allclose(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize("diffusion_fn", ["weak", "lineax"])
def test_sde_against(diffusion_fn):
    def f(t, y, args):
        del t
        k0, _ = args
        return -k0 * y

    def g(t, y, args):
        del t
        _, k1 = args
        return k1 * y

    def g_lx(t, y, args):
        del t
        _, k1 = args
        return lx.DiagonalLinearOperator(k1 * y)

    t0, t1, dt0, tol, shape = 0, 1, 0.001, 1e-5, (2,)
    bm = diffrax.VirtualBrownianTree(t0, t1, tol, shape, key=jr.PRNGKey(5678))
    drift = diffrax.ODETerm(f)
    if diffusion_fn == "weak":
        with pytest.warns(match="`WeaklyDiagonalControlTerm` is now deprecated"):
            diffusion = diffrax.WeaklyDiagonalControlTerm(g, bm)
    else:
        diffusion = diffrax.ControlTerm(g_lx, bm)
    terms = diffrax.MultiTerm(drift, diffusion)
    solver = diffrax.Heun()

    @eqx.filter_jit
    @jax.grad
    def run(y0__args, adjoint):
        y0, args = y0__args
        sol = diffrax.diffeqsolve(terms, solver, t0, t1, dt0, y0, args, adjoint=adjoint)
        return jnp.sum(sol.ys)

    y0 = jnp.array([1.0, 2.0])
    args = (0.5, 0.1)
    grads1 = run((y0, args), diffrax.DirectAdjoint())
    grads3 = run((y0, args), MEMWISE())
    assert tree_allclose(grads1, grads3, rtol=1e-3, atol=1e-3)
    assert tree_allclose(grads3, run((y0, args), diffrax.RecursiveCheckpointAdjoint()))


# --------------------------------------------------------------------------------------
# test_saveat_solution.py: test_subsaveat


# Diffrax's parametrized product (multi_subs x with_fn): a ported grid, sampled (each
# value of each parameter runs; MEMWISE_TEST_GRID=full runs all four).
@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize("multi_subs", [True, False])
@pytest.mark.parametrize("with_fn", [True, False])
def test_subsaveat(multi_subs, with_fn):
    if with_fn:
        mlp = eqx.nn.MLP(3, 1, 32, 2, key=jr.PRNGKey(1))
        apply = lambda _, x, __: mlp(x)  # noqa: E731
        subsaveat_kwargs: dict = dict(fn=apply)
    else:
        mlp = lambda x: x  # noqa: E731
        subsaveat_kwargs = dict()
    get2 = diffrax.SubSaveAt(t0=True, ts=jnp.linspace(0.5, 1.5, 3), **subsaveat_kwargs)
    if multi_subs:
        get0 = diffrax.SubSaveAt(steps=1, fn=lambda _, y, __: y[0])
        get1 = diffrax.SubSaveAt(ts=jnp.linspace(0, 1, 5), t1=True, fn=lambda _, y, __: y[1])
        subs = (get0, get1, get2)
    else:
        subs = get2

    term = diffrax.ODETerm(lambda t, y, args: -0.5 * y)
    y0 = jnp.array([2.1, 1.1, 0.1])
    stepsize_controller = diffrax.PIDController(rtol=1e-8, atol=1e-8)
    sol = diffrax.diffeqsolve(
        term,
        t0=0,
        t1=2,
        y0=y0,
        dt0=None,
        solver=diffrax.Dopri5(),
        saveat=diffrax.SaveAt(subs=subs),
        stepsize_controller=stepsize_controller,
        adjoint=MEMWISE(),
    )
    steps = sol.stats["num_accepted_steps"]
    sol2 = diffrax.diffeqsolve(
        term,
        t0=0,
        t1=2,
        y0=y0,
        dt0=None,
        solver=diffrax.Dopri5(),
        saveat=diffrax.SaveAt(dense=True),
        stepsize_controller=stepsize_controller,
        adjoint=MEMWISE(),
    )
    if multi_subs:
        ts0, ts1, ts2 = sol.ts
        ys0, ys1, ys2 = sol.ys
        assert ts0.shape == (4096,)
        assert tree_allclose(ts1, jnp.array([0, 0.25, 0.5, 0.75, 1, 2]))
        assert tree_allclose(ys0[:steps], jax.vmap(sol2.evaluate)(ts0[:steps])[:, 0])
        assert tree_allclose(ys1, jax.vmap(sol2.evaluate)(ts1)[:, 1])
    else:
        ts2, ys2 = sol.ts, sol.ys
    assert tree_allclose(ts2, jnp.array([0, 0.5, 1.0, 1.5]))
    assert tree_allclose(ys2, jax.vmap(mlp)(jax.vmap(sol2.evaluate)(ts2)))


# --------------------------------------------------------------------------------------
# beyond Diffrax's file: what this adjoint must match or refuse

_TERM = diffrax.ODETerm(lambda t, y, args: -args * y + jnp.sin(t))


def _y0_args():  # float64 under the module's configuration (not at import)
    return jnp.array([1.0, 2.0]), jnp.array(0.7)


def _solve(y0, args, adjoint, **kwargs):
    kwargs.setdefault("stepsize_controller", diffrax.PIDController(rtol=1e-6, atol=1e-6))
    return diffrax.diffeqsolve(
        _TERM, diffrax.Tsit5(), 0.0, 3.0, 0.1, y0, args=args, adjoint=adjoint, **kwargs
    )


def _dense_loss(y0, args, adjoint):
    sol = _solve(y0, args, adjoint, saveat=diffrax.SaveAt(dense=True))
    return jnp.sum(jax.vmap(sol.evaluate)(jnp.linspace(0.0, 3.0, 7)) ** 2)


def _steps_loss(y0, args, adjoint):
    sol = _solve(y0, args, adjoint, saveat=diffrax.SaveAt(steps=True), max_steps=64)
    return jnp.sum(jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0) ** 2)


@pytest.mark.slow
def test_saved_steps_cost_no_more_memory_than_recursive_checkpoint_adjoint():
    # SaveAt(steps=True) under jnp.sum: the cotangent of the (max_steps, ...) buffer is a
    # broadcast. Zeroing what each step wrote (exact for repeated writes) made it a real
    # buffer, one more of that size than Equinox's loop, which only reads it; Diffrax
    # writes each index once, so memwise's Diffrax loops only read it too.
    y0, args = _y0_args()

    def temp(adjoint, max_steps):
        def loss(y0, args):
            sol = _solve(y0, args, adjoint, saveat=diffrax.SaveAt(steps=True), max_steps=max_steps)
            return jnp.sum(sol.ys)

        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(y0, args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    for max_steps in (1_024, 4_096):
        ours = temp(MEMWISE(checkpoints=8), max_steps)
        theirs = temp(diffrax.RecursiveCheckpointAdjoint(checkpoints=8), max_steps)
        assert ours <= theirs, (max_steps, ours, theirs)


def _event_loss(y0, args, adjoint):
    event = diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5, root_finder=optx.Newton(1e-8, 1e-8))
    sol = _solve(y0, args, adjoint, event=event)
    return jnp.sum(sol.ys**2) + jnp.sum(sol.ts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss", [_dense_loss, _steps_loss, _event_loss], ids=["dense", "steps", "event"]
)
def test_same_gradients_as_recursive_checkpoint_adjoint(loss):
    y0, args = _y0_args()
    # each compiled as one program (eager, the solve's gradient and the operations
    # around it were compiled apart)
    value_and_grad = eqx.filter_jit(jax.value_and_grad(loss, (0, 1)))
    value, grads = value_and_grad(y0, args, MEMWISE(checkpoints=3))
    ref_value, ref_grads = value_and_grad(
        y0, args, diffrax.RecursiveCheckpointAdjoint(checkpoints=3)
    )
    assert tree_allclose(value, ref_value)
    assert tree_allclose(grads, ref_grads, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_unbounded_solve():
    y0, args = _y0_args()
    loss = lambda y0, adjoint: jnp.sum(_solve(y0, args, adjoint, max_steps=None).ys)  # noqa: E731
    grad = jax.grad(loss)(y0, MEMWISE(checkpoints=4))
    assert tree_allclose(
        grad, jax.grad(loss)(y0, diffrax.RecursiveCheckpointAdjoint(checkpoints=4))
    )
    # without checkpoints the solve runs, as Diffrax's, and its gradient is refused
    assert tree_allclose(loss(y0, MEMWISE()), loss(y0, diffrax.RecursiveCheckpointAdjoint()))
    with pytest.raises(RuntimeError, match="CheckpointAdjoint\\(checkpoints=<int>\\)"):
        jax.grad(loss)(y0, MEMWISE())


@pytest.mark.xfail(
    bool(getattr(jax.config, "jax_custom_vjp3", False)),
    reason="under jax_custom_vjp3, Diffrax's solver step fails in forward mode before the "
    "adjoint runs (Equinox's checkpointed_while_loop hashes an unhashable EnumerationItem); "
    "RecursiveCheckpointAdjoint fails the same way",
    raises=ValueError,
    strict=True,
)
def test_forward_mode_names_forward_mode_adjoint():
    y0, args = _y0_args()
    with pytest.raises(TypeError, match="adjoint=diffrax.ForwardMode()"):
        jax.jvp(lambda y: _solve(y, args, MEMWISE()).ys, (y0,), (y0,))


def test_unsafe_brownian_path_is_refused():
    bm = diffrax.UnsafeBrownianPath((), jr.PRNGKey(0))
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(lambda t, y, args: -y), diffrax.ControlTerm(lambda t, y, args: 0.1 * y, bm)
    )
    with pytest.raises(ValueError, match="UnsafeBrownianPath"):
        diffrax.diffeqsolve(terms, diffrax.Euler(), 0, 1, 0.01, 1.0, adjoint=MEMWISE())


@pytest.mark.parametrize(
    "checkpoints, error", [(0, ValueError), (2.5, TypeError), ("many", TypeError)]
)
def test_bad_checkpoints(checkpoints, error):
    # the wording of every loop's checkpoints= (memwise._loop_inputs.checkpoint_count)
    with pytest.raises(error, match="checkpoints must be a positive int"):
        MEMWISE(checkpoints=checkpoints)
