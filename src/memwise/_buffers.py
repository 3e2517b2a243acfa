"""Write-only buffers of a loop: arrays the body writes at traced indices, never reads.

A loop that saves its state at some steps (an ODE solver writing the solution at
``SaveAt(ts=...)``) carries an ``(n_saves, ...)`` array it only writes into. As part of
the checkpointed carry it would be stored once per checkpoint and replayed into; as a
*buffer* it is loop state outside the checkpoints. The result used is the transpose of
an indexed write: for ``out = buffer.at[i].set(value)``, ``ct_value = ct_out[i]`` and
``ct_buffer = ct_out.at[i].set(0)``, neither of which reads ``buffer``'s value. So the
backward pass of a loop needs no buffer values at all: it threads the buffer's cotangent
through the reversed steps (each step reads the cotangents of the values it wrote and
zeroes them, so of two writes at one index only the later one receives a gradient, as
in plain JAX), and the buffer's remaining cotangent is that of its initial value. A
replayed step still writes into *some* array of the buffer's shape; the loop hands it
the final buffer and discards the result, which XLA removes. A caller that writes each
index at most once (Diffrax; ``OnlineLoop.writes_once``) needs no zeroing: the
cotangents are then only read, and one that is a broadcast (of ``jnp.sum``) is never
materialized.

This holds only if the body never reads a buffer (a read in a replayed step would see
the wrong values). The body therefore sees a :class:`WriteOnlyBuffer`, which offers
``.at[index].set(value)``, ``.shape``, ``.dtype``, ``.ndim`` and ``.size`` and raises a
``TypeError`` naming the fix for anything else. Equinox's checkpointed ``while_loop``
has the same ``buffers=`` contract but leaves reads and repeated writes unchecked; here
reads raise and a repeated write is differentiated exactly.

Writes follow ``jax.numpy``'s ``.at[...].set`` semantics: a static index out of range
raises an ``IndexError`` while the body is traced; a traced index out of range cannot be
detected there, and the write is dropped, as JAX drops it, with a zero gradient for the
value that was not written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WriteOnlyBuffer", "buffer_mask", "unwrap_outer", "wrap", "unwrap"]

_READ = (
    "a loop buffer is write-only inside the loop: {what} would need its values, which the "
    "backward pass does not keep (only checkpointed carries are restored). Write with "
    "buffer.at[i].set(value); keep a value the loop needs again in the carry instead, "
    "or read the buffer after the loop"
)


class WriteOnlyBuffer:
    """The view of a loop buffer the body of ``memwise.while_loop`` receives.

    Only ``buffer.at[index].set(value)`` (returning the written buffer, to put back in
    the carry) and the ``shape``/``dtype``/``ndim``/``size`` attributes; every read
    raises a ``TypeError``.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> def body(s):
        ...     i, x, out = s
        ...     return i + 1, 2 * x, out.at[i].set(x)
        >>> _, _, out = mw.while_loop(lambda s: s[0] < 3, body, (0, 1.0, jnp.zeros(4)),
        ...                           max_steps=4, buffers=lambda s: s[2])
        >>> out
        Array([1., 2., 4., 0.], dtype=float32)
    """

    __slots__ = ("_array", "_tag")
    __array_priority__ = 1000  # NumPy defers to us, so its operators raise our message

    def __init__(self, array: Any, tag: object):
        self._array = array
        self._tag = tag

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return len(self._array.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._array.shape))

    @property
    def at(self) -> _At:
        return _At(self)

    def __repr__(self) -> str:
        return f"WriteOnlyBuffer({self.dtype}{list(self.shape)})"

    def _read(self, what: str) -> TypeError:
        return TypeError(_READ.format(what=what))

    def __getitem__(self, index: Any) -> Any:
        shown = index if isinstance(index, (int, slice)) else "..."
        raise self._read(f"buffer[{shown}]")

    def __getattr__(self, name: str) -> Any:
        # array methods (.sum(), .T, .astype) read the buffer; private names stay
        # AttributeErrors so that Python's protocols (copy, pickle) behave as usual
        if name.startswith("_"):
            raise AttributeError(name)
        raise self._read(f"buffer.{name}")

    def __jax_array__(self) -> Any:
        raise self._read("using it as an array")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._read("converting it to a NumPy array")

    def __iter__(self) -> Any:
        raise self._read("iterating over it")

    def __bool__(self) -> bool:
        raise self._read("its truth value")

    def __len__(self) -> int:
        return self.shape[0]


def _operator(name: str) -> Callable:
    def method(self: WriteOnlyBuffer, *args: Any) -> Any:
        raise self._read(f"the operator {name}")

    method.__name__ = name
    return method


for _name in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
    "__floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __matmul__ __rmatmul__ "
    "__neg__ __pos__ __abs__ __lt__ __le__ __gt__ __ge__ __and__ __rand__ __or__ __ror__ "
    "__xor__ __rxor__ __invert__ __float__ __int__ __index__"
).split():
    setattr(WriteOnlyBuffer, _name, _operator(_name))
del _name


class _At:
    __slots__ = ("_buffer",)

    def __init__(self, buffer: WriteOnlyBuffer):
        self._buffer = buffer

    def __getitem__(self, index: Any) -> _Write:
        return _Write(self._buffer, index)


class _Write:
    __slots__ = ("_buffer", "_index")

    def __init__(self, buffer: WriteOnlyBuffer, index: Any):
        self._buffer = buffer
        self._index = index

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"buffer.at[...].{name} does not exist: a write-only buffer takes "
            f".at[index].set(value, pred=...) only (it is never read in the loop)"
        )

    def set(self, value: Any, *, pred: Any = None, **options: Any) -> WriteOnlyBuffer:
        """``buffer.at[index].set(value)``; with ``pred``, only where ``pred`` is true.

        ``value`` is cast to the buffer's dtype if it promotes to it (a Python float
        into a float32 buffer) and broadcast to the shape of ``buffer[index]``.
        """
        if options:
            raise TypeError(
                f"buffer.at[...].set(value, pred=...) takes no {sorted(options)}: a "
                f"write-only buffer writes in-bounds indices only; to skip a write "
                f"(mode='drop' for an index past the end), pass pred=index < length"
            )
        buffer, index = self._buffer, self._index
        array = buffer._array
        _check_static_index(index, buffer.shape)
        target = jax.eval_shape(lambda a: a[index], array)
        value = jnp.asarray(value)
        if jnp.result_type(value, array) != array.dtype:
            raise TypeError(
                f"buffer.at[...].set(value): value is {value.dtype} but the buffer is "
                f"{array.dtype}; cast it (value.astype(jnp.{array.dtype}))"
            )
        try:
            value = jnp.broadcast_to(value.astype(array.dtype), target.shape)
        except ValueError:
            raise ValueError(
                f"buffer.at[{index!r}].set(value): value has shape {list(value.shape)}, "
                f"which does not broadcast to the written part {list(target.shape)} of the "
                f"buffer {list(buffer.shape)}"
            ) from None
        if pred is not None:
            pred = jnp.asarray(pred)
            if pred.shape != () or pred.dtype != jnp.bool_:
                raise TypeError(
                    f"buffer.at[...].set(value, pred=...): pred must be a boolean scalar, "
                    f"got {pred.dtype}{list(pred.shape)}"
                )
            # Reading the old value is safe here: it only flows back into the buffer
            # (its cotangent is added back where it was zeroed), so a replay that holds
            # another array's values still differentiates exactly.
            value = jnp.where(pred, value, array[index])
        return WriteOnlyBuffer(array.at[index].set(value), buffer._tag)


def _check_static_index(index: Any, shape: tuple[int, ...]) -> None:
    """Static integers out of range raise (traced ones follow JAX: the write is dropped)."""
    items = index if isinstance(index, tuple) else (index,)
    for axis, item in enumerate(items):
        if axis >= len(shape):
            raise IndexError(
                f"buffer.at[{index!r}]: {len(items)} indices for a buffer of "
                f"{len(shape)} dimensions {list(shape)}"
            )
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not -shape[axis] <= item < shape[axis]:
                raise IndexError(
                    f"buffer.at[{index!r}].set: index {item} is out of range for axis "
                    f"{axis} of the buffer {list(shape)}; the buffer must be allocated large "
                    "enough for every write (a traced index out of range is dropped, as in "
                    "jax.numpy)"
                )


# --------------------------------------------------------------------------------------
# which leaves of a carry are buffers


def buffer_mask(buffers: Callable | None, init: Any) -> list[bool]:
    """``mask[i]``: leaf i of ``init`` is a buffer, as ``buffers(init)`` names them.

    ``buffers`` is called on the carry's structure with each leaf replaced by its
    position, so it may index, take attributes and flatten, as Equinox's ``buffers=``
    callables do.
    """
    leaves, treedef = jax.tree_util.tree_flatten(init)
    if buffers is None:
        return [False] * len(leaves)
    if not callable(buffers):
        raise TypeError(
            f"buffers must be None or a callable carry -> the buffer leaves (e.g. "
            f"buffers=lambda carry: carry[2]), got {type(buffers).__name__}"
        )
    positions = [_Position(i) for i in range(len(leaves))]
    named = jax.tree_util.tree_leaves(buffers(jax.tree_util.tree_unflatten(treedef, positions)))
    mask = [False] * len(leaves)
    for item in named:
        if not isinstance(item, _Position):
            raise ValueError(
                f"buffers(carry) must return leaves of the carry (e.g. buffers=lambda carry: "
                f"carry[2]), got {item!r}"
            )
        mask[item.index] = True
    return mask


class _Position:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<carry leaf {self.index}>"


def unwrap_outer(leaves: list, mask: list[bool]) -> tuple[list, list]:
    """Arrays for the buffers of an enclosing loop passed into a nested one.

    Returns ``(arrays, tags)``: an enclosing loop's :class:`WriteOnlyBuffer` becomes its
    array (tag kept, to wrap the result again), which the nested loop writes as one of
    its own buffers.
    """
    arrays, tags = [], []
    for i, (leaf, is_buffer) in enumerate(zip(leaves, mask)):
        if isinstance(leaf, WriteOnlyBuffer):
            if not is_buffer:
                raise ValueError(
                    f"carry leaf {i} is a buffer of an enclosing loop: pass it as a buffer "
                    "of this loop too (name it in buffers=), since it cannot be read"
                )
            arrays.append(leaf._array)
            tags.append(leaf._tag)
        else:
            arrays.append(leaf)
            tags.append(None)
    return arrays, tags


def wrap(arrays: list, tags: list) -> list:
    """Write-only views of ``arrays`` (one tag per buffer: where it must come back)."""
    return [WriteOnlyBuffer(a, t) for a, t in zip(arrays, tags)]


def unwrap(views: list, tags: list, *, name: str) -> list:
    """The arrays of the views the body returned, checking each is the buffer it got."""
    out = []
    for view, tag in zip(views, tags):
        if not isinstance(view, WriteOnlyBuffer) or view._tag is not tag:
            raise TypeError(
                f"{name} must return each buffer it was given, written with "
                f"buffer.at[i].set(value), in its place in the carry; got "
                f"{'a new array' if not isinstance(view, WriteOnlyBuffer) else 'another buffer'} "
                "where this buffer belongs"
            )
        out.append(view._array)
    return out
