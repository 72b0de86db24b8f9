import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ops

SX = jsa.ScaledArray(jnp.array([1.0, 2.0, 3.0], jnp.float32), jnp.float32(0.5))


def _capture():
    seen = []
    return seen, lambda *args, **kwargs: seen.append((args, kwargs))


def test_top_level_export():
    assert jsa.debug_callback is ops.debug_callback


def test_callback_outside_scalify_gets_scale_one():
    seen, cb = _capture()
    x = jnp.array([1.0, 2.0])
    jax.jit(lambda a: ops.debug_callback(cb, a, jnp.arange(2), "tag", key=a))(x)
    jax.effects_barrier()
    ((args, kwargs),) = seen
    assert isinstance(args[0], jsa.ScaledArray) and float(args[0].scale) == 1.0
    np.testing.assert_array_equal(np.asarray(args[0].data), [1.0, 2.0])
    assert not isinstance(args[1], jsa.ScaledArray) and np.array_equal(args[1], [0, 1])
    assert args[2] == "tag"
    assert isinstance(kwargs["key"], jsa.ScaledArray)


def test_callback_under_scalify_gets_data_and_scale():
    seen, cb = _capture()

    def fn(x, tree):
        ops.debug_callback(cb, x, tree)
        return x

    out = jax.jit(jsa.scalify(fn))(SX, {"p": jnp.ones(2)})
    jax.effects_barrier()
    ((args, _),) = seen
    assert isinstance(args[0], jsa.ScaledArray)
    np.testing.assert_array_equal(np.asarray(args[0].data), [1.0, 2.0, 3.0])
    assert float(args[0].scale) == 0.5
    assert isinstance(args[1]["p"], jsa.ScaledArray) and float(args[1]["p"].scale) == 1.0
    assert isinstance(out, jsa.ScaledArray)


def test_callback_outside_scalify_passes_scaled_array_as_is():
    seen, cb = _capture()
    ops.debug_callback(cb, SX)
    jax.effects_barrier()
    assert float(seen[0][0][0].scale) == 0.5


def test_callback_under_vmap_and_grad():
    seen, cb = _capture()
    x = jnp.arange(6.0).reshape(2, 3)
    jax.vmap(lambda r: ops.debug_callback(cb, r))(x)
    jax.effects_barrier()
    assert sorted(np.asarray(s[0][0].data).tolist() for s in seen) == x.tolist()
    seen.clear()
    g = jax.grad(lambda a: (ops.debug_callback(cb, a), jnp.sum(a * 2.0))[1])(jnp.ones(3))
    jax.effects_barrier()
    np.testing.assert_array_equal(g, jnp.full(3, 2.0))
    assert len(seen) == 1 and np.array_equal(np.asarray(seen[0][0][0].data), np.ones(3))


def test_debug_print(capfd):
    jax.jit(jsa.scalify(lambda a: ops.debug_print("x={} n={n} y={y:.2f}", a, n=jnp.arange(2), y=a)))(SX)
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert "x=ScaledArray(data=[1. 2. 3.], scale=0.5)" in out
    assert "n=[0 1]" in out
    assert "y=ScaledArray(data=[1.00 2.00 3.00], scale=0.50)" in out


def test_debug_print_outside_scalify(capfd):
    ops.debug_print("v {}", jnp.array([4.0]))
    jax.effects_barrier()
    assert "v ScaledArray(data=[4.], scale=1.0)" in capfd.readouterr().out


def test_callback_grad_sees_cotangent_and_returns_x():
    seen, cb = _capture()
    x = jnp.array([1.0, 2.0])
    assert ops.debug_callback_grad(cb, x) is not None
    np.testing.assert_array_equal(ops.debug_callback_grad(cb, x), x)
    jax.effects_barrier()
    assert seen == []  # forward: nothing

    def loss(a, b):
        a, b = ops.debug_callback_grad(cb, a, b)
        return jnp.sum(a * 3.0 + b)

    g = jax.jit(jax.grad(loss))(x, x)
    jax.effects_barrier()
    np.testing.assert_array_equal(g, jnp.full(2, 3.0))
    ((args, _),) = seen
    np.testing.assert_array_equal(np.asarray(args[0].data), [3.0, 3.0])
    np.testing.assert_array_equal(np.asarray(args[1].data), [1.0, 1.0])


def test_callback_grad_under_scalify_sees_scaled_cotangent():
    seen, cb = _capture()
    c = jsa.ScaledArray(jnp.array([1.5, 1.0], jnp.float32), jnp.float32(2.0**-30))

    def grad_fn(x, c):
        return jax.grad(lambda a: jnp.sum(ops.debug_callback_grad(cb, a) * c))(x)

    g = jsa.scalify(grad_fn)(jnp.ones(2), c)
    jax.effects_barrier()
    ((args, _),) = seen
    assert float(args[0].scale) == 2.0**-30
    np.testing.assert_array_equal(np.asarray(args[0].data), [1.5, 1.0])
    np.testing.assert_array_equal(np.asarray(jsa.asarray(g)), np.asarray(c.to_array()))


def test_print_grad(capfd):
    g = jax.grad(lambda a: jnp.sum(ops.debug_print_grad("ct {}", a) * 3.0))(jnp.ones(2))
    jax.effects_barrier()
    np.testing.assert_array_equal(g, jnp.full(2, 3.0))
    assert "ct ScaledArray(data=[3. 3.], scale=1.0)" in capfd.readouterr().out


def test_grad_variants_reject_non_floating():
    with pytest.raises(TypeError, match="floating"):
        ops.debug_callback_grad(print, jnp.arange(3))
    with pytest.raises(TypeError, match="at least one"):
        ops.debug_print_grad("{}")
