"""``python -m benchmarks``: the benchmark runner (see run.py), from a source checkout."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).with_name("run.py")), run_name="__main__")
