import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ops
from tests.invariance import STATIC_POLICY, assert_pow2_scales

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
X = jnp.array([1.1, -3.3, 0.2, 17.0], jnp.float32)


def _eqns(fn, *args):
    return [(eqn.primitive.name, eqn.params) for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def test_cast_on_forward_casts_value_and_grad_back():
    y = ops.cast_on_forward(X, jnp.float16)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(y, X.astype(jnp.float16))
    g = jax.grad(lambda a: jnp.sum(ops.cast_on_forward(a, jnp.bfloat16).astype(jnp.float32) * 3.0))(X)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, jnp.full_like(X, 3.0))
    np.testing.assert_array_equal(jax.jit(ops.cast_on_forward, static_argnums=1)(X, E4M3), X.astype(E4M3))


def test_cast_on_backward_forward_identity():
    np.testing.assert_array_equal(ops.cast_on_backward(X, E5M2), X)
    assert ops.cast_on_backward(X, E5M2).dtype == jnp.float32
    np.testing.assert_array_equal(jax.vmap(lambda a: ops.cast_on_backward(a, E5M2))(X), X)


def test_cast_on_backward_casts_the_cotangent():
    w = jnp.full((4, 3), 1.1, jnp.float32)

    def loss(w, x):
        y = ops.cast_on_backward(x @ w, E5M2)
        return jnp.sum(y * 1.3)

    eqns = _eqns(jax.grad(loss, argnums=(0, 1)), w, X[None])
    converts = [p["new_dtype"] for name, p in eqns if name == "convert_element_type"]
    assert E5M2 in converts
    # The backward matmuls consume the E5M2 cotangent.
    assert any(
        name == "dot_general" for name, _ in eqns[eqns.index(next(e for e in eqns if e[0] == "convert_element_type")) :]
    )
    gw, gx = jax.grad(loss, argnums=(0, 1))(w, X[None])
    ct = float(jnp.asarray(1.3, jnp.float32).astype(E5M2).astype(jnp.float32))  # 1.25
    np.testing.assert_allclose(gx, np.full((1, 4), 3 * 1.1 * ct, np.float32), rtol=1e-6)
    assert gw.dtype == jnp.float32


def test_cast_on_backward_grad_wrt_input_has_the_dtype():
    g = jax.grad(lambda a: jnp.sum(ops.cast_on_backward(a, jnp.bfloat16) * 3.0))(X)
    assert g.dtype == jnp.bfloat16


def test_reduce_precision_on_forward():
    y = ops.reduce_precision_on_forward(X, E4M3)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, X.astype(E4M3).astype(jnp.float32))
    grad_fn = jax.grad(lambda a: jnp.sum(ops.reduce_precision_on_forward(a, E4M3) * 1.1))
    np.testing.assert_array_equal(grad_fn(X), jnp.full_like(X, 1.1))  # cotangent not rounded
    assert "reduce_precision" not in [name for name, _ in _eqns(grad_fn, X)[2:]]


def test_reduce_precision_on_backward():
    np.testing.assert_array_equal(ops.reduce_precision_on_backward(X, E4M3), X)
    grad_fn = jax.grad(lambda a: jnp.sum(ops.reduce_precision_on_backward(a, E4M3) * 1.1))
    g = jax.jit(grad_fn)(X)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, jnp.full_like(X, 1.125))  # 1.1 rounded to 3 mantissa bits
    rp = [p for name, p in _eqns(grad_fn, X) if name == "reduce_precision"]
    assert rp == [{"exponent_bits": 4, "mantissa_bits": 3}]


def test_bad_arguments():
    with pytest.raises(TypeError, match="floating dtype"):
        ops.cast_on_forward(X, jnp.int32)
    with pytest.raises(TypeError, match="floating array"):
        ops.cast_on_backward(jnp.arange(3), E5M2)
    with pytest.raises(TypeError, match="jax.tree.map"):
        ops.reduce_precision_on_forward({"a": X}, E4M3)


def test_casts_under_scalify_keep_scale():
    sx = jsa.ScaledArray(X, jnp.float32(2.0**-20))
    y = jsa.scalify(lambda a: ops.cast_on_forward(a, jnp.float16), policy=STATIC_POLICY)(sx)
    assert y.dtype == jnp.float16 and float(y.scale) == 2.0**-20
    y = jsa.scalify(lambda a: ops.reduce_precision_on_forward(a, E4M3), policy=STATIC_POLICY)(sx)
    assert float(y.scale) == 2.0**-20
    np.testing.assert_array_equal(np.asarray(y.data), np.asarray(X.astype(E4M3).astype(jnp.float32)))
    assert_pow2_scales(y)


def test_cast_on_backward_under_scalify_casts_the_cotangent_data():
    a = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32))
    c = jsa.ScaledArray(jnp.full((2, 3), 1.3, jnp.float32), jnp.float32(2.0**-20))
    seen = []

    def grad_fn(a, w, c):
        def loss(w):
            z = ops.debug_callback_grad(seen.append, a @ w)  # sees the cotangent after the cast
            return jnp.sum(ops.cast_on_backward(z, E5M2) * c)

        return jax.grad(loss)(w)

    g = jsa.scalify(grad_fn)(jsa.as_scaled_array(a), w, c)
    jax.effects_barrier()
    (ct,) = seen
    assert ct.dtype == E5M2 and float(ct.scale) == 2.0**-20
    np.testing.assert_array_equal(np.asarray(ct.data, np.float32), np.full((2, 3), 1.25, np.float32))
    assert_pow2_scales(g)
    expected = np.asarray(a).T @ np.full((2, 3), 1.25 * 2.0**-20, np.float32)
    np.testing.assert_allclose(np.asarray(jsa.asarray(g)), expected, rtol=1e-5)
