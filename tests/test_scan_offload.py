"""``memwise.scan(..., schedule="nested", offload="host")``: segment carries in host memory.

On an accelerator these run the real offload (``make test-accelerator``); on a CPU, where
the option only warns, the offloading program is forced (``_to_host`` patched), so its
gradients are still checked here, and the warning is checked as the CPU's behaviour.
"""

import contextlib
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from _close import ON_CPU, assert_tree_close

import memwise as mw
from memwise import knobs, schedule
from memwise.measure import compiled_memory

SCAN = sys.modules["memwise.scan"]  # the module (``memwise.scan`` is the function)


REMAT3 = bool(getattr(jax.config, "jax_remat3", False))


@pytest.fixture
def offloading(monkeypatch):
    """The offloading program on every backend: on a CPU the option would only warn."""
    if REMAT3:
        pytest.skip(
            "jax_remat3 does not apply jax.checkpoint's offloading policies yet; memwise "
            "raises there (test_under_jax_remat3_offload_raises_naming_the_flag)"
        )
    if ON_CPU:
        monkeypatch.setattr(SCAN, "_to_host", lambda offload, stacklevel=3: offload is not None)


def loss_with(scan_fn, reverse=False, **kwargs):
    # The carry has a scalar leaf: a TPU cannot offload one (it stays on the device).
    def loss(w, xs, h0):
        def body(carry, x):
            h, total = carry
            h = jnp.tanh(w @ h + x)
            return (h, total + jnp.sum(h)), jnp.sum(h**2)

        (h, total), ys = scan_fn(body, (h0, jnp.float32(0)), xs, reverse=reverse, **kwargs)
        return jnp.sum(h**2) + jnp.sum(jnp.sin(ys)) + jnp.sin(total)

    return loss


def inputs(n, hidden=8):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = 0.6 * jax.random.normal(k1, (hidden, hidden)) / hidden**0.5
    return w, jax.random.normal(k2, (n, hidden)), jax.random.normal(k3, (hidden,))


def offloaded(f, init, xs, reverse, checkpoints=None):
    return mw.scan(
        f, init, xs, reverse=reverse, schedule="nested", offload="host", checkpoints=checkpoints
    )


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("checkpoints", [None, 7])
def test_values_and_gradients_equal_lax_scan(offloading, reverse, checkpoints):
    # A reversed scan too: an XLA report (2026) found silently wrong gradients when a
    # scan's residuals were offloaded on GPU. 103 steps: segments of 11 (the default,
    # about sqrt(n)) or 7, and a shorter last one.
    args = inputs(103)
    ours = loss_with(lambda *a, **k: offloaded(*a, **k, checkpoints=checkpoints), reverse)
    ref = loss_with(jax.lax.scan, reverse)
    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(*args)
    # w's gradient sums 103 steps' terms of up to about 10 in float32, in another order
    assert_tree_close(got, want, atol=2e-5)
    # the carries do go to host memory and back: one device_put each way per segment loop
    jaxpr = jax.make_jaxpr(jax.grad(ours))(*args)
    assert str(jaxpr).count("device_put") >= 2


def test_body_evaluations_are_the_segmented_plans(offloading):
    n, calls = 101, []

    def loss(w, xs, h0):
        def body(h, x):
            jax.debug.callback(lambda h: calls.append(1), h)
            return jnp.tanh(w @ h + x), None

        h, _ = mw.scan(body, h0, xs, schedule="nested", offload="host", checkpoints=10)
        return jnp.sum(h)

    jax.block_until_ready(jax.jit(jax.grad(loss))(*inputs(n)))
    plan = schedule.segmented(n, 10)
    assert (plan.n_chunks, plan.remainder_inner.n_steps) == (10, 1)
    assert len(calls) == plan.evaluations == 2 * n


def flat_loop(kind, w, h0, n):
    """``n`` steps of ``h -> tanh(h @ w)`` in segments of 100 with host offload, as a
    scan or a bounded while loop (whose scalar counter stays on the device)."""
    step = lambda h: jnp.tanh(h @ w)  # noqa: E731
    options = dict(schedule="nested", offload="host", checkpoints=100)
    if kind == "scan":
        return mw.scan(lambda h, _: (step(h), None), h0, length=n, **options)[0]
    cond, body = (lambda s: s[1] < 1_500), (lambda s: (step(s[0]), s[1] + 1))  # noqa: E731
    return mw.while_loop(cond, body, (h0, 0), max_steps=n, **options)[0]


@pytest.mark.skipif(ON_CPU, reason="a CPU has no separate host memory")
@pytest.mark.parametrize("kind", ["scan", "while_loop"])
def test_device_memory_does_not_grow_with_length_or_host_carries(kind):
    # The device holds one segment of 100 steps; the host one carry per segment (a while
    # loop's bound, max_steps, sets its segments).
    hidden = 256

    def compiled(n):
        loss = lambda w, h0: jnp.sum(flat_loop(kind, w, h0, n))  # noqa: E731
        w, h0 = jnp.eye(hidden) * 0.5, jnp.ones((8, hidden))
        return jax.jit(jax.grad(loss)).lower(w, h0).compile().memory_analysis()

    small, large = compiled(2_000), compiled(20_000)
    carry = 8 * hidden * 4
    assert large.temp_size_in_bytes <= small.temp_size_in_bytes + 2 * carry
    assert large.host_temp_size_in_bytes >= 200 * carry  # the 200 segment carries


@pytest.mark.skipif(not ON_CPU, reason="the CPU's behaviour")
def test_on_a_cpu_it_warns_and_runs_the_same_segments_on_the_device():
    args = inputs(50)
    ref = jax.jit(jax.grad(loss_with(jax.lax.scan)))(*args)
    with pytest.warns(UserWarning, match="offload='host'.* on a CPU"):
        got = jax.jit(jax.grad(loss_with(lambda *a, **k: offloaded(*a, **k, checkpoints=5))))(*args)
    assert_tree_close(got, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the option is checked, not silently ignored: a
        with pytest.raises(ValueError, match="offload must be None, 'host' or 'auto'"):
            mw.scan(lambda h, x: (h, None), jnp.zeros(2), jnp.ones(3), offload="disk")


@pytest.mark.skipif(not ON_CPU, reason="the CPU's behaviour")
def test_the_cpu_notice_points_at_the_callers_line():
    with pytest.warns(UserWarning, match="on a CPU") as scan_warning:
        mw.scan(lambda h, x: (h + x, None), 0.0, jnp.ones(3), schedule="nested", offload="host")
    with pytest.warns(UserWarning, match="on a CPU") as while_warning:
        newton_loop(jnp.ones(2), 3, 5, offload="host")
    assert scan_warning[0].filename == __file__
    assert while_warning[0].filename == __file__


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"offload": "cpu"}, "offload must be None, 'host' or 'auto', got 'cpu'"),
        ({"offload": "auto"}, "offload='auto' runs with schedule='nested'"),
        ({"offload": "host"}, "offload='host' runs with schedule='nested'"),
        ({"offload": "host", "schedule": "per_step"}, "not schedule='per_step'"),
        (
            {"offload": "host", "schedule": "nested", "inverse": lambda h, x: h},
            "nothing to offload with inverse=",
        ),
        (
            {"offload": "host", "schedule": "nested", "checkpoints": 0},
            "checkpoints.*steps per segment",
        ),
    ],
)
def test_bad_options_name_the_fix(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's notice
        with pytest.raises(ValueError, match=message):
            mw.scan(lambda h, x: (h, None), jnp.zeros(2), jnp.ones(3), **kwargs)


def auto_loss(w, xs, h0):
    return loss_with(
        lambda *a, **k: mw.scan(*a, **k, schedule="nested", offload="auto", checkpoints=7)
    )(w, xs, h0)


def test_offload_auto_is_a_knob_between_the_device_and_host_memory(offloading, monkeypatch):
    # Where the device has host memory (forced on a CPU), offload='auto' registers one
    # knob, the device first; each plan runs the same 7-step segments, the second with
    # their carries sent to host memory and back, and both give lax.scan's gradients.
    monkeypatch.setattr(SCAN, "_offload_candidates", lambda: (None, "host"))
    args = inputs(52)
    want = jax.jit(jax.grad(loss_with(jax.lax.scan), argnums=(0, 1, 2)))(*args)
    with knobs.recording() as found:
        jax.make_jaxpr(auto_loss)(*args)
    (knob,) = found
    assert (knob.kind, knob.candidates, knob.default) == ("offload", (None, "host"), None)
    assert knob.cost[0] == 1.0 < knob.cost[1] <= 1.1
    for index, transfers in [(0, False), (1, True)]:
        with knobs.recording(plan=[index], layout=found):
            jaxpr = str(jax.make_jaxpr(jax.grad(auto_loss))(*args))
            got = jax.jit(jax.grad(auto_loss, argnums=(0, 1, 2)))(*args)
        assert ("device_put" in jaxpr) == transfers
        assert_tree_close(got, want)
    assert "device_put" not in str(jax.make_jaxpr(jax.grad(auto_loss))(*args))  # outside fit


@pytest.mark.skipif(not ON_CPU, reason="the CPU's behaviour")
def test_offload_auto_on_a_cpu_is_no_knob_and_no_warning():
    args = inputs(30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with knobs.recording() as found:
            got = jax.jit(jax.grad(auto_loss))(*args)
    assert found == []
    assert_tree_close(got, jax.jit(jax.grad(loss_with(jax.lax.scan)))(*args))


@pytest.mark.skipif(ON_CPU or REMAT3, reason="host memory on an accelerator")
def test_fit_offloads_the_segment_carries_when_the_budget_needs_it():
    # 2,000 steps in segments of 10: 200 segment carries of 256 KiB (50 MiB) against one
    # segment's residuals.
    hidden, n = 1024, 2_000

    def loss(w, h0, offload="auto"):
        h, _ = mw.scan(
            lambda h, _: (jnp.tanh(h @ w), None),
            h0,
            length=n,
            schedule="nested",
            offload=offload,
            checkpoints=10,
        )
        return jnp.sum(h)

    w, h0 = jnp.eye(hidden) * 0.5, jnp.ones((64, hidden))
    on_device = compiled_memory(loss, w, h0, grad=True).peak_bytes
    on_host = compiled_memory(lambda w, h0: loss(w, h0, "host"), w, h0, grad=True).peak_bytes
    assert on_host < on_device - 150 * 64 * hidden * 4  # most segment carries left
    assert mw.fit(loss, budget=on_device, policies=False).plan_for(w, h0).values == (None,)
    fitted = mw.fit(loss, budget=(on_host + on_device) // 2, policies=False)
    assert fitted.plan_for(w, h0).values == ("host",)

    def reference(w, h0):
        return jnp.sum(jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h0, length=n)[0])

    assert_tree_close(jax.jit(jax.grad(fitted))(w, h0), jax.jit(jax.grad(reference))(w, h0))


def newton_loop(a, limit, max_steps, **kwargs):
    # a vector: a TPU offloads the carry's vectors (its scalar counter stays on the device)
    x, i = mw.while_loop(
        lambda s: s[1] < limit,
        lambda s: (0.5 * (s[0] + a / s[0]), s[1] + 1),
        (a, 0),
        max_steps=max_steps,
        schedule="nested",
        **kwargs,
    )
    return x


@pytest.mark.parametrize("limit", [0, 13, 40])
def test_a_nested_while_loop_offloads_its_segment_carries(offloading, limit):
    # max_steps 40 in segments of 6 (the last of 4): stopping before any step, inside a
    # segment, and at max_steps.
    def reference(a):
        return jnp.sum(jax.lax.fori_loop(0, limit, lambda i, x: 0.5 * (x + a / x), a))

    def ours(a):
        return jnp.sum(newton_loop(a, limit, 40, checkpoints=6, offload="host"))

    a = jnp.array([2.0, 3.0, 5.0, 7.0])
    got = jax.jit(jax.value_and_grad(ours))(a)
    assert_tree_close(got, jax.jit(jax.value_and_grad(reference))(a))
    assert "device_put" in str(jax.make_jaxpr(jax.grad(ours))(a))


@contextlib.contextmanager
def remat3(value):
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", value)
    try:
        yield
    finally:
        jax.config.update("jax_remat3", before)


@pytest.mark.skipif(not hasattr(jax.config, "jax_remat3"), reason="no jax_remat3 here")
def test_under_jax_remat3_offload_raises_naming_the_flag():
    # JAX's next checkpoint (a flag in JAX 0.10) ignores the offloading policy: the
    # carries would silently stay on the device, so an accelerator run raises instead.
    with remat3(True), pytest.raises(ValueError, match="jax_remat3 .* does not apply yet"):
        SCAN._check_remat3()
    with remat3(False):
        SCAN._check_remat3()  # no error
