"""Benchmark ``lstm``: gradient of a Flax LSTM over T steps, six ways; the LSTM of the Flax
discussion "How to use nn.remat for LSTM to save memory?" (10,000 steps).

Variants: ``nn.scan`` (``lax.scan``, all residuals), ``nn.scan(nn.remat(step))`` (the
discussion's fix), ``nn.remat_scan`` (Flax's nested remat; it has no per-step outputs, so only
seq2seq=False), Equinox's checkpointed scan (online treeverse) at its default checkpoint
count and at c=16, and ``memwise.flax.scan`` at its default count and at c=16. Columns:
XLA temp memory of the gradient, body evaluations counted with ``jax.debug.callback``
(the optimum 2T + J(T, c) next to memwise's), wall time relative to ``nn.scan``. A second
table compares compile times of the memwise gradient at T=1,000 and T=100,000.
"""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp

from memwise import schedule
from memwise.scan import resolve_checkpoints
from memwise.scenarios import lstm


def _counter():
    calls = []
    return calls, lambda *_: calls.append(1)


def _flax_loss(kind, shape, checkpoints=None, counter=None):
    net = lstm.model(kind, checkpoints=checkpoints, counter=counter, **shape)
    return jax.value_and_grad(lstm.loss_fn(net))


def _equinox_loss(shape, checkpoints, counter=None):
    import equinox.internal as eqxi
    import flax.linen as nn

    cell = nn.OptimizedLSTMCell(shape["hidden"])
    dense = nn.Dense(shape["output_dim"])
    seq2seq = shape["seq2seq"]

    def loss(params, x, y):
        carry0 = _zero_carry(x.shape[0], shape["hidden"])

        def step(carry, x_t):
            if counter is not None:
                jax.debug.callback(counter, x_t)
            carry, h = cell.apply({"params": params["cell"]}, carry, x_t)
            return carry, (h if seq2seq else None)

        (_, last_h), ys = eqxi.scan(
            step, carry0, jnp.swapaxes(x, 0, 1), kind="checkpointed", checkpoints=checkpoints
        )
        feats = jnp.swapaxes(ys, 0, 1) if seq2seq else last_h
        preds = dense.apply({"params": params["linear"]}, feats)
        return jnp.mean(0.5 * (preds - y) ** 2)

    return jax.value_and_grad(loss)


def _remat_scan_loss(shape, seq_length, counter=None):
    """``nn.remat_scan`` over a step that reads x_t from the (closed-over) sequence."""
    import flax.linen as nn

    inner = max(d for d in range(1, int(math.isqrt(seq_length)) + 1) if seq_length % d == 0)
    lengths = (seq_length // inner, inner)

    class Step(nn.Module):
        xs: jax.Array  # (T, B, X), time-major
        hidden: int

        @nn.compact
        def __call__(self, state):
            carry, t = state
            x_t = jax.lax.dynamic_index_in_dim(self.xs, t, 0, keepdims=False)
            if counter is not None:
                jax.debug.callback(counter, x_t)
            carry, _ = nn.OptimizedLSTMCell(self.hidden, name="cell")(carry, x_t)
            return carry, t + 1

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.remat_scan(
                Step,
                lengths=lengths,
                variable_broadcast="params",
                variable_axes={},
                split_rngs={"params": False},
            )
            carry0 = _zero_carry(x.shape[0], shape["hidden"])
            (_, last_h), _ = stack(jnp.swapaxes(x, 0, 1), shape["hidden"], name="rnn")(
                (carry0, jnp.int32(0))
            )
            return nn.Dense(shape["output_dim"], name="linear")(last_h)

    net = Model()

    def loss(params, x, y):
        return jnp.mean(0.5 * (net.apply({"params": params}, x) - y) ** 2)

    return net, jax.value_and_grad(loss)


def _zero_carry(batch, hidden):
    # what OptimizedLSTMCell.initialize_carry returns (zeros), as in the Flax variants
    return jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden))


def _run_once(fn, args) -> None:
    jax.block_until_ready(jax.jit(fn)(*args))


def _variants(size, quick):
    shape = dict(hidden=size["hidden"], output_dim=size["output_dim"], seq2seq=size["seq2seq"])
    n = size["seq_length"]
    x, y = lstm.data(size["batch"], n, size["input_dim"], size["output_dim"], size["seq2seq"])
    params = lstm.model("scan", **shape).init(jax.random.PRNGKey(0), x[:, :2])["params"]
    args = (params, x, y)
    c_default = resolve_checkpoints(None, n)

    specs = [
        ("lax.scan (nn.scan)", lambda cnt: _flax_loss("scan", shape, counter=cnt), args, {}),
        ("nn.scan(nn.remat)", lambda cnt: _flax_loss("remat", shape, counter=cnt), args, {}),
    ]
    if not size["seq2seq"]:
        net, _ = _remat_scan_loss(shape, n)
        rs_params = net.init(jax.random.PRNGKey(0), x)["params"]
        specs.append(
            ("nn.remat_scan", lambda cnt: _remat_scan_loss(shape, n, cnt)[1], (rs_params, x, y), {})
        )
    specs += [
        (
            "equinox checkpointed (default c)",
            lambda cnt: _equinox_loss(shape, None, cnt),
            args,
            {"checkpoints": "eqx default"},
        ),
        (
            "equinox checkpointed c=16",
            lambda cnt: _equinox_loss(shape, 16, cnt),
            args,
            {"checkpoints": 16},
        ),
        (
            f"memwise default (c={c_default})",
            lambda cnt: _flax_loss("memwise", shape, None, cnt),
            args,
            {"checkpoints": c_default, "optimum": schedule.evaluations(n, c_default)},
        ),
        (
            "memwise c=16",
            lambda cnt: _flax_loss("memwise", shape, 16, cnt),
            args,
            {"checkpoints": 16, "optimum": schedule.evaluations(n, 16)},
        ),
    ]
    variants = []
    for name, build, variant_args, extra in harness.progress(specs, desc="count"):
        calls, counter = _counter()
        _run_once(build(counter), variant_args)
        variants.append(
            harness.Variant(
                name, build(None), variant_args, extra={"evaluations": len(calls), **extra}
            )
        )
    return variants


def _compile_table(quick):
    lengths = (1_000, 10_000) if quick else (1_000, 100_000)

    def variants_at(n):
        size = dict(lstm.SIZES["report"], seq_length=n, seq2seq=False)
        shape = dict(hidden=size["hidden"], output_dim=size["output_dim"], seq2seq=False)
        x, y = lstm.data(size["batch"], n, size["input_dim"], size["output_dim"], False)
        params = lstm.model("scan", **shape).init(jax.random.PRNGKey(0), x[:, :2])["params"]
        return [
            harness.Variant(f"{name}, T={n:,}", fn, (params, x, y), run=False)
            for name, fn in (
                ("memwise c=16", _flax_loss("memwise", shape, 16)),
                ("equinox c=16", _equinox_loss(shape, 16)),
            )
        ]

    # Compile other functions first (a shorter T), so that neither measured length pays
    # the one-off cost of the first compilation in the process.
    for warm in variants_at(500):
        jax.jit(warm.fn).lower(*warm.args).compile()
    variants = [v for n in lengths for v in variants_at(n)]
    return harness.run_table(
        "compile time (trace + compile) of the gradient vs T (seq2seq=False, compile only)",
        variants,
        baseline=variants[0].name,
        quick=quick,
        time=False,
    )


def main(quick: bool = False) -> None:
    tables = []
    for seq2seq in (False, True):
        size = dict(lstm.SIZES["report"], seq2seq=seq2seq)
        if quick:
            size.update(seq_length=1000)
        variants = _variants(size, quick)
        title = (
            f"LSTM gradient, T={size['seq_length']:,}, batch {size['batch']}, hidden "
            f"{size['hidden']}, seq2seq={seq2seq}"
        )
        table = harness.run_table(title, variants, baseline="lax.scan (nn.scan)", quick=quick)
        harness.print_table(table)
        tables.append(table)
    table = _compile_table(quick)
    harness.print_table(table)
    tables.append(table)
    harness.save("lstm", tables, notes=__doc__.split("\n\n")[0], quick=quick)


if __name__ == "__main__":
    harness.cli(main)
