"""``dot_product_attention``'s arguments, checked: the validation stage of
:func:`memwise.dot_product_attention` (:mod:`memwise.sdpa`).

Why a module of its own: every argument of the ``jax.nn`` drop-in is checked up front,
with a message that names it and the accepted values, before anything is traced for the
tiles; the checks are a third of the code and none of the algorithm. :func:`validate`
returns a :class:`Checked` (q, k, v and a mask or bias at rank 4, the rest typed, the
static visibility as one :class:`~memwise._attention_tiles.Visibility`), from which the
public function's later stages (layout, operands, dispatch, corrections) read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import as_array
from memwise._attention_args import check_scale
from memwise._attention_tiles import Visibility, check_stripes
from memwise.engine.kernels import check_implementation

__all__ = ["Checked", "check_options", "validate"]


def _four_d(arr: jax.Array | None, name: str) -> jax.Array | None:
    """``arr`` with leading singleton dims up to rank 4 (``jax.nn``'s broadcasting)."""
    if arr is None:
        return None
    if arr.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims (B, N, T, S), got shape {arr.shape}")
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape)


def _check_pair(arr: jax.Array, name: str, full: tuple[int, ...]) -> None:
    """A mask or bias must broadcast to ``(B, N, T, S)`` dim by dim (each that size or 1)."""
    if any(a not in (1, f) for a, f in zip(arr.shape, full)):
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to (B, N, T, S) = {full}: "
            "each dim must be that size or 1"
        )


def _int_vector(value: Any, name: str, shape: tuple[int, ...]) -> jax.Array:
    arr = as_array(value, name)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    return arr


def _window(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    pair = (value, value) if isinstance(value, (int, np.integer)) else value
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0 for w in pair)
    ):
        raise ValueError(
            "local_window_size must be a non-negative int or a (left, right) pair of them, "
            f"got {value!r}"
        )
    return int(pair[0]), int(pair[1])


def _positive_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a positive Python float (static), got {value!r}")
    if not value > 0 or not np.isfinite(value):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def _segments(
    q_ids: Any, kv_ids: Any, batch: int, lq: int, lk: int
) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
    """Both segment-id arrays as ``(B, T)`` and ``(B, S)`` int arrays (or both None)."""
    if q_ids is None and kv_ids is None:
        return None, None
    if kv_ids is None or q_ids is None:
        if lq != lk:
            given = "q_segment_ids" if kv_ids is None else "kv_segment_ids"
            raise ValueError(
                f"only {given} was given and the query and key lengths differ ({lq} vs "
                f"{lk}): pass both q_segment_ids and kv_segment_ids"
            )
        q_ids = kv_ids if q_ids is None else q_ids
        kv_ids = q_ids if kv_ids is None else kv_ids
    out = []
    for ids, name, length in ((q_ids, "q_segment_ids", lq), (kv_ids, "kv_segment_ids", lk)):
        arr = as_array(ids, name)
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
        if arr.ndim == 1:
            arr = arr[None]
        if arr.shape not in ((batch, length), (1, length)):
            raise ValueError(f"{name} must have shape ({batch}, {length}), got {arr.shape}")
        out.append(jnp.broadcast_to(arr.astype(jnp.int32), (batch, length)))
    return out[0], out[1]


def _dropout_seed(rate: Any, rng: Any) -> tuple[float, jax.Array | None]:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1), got {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
    if rate == 0.0:
        return 0.0, None
    if rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (a PRNG key, e.g. jax.random.key(0))")
    try:
        key = (
            rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)
        )
        seed = jax.random.bits(key, (2,), jnp.uint32)
    except (TypeError, ValueError, AttributeError) as e:
        raise TypeError(
            f"dropout_rng must be a PRNG key (jax.random.key or PRNGKey), got {rng!r}"
        ) from e
    return float(rate), seed


@dataclasses.dataclass(frozen=True)
class Checked:
    """The arguments, checked: q, k, v (and a mask or bias) at rank 4, the rest typed."""

    q: jax.Array  # (B, T, N, H)
    k: jax.Array  # (B, S, K, H)
    v: jax.Array  # (B, S, K, Hv)
    mask: jax.Array | None  # broadcastable to (B, N, T, S), at rank 4
    bias: jax.Array | None
    scale: jax.Array
    visibility: Visibility
    stripes: tuple[int, int, int] | None
    seed: jax.Array | None  # dropout's
    q_len: jax.Array | None  # (B,)
    kv_len: jax.Array | None
    q_seg: jax.Array | None  # (B, T)
    kv_seg: jax.Array | None  # (B, S)
    sinks: jax.Array | None  # (N,)
    dropout_broadcast: bool
    own_segments: bool  # one array of segment ids for the queries and keys of one sequence
    out_lead: tuple[int, ...]  # the output's shape but its last dim (unbatched: no B)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(B, T, S, N, K, G)``: batch, query and key lengths, heads, K/V heads, group."""
        B, T, N, _ = self.q.shape
        S, K = self.k.shape[1:3]
        return B, T, S, N, K, N // K

    @property
    def may_see_nothing(self) -> bool:
        """Whether some query may see no key (its row then needs a correction).

        Positions hide a whole row only as :meth:`Visibility.may_hide_whole_rows` says;
        with one array of segment ids for queries and keys of one sequence, every query
        sees its own key. A bias of -inf can hide a whole row too: it gets the values'
        mean, as a masked row, whether or not a mask is passed.
        """
        _, T, S, *_ = self.shape
        return (
            any(a is not None for a in (self.mask, self.bias, self.q_len, self.kv_len))
            or (self.q_seg is not None and not self.own_segments)
            or self.visibility.may_hide_whole_rows(T, S)
        )


def check_options(implementation: Any, flags: dict[str, Any]) -> None:
    """A clear error for an unknown ``implementation`` or a non-bool static flag."""
    if implementation == "cudnn":
        raise ValueError(
            "implementation='cudnn' is not memwise's: memwise runs its own kernels "
            "(implementation=None, 'xla' or 'pallas'); for cuDNN's fused kernel call "
            "jax.nn.dot_product_attention(..., implementation='cudnn')"
        )
    check_implementation(implementation)
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{name} must be a Python bool (it decides which tiles run), got {flag!r}; "
                "under jit pass it as a static argument"
            )


def _qkv(
    query: Any, key: Any, value: Any
) -> tuple[jax.Array, jax.Array, jax.Array, tuple[int, ...]]:
    """``(q, k, v)`` checked and at rank 4, and the output's leading shape."""
    arrays = [as_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value"))]
    for arr, name in zip(arrays, ("query", "key", "value")):
        if arr.ndim not in (3, 4):
            raise ValueError(f"{name} must be (B, T, N, H) or (T, N, H), got shape {arr.shape}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    if len({a.dtype for a in arrays}) > 1:
        raise ValueError(
            "query, key and value must have one dtype (as jax.nn.dot_product_attention "
            f"requires), got {arrays[0].dtype}, {arrays[1].dtype} and {arrays[2].dtype}: "
            "cast them to one, e.g. key.astype(query.dtype)"
        )
    out_lead = arrays[0].shape[:-1]
    q4, k4, v4 = (_four_d(a, n) for a, n in zip(arrays, ("query", "key", "value")))
    assert q4 is not None and k4 is not None and v4 is not None
    B, T, N, H = q4.shape
    _, S, K, _ = k4.shape
    if k4.shape[0] != B or k4.shape[-1] != H:
        raise ValueError(
            f"key must be (B, S, K, H) with query's B and H: query {q4.shape}, key {k4.shape}"
        )
    if v4.shape[:3] != k4.shape[:3]:
        raise ValueError(f"value must have key's (B, S, K); got key {k4.shape}, value {v4.shape}")
    if K == 0 or N % K:
        raise ValueError(
            f"the number of query heads ({N}) must be a multiple of the number of key/value "
            f"heads ({K}): repeat K/V heads or change num_heads"
        )
    return q4, k4, v4, out_lead


def _mask_and_bias(
    mask: Any, bias: Any, full: tuple[int, ...]
) -> tuple[jax.Array | None, jax.Array | None]:
    """A boolean ``mask`` and a float ``bias``, each at rank 4 and broadcastable to ``full``."""
    if mask is not None:
        mask = _four_d(as_array(mask, "mask"), "mask")
        assert mask is not None
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = attend), got dtype {mask.dtype}; "
                "pass additive masks (0 / -inf) as bias= instead"
            )
        _check_pair(mask, "mask", full)
    if bias is not None:
        bias = _four_d(as_array(bias, "bias"), "bias")
        assert bias is not None
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(
                f"bias must be a float array added to the scores, got dtype {bias.dtype}; "
                "pass boolean masks as mask="
            )
        _check_pair(bias, "bias", full)
    return mask, bias


def _sinks(sinks: Any, heads: int) -> jax.Array | None:
    """``sinks`` as a float array of one logit per query head (or None)."""
    if sinks is None:
        return None
    sinks = as_array(sinks, "sinks")
    if not jnp.issubdtype(sinks.dtype, jnp.floating) or sinks.shape != (heads,):
        raise TypeError(
            f"sinks must be a float array of shape (N,) = ({heads},), one logit per query "
            f"head; got shape {sinks.shape} and dtype {sinks.dtype}"
        )
    return sinks


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    *,
    scale: Any,
    is_causal: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    local_window_size: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    logit_soft_cap: Any,
    sinks: Any,
    dropout_rate: Any,
    dropout_rng: Any,
    dropout_broadcast: Any,
    stripes: Any,
) -> Checked:
    """Validation: every argument checked up front, with an error that names it."""
    q4, k4, v4, out_lead = _qkv(query, key, value)
    B, T, N, H = q4.shape
    S = k4.shape[1]
    scale = check_scale(scale, H)
    window = _window(local_window_size)
    striped = check_stripes(stripes, T, S)
    softcap = _positive_float(logit_soft_cap, "logit_soft_cap")
    rate, seed = _dropout_seed(dropout_rate, dropout_rng)
    mask, bias = _mask_and_bias(mask, bias, (B, N, T, S))
    q_len = kv_len = None
    if query_seq_lengths is not None:
        q_len = _int_vector(query_seq_lengths, "query_seq_lengths", (B,))
    if key_value_seq_lengths is not None:
        kv_len = _int_vector(key_value_seq_lengths, "key_value_seq_lengths", (B,))
    q_seg, kv_seg = _segments(q_segment_ids, kv_segment_ids, B, T, S)
    own_segments = T == S and (
        q_segment_ids is None or kv_segment_ids is None or q_segment_ids is kv_segment_ids
    )
    return Checked(
        q4,
        k4,
        v4,
        mask,
        bias,
        scale,
        Visibility(bool(is_causal), window, softcap, rate),
        striped,
        seed,
        q_len,
        kv_len,
        q_seg,
        kv_seg,
        _sinks(sinks, N),
        bool(dropout_broadcast),
        own_segments,
        out_lead,
    )
