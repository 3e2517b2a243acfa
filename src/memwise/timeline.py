"""Live memory along a compiled program's schedule, read from XLA's own buffer analysis.

XLA schedules every instruction of a compiled program and assigns every buffer before
anything runs. Compiling with ``compiler_options={"xla_dump_to": DIR,
"xla_dump_hlo_as_text": True}`` writes that analysis next to the optimized HLO:

* ``*after_optimizations-live-range.txt``: the flattened instruction sequence (a while
  loop's condition and body are inlined once, before the ``while`` instruction itself)
  and the live range ``[start, end]`` (inclusive steps) of every value;
* ``*after_optimizations-buffer-assignment.txt``: every allocation (argument, output,
  constant, the temporaries' heap) and the size and offset of each value in it;
* ``*after_optimizations.txt``: the optimized HLO, whose instructions carry
  ``op_name`` and source metadata (a ``stack_frame_id`` into the module's
  ``FileLocations``/``StackFrames`` tables, or ``source_file``/``source_line``).

This module parses those three files (plain Python, tested on small texts) into a
:class:`Timeline`: the bytes live at every step, the peak step and the buffers alive
there, each with its shape, the producing operation and the user's source line. Values
that XLA places at the same offset of the same allocation while both are live are one
buffer seen twice (a while loop's carry and its body's parameter, a tuple and its
elements), so each such slot is counted once.

The dump is written to a temporary directory that is removed afterwards. The program is
compiled again for it with JAX's persistent compilation cache bypassed, since a cache hit
would return the executable without running the compiler, and so without a dump.

Relation to ``memory_analysis()``: the allocator packs values into allocations, and an
argument or output allocation is counted for the whole program, so the timeline's
maximum is at most arguments + outputs - aliased + temporaries and falls short of it
only by what the packing leaves unused at the peak step.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from memwise._display import _pyplot, check_plot_path, format_bytes

__all__ = ["Buffer", "Loop", "Timeline", "argument_source", "of_lowered", "parse_dump"]


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


# HLO element types: (numpy name, bytes per element).
_DTYPES = {
    "pred": ("bool", 1),
    "s8": ("int8", 1),
    "s16": ("int16", 2),
    "s32": ("int32", 4),
    "s64": ("int64", 8),
    "u8": ("uint8", 1),
    "u16": ("uint16", 2),
    "u32": ("uint32", 4),
    "u64": ("uint64", 8),
    "f16": ("float16", 2),
    "bf16": ("bfloat16", 2),
    "f32": ("float32", 4),
    "f64": ("float64", 8),
    "c64": ("complex64", 8),
    "c128": ("complex128", 16),
}


def _array_type(text: str) -> tuple[tuple[int, ...], str, int]:
    """``f32[128,256]{1,0}`` -> ((128, 256), 'float32', 131072); a tuple -> ((), 'tuple', 0)."""
    match = re.match(r"\s*([a-z]+[0-9]*)\[([0-9,\s]*)\]", text)
    if text.lstrip().startswith("(") or match is None:
        return (), "tuple", 0
    dims = tuple(int(d) for d in match[2].split(",") if d.strip())
    dtype, itemsize = _DTYPES.get(match[1], (match[1], 0))
    return dims, dtype, int(np.prod(dims, dtype=np.int64)) * itemsize


# ----------------------------------------------------------------------------------------
# parsers of the three dump files


def parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """(instruction per step, {value name: (start, end)}) from a live-range dump."""
    steps: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "sequence"
        elif stripped == "BufferLiveRange:":
            section = "ranges"
        elif stripped.startswith("Live ranges at") or stripped.startswith("Stack trace"):
            section = None
        elif section == "sequence" and (m := re.fullmatch(r"(\d+):(\S+)", stripped)):
            steps.append(m[2])
        elif section == "ranges" and (m := re.fullmatch(r"(\S+?):(\d+)-(\d+)", stripped)):
            ranges[m[1]] = (int(m[2]), int(m[3]))
    if not steps:
        raise ValueError("the live-range dump has no InstructionSequence")
    return steps, ranges


@dataclasses.dataclass(frozen=True)
class _Value:
    size: int
    allocation: int
    offset: int
    kind: str
    type_text: str


def _value_key(name: str) -> str:
    """Live-range names carry a tuple index (``x{}``); buffer assignment omits ``{}``."""
    return name if name.endswith("}") else name + "{}"


def parse_buffer_assignment(text: str) -> dict[str, _Value]:
    """{value name with index: its size, allocation, offset and kind}."""
    values: dict[str, _Value] = {}
    allocation, kind = -1, "temporary"
    for line in text.splitlines():
        if m := re.match(r"allocation (\d+): size \d+(.*):\s*$", line):
            allocation, attributes = int(m[1]), m[2]
            if "parameter" in attributes:
                kind = "argument"
            elif "output shape" in attributes or "maybe-live-out" in attributes:
                kind = "output"
            elif "constant" in attributes:
                kind = "constant"
            else:
                kind = "temporary"
        elif m := re.match(
            r"\s*value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$", line
        ):
            values[_value_key(m[1])] = _Value(int(m[2]), allocation, int(m[3]), kind, m[4])
        elif line.startswith("BufferAssignment stats") or line.startswith("Used values"):
            break
    return values


@dataclasses.dataclass(frozen=True)
class _Instruction:
    opcode: str
    type_text: str
    computation: str
    op_name: str
    source: str
    calls: dict


def _source_tables(text: str) -> dict[int, str]:
    """{stack frame id: 'file:line'} from the module's FileNames..StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            current = None if not line.strip() else current
            if line.startswith(("%", "ENTRY")):
                break
        elif current is not None and (m := re.match(r"(\d+) (.*)$", line)):
            current[int(m[1])] = m[2]
    files = {
        i: json.loads(v) if v.startswith('"') else v for i, v in tables.get("FileNames", {}).items()
    }
    locations = {}
    for i, v in tables.get("FileLocations", {}).items():
        file_id = re.search(r"file_name_id=(\d+)", v)
        line_no = re.search(r"\bline=(\d+)", v)
        if file_id and line_no:
            locations[i] = f"{files.get(int(file_id[1]), '?')}:{line_no[1]}"
    frames = {}
    for i, v in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", v)
        if location and int(location[1]) in locations:
            frames[i] = locations[int(location[1])]
    return frames


_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>\(.*?\)|\S+) (?P<opcode>[a-z][\w-]*)\("
)


def parse_hlo(text: str) -> dict[str, _Instruction]:
    """{instruction name: opcode, result type, computation, op_name, user source}."""
    frames = _source_tables(text)
    instructions: dict[str, _Instruction] = {}
    computation = ""
    for line in text.splitlines():
        if line.startswith("%") or line.startswith("ENTRY %"):
            computation = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            continue
        m = _INSTRUCTION_RE.match(line)
        if m is None:
            continue
        op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
        source = ""
        if (file_m := re.search(r'source_file="([^"]*)"', line)) and (
            line_m := re.search(r"source_line=(\d+)", line)
        ):
            source = f"{file_m[1]}:{line_m[1]}"
        elif frame := re.search(r"stack_frame_id=(\d+)", line):
            source = frames.get(int(frame[1]), "")
        calls = {key: value for key, value in re.findall(r"\b(condition|body)=%(\S+?)[,\s]", line)}
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        if trip:
            calls["trip_count"] = int(trip[1])
        instructions[m["name"]] = _Instruction(
            m["opcode"],
            m["type"],
            computation,
            op_name[1] if op_name else "",
            source,
            calls,
        )
    return instructions


# ----------------------------------------------------------------------------------------
# the timeline


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
        return _live_bytes(len(self.steps), chosen, self._slots)

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


def _op(instruction: _Instruction | None) -> str:
    if instruction is None:
        return ""
    if instruction.op_name and instruction.opcode != "parameter":
        return instruction.op_name.rstrip("/").rsplit("/", 1)[-1]
    return instruction.opcode


def parse_dump(live_range: str, buffer_assignment: str, hlo: str, *, name: str = "") -> Timeline:
    """A :class:`Timeline` from the texts of the three dump files (see the module doc)."""
    steps, ranges = parse_live_range(live_range)
    values = parse_buffer_assignment(buffer_assignment)
    instructions = parse_hlo(hlo)
    step_of = {instr: i for i, instr in enumerate(steps)}

    # While loops: the steps of their body computation (nested loops included).
    computation_steps: dict[str, list[int]] = {}
    for i, instr in enumerate(steps):
        info = instructions.get(instr)
        if info is not None:
            computation_steps.setdefault(info.computation, []).append(i)
    loops = []
    for instr, info in instructions.items():
        if info.opcode == "while" and instr in step_of:
            span = [
                s
                for key in ("condition", "body")
                for s in computation_steps.get(info.calls.get(key, ""), [])
            ]
            if span:
                loops.append(
                    Loop(
                        instr,
                        min(span),
                        max(span),
                        step_of[instr],
                        info.calls.get("trip_count"),
                        info.source,
                    )
                )
    loops.sort(key=lambda lp: (lp.first, -lp.last))  # outer loops before inner ones

    buffers, slot_of = [], {}
    for value_name, (start, end) in ranges.items():
        instr_name = value_name.split("{", 1)[0]
        info = instructions.get(instr_name)
        value = values.get(_value_key(value_name))
        type_text = value.type_text if value else (info.type_text if info else "")
        shape, dtype, nbytes = _array_type(type_text)
        size = value.size if value else nbytes
        kind = value.kind if value else "temporary"
        inside = [lp for lp in loops if lp.first <= start <= lp.last]
        op, source = _op(info), info.source if info else ""
        if info is not None and info.opcode == "parameter":
            if info.computation == _entry(instructions, steps):
                source = argument_source(info.op_name) if info.op_name else "argument"
            elif inside:
                op = "loop carry"
        if not source and inside:  # made by XLA inside a loop: the loop's line
            source = inside[-1].source
        buffers.append(
            Buffer(
                value_name,
                shape,
                dtype,
                size,
                kind,
                op,
                source,
                start,
                end,
                inside[-1].name if inside else "",
            )
        )
        # Values at the same offset of one allocation, live at once, are one buffer.
        slot_of[value_name] = (
            (value.allocation, value.offset) if value else ("unassigned", value_name)
        )
    live = _live_bytes(len(steps), buffers, slot_of)
    return Timeline(
        name,
        tuple(steps),
        tuple(int(v) for v in live),
        tuple(sorted(buffers, key=lambda b: (b.start, b.name))),
        tuple(loops),
        slot_of,
    )


def _entry(instructions: dict[str, _Instruction], steps: Sequence[str]) -> str:
    last = instructions.get(steps[-1]) if steps else None
    return last.computation if last else ""


def _live_bytes(n_steps: int, buffers: Iterable[Buffer], slot_of: dict[str, tuple]) -> np.ndarray:
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


# ----------------------------------------------------------------------------------------
# compiling with the dump


def _read(folder: str, suffix: str) -> str:
    matches = sorted(glob.glob(os.path.join(folder, f"*after_optimizations{suffix}")))
    if not matches:
        raise RuntimeError(
            f"XLA wrote no '*after_optimizations{suffix}' file; this backend does not dump "
            "its buffer assignment, so memwise cannot draw a memory timeline for it"
        )
    with open(matches[-1]) as f:
        return f.read()


def of_lowered(lowered: Any, *, name: str = "") -> Timeline:
    """Compiles a ``jax.stages.Lowered`` with XLA's dump on and returns its timeline.

    The dump goes to a temporary directory, removed afterwards; JAX's persistent
    compilation cache is bypassed for this compilation so the compiler always runs.
    Prefer :meth:`memwise.measure.MemoryReport.timeline`, which prepares the program
    (static arguments, ``grad``) as the report does.
    """
    from memwise import _jax_private

    folder = tempfile.mkdtemp(prefix="memwise-timeline-")
    try:
        options = {
            "xla_dump_to": folder,
            "xla_dump_hlo_as_text": True,
            "xla_dump_hlo_module_re": ".*",
        }
        with _jax_private.persistent_cache_bypassed():
            lowered.compile(compiler_options=options)
        return parse_dump(
            _read(folder, "-live-range.txt"),
            _read(folder, "-buffer-assignment.txt"),
            _read(folder, ".txt"),
            name=name,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
