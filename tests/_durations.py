"""Writes tests/DURATIONS.md from the JUnit XML that ``make test`` leaves in build/.

``make durations`` runs it. Per-file totals and the slowest tests, so a change that makes
the suite slower shows where. Times are wall seconds per test on the machine that ran
``make test`` (two pytest-xdist workers), compilation included.
"""

from __future__ import annotations

import collections
import datetime
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(source: str = "build/test-results-*.xml", target: str = "tests/DURATIONS.md") -> None:
    """Per-file totals and the slowest tests of every JUnit file matching ``source``
    (``make test`` writes one per run)."""
    files = sorted(ROOT.glob(source))
    if not files:
        raise SystemExit(f"no {source}: run make test first")
    cases = [c for f in files for c in ElementTree.parse(f).getroot().iter("testcase")]
    times = [(c.get("classname", ""), c.get("name", ""), float(c.get("time", 0))) for c in cases]
    per_file: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for classname, _, seconds in times:
        module = classname.split(".")[1] if classname.startswith("tests.") else classname
        per_file[module] += seconds
        counts[module] += 1
    total = sum(per_file.values())
    lines = [
        "# Test durations",
        "",
        f"Written by `make durations` on {datetime.date.today()} from `make test`'s",
        f"`{source}` ({len(times)} tests and doctests, {os.cpu_count()} cores, two workers):",
        f"{total:.0f} s of test time in all. Do not edit by hand.",
        "",
        "| file | tests | seconds | share |",
        "|---|---|---|---|",
    ]
    for module, seconds in per_file.most_common():
        lines.append(f"| {module} | {counts[module]} | {seconds:.1f} | {seconds / total:.1%} |")
    lines += ["", "The 30 slowest:", "", "| test | seconds |", "|---|---|"]
    for classname, name, seconds in sorted(times, key=lambda t: -t[2])[:30]:
        lines.append(f"| {classname}::{name} | {seconds:.1f} |")
    (ROOT / target).write_text("\n".join(lines) + "\n")
    print(f"wrote {target}: {len(times)} tests, {total:.0f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
