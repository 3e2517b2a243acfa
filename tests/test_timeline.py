"""The memory timeline: XLA's dump parsed step by step, checked against memory_analysis()."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import memwise as mw
from memwise import timeline

# ----------------------------------------------------------------------------------------
# the parsers, on small hand-written dumps

LIVE_RANGE = """\
HloLiveRange (max 7):
  InstructionSequence:
    0:x.1
    1:init
    2:arg
    3:body_op
    4:cond_op
    5:while.1
    6:out
  BufferLiveRange:
    x.1{}:0-7
    init{}:1-2
    arg{}:2-5
    body_op{}:3-5
    cond_op{}:4-4
    while.1{}:5-6
    out{}:6-7
  Live ranges at 3 (peak):
"""

BUFFER_ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 400, parameter 0, shape |f32[100]| at ShapeIndex {}:
 value: <1 x.1 @0> (size=400,offset=0): f32[100]{0}
allocation 1: size 40, output shape is |f32[10]|, maybe-live-out:
 value: <7 out @0> (size=40,offset=0): f32[10]{0}
allocation 2: size 1200, preallocated-temp:
 value: <2 init @0> (size=800,offset=0): f32[200]{0}
 value: <3 arg (phi) @0> (size=800,offset=0): f32[200]{0}
 value: <4 body_op @0> (size=400,offset=800): f32[10,10]{1,0}
 value: <5 cond_op @0> (size=1,offset=1199): pred[]
 value: <6 while.1 (phi) @0> (size=800,offset=0): f32[200]{0}
"""

HLO = """\
HloModule jit_f, is_scheduled=true

FileNames
1 "/home/user/model.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=4 end_column=20}
2 {file_name_id=1 function_name_id=1 line=15 end_line=15 column=4 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%body (arg: f32[200]) -> f32[200] {
  %arg = f32[200]{0} parameter(0)
  ROOT %body_op = f32[10,10]{1,0} fusion(%arg), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/while/body/tanh" stack_frame_id=1}
}

%cond (arg.2: f32[200]) -> pred[] {
  ROOT %cond_op = pred[] compare(%arg.2), metadata={op_name="jit(f)/while/cond/lt" source_file="/home/user/model.py" source_line=14}
}

ENTRY %main (x.1: f32[100]) -> f32[10] {
  %x.1 = f32[100]{0} parameter(0), metadata={op_name="params[0]"}
  %init = f32[200]{0} broadcast(%x.1), metadata={op_name="jit(f)/broadcast_in_dim" stack_frame_id=2}
  %while.1 = f32[200]{0} while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/while" stack_frame_id=2}, backend_config={"known_trip_count":{"n":"50"}}
  ROOT %out = f32[10]{0} slice(%while.1), slice={[0:10]}
}
"""


def test_parse_dump_counts_one_buffer_per_slot_and_names_sources():
    tl = timeline.parse_dump(LIVE_RANGE, BUFFER_ASSIGNMENT, HLO, name="f")
    assert tl.steps == ("x.1", "init", "arg", "body_op", "cond_op", "while.1", "out")
    # init, arg and while.1 share offset 0 of the temp heap: one 800-byte buffer, even at
    # steps 2 and 5 where two of them are live at once.
    assert tl.live_bytes == (400, 1200, 1200, 1600, 1601, 1600, 1240)
    assert (tl.peak_step, tl.peak_bytes) == (4, 1601)
    by_name = {b.name: b for b in tl.buffers}
    assert by_name["x.1{}"].source == "argument 'params'"
    assert by_name["x.1{}"].kind == "argument" and by_name["out{}"].kind == "output"
    assert by_name["body_op{}"].source == "/home/user/model.py:12"  # via stack_frame_id
    assert by_name["body_op{}"].op == "tanh" and by_name["body_op{}"].shape == (10, 10)
    assert by_name["cond_op{}"].source == "/home/user/model.py:14"  # via source_file
    assert by_name["arg{}"].op == "loop carry" and by_name["arg{}"].loop == "while.1"
    assert by_name["arg{}"].source == "/home/user/model.py:15"  # the loop's line
    (loop,) = tl.loops
    assert (loop.name, loop.first, loop.last, loop.step, loop.trip_count) == (
        "while.1",
        2,
        4,
        5,
        50,
    )
    assert [b.name for b in tl.at_peak()] == ["arg{}", "body_op{}", "x.1{}", "cond_op{}"]
    assert list(tl.curve(("argument",))) == [400] * 7


def test_bad_kinds_and_steps_name_the_argument():
    tl = timeline.parse_dump(LIVE_RANGE, BUFFER_ASSIGNMENT, HLO)
    with pytest.raises(ValueError, match="kinds must be among"):
        tl.curve(("temps",))
    with pytest.raises(ValueError, match=r"step must be in \[0, 7\)"):
        tl.live_at(7)


def test_a_dump_without_a_schedule_is_refused():
    with pytest.raises(ValueError, match="no InstructionSequence"):
        timeline.parse_dump("HloLiveRange (max 0):\n", "", "")


# ----------------------------------------------------------------------------------------
# real programs: the timeline's maximum against memory_analysis()


def mlp(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)  # the mlp's line
    return jnp.sum(h**2)


def scanned(w, xs):
    step = lambda h, x: (jnp.tanh(w @ h + x), h.sum())  # noqa: E731
    h, ys = jax.lax.scan(step, jnp.zeros(64), xs)
    return h.sum() + ys.sum()


def checkpointed(w, xs):
    step = lambda h, x: (jnp.tanh(w @ h + x), h.sum())  # noqa: E731
    h, ys = mw.scan(step, jnp.zeros(64), xs, checkpoints=4)
    return h.sum() + ys.sum()


def pairwise(x, y):
    return jnp.sum(
        mw.pairwise_reduce(
            lambda a, b: -jnp.sum((a - b) ** 2), x, y, reduce="logsumexp", chunk_size=(128, 128)
        )
    )


PROGRAMS = {
    "mlp gradient": (mlp, ([jnp.ones((128, 128)) / 128] * 3, jnp.ones((64, 128))), True),
    "mlp forward": (mlp, ([jnp.ones((128, 128)) / 128] * 3, jnp.ones((64, 128))), False),
    "lax.scan gradient": (scanned, (jnp.eye(64), jnp.ones((300, 64))), True),
    "mw.scan gradient": (checkpointed, (jnp.eye(64), jnp.ones((300, 64))), True),
    "pairwise_reduce gradient": (pairwise, (jnp.ones((700, 3)), jnp.ones((500, 3))), True),
}


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.slow
def test_timeline_peak_matches_memory_analysis_within_packing(program):
    fn, args, grad = PROGRAMS[program]
    report = mw.memory_report(fn, *args, grad=grad)
    tl = report.timeline()
    assigned = report.argument_bytes + report.output_bytes - report.alias_bytes + report.temp_bytes
    # XLA's constants (schedule tables) are outside memory_analysis()'s three totals.
    peak = int(tl.curve(("argument", "output", "temporary")).max())
    # Never above what XLA assigned; below it only by what packing leaves unused (and
    # output allocations, counted by memory_analysis for the whole program).
    assert peak <= assigned
    assert peak >= 0.9 * assigned, (peak, assigned)
    assert tl.peak_bytes == max(tl.live_bytes) >= peak
    assert report.timeline() is tl  # compiled once


def test_buffers_at_the_peak_name_the_users_line():
    fn, args, grad = PROGRAMS["mlp gradient"]
    tl = mw.memory_report(fn, *args, grad=grad).timeline()
    line = next(i for i, text in enumerate(open(__file__), 1) if "# the mlp's line" in text)
    at_peak = tl.at_peak()
    assert {b.source for b in at_peak if b.kind == "argument"} == {
        "argument 'params'",
        "argument 'x'",
    }
    made = [b for b in at_peak if b.kind in ("temporary", "output")]
    assert made and all(b.source == f"{__file__}:{line}" for b in made), made
    assert sum(b.nbytes for b in at_peak) == tl.peak_bytes


def test_a_loop_body_is_shown_once_with_its_trip_count():
    fn, args, grad = PROGRAMS["lax.scan gradient"]
    tl = mw.memory_report(fn, *args, grad=grad).timeline()
    assert len(tl.loops) == 2  # forward and backward scans
    assert all(loop.trip_count == 300 for loop in tl.loops)
    assert all(loop.first <= loop.last < loop.step for loop in tl.loops)
    text = tl.to_text()
    assert "its body is steps" in text and "300 iterations" in text
    # the residuals stacked by the forward loop are alive across the backward loop
    backward = max(tl.loops, key=lambda lp: lp.step)
    stacked = [b for b in tl.live_at(backward.first) if b.shape == (300, 64)]
    assert stacked


def test_checkpointing_lowers_the_timeline_of_a_long_loop():
    lax_tl = mw.memory_report(scanned, jnp.eye(64), jnp.ones((2000, 64)), grad=True).timeline()
    mw_tl = mw.memory_report(checkpointed, jnp.eye(64), jnp.ones((2000, 64)), grad=True).timeline()
    args = 64 * 64 * 4 + 2000 * 64 * 4
    assert mw_tl.peak_bytes - args < 0.1 * (lax_tl.peak_bytes - args)


def test_to_dict_plot_and_text(tmp_path):
    fn, args, grad = PROGRAMS["mw.scan gradient"]
    tl = mw.memory_report(fn, *args, grad=grad).timeline()
    data = json.loads(json.dumps(tl.to_dict()))
    assert data["peak_bytes"] == tl.peak_bytes and len(data["live_bytes"]) == len(tl.steps)
    assert data["at_peak"][0]["nbytes"] == tl.at_peak()[0].nbytes
    path = tmp_path / "timeline.png"
    tl.plot(path)
    assert path.stat().st_size > 10_000
    with pytest.raises(ValueError, match=r"no \.bogus format"):
        tl.plot(tmp_path / "timeline.bogus")
    # The CLI's check, shared: matplotlib's own FileNotFoundError would not say what to do.
    with pytest.raises(ValueError, match=r"cannot write path .*does not exist.*writable folder"):
        tl.plot(tmp_path / "missing" / "timeline.png")
    with pytest.raises(ValueError, match="it is a folder; pass a file path"):
        tl.plot(tmp_path)
    with pytest.raises(TypeError, match=r"path must be a file path .* got int 3"):
        tl.plot(3)  # os.fspath's "expected str, bytes or os.PathLike object" came instead
    assert "memory timeline: gradient of checkpointed" in tl.to_text()


def test_a_report_built_by_hand_has_no_timeline():
    report = mw.measure.MemoryReport(0, 0, 0, 0, 0, 0, 0, 0, name="x")
    with pytest.raises(RuntimeError, match="make it with mw.memory_report"):
        report.timeline()
    assert "_lowered" not in report.to_dict()


def test_timeline_works_when_the_persistent_cache_holds_the_program(tmp_path):
    # A persistent-cache hit skips the compiler, hence the dump: memwise bypasses it.
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        import memwise as mw
        f = lambda x: jnp.sum(jnp.tanh(x @ x))
        for _ in range(2):
            jax.jit(f).lower(jnp.ones((64, 64))).compile()  # fills, then hits the cache
            print(mw.memory_report(f, jnp.ones((64, 64))).timeline().peak_bytes)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split()
    assert int(first) == int(second) > 0
    assert any(tmp_path.iterdir())  # the cache was in use
