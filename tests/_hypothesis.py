"""Hypothesis profiles for the suite.

``ci`` (the default) is derandomized: every run replays the same cases, so a failure in
CI reproduces locally and a green run means the same thing twice. ``thorough``
(``HYPOTHESIS_PROFILE=thorough make test``) draws fresh random cases, ten times as many
per test, for hunting before a release.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("thorough", derandomize=False, deadline=None, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' or 'thorough'.")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """``n`` examples in the ``ci`` profile, ``10 n`` in ``thorough``."""
    return n * 10 if PROFILE == "thorough" else n
