"""The memory timeline: bytes live at every step of a compiled schedule, and who is live.

A :class:`Timeline` holds the steps of a compiled program's schedule, every
:class:`Buffer` with its live range, and the while loops (:class:`Loop`) whose body the
schedule shows once. It answers what is live at a step (:meth:`Timeline.live_at`, the
peak's :meth:`Timeline.at_peak`), the curve restricted to some kinds of buffer, and shows
itself as text, a dict or a plot. Values placed at one offset of one allocation while
both are live are one slot, counted once with the largest of its values live at a step
(:func:`bytes_per_step`). Reading XLA's dump into a timeline is
:mod:`memwise.timeline.dump`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np

from memwise._display import _pyplot, check_plot_path, format_bytes

__all__ = ["Buffer", "Loop", "Timeline", "argument_source", "bytes_per_step"]


def argument_source(name: str) -> str:
    """``"argument 'params'"`` for a leaf path such as ``params[0]`` or ``params.w``.

    The one place memwise names an argument as a source: leaves of one argument are
    grouped under it (residuals and timeline buffers alike).
    """
    base = re.split(r"[\[.]", name, maxsplit=1)[0] or name
    return f"argument {base!r}"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value of the compiled program and the steps during which it is live.

    ``name`` is XLA's (instruction and tuple index, e.g. ``fusion.3{}``); ``kind`` is
    ``"argument"``, ``"output"``, ``"constant"`` or ``"temporary"``; ``op`` the JAX
    operation that produced it (the HLO opcode when XLA made it); ``source`` the user's
    ``file:line`` (memwise's own frames attributed to the line that called memwise), or
    ``argument 'x'``; ``loop`` the while loop whose body defines it ("" outside loops).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    op: str
    source: str
    start: int
    end: int
    loop: str = ""


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop in the schedule: its body occupies ``steps[first:last + 1]`` once.

    ``trip_count`` is XLA's known trip count (None when XLA does not know it).
    """

    name: str
    first: int
    last: int
    step: int
    trip_count: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Bytes live at every step of a compiled program's schedule. See :func:`of_lowered`.

    Attributes:
      name: what was compiled (``"gradient of loss"``).
      steps: the instruction at each step, in schedule order (a while loop's body is
        inlined once, as one iteration, right before the ``while`` step; see ``loops``).
      live_bytes: bytes of the buffers live at each step.
      peak_step: the first step where ``live_bytes`` is largest.
      buffers: every buffer with its live range ``[start, end]``.
      loops: the while loops, with the steps their body occupies.
    """

    name: str
    steps: tuple[str, ...]
    live_bytes: tuple[int, ...]
    buffers: tuple[Buffer, ...]
    loops: tuple[Loop, ...] = ()
    # Buffer name -> (allocation, offset): values sharing a slot while live are one buffer.
    _slot_of: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def curve(
        self, kinds: Sequence[str] = ("argument", "output", "temporary", "constant")
    ) -> np.ndarray:
        """Bytes live per step, counting only buffers of these ``kinds``.

        ``curve(("argument", "output", "temporary"))`` leaves out XLA's constants (tables
        baked into the program, e.g. a checkpoint schedule), which ``memory_analysis()``
        does not count in its arguments, outputs or temporaries.
        """
        unknown = set(kinds) - {"argument", "output", "temporary", "constant"}
        if unknown:
            raise ValueError(
                f"kinds must be among 'argument', 'output', 'temporary', "
                f"'constant'; got {sorted(unknown)}"
            )
        chosen = [b for b in self.buffers if b.kind in kinds]
        return bytes_per_step(len(self.steps), chosen, self._slots)

    @property
    def peak_step(self) -> int:
        return int(np.argmax(self.live_bytes)) if self.live_bytes else 0

    @property
    def peak_bytes(self) -> int:
        return int(max(self.live_bytes, default=0))

    def live_at(self, step: int) -> list[Buffer]:
        """Buffers live at ``step``, largest first (one per slot, as counted)."""
        if not 0 <= step < len(self.steps):
            raise ValueError(f"step must be in [0, {len(self.steps)}), got {step}")
        seen: dict[tuple, Buffer] = {}
        for b in self.buffers:
            if b.start <= step <= b.end:
                slot = self._slots[b.name]
                if slot not in seen or b.nbytes > seen[slot].nbytes:
                    seen[slot] = b
        return sorted(seen.values(), key=lambda b: (-b.nbytes, b.name))

    def at_peak(self) -> list[Buffer]:
        """Buffers alive at the peak step, largest first."""
        return self.live_at(self.peak_step)

    @property
    def _slots(self) -> dict[str, tuple]:
        return {b.name: self._slot_of.get(b.name, ("own", b.name)) for b in self.buffers}

    def to_dict(self, max_buffers: int = 50) -> dict:
        """JSON-ready: the curve, the peak, the largest buffers at the peak and the loops."""
        return {
            "name": self.name,
            "steps": list(self.steps),
            "live_bytes": list(self.live_bytes),
            "peak_step": self.peak_step,
            "peak_bytes": self.peak_bytes,
            "at_peak": [dataclasses.asdict(b) for b in self.at_peak()[:max_buffers]],
            "loops": [dataclasses.asdict(loop) for loop in self.loops],
        }

    def to_text(self, max_rows: int = 12) -> str:
        """The peak, the buffers alive there (largest first) and the loops."""
        peak = self.peak_step
        lines = [
            f"memory timeline: {self.name}  ({len(self.steps)} steps of the compiled schedule)",
            f"  peak {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B) at step {peak} "
            f"({self.steps[peak]}{self._in_loop(peak)})",
        ]
        rows = [
            (
                format_bytes(b.nbytes),
                f"{b.dtype}{list(b.shape)}",
                b.kind,
                b.op,
                f"{b.start}-{b.end}",
                b.source,
            )
            for b in self.at_peak()
        ]
        shown, hidden = rows[:max_rows], rows[max_rows:]
        header = ("bytes", "shape", "kind", "op", "live", "source")
        widths = [max(len(h), *(len(r[i]) for r in shown)) for i, h in enumerate(header)]
        a, b, c, d, e = widths[:5]
        fmt = f"  {{:>{a}}}  {{:<{b}}}  {{:<{c}}}  {{:<{d}}}  {{:>{e}}}  {{}}"
        lines.append("  buffers alive at the peak, largest first:")
        lines.append(fmt.format(*header))
        lines.extend(fmt.format(*r) for r in shown)
        if hidden:
            rest = sum(b.nbytes for b in self.at_peak()[max_rows:])
            lines.append(f"  ... {len(hidden)} more, {format_bytes(rest)}")
        for loop in sorted(self.loops, key=lambda lp: lp.step):
            trips = f"{loop.trip_count} iterations" if loop.trip_count else "trip count unknown"
            lines.append(
                f"  while loop {loop.name} (step {loop.step}, {trips}, {loop.source or '?'}): "
                f"its body is steps {loop.first}-{loop.last}, shown once"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def _in_loop(self, step: int) -> str:
        inner = [lp for lp in self.loops if lp.first <= step <= lp.last]
        return f", in the body of {inner[-1].name}" if inner else ""

    def plot(self, path: str | os.PathLike, *, top: int = 6) -> None:
        """Live bytes along the schedule, the peak marked, the top buffers' live ranges.

        The upper panel is the curve (while-loop bodies shaded: one iteration each); the
        lower one draws the ``top`` largest buffers alive at the peak as bars over the
        steps where they are live, labelled with shape, operation and source line.

        Raises:
          ValueError: when ``path`` is a folder, its folder does not exist or is not
            writable, or matplotlib cannot write its file format (checked first).
        """
        check_plot_path(path)
        plt = _pyplot()
        buffers = self.at_peak()[:top]
        fig, (ax, bars) = plt.subplots(
            2,
            1,
            figsize=(10, 4.5 + 0.35 * len(buffers)),
            sharex=True,
            gridspec_kw={"height_ratios": [3, 0.6 + 0.3 * len(buffers)]},
        )
        x = np.arange(len(self.steps))
        mib = np.asarray(self.live_bytes, dtype=float) / 2**20
        ax.step(x, mib, where="mid", color="tab:blue", linewidth=1.2)
        ax.fill_between(x, mib, step="mid", alpha=0.15, color="tab:blue")
        for i, loop in enumerate(self.loops):
            trips = f" x{loop.trip_count}" if loop.trip_count else ""
            ax.axvspan(
                loop.first - 0.5,
                loop.last + 0.5,
                color="tab:orange",
                alpha=0.12,
                label="while-loop body (one iteration shown)" if i == 0 else None,
            )
            ax.text(
                (loop.first + loop.last) / 2,
                0.02,
                f"loop{trips}",
                ha="center",
                va="bottom",
                fontsize=7,
                color="tab:orange",
                transform=ax.get_xaxis_transform(),
            )
        peak = self.peak_step
        ax.plot([peak], [mib[peak]], "o", color="tab:red")
        ax.annotate(
            f"peak {format_bytes(self.peak_bytes)}",
            (peak, mib[peak]),
            textcoords="offset points",
            xytext=(8, -4),
            color="tab:red",
            fontsize=9,
        )
        ax.set_ylabel("live MiB")
        ax.set_title(f"{self.name}: live memory along the compiled schedule")
        if self.loops:
            ax.legend(loc="upper left", fontsize=8)
        for row, b in enumerate(buffers):
            bars.barh(
                row,
                b.end - b.start + 1,
                left=b.start - 0.5,
                height=0.6,
                color="tab:red" if row == 0 else "tab:gray",
                alpha=0.7,
            )
            label = (
                f"{format_bytes(b.nbytes)} {b.dtype}{list(b.shape)} {b.op} "
                f"{os.path.basename(b.source) if ':' in b.source else b.source}"
            )
            bars.text(b.start, row, " " + label, va="center", fontsize=7)
        bars.set_yticks([])
        bars.invert_yaxis()
        bars.set_xlabel("step of the compiled schedule")
        bars.set_ylabel("largest at peak", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def bytes_per_step(
    n_steps: int, buffers: Iterable[Buffer], slot_of: dict[str, tuple]
) -> np.ndarray:
    """Bytes live per step: each slot counts the largest of its values live at a step."""
    by_slot: dict[tuple, list[Buffer]] = {}
    for b in buffers:
        by_slot.setdefault(slot_of[b.name], []).append(b)
    delta = np.zeros(n_steps + 1, dtype=np.int64)
    total = np.zeros(n_steps, dtype=np.int64)
    for members in by_slot.values():
        if len(members) == 1:
            b = members[0]
            delta[b.start] += b.nbytes
            delta[min(b.end, n_steps - 1) + 1] -= b.nbytes
            continue
        occupied = np.zeros(n_steps, dtype=np.int64)
        for b in members:
            segment = occupied[b.start : b.end + 1]
            np.maximum(segment, b.nbytes, out=segment)
        total += occupied
    return total + np.cumsum(delta)[:n_steps]
