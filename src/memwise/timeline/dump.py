"""Reading XLA's buffer analysis from its dump files into a :class:`~memwise.timeline.Timeline`.

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

The parsers are plain Python, tested on small texts; :func:`parse_dump` joins the three
files into buffers (shape, producing operation, user source line, the loop that defines
them) and loops; :func:`of_lowered` compiles a program with the dump on and reads it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from memwise.timeline.live import Buffer, Loop, Timeline, argument_source, bytes_per_step

__all__ = [
    "of_lowered",
    "parse_buffer_assignment",
    "parse_dump",
    "parse_hlo",
    "parse_live_range",
]


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
# the three files joined into a timeline


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
    live = bytes_per_step(len(steps), buffers, slot_of)
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
