"""Special functions, random sampling, bitcast and the generic reduce."""

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

import jax_scalify as jsa
from jax_scalify.core import ScaledPrimitiveType, find_registered_scaled_op
from jax_scalify.lax import rules_special
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal, positive
from tests.invariance import exact_value as _value
from tests.invariance import scale_of as _scale
from tests.invariance import scaled as _scaled

SHAPE = (3, 4)


def uniform(low: float, high: float, *shape: int):
    return lambda rng: rng.uniform(low, high, shape).astype(np.float32)


# jax.random.gamma with a constant key: under jax.jit the key is traced, not a constant of
# the scalified jaxpr (a PRNG key constant is not handled by the interpreter, see the report).
_gamma = jax.jit(lambda alpha: jax.random.gamma(jax.random.key(0), alpha))


def _rng_uniform_in_range(lo):
    """rng_uniform is stateful (not reproducible): check that samples lie in [lo, lo + 1]."""
    u = lax.rng_uniform(lo, lo + 1.0, (4,))
    return (u >= lo) & (u <= lo + 1.0), lo * 2.0


def _reduce_add(x):  # init 1 is not add's identity: JAX emits the generic reduce
    return lax.reduce(x, np.float32(1.0), lax.add, (1,))


def _reduce_max_min(x):  # variadic, order operations only
    inits = (np.float32(-np.inf), np.float32(np.inf))
    return lax.reduce((x, x), inits, lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])), (0,))


def _reduce_argmax(x):  # variadic (value, index) with a select: commutes with the scale
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)

    def pick(a, b):
        take_a = a[0] >= b[0]
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(0)), pick, (1,))


def _reduce_mul(x):  # not add or order-only: computed on values
    return lax.reduce(x, np.float32(2.0), lax.mul, (1,))


INVARIANCE_CASES = [
    Case("bessel_i0e", jss.i0e, [normal(*SHAPE)], grad=True),
    Case("bessel_i1e", jss.i1e, [normal(*SHAPE)], grad=True),
    # grad w.r.t. a: igamma_grad_a.
    Case("igamma", jss.gammainc, [positive(*SHAPE, low=0.5), positive(*SHAPE)], grad=True),
    Case("igammac", jss.gammaincc, [positive(*SHAPE, low=0.5), positive(*SHAPE)]),
    Case("polygamma", lambda x: jss.polygamma(1, x), [positive(*SHAPE, low=0.5)], grad=True),
    Case(
        "polygamma_scaled_order",
        lax.polygamma,
        [lambda rng: np.full(SHAPE, 2.0, np.float32), positive(*SHAPE, low=0.5)],
    ),
    # zeta's gradient is not checked: jnp.cumprod in its JVP is not invariant (see the report).
    Case("zeta", lambda q: jss.zeta(3.0, q), [positive(*SHAPE, low=0.5)]),
    # No gradient: JAX only differentiates betainc w.r.t. x, with elementary ops covered elsewhere.
    Case(
        "regularized_incomplete_beta",
        lambda x, a, b: jss.betainc(a, b, x),
        [uniform(0.05, 0.95, *SHAPE), positive(*SHAPE, low=0.5), positive(*SHAPE, low=0.5)],
    ),
    # No gradient: it is a while loop of elementary operations (13 s for 6 examples), and the
    # sample itself is bound on the value, so it is bitwise the plain one.
    Case("random_gamma", _gamma, [positive(*SHAPE, low=0.5)]),
    Case("rng_uniform", _rng_uniform_in_range, [lambda rng: np.float32(rng.uniform(0.5, 4.0))]),
    Case("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.int32), [normal(*SHAPE)]),
    Case("frexp", jnp.frexp, [normal(*SHAPE)]),
    Case("signbit_copysign", lambda x, y: (jnp.signbit(x), jnp.copysign(x, y)), [normal(*SHAPE), normal(*SHAPE)]),
    Case("reduce_add", _reduce_add, [normal(*SHAPE)], grad=True),
    Case("reduce_max_min", _reduce_max_min, [normal(*SHAPE)]),
    Case("reduce_argmax", _reduce_argmax, [normal(*SHAPE)]),
    Case("reduce_mul", _reduce_mul, [uniform(0.5, 2.0, *SHAPE)]),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


# --- helpers ---------------------------------------------------------------------------------


# --- special functions -----------------------------------------------------------------------
def test_special_functions_have_unit_scale_and_compute_on_values():
    rng = np.random.default_rng(3)
    a, x = (
        _scaled(rng.uniform(1, 2, SHAPE), 1),
        _scaled(rng.uniform(1, 2, SHAPE), -1),
    )  # shapes of the cases: compiled once
    for fn in (jss.gammainc, jss.gammaincc):
        out = jsa.scalify(fn, policy=STATIC_POLICY)(a, x)
        assert isinstance(out, jsa.ScaledArray) and _scale(out) == 1.0
        np.testing.assert_allclose(_value(out), fn(_value(a), _value(x)), rtol=1e-6)


def test_bessel_i1e_keeps_a_small_scale_in_float16():
    """i1e(x) ~ x/2: values 2^-30 are far below float16's range but their scale carries them."""
    x = _scaled([1.0, -1.5, 1.25], -30, jnp.float16)
    out = jsa.scalify(jss.i1e, policy=STATIC_POLICY)(x)
    assert out.dtype == jnp.float16 and _scale(out) == 2.0**-30
    np.testing.assert_allclose(_value(out), _value(x) / 2, rtol=2e-3)
    assert np.all(np.asarray(jss.i1e(x.to_array(jnp.float16))) == 0)  # plain float16 underflows
    i0e = jsa.scalify(jss.i0e, policy=STATIC_POLICY)(x)
    assert _scale(i0e) == 1.0
    np.testing.assert_allclose(_value(i0e), 1.0, rtol=1e-3)


def test_narrow_data_is_computed_in_float32():
    # Value 2^20 * 1.5 in float16 data with scale 2^10: igammac(a, x) of a value above float16's range.
    a = _scaled([1.0, 2.0], 14, jnp.float16)
    x = _scaled([1.0, 1.5], 14, jnp.float16)
    out = jsa.scalify(jss.gammaincc)(a, x)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(
        _value(out), jss.gammaincc(_value(a).astype(np.float32), _value(x).astype(np.float32)), rtol=2e-3, atol=1e-6
    )


# --- random sampling -------------------------------------------------------------------------
def test_random_primitives_are_never_scaled():
    for prim in (jax.extend.core.primitives.random_gamma_p, jax.extend.core.primitives.rng_uniform_p):
        assert find_registered_scaled_op(prim)[1] == ScaledPrimitiveType.NEVER


def test_random_gamma_samples_with_the_value_of_alpha():
    alpha = _scaled(np.full((3, 4), 1.25), 3)  # value 10; same shape as the invariance case (compiled once)
    out = jsa.scalify(_gamma)(alpha)
    assert not isinstance(out, jsa.ScaledArray)
    np.testing.assert_array_equal(out, _gamma(jnp.asarray(_value(alpha), jnp.float32)))


# --- bitcast ---------------------------------------------------------------------------------
def test_bitcast_uses_the_value_not_the_data():
    x = _scaled([1.5, -1.0, 0.0], 7)
    out = jsa.scalify(lambda a: lax.bitcast_convert_type(a, jnp.uint32))(x)
    expected = np.asarray(_value(x), np.float32).view(np.uint32)
    np.testing.assert_array_equal(out, expected)
    assert not np.array_equal(out, np.asarray(x.data).view(np.uint32))


# --- generic reduce --------------------------------------------------------------------------
def test_reduce_scales():
    big = _scaled(np.random.default_rng(0).uniform(1, 2, (4, 16)), 20)
    out = jsa.scalify(_reduce_add, policy=STATIC_POLICY)(big)
    assert _scale(out) == 2.0**20 * 4  # 16 terms: r = pow2(sqrt(16)) = 4; then + 1.0: pow2(sqrt(2^44 + 1))
    np.testing.assert_allclose(_value(out), _reduce_add(_value(big)), rtol=1e-6)
    x = _scaled(np.random.default_rng(0).uniform(1, 2, (4, 16)), -20)
    out = jsa.scalify(_reduce_add, policy=STATIC_POLICY)(x)
    assert _scale(out) == 1.0  # the init 1.0 dominates
    np.testing.assert_allclose(_value(out), _reduce_add(_value(x)), rtol=1e-6)
    hi, lo = jsa.scalify(_reduce_max_min, policy=STATIC_POLICY)(x)
    assert _scale(hi) == _scale(lo) == 2.0**-20  # -inf / inf inits adopt the operand's scale
    np.testing.assert_array_equal(_value(hi), np.max(_value(x), axis=0))
    values, idx = jsa.scalify(_reduce_argmax, policy=STATIC_POLICY)(x)
    assert _scale(values) == 2.0**-20 and not isinstance(idx, jsa.ScaledArray)
    np.testing.assert_array_equal(idx, np.argmax(_value(x), axis=1))
    prod = jsa.scalify(_reduce_mul, policy=STATIC_POLICY)(_scaled(np.full((2, 3), 1.5), 0))
    assert _scale(prod) == 1.0
    np.testing.assert_allclose(_value(prod), 2 * 1.5**3)


def test_reduce_with_a_float_constant_in_the_computation_works_on_values():
    fn = lambda x: lax.reduce(x, np.float32(0.0), lambda a, b: jnp.maximum(a, b) + 0.5, (0,))  # noqa: E731
    x = _scaled([[1.0, 1.5], [1.25, 1.75]], 4)
    out = jsa.scalify(fn, policy=STATIC_POLICY)(x)
    assert _scale(out) == 1.0
    np.testing.assert_allclose(_value(out), fn(jnp.asarray(_value(x), jnp.float32)), rtol=1e-6)


def test_special_rules_are_exported_with_summaries():
    assert "scaled_igamma" in rules_special.__all__
    summaries = {prim.name: entry.summary for prim, entry in jsa.extend.registered_rules().items()}
    for name in ("bessel_i0e", "igamma", "zeta", "random_gamma", "bitcast_convert_type", "reduce"):
        assert summaries[name], name


def test_outputs_are_powers_of_two():
    x = _scaled([1.5, 1.25], -9)
    assert_pow2_scales(jsa.scalify(lambda a: (jss.i1e(a), jss.polygamma(1, a + 1)))(x))
