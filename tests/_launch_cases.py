"""The functions tests/test_launch.py runs split over several processes, and their inputs.

One module for both sides: the test imports it to compute each function's value and
gradients once, in its own process, as the reference, and copies it beside the launched
script, which runs the same functions on global arrays that each process feeds its share
of. (Each process computed the references itself: a second compilation of every
function, in every process, on 2 cores shared by 4 processes.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import memwise as mw
from memwise import ot


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    loss: Callable  # (inputs) -> the scalar function of `args`
    args: tuple[str, ...]  # names in inputs()
    split: tuple[int, ...]  # the dimension of each argument that the processes split
    n_diff: int  # gradients of the first n_diff arguments
    x64: bool = False


def inputs() -> dict[str, np.ndarray]:
    f64 = lambda seed, shape: jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)
    out = {
        "x": jax.random.normal(jax.random.PRNGKey(0), (32, 3)),
        "y": jax.random.normal(jax.random.PRNGKey(1), (24, 3)) + 1.0,
        "q": jax.random.normal(jax.random.PRNGKey(2), (2, 32, 4)),
        "w": jnp.full(3, 0.1),
        "mask": jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 32, 32)),
        "segments": jnp.asarray([[0] * 10 + [1] * 14 + [2] * 8, [0] * 20 + [1] * 12], jnp.int32),
        "lengths": jnp.asarray([30, 32], jnp.int32),
    }
    with jax.enable_x64(True):
        out |= {
            "qd": f64(2, (2, 32, 4)),
            "bias": f64(4, (2, 32, 32)),
            "qh": f64(5, (2, 32, 4, 8)),
            "kh": f64(6, (2, 32, 2, 8)),
        }
        return {name: np.asarray(value) for name, value in out.items()}


def _pairwise(_):
    A = jnp.asarray(0.5)
    return lambda x, y: jnp.sum(
        jnp.sin(
            mw.pairwise_reduce(
                lambda a, b: -A * jnp.sum((a - b) ** 2), x, y, reduce="logsumexp", chunk_size=(3, 4)
            )
        )
    )


def _ring_causal(_):
    return lambda q, k: jnp.sum(jnp.sin(mw.attention(q, k, k, causal=True, chunk_size=(8, 8))))


def _ring_mask_bias(_):
    return lambda q, k, b, m: jnp.sum(
        jnp.sin(mw.attention(q, k, k, mask=m, bias=b, chunk_size=(8, 8)))
    )


def _grouped(data):
    lengths = jnp.asarray(data["lengths"])
    return lambda q, k, v, s: jnp.sum(
        jnp.sin(
            mw.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                q_segment_ids=s,
                kv_segment_ids=s,
                key_value_seq_lengths=lengths,
                chunk_size=(8, 8),
            )
        )
    )


def _divergence(_):
    return lambda x, y: ot.sinkhorn_divergence(x, y, epsilon=0.5, chunk_size=8, threshold=1e-6)


# One tile per device and ring step (8 queries, 8 points of x, 6 of y on each of 4
# devices): every case is a ring over the processes still, and a tile more per step
# made each process's programs 1.7x longer to compile (26 s against 16 s of CPU for the
# five); the tiling inside a device's block is tested on one process's devices
# (test_attention, test_ot, test_engine).
# masks and biases on the ring (split like the queries), and jax.nn's layout with 2:1
# grouped K/V, segment ids, key padding and a causal mask (a ring at 4 devices); in
# float64, where the two summation orders agree to rounding far below 1e-5
CASES = (
    Case("pairwise_reduce", _pairwise, ("x", "y"), (0, 0), 2),
    Case("attention (ring, causal)", _ring_causal, ("q", "q"), (1, 1), 2),
    Case(
        "attention (ring, mask and bias)",
        _ring_mask_bias,
        ("qd", "qd", "bias", "mask"),
        (1, 1, 1, 1),
        3,
        x64=True,
    ),
    Case(
        "dot_product_attention (ring, grouped, segments, padding, causal)",
        _grouped,
        ("qh", "kh", "kh", "segments"),
        (1, 1, 1, 1),
        3,
        x64=True,
    ),
    Case("sinkhorn_divergence", _divergence, ("x", "y"), (0, 0), 2),
)


def microbatch_loss(w, b):
    """accumulate_grad's loss, over the rows of ``x`` split between the processes."""
    return jnp.mean(jnp.tanh(b @ w) ** 2)


def references(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each case's value and gradients in one process (``"<name>/value"``,
    ``"<name>/grad<i>"``), and accumulate_grad's (``"accumulate/..."``)."""
    out = {}
    for case in CASES:
        with jax.enable_x64(case.x64):
            args = [jnp.asarray(data[name]) for name in case.args]
            step = jax.jit(jax.value_and_grad(case.loss(data), tuple(range(case.n_diff))))
            value, grads = step(*args)
            out[f"{case.name}/value"] = np.asarray(value)
            out |= {f"{case.name}/grad{i}": np.asarray(g) for i, g in enumerate(grads)}
    value, grad = jax.jit(jax.value_and_grad(microbatch_loss))(data["w"], data["x"])
    out["accumulate/value"], out["accumulate/grad"] = np.asarray(value), np.asarray(grad)
    return out
