"""The scaling primitives: identity outside scalify, scale operations under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.lax import get_data_scale, rebalance, set_scaling, stop_scaling
from tests.invariance import STATIC_POLICY, Case

X = np.array([1.0, -2.0, 3.0], np.float32)


def _uses_all_primitives(x):
    y = set_scaling(x, jnp.float32(4.0))
    y = rebalance(y, jnp.float32(0.5))
    data, scale = get_data_scale(y)
    return stop_scaling(y), data, scale


def test_identity_outside_scalify():
    value, data, scale = _uses_all_primitives(jnp.asarray(X))
    np.testing.assert_array_equal(value, X)
    np.testing.assert_array_equal(data, X)
    assert scale == 1.0 and scale.dtype == np.float32


@pytest.mark.parametrize("transform", [jax.jit, lambda f: jax.vmap(f, in_axes=0, out_axes=0)])
def test_identity_under_jit_and_vmap(transform):
    value, data, _ = transform(_uses_all_primitives)(jnp.asarray(X))
    np.testing.assert_array_equal(value, X)
    np.testing.assert_array_equal(data, X)


def test_gradients_pass_through():
    def loss(x):
        y = rebalance(set_scaling(x, jnp.float32(8.0)), jnp.float32(2.0))
        return jnp.sum(stop_scaling(y, jnp.float32) * get_data_scale(y)[0])

    np.testing.assert_array_equal(jax.grad(loss)(jnp.asarray(X)), 2 * X)
    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(jnp.asarray(X)), 2 * X)


def test_vmap_with_batched_scale_keeps_values():
    out = jax.vmap(set_scaling)(jnp.ones((3, 2)), jnp.array([1.0, 2.0, 4.0]))
    np.testing.assert_array_equal(out, np.ones((3, 2)))


def test_set_scaling_under_scalify():
    out = jsa.scalify(set_scaling, policy=STATIC_POLICY)(jnp.asarray(X), jnp.float32(4.0))
    assert isinstance(out, jsa.ScaledArray) and float(out.scale) == 4.0
    np.testing.assert_array_equal(out.data, X / 4)
    scaled = jsa.scalify(set_scaling, policy=STATIC_POLICY)(
        jsa.as_scaled_array(X, scale=np.float32(2.0)), jnp.float32(0.25)
    )
    np.testing.assert_array_equal(scaled.to_array(), X)


def test_set_scaling_zero_scale_asserts_zero():
    out = jsa.scalify(set_scaling)(jnp.zeros(3), jnp.float32(0.0))
    assert float(out.scale) == 0.0
    np.testing.assert_array_equal(out.to_array(), np.zeros(3))


def test_get_data_scale_under_scalify():
    x = jsa.as_scaled_array(X, scale=np.float32(8.0))
    data, scale = jsa.scalify(get_data_scale)(x)
    np.testing.assert_array_equal(data, X / 8)
    assert float(scale) == 8.0
    data, scale = jsa.scalify(get_data_scale)(jnp.asarray(X))
    np.testing.assert_array_equal(data, X)
    assert float(scale) == 1.0


def test_stop_scaling_and_rebalance_under_scalify():
    x = jsa.as_scaled_array(X, scale=np.float32(8.0))
    value = jsa.scalify(stop_scaling, policy=STATIC_POLICY)(x, jnp.float16)
    assert not isinstance(value, jsa.ScaledArray) and value.dtype == jnp.float16
    np.testing.assert_array_equal(value, X)
    out = jsa.scalify(rebalance, policy=STATIC_POLICY)(x, jnp.float32(4.0))
    assert float(out.scale) == 32.0
    np.testing.assert_array_equal(out.to_array(), X)


def test_float16_range_through_set_scaling():
    tiny = np.float32(2.0**-40)

    def f(x):
        return stop_scaling(set_scaling(x, tiny), jnp.float32)

    x = jsa.ScaledArray(jnp.ones(3, jnp.float16), jnp.float32(2.0**-40))
    np.testing.assert_array_equal(jsa.scalify(f)(x), np.full(3, 2.0**-40, np.float32))


@pytest.mark.parametrize("fn", [set_scaling, rebalance])
def test_bad_scale_arguments(fn):
    with pytest.raises(TypeError, match="floating scalar"):
        fn(jnp.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match="floating"):
        fn(jnp.ones(3, jnp.int32), jnp.float32(1.0))


INVARIANCE_CASES = [
    Case(
        "scaling_primitives",
        lambda x: _uses_all_primitives(x)[0],
        [lambda rng: rng.standard_normal(5).astype(np.float32)],
        grad=True,
    ),
    Case(
        "get_data_scale_value",
        lambda x: (lambda d, s: d * s)(*get_data_scale(x)),
        [lambda rng: rng.standard_normal(5).astype(np.float32)],
    ),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_set_scaling_stands_against_the_output_policy(jit):
    """An explicit scale set on a returned value stands under the default policy (it was rescaled to 1)."""

    def f(v):
        return set_scaling(v, 8.0), set_scaling(v * 3, 8.0).astype(jnp.float16)

    step = jsa.scalify(f)
    out, cast = (jax.jit(step) if jit else step)(jsa.as_scaled_array(jnp.asarray(X)))
    assert float(out.scale) == 8.0 and float(cast.scale) == 8.0
    np.testing.assert_array_equal(out.to_array(), X)
    np.testing.assert_array_equal(cast.to_array(jnp.float32), 3 * X)


def test_set_scaling_stands_in_loop_carries_and_gradients():
    """The policy's loop-carry and gradient rescales leave a scale set with set_scaling as it is."""

    def loop(v):
        def body(c, _):
            c = set_scaling(c * 1.5, 8.0)
            return c, get_data_scale(c)[1]

        return jax.lax.scan(body, v, None, length=3)

    step = jax.jit(jsa.scalify(loop, policy=jsa.RescalePolicy(outputs=False)))
    carry, scales = step(jsa.as_scaled_array(jnp.asarray(X)))
    np.testing.assert_array_equal(np.asarray(scales), [8.0, 8.0, 8.0])
    np.testing.assert_allclose(carry.to_array(), X * 1.5**3, rtol=1e-6)

    def grad_set(v):
        return set_scaling(jax.grad(lambda v: jnp.sum(v * v))(v), 8.0)

    g = jax.jit(jsa.scalify(grad_set))(jsa.as_scaled_array(jnp.asarray(X)))
    assert float(g.scale) == 8.0
    np.testing.assert_array_equal(g.to_array(), 2 * X)


def test_set_scaling_stands_across_a_nested_jit_and_out_of_a_loop():
    """The mark of a scale set by the user is in the value (``ScaleFacts.pinned``): it crosses a
    nested ``jax.jit`` and leaves a ``scan`` whose body set it, and the default output policy leaves it."""

    def nested(v):
        return jax.jit(lambda u: set_scaling(u * 3, 8.0))(v)

    def loop(v):
        return jax.lax.scan(lambda c, _: (set_scaling(c * 1.5, 8.0), None), v, None, length=3)[0]

    x = jsa.as_scaled_array(jnp.asarray(X))
    for fn, value in ((nested, 3 * X), (loop, X * 1.5**3)):
        out = jax.jit(jsa.scalify(fn))(x)
        assert float(out.scale) == 8.0, fn.__name__
        np.testing.assert_allclose(out.to_array(), value, rtol=1e-6)


def test_dynamic_rescale_after_set_scaling_still_rescales():
    """An explicit dynamic_rescale of a value given its scale by set_scaling moves that scale."""
    out = jax.jit(jsa.scalify(lambda v: jsa.ops.dynamic_rescale(set_scaling(v, 8.0))))(jnp.asarray(X))
    assert float(out.scale) == 2.0  # RMS of X is 2.16
    np.testing.assert_allclose(out.to_array(), X, rtol=1e-6)
