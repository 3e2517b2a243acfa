"""Scenario ``lstm``: training a Flax LSTM over a 10,000-step sequence.

From the Flax discussion "How to use nn.remat for LSTM to save memory?": the user wraps
the LSTM cell in ``nn.remat`` inside ``nn.scan`` and finds only a constant saving:
``lax.scan`` still stores one carry per step, so the gradient's memory is O(T). They ask
for the O(sqrt T) of Chen et al. (2016). The memwise program changes one line,
``nn.scan`` -> ``memwise.flax.scan(..., checkpoints=...)``, which runs the optimal
binomial checkpointing schedule (Griewank & Walther 2000) and keeps O(checkpoints)
carries. Both programs compute ``jax.value_and_grad`` of the discussion's l2 loss with
respect to the parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from memwise.scenarios import Scenario

SIZES = {
    "default": dict(batch=10, seq_length=1000, hidden=32, input_dim=8, output_dim=4, seq2seq=False),
    "report": dict(
        batch=10, seq_length=10_000, hidden=128, input_dim=32, output_dim=4, seq2seq=True
    ),
}

KINDS = ("scan", "remat", "memwise")


def model(
    kind: str,
    *,
    hidden: int,
    output_dim: int,
    seq2seq: bool,
    checkpoints: int | str | None = None,
    counter: Callable | None = None,
) -> Any:
    """The discussion's ``SimpleLSTM`` with its loop written three ways.

    ``kind``: ``"scan"`` (``nn.scan``, all residuals), ``"remat"`` (``nn.scan`` over an
    ``nn.remat`` step: the user's fix) or ``"memwise"`` (``memwise.flax.scan`` with
    ``checkpoints``). ``counter``, if given, is called (via ``jax.debug.callback``) once
    per evaluation of the cell, to count recomputation.
    """
    import flax.linen as nn

    import memwise.flax

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "memwise":
        lifted = functools.partial(
            memwise.flax.scan,
            variable_broadcast="params",
            in_axes=1,
            out_axes=1,
            split_rngs={"params": False},
            checkpoints=checkpoints,
        )
    else:
        lifted = functools.partial(
            nn.scan,
            variable_broadcast="params",
            in_axes=1,
            out_axes=1,
            split_rngs={"params": False},
        )

    def step(self, carry, x):
        if counter is not None:
            jax.debug.callback(counter, x)
        carry, h = self.cell(carry, x)
        # seq2seq=False needs only the last h, which is in the final carry: stacking
        # every step's h (as the discussion's outputs[:, -1] does) would cost T x B x
        # hidden floats, and their cotangent as much again, in every variant.
        return carry, (h if seq2seq else None)

    if kind == "remat":
        step = nn.remat(step)

    class SimpleLSTM(nn.Module):
        hidden_size: int
        output_dim: int
        seq2seq: bool

        def setup(self):
            self.cell = nn.OptimizedLSTMCell(self.hidden_size)
            self.linear = nn.Dense(self.output_dim)

        forward = lifted(step)

        def __call__(self, embedded_inputs):
            batch = embedded_inputs.shape[0]
            carry = self.cell.initialize_carry(
                jax.random.PRNGKey(0), (batch, embedded_inputs.shape[-1])
            )
            (_, last_h), outputs = self.forward(carry, embedded_inputs)
            if self.seq2seq:
                return self.linear(outputs)
            return self.linear(last_h)

    return SimpleLSTM(hidden_size=hidden, output_dim=output_dim, seq2seq=seq2seq)


def loss_fn(net: Any) -> Callable:
    """The discussion's loss: mean l2 loss of the predictions, as a function of params."""

    def loss(params, x, y):
        preds = net.apply({"params": params}, x)
        return jnp.mean(0.5 * (preds - y) ** 2)

    return loss


def data(
    batch: int,
    seq_length: int,
    input_dim: int,
    output_dim: int,
    seq2seq: bool,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    key = jax.random.PRNGKey(1) if key is None else key
    key_x, key_y = jax.random.split(key)
    x = jax.random.normal(key_x, (batch, seq_length, input_dim))
    y_shape = (batch, seq_length, output_dim) if seq2seq else (batch, output_dim)
    return x, jax.random.normal(key_y, y_shape)


def make(
    batch: int,
    seq_length: int,
    hidden: int,
    input_dim: int,
    output_dim: int,
    seq2seq: bool,
    checkpoints: int | str | None = None,
) -> Scenario:
    shape: dict[str, Any] = dict(hidden=hidden, output_dim=output_dim, seq2seq=seq2seq)
    naive_net = model("remat", **shape)
    memwise_net = model("memwise", checkpoints=checkpoints, **shape)
    x, y = data(batch, seq_length, input_dim, output_dim, seq2seq)
    params = naive_net.init(jax.random.PRNGKey(0), x[:, :2])["params"]
    return Scenario(
        name="lstm",
        description=(
            f"value_and_grad of a Flax LSTM over T={seq_length} steps (batch {batch}, "
            f"hidden {hidden}, seq2seq={seq2seq}): nn.scan(nn.remat(cell)) vs "
            "memwise.flax.scan"
        ),
        naive=jax.value_and_grad(loss_fn(naive_net)),
        memwise=jax.value_and_grad(loss_fn(memwise_net)),
        args=(params, x, y),
        rtol=1e-4,
        atol=1e-6,
    )
