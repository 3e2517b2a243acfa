"""Checkpoint schedules for reversing a loop of known length, and their exact costs.

Pure Python (no JAX): ``memwise.scan`` executes these schedules, this module only decides
them, so it can be tested exhaustively.

**Setting.** A loop of ``n`` steps maps states x_0 -> x_1 -> ... -> x_n. Reverse mode
needs, for every step i from n-1 down to 0, the state x_i to differentiate step i
("taped step"). With a ``custom_vjp`` the forward pass runs all n steps once and may store
some states in ``c`` slots (x_0 included); when the backward pass starts nothing but the
slots is live. The backward pass may restore a slot, advance (run the step without
differentiating it) and overwrite slots, holding at most ``c`` stored states at any time.
A *body evaluation* is one call of the step: n forward + advances + n taped.

**Result used.** Griewank & Walther (2000), "Algorithm 799: revolve", ACM TOMS 26(1):
with beta(s, t) = C(s + t, s), reversing n steps from one stored state with s slots needs
p(n, s) = t n - beta(s + 1, t - 1) advances, beta(s, t - 1) < n <= beta(s, t), and
p(n, s) = min_j j + p(j, s) + p(n - j, s - 1) gives an optimal split. In the custom_vjp
setting the forward sweep is free, so the backward needs
J(n, s) = min_j J(n - j, s - 1) + p(j, s) advances (store x_0 and x_j on the way, reverse
the suffix with s - 1 slots, then the prefix with all s). Both are infimal convolutions of
convex sequences, so an optimal split is found by merging the sequences' increments, in
O(t) per split; and they collapse to the closed form J(n, s) = p(n + 1, s) - n: the
minimal total is ``evaluations(n, c) = 2 n + J(n, c) = n + p(n + 1, c)``.

Compared with the online treeverse of Stumm & Walther (2010) used by Equinox
(``equinox.internal.scan(kind="checkpointed")``), which must place checkpoints without
knowing n and keeps 2c states, this offline schedule is optimal for every n and c (e.g.
n = 10,000, c = 16: 54,020 evaluations instead of 70,789).

**Loops of unknown length.** ``OnlineCheckpointer`` places the c carries while the loop
runs, without knowing n (a ``while_loop`` that stops on convergence); when it stops, each
segment between stored carries is reversed by revolve (``reversal_advances``). It matches
the offline optimum for n < (c+1)(c+2)/2 and stays within a few percent above (measured,
see the class). No online placement can match it at every n beyond: there, every optimal
placement ends with a segment of 2 or 3 steps, and a carry stored now starts a segment of
one (the tests check this by exhaustive search for small c).

``nested(n, levels)`` describes the transformation-transparent alternative (nested
``lax.scan`` with ``jax.checkpoint`` on each level's chunk): about ``levels * n**(1/levels)``
stored carries and ``levels * n`` evaluations under ``jax.grad``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from array import array
from collections.abc import Callable, Iterable

__all__ = [
    "Schedule",
    "NestedSchedule",
    "binomial",
    "forward_positions",
    "evaluations",
    "advances",
    "revolve_advances",
    "min_checkpoints",
    "nested",
    "segmented",
    "reversal_advances",
    "OnlineCheckpointer",
    "online_positions",
    "online_evaluations",
]


def _beta(s: int, t: int) -> int:
    """beta(s, t) = C(s + t, s): steps reversible with s slots and t repetitions."""
    if s < 0 or t < 0:
        return 0
    return math.comb(s + t, s)


def revolve_advances(n: int, slots: int) -> int:
    """p(n, s): minimal advances to reverse n steps from one stored state with s slots.

    This is the classic revolve count (the first forward sweep included). Example::

        >>> revolve_advances(10, 2)
        20
    """
    _check_counts(n, slots, allow_zero_steps=True)
    if n <= 1:
        return 0
    if slots == 1:
        return n * (n - 1) // 2
    t = 0
    while _beta(slots, t) < n:
        t += 1
    return t * n - _beta(slots + 1, t - 1)


def advances(n: int, checkpoints: int) -> int:
    """J(n, c): minimal backward advances in the custom_vjp setting (closed form).

    Example::

        >>> advances(1000, 8)
        3290
    """
    _check_counts(n, checkpoints, allow_zero_steps=True)
    if n <= 1:
        return 0
    return revolve_advances(n + 1, checkpoints) - n


def evaluations(n: int, checkpoints: int) -> int:
    """Body evaluations of ``binomial(n, checkpoints)`` under reverse mode: 2n + J(n, c).

    n forward evaluations, J(n, c) recomputations and n differentiated steps; the
    minimum any schedule with ``checkpoints`` stored carries can reach. Example::

        >>> evaluations(10_000, 16)
        54020
    """
    _check_counts(n, checkpoints)
    return 2 * n + advances(n, checkpoints)


def min_checkpoints(n: int, max_evaluations: int) -> int:
    """Smallest checkpoint count whose ``evaluations(n, c)`` is at most ``max_evaluations``.

    ``scan(checkpoints=None)`` uses ``min_checkpoints(n, 3 * n)``: about one extra forward
    pass buys O(sqrt(n)) memory. Example::

        >>> min_checkpoints(10_000, 30_000)
        139
    """
    _check_counts(n, 1)
    if max_evaluations < 2 * n:
        raise ValueError(
            f"max_evaluations={max_evaluations} is below 2 * n = {2 * n}, the cost of "
            "any reverse pass (n forward + n differentiated steps); pass at least 2 * n"
        )
    lo, hi = 1, n  # evaluations(n, n) == 2n always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if evaluations(n, mid) <= max_evaluations:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_counts(n: int, checkpoints: int, *, allow_zero_steps: bool = False) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < (0 if allow_zero_steps else 1):
        raise ValueError(f"n (the number of steps) must be a positive int, got {n!r}")
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 1:
        raise ValueError(
            f"checkpoints must be an int >= 1 (the number of stored carries), got {checkpoints!r}"
        )


def _merge_split(k: int, count_a: Callable[[int], int], count_b: Callable[[int], int]) -> int:
    """Take the k smallest increments of two convex sequences; return how many come from a.

    ``count_a(v)`` / ``count_b(v)`` give how many increments of value v each sequence has
    (v = 0, 1, ...). Ties go to sequence a, which places checkpoints as far as possible.
    """
    taken_a = 0
    v = 0
    while k > 0:
        ca, cb = count_a(v), count_b(v)
        if ca + cb >= k:
            return taken_a + min(ca, k)
        taken_a += ca
        k -= ca + cb
        v += 1
    return taken_a


@functools.lru_cache(maxsize=65536)
def _revolve_split(length: int, slots: int) -> int:
    """Optimal first advance j (1 <= j < length) of revolve with ``slots`` >= 2 slots.

    p(L, s) = min_j [j + p(j, s)] + p(L - j, s - 1): the first sequence has increments of
    value v with multiplicity beta(s - 1, v - 1) (v >= 2), the second beta(s - 2, v).
    """
    taken = _merge_split(
        length - 2,
        lambda v: _beta(slots - 1, v - 1) if v >= 2 else 0,
        lambda v: _beta(slots - 2, v) if v >= 1 else 0,
    )
    return 1 + taken


@functools.lru_cache(maxsize=65536)
def _forward_split(n: int, slots: int) -> int:
    """Optimal first segment j (1 <= j <= n) of J(n, s) = min_j J(n - j, s - 1) + p(j, s).

    J(., s - 1) from 0 has s - 1 increments 0 and C(s - 1 + v, s - 2) of each v >= 1;
    p(., s) from 1 has beta(s - 1, v) of each v >= 1. Ties go to p: longer first segments
    keep more slots free for revolve.
    """
    from_suffix = _merge_split(
        n - 1,
        lambda v: _beta(slots - 1, v) if v >= 1 else 0,
        lambda v: (slots - 1) if v == 0 else math.comb(slots - 1 + v, slots - 2),
    )
    # _merge_split counted the p increments (sequence a); the rest extend the suffix.
    return 1 + from_suffix


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """An executable checkpoint schedule for reversing ``n_steps`` steps.

    Reversed step ``k`` (k = 0 .. n-1) differentiates step ``r = n - 1 - k``: restore the
    carry of slot ``restore_slot[k]`` (it holds x at ``restore_position[k]``), advance to
    ``r``, storing x at ``store_position[m]`` into ``store_slot[m]`` for
    ``store_offsets[k] <= m < store_offsets[k + 1]`` as the advance passes those positions,
    then run the differentiated step r. During the forward pass, slot ``i`` stores x at
    ``forward_positions[i]``.

    All sequences are ``array('l')`` so that ``numpy.asarray`` takes them without copying
    element by element.

    Attributes:
      n_steps: loop length n.
      n_checkpoints: the slot budget c asked for.
      n_slots: slots actually used (<= c); the executor allocates this many carries.
      evaluations: body evaluations (forward + advances + differentiated).

    Example::

        >>> s = binomial(5, 2)  # 5 steps, 2 stored carries
        >>> list(s.forward_positions), list(s.restore_position)
        ([0, 3], [3, 3, 0, 1, 0])
        >>> s.evaluations  # 5 forward, 3 replayed, 5 differentiated
        13
    """

    n_steps: int
    n_checkpoints: int
    n_slots: int
    forward_positions: array
    restore_slot: array
    restore_position: array
    store_offsets: array
    store_position: array
    store_slot: array
    evaluations: int

    @property
    def advances(self) -> int:
        """Backward recomputations (evaluations - 2 n)."""
        return self.evaluations - 2 * self.n_steps


class _Builder:
    """Collects the backward actions of the recursion into the executable arrays."""

    def __init__(self):
        self.restore_slot = array("l")
        self.restore_position = array("l")
        self.store_offsets = array("l", [0])
        self.store_position = array("l")
        self.store_slot = array("l")
        self.pending: tuple[int, int] | None = None  # (slot, position) restored first
        self.advances = 0

    def split(self, slot: int, position: int, store_at: int, store_slot: int) -> None:
        # A split does not restore by itself: the advance happens as part of the next
        # reversed step, which restores once and stores while passing store_at.
        if self.pending is None:
            self.pending = (slot, position)
        self.store_position.append(store_at)
        self.store_slot.append(store_slot)

    def reverse(self, step: int, slot: int, position: int) -> None:
        if self.pending is None:
            self.pending = (slot, position)
        restore_slot, restore_position = self.pending
        self.restore_slot.append(restore_slot)
        self.restore_position.append(restore_position)
        self.store_offsets.append(len(self.store_position))
        self.advances += step - restore_position
        self.pending = None


def _revolve(builder: _Builder, start: int, length: int, slot: int, top: int, c: int) -> None:
    """Reverse steps start+length-1 .. start from x_start in ``slot``; slots top.. free.

    Revolve splits at the optimal j, reverses the suffix with one slot fewer, then the
    prefix with the same slots. The suffix-first order is kept with an explicit stack of
    pending prefixes, so the depth (up to c) never meets Python's recursion limit.
    """
    pending = [(start, length, slot, top)]
    while pending:
        start, length, slot, top = pending.pop()
        while length > 0:
            slots = c - top + 1
            if slots == 1 or length == 1:
                for step in range(start + length - 1, start - 1, -1):
                    builder.reverse(step, slot, start)
                break
            j = _revolve_split(length, slots)
            builder.split(slot, start, start + j, top)
            pending.append((start, j, slot, top))  # the prefix, after the suffix
            start, length, slot, top = start + j, length - j, top, top + 1


@functools.lru_cache(maxsize=64)
def forward_positions(n: int, checkpoints: int) -> tuple[int, ...]:
    """The steps whose carries the forward sweep of :func:`binomial` stores (x_0 first):
    revolve's optimal positions, O(c) Python. What an executor that computes the
    backward's splits on the device needs of the schedule.

    Example::

        >>> forward_positions(5, 2)
        (0, 3)
    """
    _check_counts(n, checkpoints)
    slots_left = min(checkpoints, n)
    positions = []
    position = 0
    while position < n:
        positions.append(position)
        remaining = n - position
        position += remaining if slots_left == 1 else _forward_split(remaining, slots_left)
        slots_left -= 1
    return tuple(positions)


@functools.lru_cache(maxsize=64)
def binomial(n: int, checkpoints: int) -> Schedule:
    """The optimal offline (revolve) schedule for n steps with ``checkpoints`` slots.

    Memory: at most ``checkpoints`` stored carries (x_0 included). Compute:
    ``evaluations(n, checkpoints)`` body calls, the minimum for that memory. Cached;
    O(n) Python for the arrays plus O(t) per checkpoint placement (t = log-like
    repetition number).

    Example::

        >>> s = binomial(10, 3)
        >>> s.evaluations == evaluations(10, 3), s.n_slots <= 3
        (True, True)
    """
    _check_counts(n, checkpoints)
    c = min(checkpoints, n)
    forward = array("l", forward_positions(n, checkpoints))
    builder = _Builder()
    bounds = list(forward) + [n]
    for segment in range(len(forward) - 1, -1, -1):
        start = bounds[segment]
        _revolve(builder, start, bounds[segment + 1] - start, segment, segment + 1, c)
    used = max([len(forward)] + [s + 1 for s in builder.store_slot])
    return Schedule(
        n_steps=n,
        n_checkpoints=checkpoints,
        n_slots=used,
        forward_positions=forward,
        restore_slot=builder.restore_slot,
        restore_position=builder.restore_position,
        store_offsets=builder.store_offsets,
        store_position=builder.store_position,
        store_slot=builder.store_slot,
        evaluations=2 * n + builder.advances,
    )


@dataclasses.dataclass(frozen=True)
class NestedSchedule:
    """Nested ``lax.scan`` + ``jax.checkpoint`` plan for n steps.

    Level 0 scans ``n_chunks`` chunks of ``chunk`` steps (each chunk under
    ``jax.checkpoint``, planned by ``inner``) and then one ``remainder`` chunk of
    ``n_steps - n_chunks * chunk`` steps (planned by ``remainder_inner``). With one level it
    is a plain scan.

    Attributes:
      evaluations: body calls under ``jax.grad``: n for the forward pass plus, per chunk,
        the evaluations of its own plan when ``jax.checkpoint`` replays it (``levels * n``
        when every level has more than one step); a plain scan (levels=1) evaluates n
        times.
      carries: carries stored at the peak (the chunk boundaries of every level on the
        current path) plus the innermost chunk's steps, whose residuals are kept.

    Example::

        >>> plan = nested(100, 2)  # 10 chunks of 10 steps
        >>> plan.chunk, plan.n_chunks, plan.inner.n_steps, plan.carries
        (10, 10, 10, 20)
    """

    n_steps: int
    levels: int
    chunk: int
    n_chunks: int
    inner: NestedSchedule | None
    remainder_inner: NestedSchedule | None
    evaluations: int
    carries: int


def segmented(n: int, steps: int) -> NestedSchedule:
    """Two levels: segments of ``steps`` steps (the last one shorter), each replayed and
    differentiated by ``lax.scan``'s own backward: ``ceil(n / steps)`` segment carries,
    ``steps`` steps' residuals, 2n body evaluations. The plan of ``memwise.scan(...,
    schedule="nested", offload="host")``, whose segment carries live in host memory, so
    the device holds one segment whatever n is.

    Example::

        >>> plan = segmented(1_000, 300)  # 3 segments of 300 steps, one of 100
        >>> plan.n_chunks, plan.remainder_inner.n_steps, plan.evaluations
        (3, 100, 2000)
    """
    _check_counts(n, 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    steps = min(steps, n)
    n_chunks, rest = divmod(n, steps)
    return NestedSchedule(
        n_steps=n,
        levels=2,
        chunk=steps,
        n_chunks=n_chunks,
        inner=nested(steps, 1),
        remainder_inner=nested(rest, 1) if rest else None,
        evaluations=2 * n,
        carries=n_chunks + (1 if rest else 0) + steps,
    )


@functools.lru_cache(maxsize=1024)
def nested(n: int, levels: int) -> NestedSchedule:
    """Plan ``levels`` nested checkpointed scans over n steps (chunks ~ n**(1/levels)).

    Memory: about ``levels * n**(1/levels)`` carries; compute: ``levels * n`` body
    evaluations under ``jax.grad``. Unlike ``binomial`` it is built from ``lax.scan`` and
    ``jax.checkpoint`` only, so it composes with ``jvp``, ``vmap`` and ``grad(grad)``.

    Example::

        >>> plan = nested(10_000, 2)
        >>> plan.chunk, plan.n_chunks, plan.evaluations
        (100, 100, 20000)
    """
    _check_counts(n, 1)
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1, got {levels!r}")
    if levels == 1 or n == 1:
        return NestedSchedule(n, 1, 1, n, None, None, n, n)
    chunk = max(1, min(n, math.ceil(round(n ** ((levels - 1) / levels), 9))))
    n_chunks, rest = divmod(n, chunk)
    inner = nested(chunk, levels - 1)
    remainder_inner = nested(rest, levels - 1) if rest else None
    carries = (
        n_chunks
        + (1 if rest else 0)
        + max(inner.carries, remainder_inner.carries if remainder_inner else 0)
    )
    return NestedSchedule(
        n_steps=n,
        levels=levels,
        chunk=chunk,
        n_chunks=n_chunks,
        inner=inner,
        remainder_inner=remainder_inner,
        evaluations=n
        + n_chunks * inner.evaluations
        + (remainder_inner.evaluations if remainder_inner else 0),
        carries=carries,
    )


# --------------------------------------------------------------------------------------
# online: loops whose length is unknown while they run


def _segment_advances(length: int, slots: int) -> int:
    """p(length, slots) without input checks (0 for length <= 1)."""
    if length <= 1:
        return 0
    if slots == 1:
        return length * (length - 1) // 2
    t, beta = 1, slots + 1  # beta = beta(slots, t)
    while beta < length:
        t += 1
        beta = beta * (slots + t) // t
    return t * length - beta * t // (slots + 1)  # beta(slots + 1, t - 1) = beta * t / (s + 1)


def reversal_advances(positions: Iterable[int], n: int, checkpoints: int) -> int:
    """Backward advances to reverse n steps from the carries a forward pass stored.

    ``positions`` (sorted, starting at 0, at most ``checkpoints`` of them) are the steps
    whose carries are held when the backward pass starts. Segment k (from
    ``positions[k]`` to the next position, or n) is reversed last-first by revolve with
    ``checkpoints - k`` slots (its own and those the later segments freed):
    sum_k p(len_k, c - k). With the positions of ``binomial(n, c)`` this is
    ``advances(n, c)``. Example::

        >>> reversal_advances([0, 5, 8], 10, 3), advances(10, 3)
        (8, 8)
    """
    _check_counts(n, checkpoints)
    positions = list(positions)
    if not positions or positions[0] != 0 or positions != sorted(set(positions)):
        raise ValueError(f"positions must be sorted, distinct and start at 0, got {positions}")
    if len(positions) > checkpoints or positions[-1] >= n:
        raise ValueError(
            f"positions {positions} do not fit {checkpoints} checkpoints and {n} steps"
        )
    bounds = positions + [n]
    return sum(
        _segment_advances(bounds[k + 1] - bounds[k], checkpoints - k) for k in range(len(positions))
    )


class OnlineCheckpointer:
    """Decides, step by step and without knowing n, which carries the forward pass keeps.

    The loop offers every carry x_i (i = 1, 2, ...) in order; x_0 is always kept. While
    a slot is free the carry is stored. Once the ``checkpoints`` slots are full, storing
    x_i means evicting a stored carry k >= 1, which merges the segments on either side of
    it and gives every later segment one more slot for its reversal. The rule is a
    one-step lookahead on the exact reversal cost (:func:`reversal_advances`): store x_i,
    evicting the carry that costs least, exactly when that makes reversing cheaper at
    the horizon n = i + L + 1, L being the length of the open last segment (the loop is
    assumed to run as long again as that segment). Ties keep the current carries, then
    evict the earliest.

    Results relied on and measured (``benchmarks/while_loop.py`` and the tests): the
    rule is exactly optimal (it matches ``evaluations(n, c)``) for n < (c+1)(c+2)/2,
    the range of Stumm & Walther's (2010) "Algorithm I" ("New algorithms for optimal
    online checkpointing", SIAM J. Sci. Comput. 32(2)); like the dynamic checkpointing
    of Wang, Moin & Iaccarino (2009, SIAM J. Sci. Comput. 31(4)) it keeps going for any
    n. Unlike both, it is measured against the offline optimum rather than proven: for
    every n <= 10,000 its evaluations are within 5.0%, 4.0%, 2.0% and 0.1% of
    ``evaluations(n, c)`` at c = 4, 8, 16 and 64 (11% at c = 2, 10% at c = 3). The
    backward pass (``memwise.while_loop``) reverses each segment with optimal revolve,
    where Equinox's bisects.

    Memory/compute: O(c) state. The decision at each step reads the open segment's
    length and one cached number; a store recomputes the eviction costs, O(c).

    Example::

        >>> online = OnlineCheckpointer(3)
        >>> for i in range(1, 10):
        ...     _ = online.offer(i)
        >>> online.positions, online.evaluations(10), evaluations(10, 3)
        ([0, 4, 9], 29, 28)
    """

    def __init__(self, checkpoints: int):
        _check_counts(1, checkpoints)
        self.n_checkpoints = checkpoints
        self.positions = [0]
        self._eviction = (math.inf, 0)  # (cost, index) of the best closed-segment merge

    def offer(self, i: int) -> bool:
        """x_i is in hand (offers come in order, i >= 1): store it? Returns True if stored."""
        c, positions = self.n_checkpoints, self.positions
        if i <= positions[-1]:
            raise ValueError(f"offers must come in increasing order, got {i} after {positions[-1]}")
        if len(positions) < c:
            positions.append(i)
            self._eviction = self._closed_evictions()
            return True
        if c == 1:
            return False
        length = i - positions[-1]
        last_closed = positions[-1] - positions[-2]
        # Evicting the newest carry merges the open segment into the last closed one.
        merge_newest = (
            _segment_advances(last_closed + length, 2)
            - _segment_advances(last_closed, 2)
            - _segment_advances(length, 2)
        )
        best_closed, closed_index = self._eviction
        stored = (
            _segment_advances(length, 2)
            + _segment_advances(length + 1, 1)
            + min(best_closed, merge_newest)
        )
        if not stored < _segment_advances(2 * length + 1, 1):
            return False
        evict = closed_index if best_closed <= merge_newest else c - 1
        del positions[evict]
        positions.append(i)
        self._eviction = self._closed_evictions()
        return True

    def _closed_evictions(self) -> tuple[float, int]:
        """(cost, k) of the cheapest eviction k in 1..c-2 (ties: smallest k).

        Evicting k merges closed segments k-1 and k (now reversed with c-k+1 slots) and
        gives each later closed segment one more slot; only meaningful once full.
        """
        c, positions = self.n_checkpoints, self.positions
        if len(positions) < c or c < 3:
            return (math.inf, 0)
        lengths = [positions[j + 1] - positions[j] for j in range(c - 1)]
        own = [_segment_advances(lengths[j], c - j) for j in range(c - 1)]
        gain = [_segment_advances(lengths[j], c - j + 1) - own[j] for j in range(c - 1)]
        best = (math.inf, 0)
        later = 0  # sum of gains of closed segments after k
        for k in range(c - 2, 0, -1):
            merged = _segment_advances(lengths[k - 1] + lengths[k], c - k + 1)
            cost = merged - _segment_advances(lengths[k - 1], c - k + 1) - own[k] + later
            if cost <= best[0]:
                best = (cost, k)
            later += gain[k]
        return best

    def evaluations(self, n: int) -> int:
        """Body evaluations if the loop stops at n (after offers up to n - 1): forward,
        revolve reversal of every segment, differentiated steps."""
        return 2 * n + reversal_advances(self.positions, n, self.n_checkpoints)


def online_positions(n: int, checkpoints: int) -> list[int]:
    """The steps whose carries :class:`OnlineCheckpointer` holds after n steps.

    Example::

        >>> online_positions(10, 3)
        [0, 4, 9]
    """
    _check_counts(n, checkpoints)
    online = OnlineCheckpointer(checkpoints)
    for i in range(1, n):
        online.offer(i)
    return online.positions


def online_evaluations(n: int, checkpoints: int) -> int:
    """Body evaluations under reverse mode of a loop that stopped after n steps, with
    the online placement and revolve reversal (``memwise.while_loop``): at least
    ``evaluations(n, checkpoints)``, equal for n < (c+1)(c+2)/2. O(n) Python.

    Example::

        >>> online_evaluations(1000, 8), evaluations(1000, 8)
        (5301, 5290)
    """
    _check_counts(n, checkpoints)
    return 2 * n + reversal_advances(online_positions(n, checkpoints), n, checkpoints)
