"""Tests for memwise.chunked: chunked_map and chunked_sum against dense JAX, forward-mode
errors, and memory flat in the number of items (compiled, never run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memwise as mw
from memwise.measure import compiled_memory


@pytest.fixture(autouse=True, scope="module")
def _float64_in_this_module():
    # Scoped to this module: a global jax_enable_x64 would change every other module's
    # dtypes (and OTT comparisons' iteration counts) once pytest collects this file.
    with jax.enable_x64(True):
        yield

MiB = 2**20


