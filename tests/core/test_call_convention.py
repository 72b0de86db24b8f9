"""scalify's call convention: arrays are traced, every other leaf reaches the function as it is.

As under ``eqx.filter_jit``: Python numbers, functions, dtypes, strings and ``None`` are
static (part of the trace's cache key), ``static_argnums``/``static_argnames`` work as in
``jax.jit``, and non-array outputs come back as they are.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from tests.invariance import assert_pow2_scales, scaled

X = np.array([1.0, -2.0, 3.0, 0.5], np.float32)


def counting(fn):
    """``fn`` and a list that grows by one at each trace of it (each Python call)."""
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)
        return fn(*args, **kwargs)

    return counted, traces


def test_static_bool_under_jax_jit():
    """Regression: ``jax.jit(scalify(f), static_argnums=1)(x, True)`` raised TracerBoolConversionError."""

    def f(x, negate):
        return -x if negate else x

    fn = jax.jit(jsa.scalify(f), static_argnums=1)
    np.testing.assert_array_equal(fn(scaled(X, 3), True).to_array(), -X * 8)
    np.testing.assert_array_equal(fn(scaled(X, 3), False).to_array(), X * 8)


def test_non_array_leaves_reach_the_function_as_they_are():
    seen = {}

    def f(x, config):
        seen.update(config)
        out = config["act"](x) * config["gain"]
        return (jnp.zeros(config["size"]) + jnp.sum(out)).astype(config["dtype"]), config["name"]

    config = {"act": jnp.tanh, "gain": 2.0, "size": 3, "dtype": jnp.float16, "name": "layer", "off": None, "on": True}
    out, name = jsa.scalify(f)(scaled(X, -4), config)
    assert seen["act"] is jnp.tanh and type(seen["gain"]) is float and type(seen["size"]) is int
    assert seen["on"] is True and seen["off"] is None and name == "layer"
    assert out.dtype == jnp.float16 and out.shape == (3,)
    np.testing.assert_allclose(out.to_array(jnp.float32), np.full(3, np.sum(np.tanh(X / 16)) * 2), rtol=1e-3)


def test_python_float_is_a_constant_cached_by_value_and_type():
    f, traces = counting(lambda x, c: x * c)
    fn = jsa.scalify(f)
    for c in (0.5, 0.5, 0.25, 1.0, 1, True):
        out = fn(scaled(X, 0), c)
        np.testing.assert_array_equal(jsa.asarray(out), X * c)
    assert len(traces) == 5  # 0.5 once, 0.25, and 1.0 / 1 / True each its own trace
    assert float(fn(scaled(X, 0), 0.5).scale) == 0.5  # a constant folds into the scale
    assert len(traces) == 5


@pytest.mark.parametrize("as_array", [jnp.asarray, np.float32], ids=["jax", "numpy"])
def test_a_learning_rate_passed_as_an_array_is_traced_once(as_array):
    f, traces = counting(lambda w, lr: w - lr * w)
    fn = jax.jit(jsa.scalify(f))
    for lr in (1e-3, 3e-3, 0.5):
        out = fn(scaled(X, -6), as_array(lr))
        np.testing.assert_allclose(out.to_array(), X * 2.0**-6 * (1 - np.float32(lr)), rtol=1e-6)
        assert_pow2_scales(out)
    assert len(traces) == 1


def test_non_array_outputs_are_returned_as_they_are():
    """Regression: returning a string or a dtype raised an internal tracing error."""

    def f(x):
        return {"y": x * 2, "name": "double", "dtype": x.dtype, "fn": jnp.sin, "n": 3, "none": None}

    out = jsa.scalify(f)(scaled(X, 2))
    assert out["name"] == "double" and out["dtype"] == jnp.float32 and out["fn"] is jnp.sin
    assert out["n"] == 3 and type(out["n"]) is int and out["none"] is None
    np.testing.assert_array_equal(out["y"].to_array(), X * 8)
    cached = jsa.scalify(f)
    cached(scaled(X, 2))
    assert cached(scaled(X, 1))["name"] == "double"  # static outputs are kept with the cached trace


def test_static_argnums_and_argnames_as_in_jax_jit():
    def f(x, n, *, shift):
        return jnp.zeros(n) + jnp.sum(x) + shift.sum()

    n = np.int32(3)  # an array leaf: traced unless named static
    with pytest.raises(TypeError):
        jsa.scalify(f)(scaled(X, 0), n, shift=np.zeros(1, np.float32))
    for fn in (
        jsa.scalify(f, static_argnums=1),
        jsa.scalify(f, static_argnums=-1),
        jsa.scalify(f, static_argnames="n"),
        jsa.scalify(f, static_argnums=1, static_argnames="shift"),
    ):
        out = fn(scaled(X, 0), n, shift=np.ones(1, np.float32))
        np.testing.assert_array_equal(jsa.asarray(out), np.full(3, X.sum() + 1))


def test_unhashable_static_argument_is_traced_at_every_call():
    f, traces = counting(lambda x, table: x * table[0])
    fn = jsa.scalify(f, static_argnums=1)
    for _ in range(2):
        np.testing.assert_array_equal(fn(scaled(X, 0), np.array([2.0])).to_array(), 2 * X)
    assert len(traces) == 2


def test_static_argnums_on_a_scalified_function_wraps_it_again():
    once = jsa.scalify(lambda x, n: jnp.tile(x, n))
    assert jsa.scalify(once) is once
    twice = jsa.scalify(once, static_argnums=1)
    assert twice is not once
    np.testing.assert_array_equal(twice(scaled(X, 1), np.int32(2)).to_array(), np.tile(X, 2) * 2)


def test_inside_equinox_filter_jit_with_non_array_leaves():
    eqx = pytest.importorskip("equinox")

    def f(x, act, size, t1):
        return act(x) * t1, jnp.ones(size) * t1, "done"

    fn = eqx.filter_jit(jsa.scalify(f))
    y, ones, tag = fn(scaled(X, -2), jnp.tanh, 2, 0.5)
    np.testing.assert_allclose(y.to_array(), np.tanh(X / 4) * 0.5, rtol=1e-6)
    np.testing.assert_array_equal(ones, [0.5, 0.5])
    assert tag == "done"


def test_vmap_outside_scalify_with_in_axes_that_leave_the_scale_unmapped():
    """The form docs/pytrees.md gives for mapping a scalified function from outside."""
    x = jsa.as_scaled_array(jnp.arange(12.0).reshape(4, 3) + 1)
    axes = jax.tree.unflatten(jax.tree.structure(x), [0, None])
    y = jax.vmap(jsa.scalify(lambda a: a * 2), in_axes=(axes,))(x)
    assert jnp.shape(y.scale) == (4,)  # the default policy rescales each example's output
    np.testing.assert_allclose(np.asarray(y.data * y.scale[:, None]), 2 * np.asarray(x.to_array()))
    static = jsa.scalify(lambda a: a * 2, policy=jsa.RescalePolicy.static())
    y = jax.vmap(static, in_axes=(axes,), out_axes=axes)(x)
    assert jnp.shape(y.scale) == ()
    np.testing.assert_allclose(np.asarray(y.to_array()), 2 * np.asarray(x.to_array()))
