"""Scenario ``lmhead``: a GPT-style model's output layer and loss, logits vs tiles.

The public request for a fused linear cross-entropy in JAX (a feature request and a
pull request for ``jax.experimental``, early 2026; PyTorch has Liger's and Apple's Cut
Cross-Entropy): in a language model's training step the logits ``h @ E^T`` of the
output layer, tokens x vocabulary, and their gradient are the largest buffers. Here the
hidden states of a GPT-2-sized model (``d = 768``, tied embeddings, the 50,257-word
vocabulary) go through the head and ``optax``'s cross-entropy (the naive program), and
through ``mw.linear_cross_entropy`` (the memwise program), both with the gradient of the
hidden states and of the embedding table. 50,257 is not a multiple of any tile: the
last vocabulary tile is ragged, as in practice.
"""

from __future__ import annotations

import jax

from memwise.cross_entropy import linear_cross_entropy
from memwise.scenarios import Scenario

SIZES = {
    "default": dict(tokens=1024, d=128, vocab=50_257),
    # GPT-2 small's head on 8 sequences of 1,024 tokens.
    "report": dict(tokens=8_192, d=768, vocab=50_257),
}


def dense_loss(h: jax.Array, table: jax.Array, labels: jax.Array) -> jax.Array:
    """What users write: the tied head's logits, then optax."""
    import optax  # type: ignore[import-untyped]  # no py.typed

    logits = h @ table.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def tiled_loss(h: jax.Array, table: jax.Array, labels: jax.Array) -> jax.Array:
    return linear_cross_entropy(h, table, labels, layout="vd")


def make(tokens: int, d: int, vocab: int) -> Scenario:
    key_h, key_e, key_y = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(key_h, (tokens, d))
    table = jax.random.normal(key_e, (vocab, d)) * 0.02  # GPT-2's initialisation scale
    labels = jax.random.randint(key_y, (tokens,), 0, vocab)

    def naive(h, table, labels):
        return jax.value_and_grad(dense_loss, (0, 1))(h, table, labels)

    def memwise(h, table, labels):
        return jax.value_and_grad(tiled_loss, (0, 1))(h, table, labels)

    return Scenario(
        name="lmhead",
        description=(
            f"value and gradients (hidden states, tied embedding table) of the "
            f"cross-entropy of {tokens:,} tokens over a {vocab:,}-word vocabulary, d = {d}"
        ),
        naive=naive,
        memwise=memwise,
        args=(h, table, labels),
        rtol=1e-4,
        atol=1e-7,
    )
