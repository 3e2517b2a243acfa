"""Live memory along a compiled program's schedule, read from XLA's own buffer analysis.

XLA schedules every instruction of a compiled program and assigns every buffer before
anything runs. Compiled with XLA's dump on, it writes that analysis as text: the
instruction sequence with the live range of every value, the buffer assignment (each
value's allocation, size and offset) and the optimized HLO with its source metadata.

* ``memwise.timeline.dump`` parses those three files (plain Python, tested on small
  texts; :func:`parse_dump`) and compiles a program with the dump on
  (:func:`of_lowered`);
* ``memwise.timeline.live`` holds the result, a :class:`Timeline`: the bytes live at
  every step, the peak step and the buffers alive there (:class:`Buffer`), each with
  its shape, the producing operation and the user's source line, and the while loops
  (:class:`Loop`). Values that XLA places at the same offset of the same allocation
  while both are live are one buffer seen twice (a while loop's carry and its body's
  parameter, a tuple and its elements), so each such slot is counted once.

The dump is written to a temporary directory that is removed afterwards. The program is
compiled again for it with JAX's persistent compilation cache bypassed, since a cache hit
would return the executable without running the compiler, and so without a dump.

Relation to ``memory_analysis()``: the allocator packs values into allocations, and an
argument or output allocation is counted for the whole program, so the timeline's
maximum is at most arguments + outputs - aliased + temporaries and falls short of it
only by what the packing leaves unused at the peak step.
"""

from memwise.timeline.dump import of_lowered, parse_dump

# The dump's parsers, importable from here as from the single module this package was.
from memwise.timeline.dump import parse_buffer_assignment as parse_buffer_assignment
from memwise.timeline.dump import parse_hlo as parse_hlo
from memwise.timeline.dump import parse_live_range as parse_live_range
from memwise.timeline.live import Buffer, Loop, Timeline, argument_source

__all__ = ["Buffer", "Loop", "Timeline", "argument_source", "of_lowered", "parse_dump"]
