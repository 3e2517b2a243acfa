"""jax.random's samplers for the tests' inputs, drawn flat and reshaped.

The same values as ``jax.random.normal(key, shape)`` (threefry numbers the elements in
row-major order, so a flat draw reshaped is the shaped draw, bit for bit), at a fraction
of the compilation: XLA:CPU took 1-5 s to compile the sampler for one rank-3 or rank-4
shape (the partitionable threefry's per-dimension counters), a flat one 0.3 s, and the
suite draws hundreds of shapes, each compiled eagerly for its own.
"""

import math

import jax


def _flat(shape):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return shape, (math.prod(shape),)


def normal(key, shape=(), dtype=float):
    shape, flat = _flat(shape)
    return jax.random.normal(key, flat, dtype).reshape(shape)


def uniform(key, shape=(), dtype=float, minval=0.0, maxval=1.0):
    shape, flat = _flat(shape)
    return jax.random.uniform(key, flat, dtype, minval, maxval).reshape(shape)


def bernoulli(key, p=0.5, shape=None):
    if shape is None or getattr(p, "ndim", 0):  # p's shape: drawn as jax.random draws it
        return jax.random.bernoulli(key, p, shape)
    shape, flat = _flat(shape)
    return jax.random.bernoulli(key, p, flat).reshape(shape)
