"""The contraction of two Jacobians into NTK blocks, shared by ``memwise.ntk`` and
``memwise.nt``.

``Theta(x1, x2) = J(x1) J(x2)^T`` summed over parameter leaves (Jacot et al. 2018).
:func:`contract_jacobians` is used by :func:`memwise.ntk.empirical.empirical` and by
neural-tangents' layout in :mod:`memwise.nt.empirical`; kept in a private module below
both so that neither imports private names of the other.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from memwise._dtypes import accumulation_dtype

__all__ = ["contract_jacobians"]


def contract_jacobians(j1: Any, j2: Any, out_ndim: int) -> jax.Array:
    """(O x P) . (O x P)^T summed over leaves -> (O, O) (or () for scalar outputs), in at
    least float32 and cast back (a bfloat16 sum over thousands of parameters keeps about two digits)."""
    pairs = list(zip(jax.tree_util.tree_leaves(j1), jax.tree_util.tree_leaves(j2)))
    dtype = jnp.result_type(*(x for pair in pairs for x in pair))
    acc = accumulation_dtype(dtype)
    terms = []
    for a, b in pairs:
        param_axes = list(range(out_ndim, a.ndim))
        terms.append(jnp.tensordot(a, b, axes=(param_axes, param_axes), preferred_element_type=acc))
    return sum(terms[1:], terms[0]).astype(dtype)
