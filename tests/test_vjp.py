"""The custom-VJP toolkit under both of JAX's custom_vjp implementations.

JAX picks the implementation when a function is declared (``jax_custom_vjp3`` on or
off), so each test declares its own function inside the flag's setting; the suite's
other tests run memwise under whatever the process's flag says (``make test-next-jax``
turns it on).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from _close import assert_allclose

from memwise._vjp import Static, custom_vjp, unwrap

HAS_NEXT = hasattr(jax.config, "jax_custom_vjp3")
IMPLEMENTATIONS = [
    "default",
    pytest.param(
        "custom_vjp3",
        marks=pytest.mark.skipif(not HAS_NEXT, reason="this jax has no jax_custom_vjp3 flag"),
    ),
]


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    power: int
    names: tuple[str, ...]


def _declare(implementation, **options):
    """``f(spec, scale, (x, y)) = scale * sum(x ** power) * y`` as a toolkit custom VJP,
    declared under ``implementation``; ``seen`` records what the rules received."""
    seen = {}

    def value(spec, scale, xy):
        x, y = xy
        return scale * jnp.sum(x**spec.power) * y

    def fwd(spec, scale, xy):
        seen["fwd spec"] = spec
        (x, y), flags = unwrap(xy)
        seen["perturbed"] = flags
        seen["y type"] = (y.shape, y.dtype)  # arrays, even where the call passed a literal
        return value(spec, scale, (x, y)), (x, y, Static(flags))

    def bwd(spec, scale, residuals, ct):
        seen["bwd spec"] = spec
        x, y, flags = residuals
        dx = ct * scale * spec.power * x ** (spec.power - 1) * y
        dy = ct * scale * jnp.sum(x**spec.power)
        return ([dx if flags.value[0] else None, dy if flags.value[1] else None],)

    with _implementation(implementation):
        rule = custom_vjp(value, nondiff_argnums=(0, 1), **options)
    rule.defvjp(fwd, bwd)
    return rule, seen


@contextlib.contextmanager
def _implementation(implementation):
    """JAX's next custom_vjp and remat on (``custom_vjp3``) or off, restored after."""
    flags = ("jax_custom_vjp3", "jax_remat3") if HAS_NEXT else ()
    previous = {f: bool(getattr(jax.config, f)) for f in flags}
    for f in flags:
        jax.config.update(f, implementation == "custom_vjp3")
    try:
        yield
    finally:
        for f, value in previous.items():
            jax.config.update(f, value)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_rules_get_the_static_arguments_as_passed(implementation):
    rule, seen = _declare(implementation)
    spec = _Spec(3, ("a", "b"))
    x, y = jnp.array([0.5, -1.0, 2.0]), jnp.float32(1.5)

    def ours(x, y):
        return rule(spec, 2.0, [x, y])

    def dense(x, y):
        return 2.0 * jnp.sum(x**3) * y

    got = jax.grad(ours)(x, y)  # only x is differentiated
    assert_allclose(got, jax.grad(dense)(x, y), rtol=1e-6)
    # The static spec reaches both rules as the object passed (not wrapped in
    # CustomVJPPrimal), and the flags say that y was not differentiated.
    assert seen["fwd spec"] is spec and seen["bwd spec"] is spec
    assert seen["perturbed"] == (True, False)
    both = jax.grad(ours, argnums=(0, 1))(x, y)
    for a, b in zip(both, jax.grad(dense, argnums=(0, 1))(x, y)):
        assert_allclose(a, b, rtol=1e-6)
    assert seen["perturbed"] == (True, True)
    assert_allclose(jax.jit(ours)(x, y), dense(x, y), rtol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_literal_operands_under_checkpoint_reach_the_rule_as_arrays(implementation):
    # Under jax.checkpoint the next implementation passes the program's literal (the 3
    # below) as a Python int subclass without a shape; the rule gets an array.
    rule, seen = _declare(implementation)
    spec = _Spec(2, ())
    with _implementation(implementation):
        loss = jax.checkpoint(lambda x: rule(spec, 1.0, [x, 3]))
    x = jnp.array([1.0, -2.0])
    assert_allclose(jax.grad(loss)(x), 6.0 * x, rtol=1e-6)
    assert seen["y type"] == ((), jnp.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_mode_raises_a_type_error_with_the_given_message(implementation):
    generic, _ = _declare(implementation)
    named, _ = _declare(
        implementation, forward_mode_error=lambda spec, scale: f"no jvp {spec.names}"
    )
    spec, x, y = _Spec(2, ("p",)), jnp.ones(3), jnp.float32(1.0)
    for transform in (jax.jvp, jax.jit(jax.jvp, static_argnums=0)):
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            transform(lambda x: generic(spec, 1.0, [x, y]), (x,), (x,))
    if implementation == "custom_vjp3":
        # The default implementation raises JAX's own TypeError; the next one's
        # NotImplementedError is replaced by the given message.
        with pytest.raises(TypeError, match=r"no jvp \('p',\)"):
            jax.jvp(lambda x: named(spec, 1.0, [x, y]), (x,), (x,))
        with pytest.raises(TypeError, match=r"no jvp \('p',\)"):
            jax.linearize(lambda x: named(spec, 1.0, [x, y]), x)
