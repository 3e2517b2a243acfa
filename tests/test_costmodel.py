"""The roofline cost model: the machine's balance, its cache, and tile times."""

import json

import jax.numpy as jnp
import pytest

from memwise import costmodel

MACHINE = costmodel.Machine(
    "cpu/test",
    flops_per_s=1e11,
    bandwidth=((2**15, 1e11), (2**20, 1e11), (2**25, 1e10)),
    op_overhead_s=1e-7,
)


def test_a_bandwidth_dip_does_not_make_a_mid_size_working_set_slow():
    noisy = costmodel.Machine(
        "cpu/test", 1e11, ((2**15, 5e10), (2**20, 2e10), (2**25, 8e10), (2**27, 1e10)), 1e-7
    )
    assert noisy.bandwidth_at(2**15) == pytest.approx(8e10)
    assert noisy.bandwidth_at(2**20) == pytest.approx(8e10)
    assert noisy.bandwidth_at(2**27) == pytest.approx(1e10)


def test_bandwidth_falls_off_past_the_cache():
    assert MACHINE.bandwidth_at(2**16) == pytest.approx(1e11)
    assert MACHINE.bandwidth_at(2**30) == pytest.approx(1e10)  # flat past the last size
    assert 1e10 < MACHINE.bandwidth_at(2**22) < 1e11


def test_memory_bound_tiles_prefer_the_cache_and_compute_bound_ones_do_not():
    pairs = 2**24  # the whole problem; each tiling covers it
    # 12 bytes and 4 flops per pair (memory-bound); 10 bytes and 4,000 flops (compute-bound)
    for per_pair_bytes, per_pair_flops, want_largest in ((12, 4, False), (10, 4000, True)):
        times = {}
        for tile in (2**12, 2**16, 2**20, 2**24 // 2):
            cost = costmodel.Cost(
                per_pair_flops * tile, per_pair_bytes * tile, 10, per_pair_bytes * tile
            )
            times[tile] = costmodel.tile_time(cost, pairs // tile, MACHINE)
        best = min(times, key=times.get)
        assert (best == 2**23) == want_largest, times
        if not want_largest:
            assert best == 2**16 and times[2**23] > 3 * times[best]


def test_one_tile_costs_its_arithmetic_alone():
    cost = costmodel.Cost(1e9, 1e12, 50, 1e12)
    assert costmodel.tile_time(cost, 1, MACHINE) == pytest.approx(1e9 / 1e11)


def test_compiled_cost_reads_xla():
    import jax

    s = jax.ShapeDtypeStruct
    small = costmodel.compiled_cost(
        lambda a, b: jnp.sum(a @ b), s((64, 64), jnp.float32), s((64, 64), jnp.float32)
    )
    large = costmodel.compiled_cost(
        lambda a, b: jnp.sum(a @ b), s((128, 128), jnp.float32), s((128, 128), jnp.float32)
    )
    assert small.flops >= 2 * 64**3 and large.flops == pytest.approx(8 * small.flops, rel=0.05)
    assert large.bytes_accessed > small.bytes_accessed > 0 and small.operations >= 1
    assert large.working_set >= 2 * 128 * 128 * 4 > small.working_set > 0  # the two inputs


def test_machine_is_measured_once_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costmodel, "_MACHINES", {})
    calls = []
    monkeypatch.setattr(costmodel, "measure_machine", lambda: calls.append(1) or MACHINE)
    assert costmodel.machine() == MACHINE
    assert costmodel.machine() == MACHINE and len(calls) == 1  # in-process cache
    (cached,) = tmp_path.iterdir()
    assert json.loads(cached.read_text())["flops_per_s"] == 1e11
    monkeypatch.setattr(costmodel, "_MACHINES", {})
    assert costmodel.machine() == MACHINE and len(calls) == 1  # from disk
    cached.write_text("{not json")
    monkeypatch.setattr(costmodel, "_MACHINES", {})
    assert costmodel.machine() == MACHINE and len(calls) == 2  # unreadable: measured again
    assert costmodel.machine(refresh=True) == MACHINE and len(calls) == 3  # asked: again
    assert json.loads(cached.read_text())["flops_per_s"] == 1e11  # and rewritten
    with pytest.raises(TypeError, match="refresh must be True or False"):
        costmodel.machine(refresh="yes")


def test_no_disk_cache_when_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMWISE_CACHE_DIR", "")
    monkeypatch.setattr(costmodel, "_MACHINES", {})
    monkeypatch.setattr(costmodel, "measure_machine", lambda: MACHINE)
    assert costmodel.machine() == MACHINE and costmodel._cache_file("cpu/x") is None


@pytest.mark.slow
def test_measured_balance_is_physical():
    m = costmodel.measure_machine(repeats=2)
    assert 1e8 < m.flops_per_s < 1e16
    assert all(1e8 < rate < 1e14 for _, rate in m.bandwidth)
    assert 0 < m.op_overhead_s < 1e-3
