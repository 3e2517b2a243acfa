"""Suite-wide set-up: the Hypothesis profile (see tests/_hypothesis.py)."""

import _hypothesis  # noqa: F401  (registers and loads the profile)
