"""Tests for memwise.sharding: chunked primitives on 4 CPU devices (a subprocess) against
dense JAX, detected and explicit meshes, inside a user's shard_map, per-device memory."""

import pytest

from _multidevice import run_on_devices


