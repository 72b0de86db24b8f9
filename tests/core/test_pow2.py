import functools
import itertools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import jax_scalify as jsa
from jax_scalify.core import (
    Pow2RoundMode,
    ScaledArray,
    ScalifyConfig,
    get_mantissa,
    pow2,
    pow2_decompose,
    pow2_exponent,
    pow2_round,
    pow2_round_down,
    pow2_round_up,
)
from jax_scalify.core.pow2 import (
    binary,
    computed_once,
    map_scalars,
    pow2_round_positive_or_one,
    pow2_twice_reciprocal,
    scales_are_pow2,
)
from jax_scalify.lax import rules_arithmetic
from tests.invariance import assert_pow2_scales

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)


@pytest.mark.parametrize("npapi", [np, jnp])
@pytest.mark.parametrize("mode", [Pow2RoundMode.DOWN, Pow2RoundMode.UP])
def test_decompose_is_exact_for_normals(npapi, mode):
    x = npapi.asarray(np.array([1.0, 1.5, 3.0, -3.0, 0.1, 2.0**100 * 1.3, 2.0**-100 * 1.7], np.float32))
    scale, mantissa = pow2_decompose(x, mode=mode)
    np.testing.assert_array_equal(np.asarray(scale) * np.asarray(mantissa), np.asarray(x))
    m = np.abs(np.asarray(mantissa))
    if mode == Pow2RoundMode.DOWN:
        assert np.all((m >= 1) & (m < 2))
    else:
        assert np.all((m > 0.5) & (m <= 1))


def test_decompose_subnormals_float32_numpy():
    x = np.array([1e-44, 3e-39, np.float32(2.0**-149)], np.float32)
    scale, mantissa = pow2_decompose(x)
    np.testing.assert_array_equal(scale * mantissa, x)
    np.testing.assert_array_equal(scale, [2.0**-147, 2.0**-128, 2.0**-149])


def test_decompose_subnormals_float16_jax():
    x = jnp.asarray(np.array([2.0**-24, 3 * 2.0**-24, 1e-5], np.float16))
    scale, mantissa = pow2_decompose(x)
    np.testing.assert_array_equal(np.asarray(scale) * np.asarray(mantissa, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(scale), np.array([2.0**-24, 2.0**-23, 2.0**-17], np.float16))


@pytest.mark.parametrize("npapi", [np, jnp])
def test_decompose_special_values(npapi):
    scale, mantissa = pow2_decompose(npapi.asarray(SPECIALS))
    np.testing.assert_array_equal(np.asarray(scale), [0, 0, np.inf, np.inf, np.nan])
    np.testing.assert_array_equal(np.asarray(mantissa), [0, 0, 1, -1, np.nan])


def test_decompose_scale_dtype_and_fp8():
    x = jnp.asarray(np.array([0.001953125, 3.0, 448], ml_dtypes.float8_e4m3fn))
    scale, mantissa = pow2_decompose(x, scale_dtype=np.float32)
    assert scale.dtype == np.float32 and mantissa.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(scale), [2.0**-9, 2.0, 256.0])


def test_decompose_none_mode():
    scale, mantissa = pow2_decompose(np.float32(-3.0), mode=Pow2RoundMode.NONE)
    assert scale == 3.0 and mantissa == -1.0


def test_round_down_up_and_mantissa():
    x = np.array([3.0, -3.0, 4.0, 0.3], np.float32)
    np.testing.assert_array_equal(pow2_round_down(x), [2.0, -2.0, 4.0, 0.25])
    np.testing.assert_array_equal(pow2_round_up(x), [4.0, -4.0, 4.0, 0.5])
    np.testing.assert_array_equal(get_mantissa(x), np.array([1.5, -1.5, 1.0, 0.3 * 4], np.float32))
    np.testing.assert_array_equal(pow2_round(x, Pow2RoundMode.NONE), x)
    np.testing.assert_array_equal(pow2_round(x), pow2_round_down(x))
    np.testing.assert_array_equal(pow2_round_down(SPECIALS), SPECIALS)
    np.testing.assert_array_equal(pow2_round_up(SPECIALS), SPECIALS)


def test_round_up_overflow_gives_inf():
    assert pow2_round_up(np.float32(2.0**127 * 1.5)) == np.inf


def test_exponent():
    np.testing.assert_array_equal(pow2_exponent(np.array([1.0, 3.0, 0.5, 1e-44], np.float32)), [0, 1, -1, -147])


def test_rejects_integers_and_stochastic():
    with pytest.raises(TypeError, match="floating"):
        pow2_decompose(np.array([1, 2]))
    with pytest.raises(NotImplementedError, match="STOCHASTIC"):
        pow2_round(np.float32(3.0), Pow2RoundMode.STOCHASTIC)


@settings(max_examples=200, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_decompose_property(value):
    x = np.float32(value)
    scale, mantissa = pow2_decompose(x)
    assert scale * mantissa == x
    if x != 0:
        assert 1 <= abs(mantissa) < 2
        assert pow2_round_down(scale) == scale


def test_decompose_subnormals_float32_jax_matches_numpy():
    x = np.array([1e-44, 3e-39, 2.0**-149, 3 * 2.0**-140, -5e-42, 1.0, 0.0, np.inf], np.float32)
    for mode in (Pow2RoundMode.DOWN, Pow2RoundMode.UP):
        np_scale, np_mantissa = pow2_decompose(x, mode=mode)
        jax_scale, jax_mantissa = pow2_decompose(jnp.asarray(x), mode=mode)
        np.testing.assert_array_equal(np.asarray(jax_scale), np_scale)
        np.testing.assert_array_equal(np.asarray(jax_mantissa), np_mantissa)
    assert float(pow2_round_down(jnp.asarray(np.float32(3 * 2.0**-140)))) == 2.0**-139


# --- lean bit-level pow2 functions (single lax operations, no nested jit) -------------------------
def _count_equations(jaxpr, name=None) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += name is None or eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_equations(getattr(sub, "jaxpr", sub), name)
    return n


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_lean_jax_pow2_functions_match_numpy(dtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(512) * 10.0 ** rng.uniform(-40, 40, 512)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-44, 3e-39, 2.0**-149, 3 * 2.0**-140, -5e-42, 1.0, 2.0, 0.5]
    with np.errstate(over="ignore"):
        x = np.concatenate([values, specials]).astype(np.float32).astype(dtype)
    for fn in (pow2_round_down, pow2_round_up, pow2_exponent):
        expected = np.asarray(fn(x)).astype(np.float64)
        for got in (fn(jnp.asarray(x)), jax.jit(fn)(jnp.asarray(x))):
            got = np.asarray(got).astype(np.float64)
            np.testing.assert_array_equal(got, expected, err_msg=f"{fn.__name__} {np.dtype(dtype).name}")


def test_lean_round_emits_no_nested_jit():
    jaxpr = jax.make_jaxpr(pow2_round_down)(np.float32(3))
    assert _count_equations(jaxpr.jaxpr, "jit") == 0 and _count_equations(jaxpr.jaxpr) <= 16


# --- the power-of-two contract ------------------------------------------------------------------
def test_scales_are_pow2_unless_rounding_is_off():
    assert scales_are_pow2()
    with ScalifyConfig(rounding_mode=Pow2RoundMode.UP):
        assert scales_are_pow2()
    with ScalifyConfig(rounding_mode=Pow2RoundMode.NONE):
        assert not scales_are_pow2()


SPECIAL_SCALES = [0.0, np.inf, np.nan, 2.0**-149, 2.0**-127, 2.0**-126, 2.0**-20, 0.5, 1.0, 2.0, 2.0**30, 2.0**127]


@jax.jit
def _general_sum_scale(sa, sb):
    """The scale of a sum for any scales, ``pow2_round_down(sqrt(sa**2 + sb**2))`` (1 if not positive)."""
    hi, lo = jnp.maximum(sa, sb), jnp.minimum(sa, sb)
    return pow2_round_positive_or_one(hi * jnp.sqrt(1 + (lo / hi) ** 2), Pow2RoundMode.DOWN)


@pytest.mark.parametrize("sa, sb", list(itertools.product(SPECIAL_SCALES, repeat=2)))
def test_sum_scale_shortcut_equals_the_general_formula(sa, sb):
    """For power-of-two (or 0, nan) scales the add rule's ``max(sa, sb)`` is the general formula's
    scale. An infinite scale (an overflowed product of scales) defers to the other one: the
    common scale is the largest finite scale, 1 if that is 0 or nan or if both are inf."""
    a = ScaledArray.unchecked(jnp.asarray([1.0, -2.0, 3.0]), jnp.float32(sa))
    b = ScaledArray.unchecked(jnp.asarray([0.5, 0.25, -1.0]), jnp.float32(sb))
    out = jax.jit(rules_arithmetic.scaled_add)(a, b)
    if np.isinf(sa) or np.isinf(sb):
        other = sb if np.isinf(sa) else sa  # XLA:CPU flushes a subnormal scale to 0; nan gives 1
        expected = other if np.finfo(np.float32).tiny <= other < np.inf else 1.0
        np.testing.assert_array_equal(np.asarray(out.scale), np.float32(expected))
        return
    np.testing.assert_array_equal(
        np.asarray(out.scale), np.asarray(_general_sum_scale(jnp.float32(sa), jnp.float32(sb)))
    )


def _compiled_scale_ops(config: ScalifyConfig) -> tuple[int, int]:
    """``(sqrt, divide)`` scalar float32 instructions XLA compiles for the sum of two operands with traced scales.

    (The sum's data is :func:`computed_once`, an integer division that is not counted.)
    """
    a, b = jsa.as_scaled_array(jnp.ones((4, 4))), jsa.as_scaled_array(jnp.full((4, 4), 2.0))
    with config:  # a fresh function: JAX caches traces per function
        hlo = jax.jit(lambda a, b: rules_arithmetic.scaled_add(a, b)).lower(a, b).compile().as_text()
    return hlo.count(" sqrt("), hlo.count("= f32[] divide(")


def test_sum_of_traced_scales_emits_no_sqrt_and_one_division_unless_rounding_is_off():
    """Power-of-two scales: the common scale is the larger one, and both operands' quotients share one division."""
    assert _compiled_scale_ops(ScalifyConfig()) == (0, 1)
    assert _compiled_scale_ops(ScalifyConfig(rounding_mode=Pow2RoundMode.NONE)) == (1, 3)


def _sums_in_jit_and_scan(x, w):
    h = jnp.tanh(x @ w) + x
    h = jax.jit(lambda v: v * 3.0 + v)(h)
    h, _ = jax.lax.scan(lambda c, _: (c @ w + c, None), h, None, length=3)
    return h * 3.0 - h


def test_every_sum_takes_the_shortcut_in_jit_and_scan_bodies():
    """No power-of-two bookkeeping at the jit and scan boundaries: scales are powers of two there too."""
    static = jsa.RescalePolicy.static()
    x = jsa.as_scaled_array(jnp.ones((4, 4)))
    assert _count_equations(jax.make_jaxpr(jsa.scalify(_sums_in_jit_and_scan, policy=static))(x, x).jaxpr, "sqrt") == 0
    rng = np.random.default_rng(0)
    args = [jsa.as_scaled_array(jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)) for _ in range(2)]
    expected = _sums_in_jit_and_scan(*jsa.asarray(args))
    got = jsa.scalify(_sums_in_jit_and_scan, policy=static)(*args)
    assert_pow2_scales(got)
    np.testing.assert_allclose(np.asarray(got.to_array()), expected, rtol=1e-5, atol=1e-5)


def test_rounding_off_takes_the_general_path_with_scales_that_are_no_powers_of_two():
    static = jsa.RescalePolicy.static()
    rng = np.random.default_rng(1)
    values = [jnp.asarray(rng.standard_normal((4, 4)), jnp.float32) for _ in range(2)]
    expected = _sums_in_jit_and_scan(*values)
    with ScalifyConfig(rounding_mode=Pow2RoundMode.NONE):
        args = [jsa.as_scaled_array(v, scale=np.float32(3.0)) for v in values]
        fn = jsa.scalify(_sums_in_jit_and_scan, policy=static)
        assert _count_equations(jax.make_jaxpr(fn)(*args).jaxpr, "sqrt") >= 3  # the sums of the body, jit and scan
        got = fn(*args)
    mantissa = np.frexp(np.float64(got.scale))[0]
    assert mantissa != 0.5  # a scale of 3 * sqrt(2)**k: rounding is off, so none is a power of two
    np.testing.assert_allclose(np.asarray(got.to_array()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pow2_twice_reciprocal_is_exact_from_the_bits(dtype):
    """``2 / s`` for every power of two (normal for every normal ``s``), ±0 -> ±inf, ±inf -> ±0, NaN -> 0."""
    finfo = np.finfo(dtype)
    exponents = np.arange(int(finfo.minexp), int(finfo.maxexp))
    scales = np.concatenate([np.ldexp(1.0, exponents), -np.ldexp(1.0, exponents[::7])]).astype(dtype)
    expected = (np.float64(2) / scales.astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(pow2_twice_reciprocal)(jnp.asarray(scales))), expected)
    np.testing.assert_array_equal(pow2_twice_reciprocal(scales), expected)
    special = jnp.asarray([0.0, -0.0, np.inf, -np.inf, np.nan, finfo.smallest_subnormal], dtype)
    out = np.asarray(jax.jit(pow2_twice_reciprocal)(special))
    np.testing.assert_array_equal(out, np.asarray([np.inf, -np.inf, 0.0, -0.0, 0.0, np.inf], dtype))
    assert np.signbit(out[3]) and not np.signbit(out[2])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_computed_once_returns_every_value_bit_for_bit(dtype):
    values = np.array([0.0, -0.0, 1.0, -3.5, 2.0**-140, np.inf, -np.inf, np.nan, 6e4, 2.0**-20], np.float32)
    x = jnp.asarray(values).astype(dtype)
    got = jax.jit(computed_once)(x)
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    bits = lambda a: np.asarray(a).view(uint)  # noqa: E731
    np.testing.assert_array_equal(bits(got), bits(x))
    assert computed_once(np.float32(2.0)) == 2.0  # NumPy values are returned as they are


def test_computed_once_has_the_derivative_of_the_identity():
    """A scalified function differentiated by ``jax.grad`` outside ``scalify`` reads its sums through it."""
    assert jax.grad(lambda x: 3.0 * computed_once(x * x))(jnp.float32(2.0)) == 12.0
    np.testing.assert_array_equal(jax.jvp(computed_once, (jnp.ones(3),), (jnp.arange(3.0),))[1], np.arange(3.0))


def test_computed_once_is_one_division_that_xla_keeps():
    """Consumers read the computed value: the chain before it is not copied into each of them."""

    def many_consumers(s, a, b, c):
        t = computed_once(jnp.maximum(s * 3.25, 0.75))  # copied into each consumer without it
        return a * t, jnp.tanh(b) * t, (c + 1) @ c * t

    args = (jnp.float32(3.0), jnp.ones(8), jnp.ones(8), jnp.ones((8, 8)))
    hlo = jax.jit(many_consumers).lower(*args).compile().as_text()
    assert hlo.count("constant(3.25)") == 1


def _moved(scale, stat):
    """Elementwise scale arithmetic of the kind a batch of rescales does."""
    factor = pow2_round_positive_or_one(stat)
    return 1 / factor, scale * factor


def test_map_scalars_gives_each_row_fn_of_its_scalars_in_both_forms():
    scales = [jnp.float32(2.0**k) for k in (-3, 0, 5, 9)]
    stats = [jnp.float32(v) for v in (0.3, 0.0, 7.5, np.inf)]
    expected = [_moved(s, t) for s, t in zip(scales, stats)]
    got = jax.jit(lambda a, b: map_scalars(_moved, a, b))(scales, stats)
    flat = scales + stats
    for form in (pow2._mapped_apart, pow2._mapped_together):
        rows = jax.jit(functools.partial(form, _moved, 4))(*flat)
        for row, want in zip(rows, expected):
            chex.assert_trees_all_equal(tuple(row), tuple(want))
    for row, want in zip(got, expected):
        chex.assert_trees_all_equal(tuple(row), tuple(want))


def test_map_scalars_reads_each_row_apart_on_cpu_and_one_vector_elsewhere():
    """XLA:CPU compiles identical kernels once: a kernel slicing a batch vector at its row's offset
    is distinct from every other. XLA:GPU fuses sibling kernels that read one vector."""

    def apply(xs, scales, stats):
        rows = map_scalars(_moved, scales, stats)
        return [x * inverse * new_scale for x, (inverse, new_scale) in zip(xs, rows)]

    args = ([jnp.ones((8, 8))] * 3, [jnp.float32(1.0)] * 3, [jnp.float32(3.0)] * 3)
    traced = jax.jit(apply).trace(*args)
    assert traced.lower(lowering_platforms=("cpu",)).as_text().count("stablehlo.slice") == 0
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.slice") == 6


def _traced_equations(fn, *args) -> list[str]:
    return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


@pytest.mark.parametrize(
    "op, other",
    [
        (jax.lax.mul, 0.5),
        (jax.lax.lt, np.inf),
        (jax.lax.gt, 0),
        (jax.lax.mul, np.float32(2.0)),
        (jax.lax.add, np.ones((3,), np.float32)),
    ],
)
def test_binary_is_one_lax_equation_beside_a_traced_operand(op, other):
    """No nested ``jit`` (what ``jax.numpy``'s operators trace), and the operator's value."""
    x = jnp.asarray([0.25, 1.0, 4.0], jnp.float32)
    assert _traced_equations(lambda x: binary(op, x, other), x) == [op.__name__]
    np.testing.assert_array_equal(binary(op, x, other), pow2._OPERATORS[op](x, other))
    np.testing.assert_array_equal(binary(op, other, x), pow2._OPERATORS[op](other, x))


def test_binary_keeps_numpy_constants_numpy_and_promotes_like_the_operator_otherwise():
    assert isinstance(binary(jax.lax.mul, np.float32(3), 0.5), np.floating)  # folds at trace time
    x16 = jnp.ones((2,), jnp.float16)
    out = jax.eval_shape(lambda x: binary(jax.lax.mul, x, np.ones((2,), np.float32)), x16)
    assert out.dtype == jnp.float32  # mixed dtypes: jax.numpy's promotion, as ``x * y``
    ints = jnp.ones((2,), jnp.int32)
    assert jax.eval_shape(lambda i: binary(jax.lax.bitwise_and, i, 0x7F800000), ints).dtype == jnp.int32
    assert pow2._lax_operands(ints, 2**40) is None  # out of int32's range: left to the operator (which refuses it)
    assert pow2._lax_operands(x16, 0.1) is None  # not a float16 number: the operator rounds it
