"""The checked inputs of :func:`memwise.linear_cross_entropy`, and where it runs.

Everything a trace would fail on with a raw JAX error (a float label, shapes that do
not line up, an option out of range, a concrete label outside the vocabulary) is
checked here first, with a message that names the argument and the fix; and
:func:`vocabulary_split` reads, from the arguments or the data's sharding, whether the
tokens and the vocabulary are split over a mesh (the rules of :mod:`memwise.sharding`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import as_array
from memwise.sharding import auto_split, declared_split

__all__ = [
    "as_arrays",
    "check_cap",
    "check_fraction",
    "check_labels_in_range",
    "check_mask",
    "check_nonnegative",
    "check_shapes",
    "float_array",
    "label_flags",
    "vocabulary_split",
]


def float_array(a: Any, name: str) -> jax.Array:
    a = as_array(a, name)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name} must be a real float array, got dtype {a.dtype}")
    return a


def as_arrays(x: Any, w: Any, labels: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, w = float_array(x, "x"), float_array(w, "w")
    labels = as_array(labels, "labels")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"labels must be an integer array (word indices), got dtype {labels.dtype}; "
            "for soft targets use optax.softmax_cross_entropy on dense logits, or cast "
            "class indices with labels.astype(jnp.int32)"
        )
    return x, w, labels


def check_shapes(
    x: jax.Array, w: jax.Array, labels: jax.Array, bias: jax.Array | None, layout: str
) -> tuple[int, int]:
    if x.ndim < 1:
        raise ValueError("x must have shape (..., d), got a scalar")
    if w.ndim != 2:
        raise ValueError(
            f"w must be a 2-D matrix, (d, V) for layout='dv' or (V, d) for layout='vd'; "
            f"got shape {w.shape}"
        )
    d, vocab = w.shape if layout == "dv" else w.shape[::-1]
    if x.shape[-1] != d:
        hint = (
            " (w looks like (V, d): pass layout='vd')"
            if layout == "dv" and w.shape[1] == x.shape[-1]
            else ""
        )
        raise ValueError(
            f"x's last dim {x.shape[-1]} must equal w's d = {d} (w {w.shape}, "
            f"layout={layout!r}){hint}"
        )
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"labels must have shape x.shape[:-1] = {x.shape[:-1]} (one per token), "
            f"got {labels.shape}"
        )
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must have shape (V,) = ({vocab},), got {bias.shape}")
    if vocab < 1:
        raise ValueError(f"w must have at least one vocabulary word, got shape {w.shape}")
    return int(d), int(vocab)


def check_mask(where: Any, labels: jax.Array) -> jax.Array:
    if where is None:
        return jnp.ones((), bool)
    where = as_array(where, "where")
    if where.dtype != jnp.bool_:
        raise TypeError(
            f"where must be a boolean array (True = count the token), got {where.dtype}"
        )
    try:
        full = jnp.broadcast_shapes(where.shape, labels.shape)
    except ValueError:
        full = None
    if full != labels.shape:
        raise ValueError(f"where must broadcast to labels' shape {labels.shape}, got {where.shape}")
    return where


def check_fraction(value: Any) -> float:
    value = check_nonnegative(value, "label_smoothing")
    if value >= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {value}")
    return value


def check_nonnegative(value: Any, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a Python float, got {value!r}")
    value = float(value)
    if not value >= 0.0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float >= 0, got {value}")
    return value


def check_cap(value: Any) -> float | None:
    if value is None:
        return None
    message = "logit_soft_cap must be a finite float > 0 (e.g. 30.0) or None for no cap, got"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{message} {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"{message} {float(value)}")
    return float(value)


def label_flags(
    labels: jax.Array, vocab: int, ignore_index: int | None
) -> tuple[jax.Array, jax.Array]:
    """``(ignored, in_range)`` per token, each comparison exact in any integer dtype.

    JAX converts a Python int to the labels' dtype before comparing, wrapping it: with
    uint8 labels ``ignore_index=-100`` became 156 and ``labels < 300`` ``labels < 44``.
    A bound the dtype cannot hold decides the comparison here without one.
    """
    info = jnp.iinfo(labels.dtype)
    ignored = jnp.zeros(labels.shape, bool)
    if ignore_index is not None and info.min <= ignore_index <= info.max:
        ignored = labels == ignore_index
    in_range = labels >= 0
    if vocab <= info.max:
        in_range = in_range & (labels < vocab)
    return ignored, in_range


def check_labels_in_range(
    labels: jax.Array, where: Any, vocab: int, ignore_index: int | None
) -> None:
    """Raise for out-of-range labels of the tokens counted, when ``labels`` and ``where``
    are concrete (also closed over under ``jit``); compared on the host in int64.
    Traced ones are not checked: their tokens give NaN losses."""
    if any(isinstance(a, jax.core.Tracer) for a in (labels, where)):
        return
    host = np.asarray(labels).astype(np.int64)
    bad = (host < 0) | (host >= vocab)
    if ignore_index is not None:
        bad &= host != ignore_index
    if where is not None:
        bad &= np.asarray(where)
    if bad.any():
        first = np.asarray(labels)[bad][0]
        ignored = "" if ignore_index is None else f" (ignore_index={ignore_index})"
        raise ValueError(
            f"labels must be in [0, {vocab}) or ignore_index{ignored}; got {int(first)} "
            f"at {int(bad.sum())} token(s). Under jit such tokens give a NaN loss."
        )


def vocabulary_split(
    x: jax.Array, w: jax.Array, layout: str, mesh: Any, token_axis: Any, vocab_axis: Any
) -> tuple[Any, Any, Any] | None:
    """``(mesh, token axes, vocabulary axes)`` when the call runs on many devices.

    Explicit ``mesh=`` with ``token_axis=``/``vocab_axis=``; otherwise the split the
    data declares: ``x``'s first axis (tokens) and ``w``'s vocabulary axis, from a
    concrete array's ``NamedSharding`` or, under ``jit``, a type sharded over Explicit
    mesh axes; else, on a mesh with Auto axes, the tokens split over all of them (as
    :func:`memwise.pairwise_reduce` reads it).
    """
    vocab_dim = 1 if layout == "dv" else 0
    if mesh is None:
        if token_axis is not None or vocab_axis is not None:
            raise ValueError(
                "token_axis and vocab_axis need mesh=: pass the jax.sharding.Mesh they name"
            )
        if x.ndim < 2:
            return None
        tokens, words = declared_split(x, 0), declared_split(w, vocab_dim)
        if tokens is None and words is None:
            # On a mesh with Auto axes (no declared split): the tokens over all of them.
            tokens = auto_split(x, 0)
            if tokens is None:
                return None
        if tokens is not None and words is not None and tokens[0] != words[0]:
            raise ValueError("x and w are split over different meshes; put them on one mesh")
        split = tokens if tokens is not None else words
        assert split is not None  # both None returned above
        mesh = split[0]
        token_axis = None if tokens is None else tokens[1]
        vocab_axis = None if words is None else words[1]
    else:
        if token_axis is None and vocab_axis is None:
            raise ValueError(
                "mesh= needs token_axis= (x's first axis split) and/or vocab_axis= "
                "(w's vocabulary split): name the mesh axes"
            )
        for name in _names(token_axis) + _names(vocab_axis):
            if name not in mesh.axis_names:
                raise ValueError(f"{name!r} is not an axis of the mesh {mesh.axis_names}")
        if token_axis is not None and x.ndim < 2:
            raise ValueError("token_axis needs x of shape (tokens, ..., d) with a token axis")
    if set(_names(token_axis)) & set(_names(vocab_axis)):
        raise ValueError(
            f"the tokens and the vocabulary are split over the same mesh axes "
            f"({token_axis!r}, {vocab_axis!r}); split them over different axes"
        )
    return mesh, token_axis, vocab_axis


def _names(axes: Any) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, tuple) else (axes,)
