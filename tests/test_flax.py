"""memwise.flax against Flax's own nn.scan / nnx, and the lstm scenario."""

from __future__ import annotations

import functools

import _draw
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _close import assert_tree_close
from flax import nnx

import memwise.flax
from memwise.measure import compiled_memory
from memwise.scenarios import lstm


@pytest.mark.parametrize("seq2seq", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.slow
def test_remat_discussion_lstm_one_line_change_matches_nn_scan(seq2seq):
    shape = dict(hidden=8, output_dim=3, seq2seq=seq2seq)
    x, y = lstm.data(2, 40, 5, 3, seq2seq)
    flax_net = lstm.model("scan", **shape)
    ours = lstm.model("memwise", checkpoints=3, **shape)
    params = flax_net.init(jax.random.PRNGKey(0), x)["params"]
    assert_tree_close(ours.init(jax.random.PRNGKey(0), x)["params"], params)
    ref = jax.jit(jax.value_and_grad(lstm.loss_fn(flax_net)))(params, x, y)  # compiled
    got = jax.jit(jax.value_and_grad(lstm.loss_fn(ours)))(params, x, y)
    assert_tree_close(got, ref)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(got[1]))


@pytest.mark.slow
def test_gradient_memory_flat_in_sequence_length():
    shape = dict(hidden=64, output_dim=2, seq2seq=False)
    batch, input_dim = 4, 2

    def temp(kind, n):
        x, y = lstm.data(batch, n, input_dim, 2, False)
        net = (
            lstm.model(kind, checkpoints=8, **shape)
            if kind == "memwise"
            else lstm.model(kind, **shape)
        )
        params = net.init(jax.random.PRNGKey(0), x[:, :2])["params"]
        return compiled_memory(lstm.loss_fn(net), params, x, y, grad=True).temp_bytes

    short, long = 200, 1000
    ours = temp("memwise", long) - temp("memwise", short)
    remat = temp("remat", long) - temp("remat", short)
    carry_bytes = 2 * batch * shape["hidden"] * 4
    assert remat >= (long - short) * carry_bytes  # nn.remat still keeps a carry per step
    # what grows with T is only the time-major copy of x (batch * input_dim floats/step)
    assert ours <= (long - short) * batch * input_dim * 4 * 2 + 16 * carry_bytes
    assert ours < remat / 10


@pytest.mark.slow
def test_broadcast_inputs_and_split_rngs_match_nn_scan():
    class Step(nn.Module):
        @nn.compact
        def __call__(self, carry, x, scale):
            h = nn.Dense(6)(jnp.concatenate([carry, x * scale], -1))
            h = nn.Dropout(0.3, deterministic=False)(jnp.tanh(h))
            return h, h.sum(-1)

    def build(lift):
        return lift(
            Step,
            variable_broadcast="params",
            split_rngs={"params": False, "dropout": True},
            in_axes=(1, nn.broadcast),
            out_axes=1,
        )

    flax_step, our_step = build(nn.scan), build(functools.partial(memwise.flax.scan, checkpoints=2))
    x = _draw.normal(jax.random.PRNGKey(1), (3, 17, 4))
    carry = jnp.zeros((3, 6))
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(2)}
    variables = flax_step().init(rngs, carry, x, 2.0)

    def loss(step):
        def f(params):
            (c, ys) = step().apply(
                {"params": params}, carry, x, 2.0, rngs={"dropout": jax.random.PRNGKey(3)}
            )
            return jnp.sum(c**2) + jnp.sum(jnp.sin(ys))

        return f

    # compiled (eager, each operation of the loops compiled alone)
    assert_tree_close(
        jax.jit(jax.value_and_grad(loss(our_step)))(variables["params"]),
        jax.jit(jax.value_and_grad(loss(flax_step)))(variables["params"]),
    )


@pytest.mark.slow
def test_nnx_scan_module_gradients():
    cell = nnx.OptimizedLSTMCell(3, 8, rngs=nnx.Rngs(0))
    carry = (jnp.zeros((2, 8)), jnp.zeros((2, 8)))
    xs = _draw.normal(jax.random.PRNGKey(1), (30, 2, 3))

    def ours(cell):
        _, ys = memwise.flax.scan_module(lambda m, c, x: m(c, x), cell, carry, xs, checkpoints=4)
        return jnp.sum(ys**2)

    def ref(cell):
        _, ys = jax.lax.scan(lambda c, x: cell(c, x), carry, xs)
        return jnp.sum(ys**2)

    got, want = nnx.jit(nnx.grad(ours))(cell), nnx.jit(nnx.grad(ref))(cell)  # compiled
    assert_tree_close(nnx.state(got), nnx.state(want))


def test_nnx_state_mutation_is_rejected():
    class Counter(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(jnp.zeros(()))

        def __call__(self, carry, x):
            self.calls[...] = self.calls[...] + 1
            return carry + x, None

    with pytest.raises(ValueError, match="read-only"):
        memwise.flax.scan_module(lambda m, c, x: m(c, x), Counter(), 0.0, jnp.ones(5))


def test_bad_arguments():
    with pytest.raises(TypeError, match="variable_broadcast"):

        class Bad(nn.Module):
            @functools.partial(memwise.flax.scan, variable_broadcast=True)
            def __call__(self, c, x):
                return c, x

        Bad().apply({}, jnp.zeros(2), jnp.ones((3, 2)))


@pytest.mark.slow
def test_lstm_scenario_agrees_at_small_size():
    scenario = lstm.make(
        batch=2, seq_length=60, hidden=8, input_dim=3, output_dim=2, seq2seq=True, checkpoints=4
    )
    naive = jax.jit(scenario.naive)(*scenario.args)
    ours = jax.jit(scenario.memwise)(*scenario.args)
    assert scenario.agree(naive, ours)
    assert set(lstm.SIZES) == {"default", "report"}
    assert lstm.SIZES["report"]["seq_length"] == 10_000
