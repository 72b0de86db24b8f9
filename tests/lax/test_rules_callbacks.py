"""Host callbacks under scalify: pure_callback, io_callback, debug_callback, debug_print."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import jax_scalify as jsa
from jax_scalify.extend import registered_rules
from jax_scalify.lax import rules_callbacks
from tests.invariance import Case, invariance_test, normal, value_at_scale


def with_callbacks(x, w):
    y = x * w
    jax.debug.print("y={y}", y=y)
    jax.debug.callback(lambda v: None, y)
    z = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
    z = io_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct(z.shape, z.dtype), z)
    return z + y


INVARIANCE_CASES = [Case("callbacks", with_callbacks, [normal(4), normal(4)])]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


scaled = value_at_scale  # the value x at scale 2**exponent


RNG = np.random.default_rng(0)
X4 = RNG.standard_normal(4).astype(np.float32)
W4 = RNG.standard_normal(4).astype(np.float32)


# --- callbacks -----------------------------------------------------------------------------
def test_debug_print_shows_values(capsys):
    def fn(x):
        jax.debug.print("value={x}", x=x)
        return x

    jsa.scalify(fn)(jsa.ScaledArray(jnp.array([1.0, 3.0]), jnp.float32(2.0**-3)))
    jax.effects_barrier()
    assert "value=[0.125 0.375]" in capsys.readouterr().out


def test_callbacks_receive_plain_values():
    seen = []

    def host(v):
        seen.append(v)
        return np.asarray(v) * 2

    def fn(x):
        y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        jax.debug.callback(seen.append, y)
        return y

    got = jax.jit(jsa.scalify(fn))(scaled(X4, 7))
    jax.effects_barrier()
    assert not isinstance(got, jsa.ScaledArray)
    np.testing.assert_allclose(np.asarray(seen[0]), X4, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(seen[1]), 2 * X4, rtol=1e-6)


def test_rules_registered_with_summaries():
    rules = registered_rules()
    for prim in [
        rules_callbacks.pure_callback_p,
        rules_callbacks.io_callback_p,
        rules_callbacks.debug_callback_p,
        rules_callbacks.debug_print_p,
    ]:
        assert prim in rules and rules[prim].summary, prim
