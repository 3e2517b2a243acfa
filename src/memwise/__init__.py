"""memwise: reverse-mode differentiation in JAX that fits in memory."""

from memwise import knobs
