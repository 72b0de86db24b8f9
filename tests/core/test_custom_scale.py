"""custom_scale: the plain function outside scalify, the user's scale rule under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from tests.invariance import STATIC_POLICY, Case, assert_close_values, assert_pow2_scales, invariance_test, normal

RULE_CALLS = []


@jsa.custom_scale
def gelu(x):
    return jax.nn.gelu(x)


@gelu.defscale
def _gelu_rule(x: jsa.ScaledArray) -> jsa.ScaledArray:
    """Keep x's scale (the paper's choice); the value is computed in float32."""
    RULE_CALLS.append(x)
    y = jax.nn.gelu(x.to_array(jnp.float32))
    return jsa.ScaledArray((y / x.scale).astype(x.dtype), x.scale)


@jsa.custom_scale
def marked(x, w):
    """A function whose rule is easy to observe: its output scale is always 2**7."""
    return {"y": x * w, "n": jnp.sum(x > 0)}


@marked.defscale
def _marked_rule(x, w):
    y = x.to_array(jnp.float32) * w.to_array(jnp.float32)
    return {"y": jsa.ScaledArray((y / 128).astype(x.dtype), jnp.float32(128)), "n": jnp.sum(x.data > 0)}


def gelu_of_product(x, w):
    return gelu(x * w) + x


INVARIANCE_CASES = [
    Case("custom_scale_gelu", gelu, [normal(3, 4)], grad=True),
    # Scales up to 2**10 per input: with 2**20 each, the gradient of the tanh-GELU multiplies
    # scales up to x**3 ~ 2**120 times sech(u)**2 ~ 0, and the float32 scale overflows to inf
    # where the value is 0 (0 * inf = nan). A known limit of float32 scales, see the notes.
    Case("custom_scale_in_program", gelu_of_product, [normal(4), normal(4)], grad=True, max_scale_exponent=10),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


X = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


def scaled(x, exponent):
    return jsa.ScaledArray(jnp.asarray(x / 2.0**exponent), jnp.float32(2.0**exponent))


# --- outside scalify: the plain function -----------------------------------------------------
def test_plain_outside_scalify_eager_jit_vmap_grad():
    np.testing.assert_allclose(gelu(X), jax.nn.gelu(X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(gelu)(X), jax.nn.gelu(X), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(gelu)(X), jax.nn.gelu(X), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(gelu, in_axes=1, out_axes=1)(X), jax.nn.gelu(X), rtol=1e-6)
    plain_grad = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))(X)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(gelu(x)))(X), plain_grad, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(gelu(x)))))(X), plain_grad, rtol=1e-6)
    ones = jnp.ones_like(X)
    np.testing.assert_allclose(jax.jvp(gelu, (X,), (ones,))[1], jax.jvp(jax.nn.gelu, (X,), (ones,))[1], rtol=1e-6)


def test_plain_outside_scalify_pytrees_and_integer_outputs():
    out = marked(X, W)
    np.testing.assert_allclose(out["y"], X * W, rtol=1e-6)
    assert int(out["n"]) == int(np.sum(X > 0))
    grad = jax.grad(lambda x: jnp.sum(marked(x, W)["y"]))(X)
    np.testing.assert_allclose(grad, W, rtol=1e-6)
    batched = jax.vmap(marked, in_axes=(0, None))(X, W[0])
    np.testing.assert_allclose(batched["y"], X * W[0], rtol=1e-6)


def test_closure_over_traced_values_is_differentiated():
    def fn(a, x):
        scale_by_a = jsa.custom_scale(lambda x: x * a)
        scale_by_a.defscale(lambda x: x)
        return jnp.sum(scale_by_a(x))

    np.testing.assert_allclose(jax.grad(fn)(2.0, X), np.sum(X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(fn, argnums=1))(2.0, X), np.full_like(X, 2.0), rtol=1e-6)


def test_static_argnums_and_keyword_arguments():
    def power(x, n, *, shift):
        return x**n + shift

    fn = jsa.custom_scale(power, static_argnums=(1,))
    fn.defscale(lambda x, n, *, shift: jsa.ScaledArray(x.to_array() ** n + shift.to_array(), jnp.float32(1)))
    np.testing.assert_allclose(jax.jit(lambda x: fn(x, 3, shift=1.0))(X), X**3 + 1, rtol=1e-5)
    got = jsa.scalify(lambda x: fn(x, 3, shift=jnp.float32(1.0)))(scaled(X, 2))
    np.testing.assert_allclose(got.to_array(), X**3 + 1, rtol=1e-5)


# --- under scalify: the rule ------------------------------------------------------------------
def test_rule_is_used_under_scalify():
    out = jsa.scalify(marked, policy=STATIC_POLICY)(scaled(X, 3), scaled(W, -2))
    assert isinstance(out["y"], jsa.ScaledArray) and float(out["y"].scale) == 128.0
    np.testing.assert_allclose(out["y"].to_array(), X * W, rtol=1e-6)
    assert int(out["n"]) == int(np.sum(X > 0))
    out = jax.jit(jsa.scalify(marked, policy=STATIC_POLICY))(scaled(X, 3), W)  # an unscaled input is promoted
    assert float(out["y"].scale) == 128.0


def test_rule_not_used_without_scaled_inputs():
    out = jsa.scalify(marked)(X, W)
    assert not isinstance(out["y"], jsa.ScaledArray)


def test_rule_under_scalify_in_float16_out_of_range():
    x = jsa.ScaledArray(jnp.asarray(X, np.float16), jnp.float32(2.0**-30))
    got = jsa.scalify(gelu, policy=STATIC_POLICY)(x)
    assert got.dtype == np.float16 and float(got.scale) == 2.0**-30  # the rule kept x's scale
    expected = jax.nn.gelu(X.astype(np.float64) * 2.0**-30)
    np.testing.assert_allclose(np.asarray(got.to_array(np.float32), np.float64), expected, rtol=2e-3)


def test_grad_inside_scalify_differentiates_the_plain_function_forward_uses_rule():
    RULE_CALLS.clear()
    fn = jax.value_and_grad(lambda x: jnp.sum(gelu(x)))
    value, grad = jsa.scalify(fn)(scaled(X, 4))
    assert RULE_CALLS  # the forward went through the rule
    expected_value, expected_grad = fn(X)
    assert_pow2_scales(grad)
    assert_close_values((value, grad), (expected_value, expected_grad), rtol=2e-5, atol=1e-6)


def test_vmap_inside_scalify_uses_rule_with_per_example_scales_rebalanced():
    @jsa.custom_scale
    def normalize(x):
        return x / jnp.max(jnp.abs(x))

    @normalize.defscale
    def _(x):
        # Output scale chosen from the data: one per example under vmap.
        value = x.to_array(jnp.float32)
        scale = jsa.core.pow2_round_down(jnp.max(jnp.abs(value)))
        return jsa.ScaledArray(value / jnp.max(jnp.abs(value)) * 2 / scale, scale / 2)

    x = np.stack([X[0], X[1] * 1000.0, X[2] * 1e-3])
    got = jsa.scalify(jax.vmap(normalize), policy=STATIC_POLICY)(scaled(x, 1))
    assert_pow2_scales(got)
    expected_scales = np.asarray(jsa.core.pow2_round_down(np.max(np.abs(x), axis=1))) / 2
    assert float(got.scale) == np.max(expected_scales)
    np.testing.assert_allclose(got.to_array(), jax.vmap(normalize)(x), rtol=1e-6)


# --- errors ------------------------------------------------------------------------------------
def test_missing_rule_raises():
    fn = jsa.custom_scale(lambda x: x)
    with pytest.raises(TypeError, match="defscale"):
        fn(X)


def test_rule_with_wrong_structure_raises():
    fn = jsa.custom_scale(lambda x: (x, x))
    fn.__name__ = "pair"
    fn.defscale(lambda x: x)
    with pytest.raises(TypeError, match="custom_scale function 'pair'.*structure"):
        jsa.scalify(fn)(scaled(X, 0))


def test_rule_with_wrong_shape_or_dtype_raises():
    fn = jsa.custom_scale(lambda x: x * 2)
    fn.defscale(lambda x: jsa.ScaledArray(x.data[0], x.scale))
    with pytest.raises(TypeError, match=r"returned float32\[4\] for output 0, expected float32\[3, 4\]"):
        jsa.scalify(fn)(scaled(X, 0))
    fn.defscale(lambda x: x.astype(jnp.float16))
    with pytest.raises(TypeError, match=r"float16\[3, 4\]"):
        jsa.scalify(fn)(scaled(X, 0))


def test_defscale_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        jsa.custom_scale(lambda x: x).defscale(3)


def test_registered_with_summary():
    entry = jsa.extend.registered_rules()[jsa.extend.custom_scale_call_p]
    assert entry.summary
