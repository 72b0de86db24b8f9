"""Arithmetic rules: sums, products, selections, comparisons, casts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify.lax import rules_arithmetic
from tests.invariance import (
    STATIC_POLICY,
    Case,
    assert_pow2_scales,
    booleans,
    integers,
    invariance_test,
    normal,
    positive,
)
from tests.invariance import exact_value as _value
from tests.invariance import scale_of as _scale

SHAPE = (3, 4)


def _select3(which, x, y, z):
    return lax.select_n(which, x, y, z)


INVARIANCE_CASES = [
    Case("add", lambda x, y: x + y, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("add_constant", lambda x: x + 2.5, [normal(*SHAPE)], grad=True),
    Case("add_0d_operand", lambda x, y: lax.add(x, y), [normal(*SHAPE), normal()], grad=True),
    Case("sub", lambda x, y: x - y, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("sub_from_constant", lambda x: 1.0 - x, [normal(*SHAPE)], grad=True),
    Case("add_any", lambda x: x * x + x, [normal(*SHAPE)], grad=True),
    Case("mul", lambda x, y: x * y, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("mul_constant", lambda x: x * 3.0, [normal(*SHAPE)], grad=True),
    Case("mul_0d_operand", lambda x, y: lax.mul(x, y), [normal(*SHAPE), normal()], grad=True),
    Case("div", lambda x, y: x / y, [normal(*SHAPE), positive(*SHAPE)], grad=True),
    Case("div_constant", lambda x: x / 3.0, [normal(*SHAPE)], grad=True),
    Case("rem", lambda x, y: lax.rem(x, y), [normal(*SHAPE), positive(*SHAPE)], grad=True),
    Case("pow", lambda x, y: x**y, [positive(*SHAPE), normal(*SHAPE)], grad=True),
    Case("pow_int_exponent", lambda x, n: lax.pow(x, n), [positive(*SHAPE), integers(*SHAPE)]),
    Case("atan2", jnp.arctan2, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("nextafter", jnp.nextafter, [normal(*SHAPE), normal(*SHAPE)]),
    Case("max", jnp.maximum, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("min", jnp.minimum, [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("relu", lambda x: jnp.maximum(x, 0.0), [normal(*SHAPE)], grad=True),
    Case("clamp", lambda lo, x: lax.clamp(lo, x, lo + 1.0), [normal(*SHAPE), normal(*SHAPE)], grad=True),
    Case("clamp_constants", lambda x: lax.clamp(-0.5, x, 0.5), [normal(*SHAPE)], grad=True),
    Case(
        "select_n", lambda x, y, c: lax.select_n(c, x, y), [normal(*SHAPE), normal(*SHAPE), booleans(*SHAPE)], grad=True
    ),
    Case("select_n_int", _select3, [integers(*SHAPE, high=3), normal(*SHAPE), normal(*SHAPE), normal(*SHAPE)]),
    Case("where_zero", lambda x: jnp.where(x > 0, x, 0.0), [normal(*SHAPE)]),
    Case("eq", lambda x: x == jnp.maximum(x, 0.0), [normal(*SHAPE)]),
    Case("ne", lambda x, y: x != jnp.minimum(x, y), [normal(*SHAPE), normal(*SHAPE)]),
    Case("lt", lambda x, y: x < y, [normal(*SHAPE), normal(*SHAPE)]),
    Case("le", lambda x: x <= jnp.maximum(x, 0.0), [normal(*SHAPE)]),
    Case("gt", lambda x, y: x > y, [normal(*SHAPE), normal(*SHAPE)]),
    Case("ge", lambda x: x >= 0.5, [normal(*SHAPE)]),
    Case("convert_bfloat16", lambda x: x.astype(jnp.bfloat16), [normal(*SHAPE)], grad=True),
    Case("convert_int", lambda x: (x * 4.0).astype(jnp.int32), [normal(*SHAPE)]),
    Case("convert_bool", lambda x: jnp.floor(x).astype(bool), [normal(*SHAPE)]),
    Case("convert_int_to_float", lambda x, n: x * n.astype(jnp.float32), [normal(*SHAPE), integers(*SHAPE)]),
    Case("reduce_precision", lambda x: lax.reduce_precision(x, 8, 7), [normal(*SHAPE)], grad=True),
    Case("stop_gradient", lambda x: x * lax.stop_gradient(x), [normal(*SHAPE)], grad=True),
    Case("copy", lambda x: jnp.copy(x) * 2.0, [normal(*SHAPE)], grad=True),
    Case("searchsorted_total_order", lambda a, v: jnp.searchsorted(jnp.sort(a), v), [normal(8), normal(5)]),
    Case("eq_to", lambda a, b: jsa.core.registry.lax_primitive("eq_to").bind(a, b), [normal(4), normal(4)]),
    Case("lt_to", lambda a, b: jsa.core.registry.lax_primitive("lt_to").bind(a, b), [normal(4), normal(4)]),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


# --- helpers ---------------------------------------------------------------------------------
def _f16(exponent: int, shape=(4, 5), seed=0, low=1.0, high=2.0, signed=True) -> jsa.ScaledArray:
    """float16 data in [low, high) (random signs) with scale 2**exponent."""
    rng = np.random.default_rng(seed)
    data = rng.uniform(low, high, shape) * (rng.choice([-1, 1], shape) if signed else 1)
    return jsa.ScaledArray(jnp.asarray(data, jnp.float16), jnp.float32(2.0**exponent))


# --- float16 range robustness ----------------------------------------------------------------
_BINARY = {
    "add": (lambda x, y: x + y, np.add),
    "sub": (lambda x, y: x - y, np.subtract),
    "mul": (lambda x, y: x * y, np.multiply),
    "div": (lambda x, y: x / y, np.divide),
    "max": (jnp.maximum, np.maximum),
    "min": (jnp.minimum, np.minimum),
    "clamp": (lambda x, y: lax.clamp(-jnp.abs(y), x, jnp.abs(y)), lambda x, y: np.clip(x, -np.abs(y), np.abs(y))),
    "where": (lambda x, y: jnp.where(x > y, x, y), lambda x, y: np.where(x > y, x, y)),
}


@pytest.mark.parametrize("exponent", [-40, 30])
@pytest.mark.parametrize("name", sorted(_BINARY))
def test_float16_values_out_of_range(name, exponent):
    fn, ref = _BINARY[name]
    x, y = _f16(exponent, seed=1), _f16(exponent + 2, seed=2)
    out = jsa.scalify(fn)(x, y)
    assert out.dtype == jnp.float16
    assert_pow2_scales(out)
    expected = ref(_value(x), _value(y))
    np.testing.assert_allclose(_value(out), expected, rtol=4e-3)
    # Plain float16 cannot even hold these values.
    plain = fn(x.to_array(jnp.float16), y.to_array(jnp.float16))
    assert not np.allclose(np.asarray(plain, np.float64), expected, rtol=1e-2, atol=0)


@pytest.mark.parametrize("exponent", [-40, 30])
def test_float16_comparisons_out_of_range(exponent):
    x, y = _f16(exponent, seed=3), _f16(exponent + 1, seed=4, low=0.5, high=1.0)
    ops = [(jnp.equal, np.equal), (jnp.not_equal, np.not_equal), (jnp.less, np.less)]
    ops += [(jnp.less_equal, np.less_equal), (jnp.greater, np.greater), (jnp.greater_equal, np.greater_equal)]
    for op, ref in ops:
        out = jsa.scalify(op)(x, y)
        assert out.dtype == jnp.bool_
        np.testing.assert_array_equal(out, ref(_value(x), _value(y)))


def test_float16_cast_keeps_scale():
    x = jsa.ScaledArray(jnp.asarray([1.5, -3.0], jnp.float32), jnp.float32(2.0**-50))
    out = jsa.scalify(lambda a: a.astype(jnp.float16), policy=STATIC_POLICY)(x)
    assert out.dtype == jnp.float16 and _scale(out) == 2.0**-50
    np.testing.assert_array_equal(_value(out), [1.5 * 2.0**-50, -3 * 2.0**-50])
    as_int = jsa.scalify(lambda a: (a * 2.0**50).astype(jnp.int32), policy=STATIC_POLICY)(x)
    np.testing.assert_array_equal(as_int, [1, -3])


def test_float16_nextafter_steps_in_data_dtype():
    x, y = _f16(-40, shape=(6,), seed=5), _f16(-39, shape=(6,), seed=6)
    out = jsa.scalify(jnp.nextafter)(x, y)
    expected = np.nextafter(np.asarray(x.data), np.asarray(y.data) * np.float16(2))
    np.testing.assert_array_equal(np.asarray(out.data), expected)
    assert _scale(out) == _scale(x)


# --- any-scale operands ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jnp.maximum(x, 0.0),
        lambda x: jnp.minimum(0.0, x),
        lambda x: x + 0.0,
        lambda x: 0.0 + x,
        lambda x: x - 0.0,
        lambda x: jnp.maximum(x, -jnp.inf),
        lambda x: lax.select_n(x > 0, jnp.zeros_like(x), x),
        lambda x: lax.clamp(jnp.zeros((), x.dtype), x, jnp.full((), jnp.inf, x.dtype)),
    ],
    ids=["max0", "min0", "add0", "radd0", "sub0", "max_minus_inf", "select_zeros", "clamp0inf"],
)
def test_any_scale_operand_keeps_scale(fn):
    x = _f16(-30, seed=7)
    out = jsa.scalify(fn)(x)
    assert _scale(out) == _scale(x)
    np.testing.assert_allclose(_value(out), _value(fn(jnp.asarray(_value(x), jnp.float32))), rtol=1e-3)


def test_mul_by_zero_constant_is_zero():
    out = jsa.scalify(lambda x: x * 0.0)(_f16(-30))
    np.testing.assert_array_equal(_value(out), 0.0)


BOUNDS = {
    "floor": (lambda a, c: jnp.maximum(a, c), lambda v, c: v >= c),
    "ceiling": (lambda a, c: jnp.minimum(a, -c), lambda v, c: v <= -c),
    "clip": (lambda a, c: jnp.clip(a, c, 50.0), lambda v, c: (v >= c) & (v <= 50.0)),
}


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["f16", "e4m3", "e5m2"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_constant_bound_on_narrow_data_at_a_larger_scale_stays_a_bound(bound, dtype, jit):
    """Aligned to the tensor's scale, a tiny constant's narrow data round to 0 at nearest: a
    floor ``max(x, 1e-8)`` must stay above 0 (and at least the constant), a ceiling below."""
    fn, holds = BOUNDS[bound]
    x = jsa.ScaledArray(jnp.asarray([0.0, 0.5, 1.0, 3.0], dtype), jnp.float32(32.0))
    for c in (1e-12, 1e-8, 1e-6, 0.3):
        scalified = jsa.scalify(fn, static_argnums=1)
        got = np.asarray(jsa.asarray((jax.jit(scalified, static_argnums=1) if jit else scalified)(x, c), jnp.float32))
        assert np.all(holds(got, c)), (c, got)
        expected = fn(np.asarray(x.data, np.float32) * 32, c)
        atol = 64 * float(jnp.finfo(dtype).smallest_subnormal)  # the constant's rounding at scale 32
        np.testing.assert_allclose(got, expected, rtol=2.0 ** -jnp.finfo(dtype).nmant, atol=atol)


@pytest.mark.parametrize("eps", [1e-12, 1e-8, 1e-6])
def test_the_gradient_of_a_square_root_of_a_floored_float16_distance_is_finite(eps):
    """``sqrt(max(d2, eps))`` of a distance matrix's zeros: float32's gradient there is 0."""
    d2 = jnp.asarray([0.0, 1.0, 4.0, 100.0])

    def loss(d2):
        return jnp.sum(jnp.sqrt(jnp.maximum(d2, eps)))

    grad = jax.jit(jsa.scalify(jax.grad(loss)))(jsa.tree.astype(jsa.as_scaled_array(d2), jnp.float16))
    np.testing.assert_allclose(np.asarray(jsa.asarray(grad, jnp.float32)), jax.grad(loss)(d2), rtol=1e-3)


# --- scale logic -----------------------------------------------------------------------------
def test_add_scale_rule():
    """pow2(sqrt(sa^2 + sb^2)): DOWN keeps the larger scale, UP doubles equal scales."""
    x = jsa.ScaledArray(jnp.ones(3), jnp.float32(4.0))
    y = jsa.ScaledArray(jnp.ones(3), jnp.float32(4.0))
    z = jsa.ScaledArray(jnp.ones(3), jnp.float32(2.0**-10))
    add = jsa.scalify(lambda a, b: a + b, policy=STATIC_POLICY)
    assert _scale(add(x, y)) == 4.0
    assert _scale(add(x, z)) == 4.0
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        assert _scale(add(x, y)) == 8.0
        np.testing.assert_allclose(_value(add(x, y)), 8.0)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        np.testing.assert_allclose(_scale(add(x, y)), 4 * np.sqrt(2), rtol=1e-6)
        np.testing.assert_allclose(_value(add(x, y)), 8.0, rtol=1e-6)


def test_add_scale_does_not_overflow():
    x = jsa.ScaledArray(jnp.ones(3), jnp.float32(2.0**120))
    out = jsa.scalify(lambda a: a + a, policy=STATIC_POLICY)(x)
    assert _scale(out) == 2.0**120
    np.testing.assert_array_equal(np.asarray(out.data), 2.0)


def test_add_zero_scales_gives_zero():
    x = jsa.ScaledArray(jnp.ones(3), jnp.float32(0.0))
    out = jsa.scalify(lambda a, b: a + b)(x, x)
    np.testing.assert_array_equal(_value(out), 0.0)
    assert np.all(np.isfinite(np.asarray(out.data)))


def test_a_chain_of_sums_at_run_time_scales_compiles_each_sum_once():
    """A residual stream: each partial sum is read by a kernel of its own and by the next sum.

    XLA copied each sum's alignment (convert, multiply, convert per operand) into every later
    kernel, so the HLO grew as the square of the chain's length (multiplies for 2 / 4 / 8 sums:
    38 / 98 / 290); each sum computed once, it grows linearly.
    """

    def stream(x, ys):
        outs = []
        for y in ys:
            x = x + y
            outs.append(jnp.sum(jnp.tanh(x)))
        return outs

    def multiplies(n):
        x = jsa.as_scaled_array(jnp.ones((16, 16), jnp.float16), scale=jnp.float32(1.0))
        ys = [jsa.as_scaled_array(jnp.ones((16, 16), jnp.float16), scale=jnp.float32(2.0**i)) for i in range(n)]
        return jax.jit(jsa.scalify(stream)).lower(x, ys).compile().as_text().count(" multiply(")

    m2, m4, m8 = multiplies(2), multiplies(4), multiplies(8)
    assert m8 - m4 <= 2 * (m4 - m2), (m2, m4, m8)


def test_mul_div_scales():
    x = jsa.ScaledArray(jnp.full(3, 1.5), jnp.float32(2.0**-10))
    y = jsa.ScaledArray(jnp.full(3, 1.25), jnp.float32(2.0**4))
    assert _scale(jsa.scalify(lambda a, b: a * b)(x, y)) == 2.0**-6
    assert _scale(jsa.scalify(lambda a, b: a / b)(x, y)) == 2.0**-14
    # A constant's exponent folds into the scale; the data keeps the mantissa product.
    out = jsa.scalify(lambda a: a * 6.0)(x)  # 6 = 0.75 * 2**3 (nearest power of two)
    assert _scale(out) == 2.0**-7
    np.testing.assert_array_equal(np.asarray(out.data), 1.5 * 0.75)
    out = jsa.scalify(lambda a: a * 0.999)(x)  # a constant near 1 keeps the scale
    assert _scale(out) == 2.0**-10


def test_rem_takes_divisor_scale():
    x = jsa.ScaledArray(jnp.asarray([5.0, -7.0]), jnp.float32(2.0**10))
    y = jsa.ScaledArray(jnp.asarray([1.5, 1.5]), jnp.float32(2.0**-3))
    out = jsa.scalify(lax.rem, policy=STATIC_POLICY)(x, y)
    assert _scale(out) == 2.0**-3
    np.testing.assert_allclose(_value(out), np.fmod(_value(x), _value(y)))


def test_selections_align_to_largest_scale():
    x = jsa.ScaledArray(jnp.asarray([1.0, -2.0]), jnp.float32(2.0**-5))
    y = jsa.ScaledArray(jnp.asarray([0.5, 0.5]), jnp.float32(2.0**3))
    for fn in (jnp.maximum, jnp.minimum, lambda a, b: jnp.where(a > b, a, b)):
        out = jsa.scalify(fn, policy=STATIC_POLICY)(x, y)
        assert _scale(out) == 2.0**3
        np.testing.assert_allclose(_value(out), fn(_value(x), _value(y)))


def test_comparisons_across_scales():
    # Equal values with different (data, scale) splits.
    a = jsa.ScaledArray(jnp.asarray([1 + 2.0**-10, 1.0], jnp.float16), jnp.float32(2.0**-10))
    b = jsa.ScaledArray(jnp.asarray([(1 + 2.0**-10) * 2.0**-12, 2.0**-12], jnp.float16), jnp.float32(4.0))
    np.testing.assert_array_equal(jsa.scalify(jnp.equal)(a, b), [True, True])
    np.testing.assert_array_equal(jsa.scalify(jnp.less)(a, b), [False, False])
    # A tiny positive value against a zero-data operand with a much larger scale: aligning
    # in float16 would flush the tiny value to 0, the rule compares in float32.
    tiny = jsa.ScaledArray(jnp.ones(2, jnp.float16), jnp.float32(2.0**-30))
    zero = jsa.ScaledArray(jnp.zeros(2, jnp.float16), jnp.float32(1.0))
    np.testing.assert_array_equal(jsa.scalify(jnp.greater)(tiny, zero), [True, True])
    np.testing.assert_array_equal(jsa.scalify(jnp.equal)(tiny, zero), [False, False])


def test_scales_are_powers_of_two_in_every_mode_that_rounds():
    x = jsa.ScaledArray(jnp.full(3, 1.5), jnp.float32(2.0**-7))
    y = jsa.ScaledArray(jnp.full(3, 1.25), jnp.float32(2.0**5))
    fn = jsa.scalify(lambda a, b: (a + b, a - b, a * b, a / b, jnp.maximum(a, b), lax.rem(a, b)))
    for mode in (jsa.Pow2RoundMode.DOWN, jsa.Pow2RoundMode.UP):
        with jsa.ScalifyConfig(rounding_mode=mode):
            assert_pow2_scales(fn(x, y))


def test_scale_dtype_follows_config():
    x = jsa.ScaledArray(jnp.ones(3, jnp.float16), jnp.float32(2.0))
    with jsa.ScalifyConfig(scale_dtype=np.float16):
        outs = jsa.scalify(lambda a: (a + a, a * a, jnp.maximum(a, 0.0), a.astype(jnp.bfloat16)))(x)
    for out in outs:
        assert out.scale.dtype == jnp.float16


# --- integration -----------------------------------------------------------------------------
def test_jit_and_grad_compose():
    x = jsa.ScaledArray(jnp.asarray([0.5, -1.5, 2.0]), jnp.float32(2.0**-12))

    def loss(a):
        return jnp.sum(jnp.maximum(a, 0.0) * a - 3.0 * a)

    grad = jax.jit(jsa.scalify(jax.grad(loss)))(x)
    expected = jax.grad(loss)(jnp.asarray(_value(x), jnp.float32))
    assert_pow2_scales(grad)
    np.testing.assert_allclose(_value(grad), expected, rtol=1e-6)


def test_vmap_inside_scalify():
    x = jsa.ScaledArray(jnp.asarray([[0.5, -1.5], [2.0, 1.0]]), jnp.float32(2.0**8))
    fn = jax.vmap(lambda a: jnp.where(a > 0, a * 2.0, -a))
    np.testing.assert_allclose(_value(jsa.scalify(fn)(x)), fn(jnp.asarray(_value(x))), rtol=1e-6)


def test_rules_are_exported():
    assert "scaled_add" in rules_arithmetic.__all__
    rules = jsa.extend.registered_rules()
    summaries = {prim.name: entry.summary for prim, entry in rules.items()}
    for name in ("add", "add_any", "mul", "select_n", "eq", "convert_element_type", "stop_gradient", "copy"):
        assert summaries[name], name


# --- errors ----------------------------------------------------------------------------------
def test_float_predicate_is_rejected():
    x = jsa.ScaledArray(jnp.ones(3), jnp.float32(2.0))
    with pytest.raises(TypeError):
        rules_arithmetic.scaled_select_n(x, x, x)


def test_scaled_array_outside_scalify_is_rejected():
    x = jsa.ScaledArray(jnp.ones(3), jnp.float32(2.0))
    with pytest.raises(TypeError, match="scalify"):
        jnp.maximum(x, 0.0)


def _on_the_grid_of_x(x, u):
    """``u`` (plain); its scale rules put it on ``x``'s grid, as ``jsa.optim.scale_state``'s updates are."""
    return u


def _grid_rule(declared: bool):
    def rule(x, u):
        grid = jnp.where(x.scale > 0, x.scale, u.scale)  # x's scale where it is not 0
        data = (u.data.astype(jnp.float32) * (u.scale / grid)).astype(u.dtype)
        return jsa.ScaledArray.unchecked(data, grid, grid_of=x.scale if declared else None)

    return rule


_on_grid = jsa.custom_scale(_on_the_grid_of_x)
_on_grid.defscale(_grid_rule(declared=True))
_undeclared = jsa.custom_scale(_on_the_grid_of_x)
_undeclared.defscale(_grid_rule(declared=False))


def _primitive_names(fn, *args) -> list:
    return [e.primitive.name for e in jax.make_jaxpr(jsa.scalify(fn, policy=STATIC_POLICY))(*args).jaxpr.eqns]


@pytest.mark.parametrize("x_scale", [2.0**-3, 0.0])
def test_a_sum_with_a_value_on_its_grid_aligns_nothing(x_scale):
    """``x + u`` with ``u`` declared on ``x``'s grid (``grid_of``): exact, at ``u``'s scale, no alignment.

    A scale of 0 (asserted zero, the scale of a zero-initialised parameter) reads as 0 and the
    update's own grid is kept. Undeclared, the same sum takes the common scale of two
    run-time scales and divides to align them.
    """
    x = jsa.ScaledArray(jnp.asarray([1.0, -3.0, 0.5], jnp.float16), jnp.float32(x_scale))
    u = jsa.ScaledArray(jnp.asarray([0.25, 1.0, -2.0], jnp.float16), jnp.float32(2.0**-3))
    on_grid = lambda x, u: x + _on_grid(x, u)  # noqa: E731
    out = jax.jit(jsa.scalify(on_grid, policy=STATIC_POLICY))(x, u)
    np.testing.assert_array_equal(_value(out), _value(x) + _value(u))
    assert _scale(out) == 2.0**-3
    declared = _primitive_names(on_grid, x, u)
    undeclared = _primitive_names(lambda x, u: x + _undeclared(x, u), x, u)
    assert declared.count("div") < undeclared.count("div") and len(declared) < len(undeclared)


def test_a_value_on_the_grid_of_an_invalid_scale_gives_nan():
    """An invalid input scale is NaN inside a jitted scalify: the on-grid sum keeps it visible."""
    x = jsa.ScaledArray.unchecked(jnp.ones(3, jnp.float16), jnp.float32(3.0))  # not a power of two
    u = jsa.ScaledArray(jnp.ones(3, jnp.float16), jnp.float32(1.0))
    out = jax.jit(jsa.scalify(lambda x, u: x + _on_grid(x, u), policy=STATIC_POLICY))(x, u)
    assert np.all(np.isnan(_value(out)))
