"""Unary rules: sign changes, powers and roots, log, and the maps computed on values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import primitives

import jax_scalify as jsa
from jax_scalify.core import registry
from jax_scalify.lax import rules_unary
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal, positive
from tests.invariance import exact_value as _value
from tests.invariance import scale_of as _scale

SHAPE = (3, 4)


def uniform(low: float, high: float, *shape: int):
    return lambda rng: rng.uniform(low, high, shape).astype(np.float32)


def unit_interval(*shape: int):
    return uniform(-0.9, 0.9, *shape)


INVARIANCE_CASES = [
    Case("neg", lambda x: -x, [normal(*SHAPE)], grad=True),
    Case("abs", jnp.abs, [normal(*SHAPE)], grad=True),
    Case("sign", jnp.sign, [normal(*SHAPE)]),
    Case("sign_times_x", lambda x: jnp.sign(x) * x, [normal(*SHAPE)], grad=True),
    Case("floor", jnp.floor, [uniform(-8, 8, *SHAPE)]),
    Case("ceil", jnp.ceil, [uniform(-8, 8, *SHAPE)]),
    Case("round", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), [uniform(-8, 8, *SHAPE)]),
    Case("is_finite", jnp.isfinite, [normal(*SHAPE)]),
    Case("exp", jnp.exp, [normal(*SHAPE)], grad=True),
    Case("exp2", jnp.exp2, [normal(*SHAPE)], grad=True),
    Case("log", jnp.log, [positive(*SHAPE)], grad=True),
    Case("log1p", jnp.log1p, [positive(*SHAPE)], grad=True),
    Case("expm1", jnp.expm1, [normal(*SHAPE)], grad=True),
    Case("integer_pow", lambda x: x**3, [normal(*SHAPE)], grad=True),
    Case("integer_pow_negative", lambda x: lax.integer_pow(x, -2), [positive(*SHAPE)], grad=True),
    Case("square", lax.square, [normal(*SHAPE)], grad=True),
    Case("pow_integral_float", lambda x: x**3.0, [normal(*SHAPE)], grad=True),
    Case("pow_fractional", lambda x: x**2.5, [positive(*SHAPE)], grad=True, max_scale_exponent=40),
    Case("pow_negative_fractional", lambda x: x**-0.75, [positive(*SHAPE)], grad=True, max_scale_exponent=40),
    Case("pow_third", lambda x: jnp.power(x, 1 / 3), [positive(*SHAPE)], grad=True, max_scale_exponent=100),
    Case("sqrt", jnp.sqrt, [positive(*SHAPE)], grad=True),
    Case("rsqrt", lax.rsqrt, [positive(*SHAPE)], grad=True),
    Case("cbrt", jnp.cbrt, [normal(*SHAPE)], grad=True),
    Case("tanh", jnp.tanh, [normal(*SHAPE)], grad=True),
    Case("logistic", jax.nn.sigmoid, [normal(*SHAPE)], grad=True),
    Case("erf", jax.scipy.special.erf, [normal(*SHAPE)], grad=True),
    Case("erfc", jax.scipy.special.erfc, [normal(*SHAPE)], grad=True),
    Case("erf_inv", jax.scipy.special.erfinv, [unit_interval(*SHAPE)], grad=True),
    Case("lgamma", lax.lgamma, [positive(*SHAPE)], grad=True),
    Case("digamma", lax.digamma, [positive(*SHAPE)]),
    Case("sin", jnp.sin, [normal(*SHAPE)], grad=True),
    Case("cos", jnp.cos, [normal(*SHAPE)], grad=True),
    Case("tan", jnp.tan, [uniform(-1.2, 1.2, *SHAPE)], grad=True),
    Case("asin", jnp.arcsin, [unit_interval(*SHAPE)], grad=True),
    Case("acos", jnp.arccos, [unit_interval(*SHAPE)], grad=True),
    Case("atan", jnp.arctan, [normal(*SHAPE)], grad=True),
    Case("sinh", jnp.sinh, [normal(*SHAPE)], grad=True),
    Case("cosh", jnp.cosh, [normal(*SHAPE)], grad=True),
    Case("asinh", jnp.arcsinh, [normal(*SHAPE)], grad=True),
    Case("acosh", lax.acosh, [uniform(1.1, 4.0, *SHAPE)], grad=True),
    Case("atanh", jnp.arctanh, [unit_interval(*SHAPE)], grad=True),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


# --- helpers ---------------------------------------------------------------------------------
def _scaled(data, exponent: int, dtype=jnp.float16) -> jsa.ScaledArray:
    return jsa.ScaledArray(jnp.asarray(data, dtype), jnp.float32(2.0**exponent))


def _f16(exponent: int, seed=0, signed=True, shape=(4, 5)) -> jsa.ScaledArray:
    rng = np.random.default_rng(seed)
    data = rng.uniform(1, 2, shape) * (rng.choice([-1, 1], shape) if signed else 1)
    return _scaled(data, exponent)


# --- float16 range robustness ----------------------------------------------------------------
_UNARY = {
    "neg": (lambda x: -x, np.negative, True),
    "abs": (jnp.abs, np.abs, True),
    "square": (lax.square, np.square, True),
    "cube": (lambda x: x**3, lambda v: v**3, True),
    "inverse_square": (lambda x: lax.integer_pow(x, -2), lambda v: v**-2, True),
    "sqrt": (jnp.sqrt, np.sqrt, False),
    "rsqrt": (lax.rsqrt, lambda v: 1 / np.sqrt(v), False),
    "cbrt": (jnp.cbrt, np.cbrt, True),
    "log": (jnp.log, np.log, False),
    "tanh": (jnp.tanh, np.tanh, True),
    "sin": (jnp.sin, np.sin, True),
    "floor": (jnp.floor, np.floor, True),
    "sign": (jnp.sign, np.sign, True),
}


_SATURATED = ("tanh", "sin")  # at large values: nothing for float16 to lose


@pytest.mark.parametrize(
    "name, exponent",
    [(name, e) for name in sorted(_UNARY) for e in (-41, -40, 29, 30) if e < 0 or name not in _SATURATED],
)
def test_float16_values_out_of_range(name, exponent):
    fn, ref, signed = _UNARY[name]
    x = _f16(exponent, seed=1, signed=signed)
    out = jsa.scalify(fn)(x)
    assert out.dtype == jnp.float16
    assert_pow2_scales(out)
    expected = ref(_value(x))
    np.testing.assert_allclose(_value(out), expected, rtol=2e-3)
    if name != "sign" or exponent < 0:
        plain = fn(x.to_array(jnp.float16))  # 0 or inf: float16 cannot hold these values
        assert not np.allclose(np.asarray(plain, np.float64), expected, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_narrow_dtypes(dtype):
    x = _scaled([1.0, 1.5, 1.25, 1.75], -20, dtype)
    fns = {"exp": (jnp.exp, np.exp), "sqrt": (jnp.sqrt, np.sqrt), "log": (jnp.log, np.log)}
    fns.update({"tanh": (jnp.tanh, np.tanh), "square": (lax.square, np.square), "cbrt": (jnp.cbrt, np.cbrt)})
    for name, (fn, ref) in fns.items():
        out = jsa.scalify(fn)(x)
        assert out.dtype == dtype, name
        np.testing.assert_allclose(_value(out), ref(_value(x)), rtol=0.13, err_msg=name)


# --- real jax.nn / jax.numpy functions --------------------------------------------------------
_REAL_FUNCTIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "elu": jax.nn.elu,
    "relu": jax.nn.relu,
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
    "arccosh": lambda x: jnp.arccosh(1.5 + jnp.abs(x)),
}


@pytest.mark.parametrize("name", sorted(_REAL_FUNCTIONS))
def test_real_functions(name):
    """Value and gradient of jax.nn / jax.numpy functions, on inputs with a small scale."""
    fn = _REAL_FUNCTIONS[name]
    x = _scaled(np.random.default_rng(4).standard_normal(SHAPE) * 2.0**10, -10, jnp.float32)
    value = jnp.asarray(_value(x), jnp.float32)
    out = jsa.scalify(fn)(x)
    assert_pow2_scales(out)
    np.testing.assert_allclose(_value(out), fn(value), rtol=2e-5, atol=1e-6)
    grad = jax.grad(lambda a: jnp.sum(fn(a)))
    got = jsa.scalify(grad)(x)
    assert_pow2_scales(got)
    np.testing.assert_allclose(_value(got), grad(value), rtol=2e-5, atol=1e-6)


# --- scale logic -----------------------------------------------------------------------------
@pytest.mark.parametrize("exponent", range(-7, 8))
def test_roots_are_exact_on_the_scale(exponent):
    x = _scaled([1.0, 1.5, 3.0, 0.25], exponent, jnp.float32)
    roots = [(jnp.sqrt, np.sqrt, 2, 1), (lax.rsqrt, lambda v: 1 / np.sqrt(v), 2, -1), (jnp.cbrt, np.cbrt, 3, 1)]
    for fn, ref, n, sign in roots:
        out = jsa.scalify(fn, policy=STATIC_POLICY)(x)
        assert _scale(out) == 2.0 ** (sign * -(-exponent // n)), (fn, exponent)
        np.testing.assert_allclose(_value(out), ref(_value(x)), rtol=1e-6)


def test_roots_without_rounding_take_the_root_of_the_scale():
    x = _scaled([1.0, 4.0], 3, jnp.float32)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        out = jsa.scalify(jnp.sqrt, policy=STATIC_POLICY)(x)
    np.testing.assert_allclose(_scale(out), np.sqrt(8.0), rtol=1e-7)
    np.testing.assert_allclose(_value(out), np.sqrt([8.0, 32.0]), rtol=1e-6)


def test_roots_of_traced_scales_under_jit():
    x = _scaled([1.0, 1.5], -9, jnp.float16)
    out = jax.jit(jsa.scalify(lambda a: (jnp.sqrt(a), lax.rsqrt(a), jnp.cbrt(a)), policy=STATIC_POLICY))(x)
    assert [_scale(o) for o in out] == [2.0**-4, 2.0**4, 2.0**-3]
    np.testing.assert_allclose(_value(out[0]), np.sqrt(_value(x)), rtol=1e-3)


@pytest.mark.parametrize("exponent", [127, 126, 125, -125, -126])
@pytest.mark.parametrize("jit", [False, True], ids=["numpy_scale", "traced_scale"])
def test_roots_of_scales_at_the_ends_of_the_float32_range(exponent, jit):
    """An odd exponent raised to the next multiple of n must not leave float32 (2**127 * 2 is inf)."""
    scale = np.float32(2.0**exponent)
    x = jsa.ScaledArray(jnp.asarray([2.0**80, 3.0], jnp.float32), jnp.asarray(scale) if jit else scale)
    fns = (jnp.sqrt, lax.rsqrt, jnp.cbrt)
    scalified = jsa.scalify(lambda a: tuple(f(a) for f in fns), policy=STATIC_POLICY)
    outs = (jax.jit(scalified) if jit else scalified)(x)
    for out, power in zip(outs, (0.5, -0.5, 1 / 3)):
        assert np.isfinite(_scale(out)), (exponent, power)
        got = np.log2(np.asarray(out.data, np.float64)) + np.log2(_scale(out))
        np.testing.assert_allclose(got, power * (np.log2([2.0**80, 3.0]) + exponent), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["numpy_scale", "traced_scale"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e5m2], ids=["float16", "e5m2"])
def test_roots_of_the_smallest_subnormal_data_at_an_odd_scale_exponent(dtype, jit):
    """Making the scale's exponent even halves the data: the smallest subnormal must not go to 0
    (its square root's derivative would be infinite; plain float16 holds the value)."""
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    data = jnp.asarray([tiny, 2 * tiny, 3 * tiny, 1.0], dtype)
    x = jsa.ScaledArray(data, jnp.float32(32.0) if jit else np.float32(32.0))
    fn = jsa.scalify(lambda a: (jnp.sqrt(a), lax.rsqrt(a), jnp.cbrt(a)), policy=STATIC_POLICY)
    values = np.asarray(data, np.float64) * 32
    for out, ref in zip((jax.jit(fn) if jit else fn)(x), (np.sqrt, lambda v: 1 / np.sqrt(v), np.cbrt)):
        rtol = 2.0 ** -jnp.finfo(dtype).nmant  # one rounding of the result
        np.testing.assert_allclose(np.asarray(jsa.asarray(out, jnp.float32)), ref(values), rtol=rtol)


def test_powers_are_exact_on_the_scale():
    x = _scaled([1.5, -1.25], -40)
    assert _scale(jsa.scalify(lax.square, policy=STATIC_POLICY)(x)) == 2.0**-80
    assert _scale(jsa.scalify(lambda a: a**3, policy=STATIC_POLICY)(x)) == 2.0**-120
    assert _scale(jsa.scalify(lambda a: lax.integer_pow(a, -2), policy=STATIC_POLICY)(x)) == 2.0**80


@pytest.mark.parametrize("jit", [False, True], ids=["numpy_scale", "traced_scale"])
def test_powers_by_a_constant_exponent_are_exact_on_the_scale(jit):
    """``x ** 3.0`` is ``integer_pow``; ``x ** 2.5`` moves the fraction of ``k * 2.5`` into the data."""
    x = _scaled([1.5, 1.25], -41, jnp.float32)
    fn = jsa.scalify(lambda a: (a**3.0, a**2.5, a**-0.5), policy=STATIC_POLICY)
    cube, fractional, inverse_root = (jax.jit(fn) if jit else fn)(x)
    assert (_scale(cube), _scale(fractional), _scale(inverse_root)) == (2.0**-123, 2.0**-103, 2.0**20)
    for out, y in zip((cube, fractional, inverse_root), (3, 2.5, -0.5)):
        np.testing.assert_allclose(_value(out), _value(x).astype(np.float64) ** y, rtol=1e-6)


def test_a_fractional_norm_of_small_float16_values_keeps_their_range():
    """At scale 1, float16 data flushed ``|x| ** 3.0`` of entries near 1e-3 to 0 (a norm of 0
    and non-finite gradients, as in plain float16)."""
    x = np.abs(np.random.default_rng(0).standard_normal(64)).astype(np.float32) * 1e-3
    scaled_x = jsa.tree.astype(jsa.as_scaled_array(x), jnp.float16)
    for norm in (lambda a: jnp.linalg.norm(a, ord=3), lambda a: jnp.sum(a**2.5) ** 0.4):
        value, grad = jax.jit(jsa.scalify(jax.value_and_grad(norm)))(scaled_x)
        np.testing.assert_allclose(_value(value), norm(x), rtol=3e-3)
        np.testing.assert_allclose(
            _value(grad), jax.grad(norm)(x), rtol=2e-2, atol=1e-3 * np.abs(jax.grad(norm)(x)).max()
        )


def test_negative_power_of_float16_data_with_small_entries_does_not_overflow():
    """``sigma ** -4`` for sigmas in ``[0.06, 2.6]`` spans ``2**21.7``, which float16 data hold
    at one scale; computed as ``d ** -2`` of the square's data (smallest entry 0.0036) it
    overflowed (the derivative of ``jax.scipy.stats.norm.logpdf``: an inf gradient)."""
    sigma = np.array([0.0604, 0.3, 1.0, 2.58], np.float32)
    squared = jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(sigma**2)), jnp.float16)
    out = jsa.scalify(lambda a: lax.integer_pow(a, -2))(squared)
    assert out.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out.data, np.float32)))
    got = np.asarray(out.data, np.float64) * _scale(out)
    np.testing.assert_allclose(got[:3], sigma[:3].astype(np.float64) ** -4, rtol=2e-3)

    def nll(s):
        return -jax.scipy.stats.norm.logpdf(jnp.asarray([0.5, -0.2, 0.1, 1.0], s.dtype), 0.0, s).sum()

    grad = jax.jit(jsa.scalify(jax.grad(nll)))(jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(sigma)), jnp.float16))
    # 1e-2: the backward pass multiplies residuals such as sigma ** -3, which span 2**16; centred
    # on their RMS by the policy, their smallest entries sit among float16's subnormals.
    np.testing.assert_allclose(np.asarray(grad.to_array(jnp.float32)), jax.grad(nll)(sigma), rtol=1e-2)


@pytest.mark.parametrize("square", [lax.square, lambda a: a**2], ids=["square", "integer_pow"])
@pytest.mark.parametrize("policy", [STATIC_POLICY, jsa.RescalePolicy()], ids=["static", "default"])
def test_square_of_float16_data_far_from_unit_size_does_not_overflow(square, policy):
    """Data 2**9 from unit size square past float16's range; the square is computed in
    float32 and its scale raised as far as its largest entry needs (plain float16 holds
    these values: 0.25**2)."""
    data = np.array([512.0, -384.0, 3.0, 0.5], np.float32)
    x = jsa.ScaledArray(jnp.asarray(data, jnp.float16), jnp.float32(2.0**-11))
    out = jsa.scalify(square, policy=policy)(x)
    assert out.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out.data, np.float32)))
    assert _scale(out) >= 2.0**-22
    np.testing.assert_allclose(_value(out), (data * 2.0**-11) ** 2, rtol=1e-3)


def test_log_of_large_data_and_small_scale_is_accurate():
    x = _scaled([1.5 * 2.0**20, 2.0**20, 3.0 * 2.0**21], -20, jnp.float32)
    out = jsa.scalify(jnp.log)(x)
    assert _scale(out) == 1.0
    np.testing.assert_allclose(_value(out), np.log([1.5, 1.0, 6.0]), rtol=1e-7, atol=1e-7)


def test_special_values():
    x = _scaled([0.0, -1.0, np.inf, np.nan], -30, jnp.float32)
    np.testing.assert_array_equal(_value(jsa.scalify(jnp.log)(x)), [-np.inf, np.nan, np.inf, np.nan])
    np.testing.assert_array_equal(_value(jsa.scalify(jnp.sqrt)(x)), [0.0, np.nan, np.inf, np.nan])
    np.testing.assert_array_equal(_value(jsa.scalify(lax.rsqrt)(x))[[0, 2]], [np.inf, 0.0])
    np.testing.assert_array_equal(jsa.scalify(jnp.isfinite)(x), [True, True, False, False])


def test_output_scales_of_value_maps():
    small, large = _f16(-30, seed=2), _f16(20, seed=3)
    for fn in (jnp.tanh, jnp.sin, jnp.arctan, jax.scipy.special.erf, jnp.expm1):
        assert _scale(jsa.scalify(fn, policy=STATIC_POLICY)(small)) == 2.0**-30  # f(x) ~ x near 0: keep a small scale
        assert _scale(jsa.scalify(fn, policy=STATIC_POLICY)(large)) == 1.0
    for fn in (jnp.floor, jnp.ceil, jnp.round):
        assert _scale(jsa.scalify(fn, policy=STATIC_POLICY)(small)) == 1.0
        assert _scale(jsa.scalify(fn, policy=STATIC_POLICY)(large)) == 2.0**20  # integers keep a large scale
    for fn in (jnp.exp, jnp.cos, jax.nn.sigmoid, jnp.log):
        assert _scale(jsa.scalify(fn, policy=STATIC_POLICY)(small)) == 1.0


def test_plain_outputs():
    x = _scaled([1.5, -1.0, 0.0, np.inf], -30)
    sign = jsa.scalify(jnp.sign)(x)
    assert not isinstance(sign, jsa.ScaledArray) and sign.dtype == jnp.float16
    np.testing.assert_array_equal(sign, [1, -1, 0, 1])
    finite = jsa.scalify(jnp.isfinite)(x)
    assert not isinstance(finite, jsa.ScaledArray)
    np.testing.assert_array_equal(finite, [True, True, True, False])


def test_neg_and_abs_keep_the_scale():
    x = _scaled([1.5, -1.0], -30)
    for fn in (jnp.negative, jnp.abs):
        out = jsa.scalify(fn)(x)
        assert _scale(out) == 2.0**-30
        np.testing.assert_array_equal(np.asarray(out.data), fn(np.asarray(x.data)))


def test_neg_of_constant_is_recognised():
    # neg is scalar-preserving: -4.0 is still split into mantissa -1 and scale 4.
    x = _scaled([1.5, -1.25], -30)
    out = jsa.scalify(lambda a: a * -lax.convert_element_type(4.0, jnp.float16))(x)
    assert _scale(out) == 2.0**-28
    np.testing.assert_array_equal(np.asarray(out.data), -np.asarray(x.data))


def test_unary_rules_are_exported_with_summaries():
    assert "scaled_tanh" in rules_unary.__all__
    assert rules_unary.scaled_tanh.__name__ == "scaled_tanh"
    summaries = {prim.name: entry.summary for prim, entry in jsa.extend.registered_rules().items()}
    for name in ("neg", "sqrt", "cbrt", "log", "exp", "tanh", "floor", "sign", "is_finite", "integer_pow"):
        assert summaries[name], name


# --- errors ----------------------------------------------------------------------------------
def test_missing_rule_names_the_primitive(restore_registry):
    del registry._RULES[primitives.fft_p]  # every floating primitive has a rule
    x = _scaled([1.5, 2.0], 0, jnp.float32)
    with pytest.raises(NotImplementedError, match="'fft'"):
        jsa.scalify(lambda a: jnp.fft.rfft(a))(x)


def test_scaled_array_outside_scalify_is_rejected():
    with pytest.raises(TypeError, match="scalify"):
        jnp.tanh(_scaled([1.0], 0))


def test_a_square_of_small_float16_data_is_lifted_out_of_the_subnormals():
    """``exp`` gives scale 1, so a standard deviation ``exp(-5.5) = 4e-3`` sits in float16
    data; its square (1.7e-5) was a subnormal, and the backward pass of
    ``jax.scipy.stats.norm.logpdf`` divided the cotangent by it: inf gradients, where a
    mixture density network with sharp modes went NaN (plain float16 is inf from -4)."""
    sigma = jsa.as_scaled_array(jnp.full((4,), 4e-3, jnp.float16), scale=np.float32(1))
    square = jsa.scalify(jnp.square, policy=STATIC_POLICY)(sigma)
    assert 1 <= float(jnp.max(jnp.abs(square.data.astype(jnp.float32)))) < 2
    np.testing.assert_allclose(np.asarray(jsa.asarray(square, jnp.float32)), np.float32(4e-3) ** 2, rtol=2e-3)

    def nll(log_std, mu, y):
        comp = jax.scipy.stats.norm.logpdf(y[:, None], mu, jnp.exp(log_std))
        return -jnp.mean(jax.scipy.special.logsumexp(comp, axis=-1))

    args = (
        np.full((2, 2), -5.5, np.float32),
        np.array([[0.001, 0.499]] * 2, np.float32),
        np.array([0.0, 0.5], np.float32),
    )
    expected = jax.grad(nll, argnums=(0, 1))(*args)
    scaled = [jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(a)), jnp.float16) for a in args]
    got = jsa.asarray(jax.jit(jsa.scalify(jax.grad(nll, argnums=(0, 1))))(*scaled), jnp.float32)
    for g, e in zip(got, expected):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0.03, atol=0.01)


def test_the_square_root_of_a_constant_is_folded_at_trace_time():
    """``q / jnp.sqrt(head_dim)`` (every attention layer): the root is a trace-time constant, so the
    division moves into the scale in Python instead of emitting run-time scale arithmetic."""
    values = np.linspace(-3.0, 3.0, 8, dtype=np.float32)

    def fn(data):  # the scale is a trace-time constant of the traced function
        scaled = jsa.ScaledArray(data, np.float32(4.0))
        return jsa.scalify(lambda v: v / jnp.sqrt(jnp.float32(8.0)), policy=STATIC_POLICY)(scaled)

    jaxpr = jax.make_jaxpr(fn)(jnp.asarray(values / 4)).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns] == ["div"]  # the data by sqrt(2); 2 moved into the scale
    plain = jax.jit(lambda v: v / jnp.sqrt(jnp.float32(8.0)))(values)  # XLA multiplies by the reciprocal
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(values / 4)).to_array()), np.asarray(plain))
