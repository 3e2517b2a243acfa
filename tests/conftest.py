"""Suite-wide set-up: the Hypothesis profile (see tests/_hypothesis.py)."""

import _hypothesis  # noqa: F401  (registers and loads the profile)

# Reference generators run in their own environment (jax 0.4.30 + neural-tangents); under
# `--doctest-modules` importing one turned on float64 for every later test in the worker.
collect_ignore = ["data"]
