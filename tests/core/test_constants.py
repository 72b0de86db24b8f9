"""Constants keep their exact value on narrow-float scaled data (jax_scalify.core.constants).

Traced on float16 data, ``x * 1e-8`` holds the literal 0 and ``x * 1e5`` the literal inf;
scalify recovers the values from a second trace on float32 inputs, so promotion splits the
exact constant into a power-of-two scale and a mantissa.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from jax_scalify.core import constants
from tests.invariance import assert_pow2_scales, exact_value

NARROW = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn]
X = np.array([1.0, 2.0, 0.5, -0.75], np.float32)


def _rtol(dtype) -> float:
    """Two roundings in the data dtype (the data and the constant's mantissa)."""
    return 3 * float(jnp.finfo(dtype).eps)


def _scaled(values, dtype) -> jsa.ScaledArray:
    return jsa.as_scaled_array(jnp.asarray(values, dtype))


def _run(fn, *args, jit: bool):
    # The static policy: these tests are about the scales that constants get when promoted.
    # The default policy also rescales the returned value to its RMS, which for a tensor
    # holding both ~1 and -1e9 moves the ~1 entries below float16's range.
    scalified = jsa.scalify(fn, policy=jsa.RescalePolicy.static())
    return (jax.jit(scalified) if jit else scalified)(*args)


def _check_finite_pow2_scale(out) -> None:
    assert_pow2_scales(out)
    assert np.all(np.isfinite(np.asarray(out.scale))), out.scale


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("constant", [1e5, 1e-8, 1e-16])
def test_product_with_a_constant_outside_the_data_range_keeps_its_value(constant, dtype, jit):
    out = _run(lambda x: x * constant, _scaled(X, dtype), jit=jit)
    _check_finite_pow2_scale(out)
    x = np.asarray(jnp.asarray(X, dtype), np.float64)
    np.testing.assert_allclose(exact_value(out), x * constant, rtol=_rtol(dtype))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
def test_float32_max_constant(dtype, jit):
    fmax = float(jnp.finfo(jnp.float32).max)
    x = np.array([0.5, -0.25, 0.125], np.float32)
    out = _run(lambda x: x * fmax, _scaled(x, dtype), jit=jit)
    _check_finite_pow2_scale(out)
    np.testing.assert_allclose(exact_value(out), x.astype(np.float64) * fmax, rtol=_rtol(dtype))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_where_mask_constant_keeps_its_value_and_the_data(dtype, jit):
    out = _run(lambda x: jnp.where(x > 0.7, x, -1e9), _scaled(X, dtype), jit=jit)
    _check_finite_pow2_scale(out)
    x = np.asarray(jnp.asarray(X, dtype), np.float64)
    expected = np.where(x > 0.7, x, -1e9)
    # The mask value fits the data dtype at the common scale; the kept values are not flushed.
    np.testing.assert_allclose(exact_value(out), expected, rtol=_rtol(dtype))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_mask_constant_beyond_float8s_reach_saturates_and_the_data_stay(jit):
    """In E4M3 (max 448) ``-1e9`` needs the scale 2**22, at which x's data would flush: one
    scale per tensor cannot hold both. The masked entries saturate below every kept value
    (plain FP8 holds NaN there: E4M3 has no inf), and the kept values keep their data."""
    out = _run(lambda x: jnp.where(x > 0.7, x, -1e9), _scaled(X, jnp.float8_e4m3fn), jit=jit)
    _check_finite_pow2_scale(out)
    value = exact_value(out)
    kept = X > 0.7
    np.testing.assert_array_equal(value[kept], X[kept])
    assert np.all(np.isfinite(value)) and np.all(value[~kept] <= -(2.0**10) * np.max(np.abs(X)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mask", [-1e30, float(np.finfo(np.float32).min)], ids=["-1e30", "f32min"])
def test_a_float32_mask_on_float16_data_saturates_and_the_data_stay(mask, jit):
    """float32's min as a mask (``jnp.finfo(jnp.float32).min``, as float32 code writes it)
    fits float16 data only at 2**113, where unit-sized data flush: the loss of an InfoNCE
    with a masked diagonal was 0 in float16 under scalify (plain float16: -inf there, 3.6875)."""
    sim = np.random.RandomState(0).uniform(-5, 5, (8, 8)).astype(np.float32)
    labels = (np.arange(8) + 4) % 8

    def loss(s):
        s = jnp.where(jnp.eye(8, dtype=bool), mask, s)
        return optax.softmax_cross_entropy_with_integer_labels(s, labels).mean()

    expected = jax.value_and_grad(loss)(jnp.asarray(sim, jnp.float16).astype(jnp.float32))
    got = _run(jax.value_and_grad(loss), _scaled(sim, jnp.float16), jit=jit)
    np.testing.assert_allclose(float(got[0]), float(expected[0]), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(jsa.asarray(got[1], jnp.float32)), expected[1], rtol=1e-2, atol=1e-4)
    masked = _run(lambda s: jnp.where(jnp.eye(8, dtype=bool), mask, s), _scaled(sim, jnp.float16), jit=jit)
    # The common scale is at most 2**14 above the data's (2): their values are kept to the
    # spacing of float16 subnormals there, 2**-24 * 2**15.
    off_diagonal = ~np.eye(8, dtype=bool)
    kept = sim.astype(np.float16)[off_diagonal]
    np.testing.assert_allclose(exact_value(masked)[off_diagonal], kept, rtol=1e-3, atol=2.0**-9)
    assert np.all(exact_value(masked)[~off_diagonal] < -(2.0**20) * float(np.max(np.abs(kept))))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_scatter_of_a_large_constant_keeps_the_other_entries_under_grad(jit):
    """``s.at[i, i].set(-1e9)`` under ``jax.grad``: JAX's JVP of the scatter adds the constant,
    selected by a traced mask (a value whose scale, 2**30, is known at trace time), into the
    zeroed diagonal; aligned at 2**30, the float16 similarities flushed and the loss was 0."""
    sim = np.random.RandomState(0).uniform(-5, 5, (8, 8)).astype(np.float32)
    labels = (np.arange(8) + 4) % 8

    def loss(s):
        s = s.at[jnp.arange(8), jnp.arange(8)].set(-1e9)
        return optax.softmax_cross_entropy_with_integer_labels(s, labels).mean()

    expected = jax.value_and_grad(loss)(jnp.asarray(sim, jnp.float16).astype(jnp.float32))
    for policy in (None, jsa.RescalePolicy.static()):
        scalified = jsa.scalify(jax.value_and_grad(loss), policy=policy)
        got = (jax.jit(scalified) if jit else scalified)(_scaled(sim, jnp.float16))
        np.testing.assert_allclose(float(got[0]), float(expected[0]), rtol=1e-3)
        np.testing.assert_allclose(np.asarray(jsa.asarray(got[1], jnp.float32)), expected[1], rtol=1e-2, atol=1e-4)


# Scale of the second moment v, so that eps = 1e-8 at the scale of sqrt(v) is within the data
# dtype's range (float16 subnormals reach 2**-24, float8_e4m3fn's 2**-9 only).
ADAM_V_SCALE = {jnp.float16: 2.0**-20, jnp.bfloat16: 2.0**-20, jnp.float8_e4m3fn: 2.0**-44}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
def test_adam_style_denominator_is_not_zero(dtype, jit):
    """m / (sqrt(v) + 1e-8) with m = v = 0 entries: 0, not 0 / 0 (eps was 0 in the data trace)."""
    v_scale = ADAM_V_SCALE[dtype]
    m_data = np.array([0.0, 0.25, -0.5, 0.0], np.float32)
    v_data = np.array([0.0, 0.25, 1.0, 2.0], np.float32)
    m = jsa.ScaledArray(jnp.asarray(m_data, dtype), jnp.float32(2.0**-10))
    v = jsa.ScaledArray(jnp.asarray(v_data, dtype), jnp.float32(v_scale))
    out = _run(lambda m, v: m / (jnp.sqrt(v) + 1e-8), m, v, jit=jit)
    _check_finite_pow2_scale(out)
    got = exact_value(out)
    assert np.all(np.isfinite(got)), got
    m64, v64 = exact_value(m), exact_value(v)
    np.testing.assert_allclose(got, m64 / (np.sqrt(v64) + 1e-8), rtol=_rtol(dtype))


def test_constant_broadcast_by_full_like_keeps_its_value():
    out = jsa.scalify(lambda x: x * jnp.full_like(x, 1e-8))(_scaled(X, jnp.float16))
    np.testing.assert_allclose(exact_value(out), np.asarray(X, np.float64) * 1e-8, rtol=_rtol(jnp.float16))


def _float16_inputs_and_values():
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (32, 16))) / np.sqrt(32)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (128, 32)))
    scaled_inputs = jsa.tree.astype(jsa.as_scaled_array((w, x)), jnp.float16)
    return scaled_inputs, tuple(np.asarray(a.to_array(jnp.float32)) for a in scaled_inputs)


LABELS = np.arange(128) % 16
CROSS_ENTROPIES = {
    "slice": lambda logits: -jnp.mean(jax.nn.log_softmax(logits)[:, 0]),
    "integer_labels": lambda logits: optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean(),
    "float32_one_hot": lambda logits: -jnp.mean(jnp.sum(jax.nn.one_hot(LABELS, 16) * jax.nn.log_softmax(logits), -1)),
}


@pytest.mark.parametrize("factor", [1e-6, 1e-5])
@pytest.mark.parametrize("loss", CROSS_ENTROPIES)
def test_a_loss_factor_below_float16s_range_reaches_the_gradient(loss, factor):
    """The cotangent ``factor / N`` is below float16's normal range: spread by the transpose
    of a slice or a label lookup (``pad``, ``scatter-add``) in float16, or multiplied by
    float32 one-hot labels and cast to float16, it was 0 or subnormal (a zero gradient: the
    program trained nothing)."""
    (scaled_inputs, (w, x)), ce = _float16_inputs_and_values(), CROSS_ENTROPIES[loss]

    def loss_fn(w, x):
        return ce(x @ w) * factor

    got = jax.jit(jsa.scalify(jax.grad(loss_fn)))(*scaled_inputs)
    expected = jax.grad(loss_fn)(w, x)
    np.testing.assert_allclose(exact_value(got), expected, rtol=0, atol=2e-3 * np.abs(expected).max())


def test_optax_adam_step_with_float16_state_is_not_nan():
    """eps=1e-8 is 0 in a float16 trace: every zero gradient gave 0 / 0 at the first step."""
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.float16)}
    grads = {"w": jnp.array([[0.1, 0.0], [-0.2, 0.3]], jnp.float16)}
    opt = optax.adam(1e-3)

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # Moments start as asserted zeros (scale 0), so they take the scale of the first update.
    state = jax.tree.map(
        lambda x: jsa.ScaledArray(x, jnp.float32(0)) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        opt.init(params),
    )
    sp, sg = jsa.as_scaled_array(params), jsa.as_scaled_array(grads)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    g32 = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
    s32 = opt.init(p32)
    step_scaled = jax.jit(jsa.scalify(step))
    for _ in range(3):
        sp, state = step_scaled(sp, state, sg)
        p32, s32 = step(p32, s32, g32)
    got = np.asarray(jsa.asarray(sp)["w"], np.float32)
    assert np.all(np.isfinite(got)), got
    # One float16 ulp (about 2e-3 at 2.0) per step.
    np.testing.assert_allclose(got, np.asarray(p32["w"]), atol=4e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_nan_to_num_on_scaled_input(dtype):
    x = jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf, 3.0], dtype)
    # Static policy: an output spanning 1 to float32 max has no RMS scale that keeps both.
    out = jsa.scalify(jnp.nan_to_num, policy=jsa.RescalePolicy.static())(jsa.as_scaled_array(x))
    _check_finite_pow2_scale(out)
    expected = np.asarray(jnp.nan_to_num(x), np.float64)
    np.testing.assert_array_equal(exact_value(out), expected)


def test_nan_to_num_float32_reported_example():
    out = jsa.scalify(jnp.nan_to_num)(jsa.as_scaled_array(jnp.ones(3)))
    np.testing.assert_array_equal(np.asarray(jsa.asarray(out)), np.ones(3, np.float32))
    _check_finite_pow2_scale(out)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_nan_to_num_keeps_the_scale_of_its_input_under_the_default_policy(dtype):
    """The never-selected replacement of ``-inf`` (the dtype's max) raised the result's scale
    to ``2**64`` in float32: its square overflowed the scale (NaN where plain JAX gives
    ``1.3e-5``). The select is rescaled by its largest entry; selected replacements keep
    their value. (Found in ``optax.contrib.schedule_free``, which interpolates the parameters
    with such a factor: their float16 casts at scale ``2**64`` flushed.)"""
    x = jnp.asarray([0.0036, -1.5, 2.0], dtype)
    square = jax.jit(jsa.scalify(lambda x: jnp.nan_to_num(x) ** 2))(jsa.as_scaled_array(x))
    expected = np.asarray(x, np.float64) ** 2  # 1.3e-5 is subnormal in float16 data at scale 1
    np.testing.assert_allclose(exact_value(square), expected, rtol=_rtol(dtype), atol=_rtol(dtype) * 2**-14)
    assert float(square.scale) <= 16
    with_infs = jnp.asarray([1.0, jnp.nan, jnp.inf, -jnp.inf, 3.0], dtype)
    out = jax.jit(jsa.scalify(jnp.nan_to_num))(jsa.as_scaled_array(with_infs))
    np.testing.assert_array_equal(exact_value(out), np.asarray(jnp.nan_to_num(with_infs), np.float64))


def test_a_float16_mask_at_the_dtypes_min_costs_no_reduction():
    """``jnp.finfo(jnp.float16).min`` fits float16 data at scale 2 (Flax's attention masks):
    the select stays static; ``-1e9`` needs ``2**15`` and has its scale lowered to its
    largest entry (one reduction)."""
    mask = jnp.tril(jnp.ones((4, 4), bool))
    x = jsa.tree.astype(jsa.as_scaled_array(jnp.ones((4, 4))), jnp.float16)

    def reductions(fill):
        jaxpr = jax.make_jaxpr(jsa.scalify(lambda x: jnp.where(mask, x, fill)))(x)
        return str(jaxpr).count("reduce_max")

    assert reductions(float(jnp.finfo(jnp.float16).min)) == 0
    assert reductions(-1e9) == 1


def test_unscaled_equations_compute_what_jax_computes():
    """The exact value only serves promotion: a plain float16 input still gets JAX's 0."""
    x, y = _scaled(X, jnp.float16), jnp.asarray(X, jnp.float16)
    got_x, got_y = jsa.scalify(lambda x, y: (x * 1e-8, y * 1e-8))(x, y)
    assert not isinstance(got_y, jsa.ScaledArray)
    np.testing.assert_array_equal(np.asarray(got_y), np.asarray(y * 1e-8))
    assert np.all(exact_value(got_x) != 0)


def test_dtype_dependent_constant_is_left_alone():
    """finfo(x.dtype).max is 65504 on float16 data and float32 max on float32: not the same constant."""
    fn = lambda x: x * jnp.finfo(x.dtype).max * 1e-8  # noqa: E731
    out = jsa.scalify(fn)(_scaled(X / 4, jnp.float16))
    x = np.asarray(jnp.asarray(X / 4, jnp.float16), np.float64)
    np.testing.assert_allclose(exact_value(out), x * 65504.0 * 1e-8, rtol=_rtol(jnp.float16))


def test_known_scalar_of_trace_time_values():
    assert constants.known_scalar(2.5) == 2.5
    broadcast = constants.known_scalar(np.broadcast_to(np.float16(3), (4, 5)))  # zero strides: one scalar
    assert broadcast.shape == () and broadcast.dtype == np.float16 and broadcast == 3
    assert constants.known_scalar(np.arange(3.0)) is None
    assert constants.known_scalar(np.broadcast_to(np.arange(3.0), (2, 3))) is None  # repeated rows only
    assert constants.known_scalar(np.zeros((0,), np.float32)) is None
    seen = []
    jax.make_jaxpr(lambda t: seen.append(constants.known_scalar(t)) or t)(np.float32(1))
    assert seen == [None]  # a tracer is not known, even of a concrete example


def test_exact_values_of_folded_constants_live_in_their_scope_only():
    """Recorded beside (never into) the recovered constants that a trace cache keeps."""
    found = constants.ExactConstants()
    with constants.known_constants(found):
        value = constants.constant_value(np.asarray(0, np.float16), (3,), np.asarray(1e-8, np.float32))
        assert constants.known_scalar(value) == np.float32(1e-8)
    assert not found.exact
    assert constants.known_scalar(value) == 0 and constants.known_scalar(value).dtype == np.float16


def test_plain_constant_equations_are_folded_into_numpy_values():
    """A constant computed from literals is a NumPy value: no equation, a constant of the trace."""
    fn = lambda x: (x * jnp.full_like(x, 3.0), jnp.zeros(x.shape) + 1.0)  # noqa: E731
    scalified = jsa.scalify(fn, policy=jsa.RescalePolicy.static())
    jaxpr = jax.make_jaxpr(scalified)(_scaled(X, jnp.float32)).jaxpr
    # After the check of the traced input scale (what scalify of the identity traces):
    check = jax.make_jaxpr(jsa.scalify(lambda x: x, policy=jsa.RescalePolicy.static()))(_scaled(X, jnp.float32))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names[len(check.jaxpr.eqns) :] == ["mul", "mul"]  # the data and the scale times 4
    scaled, plain = scalified(_scaled(X, jnp.float32))
    assert isinstance(plain, jax.Array)  # returned as a JAX array
    np.testing.assert_array_equal(np.asarray(plain), np.ones(4))
    np.testing.assert_array_equal(exact_value(scaled), 3 * X)


def test_constants_of_symbolic_shapes_are_left_to_jax():
    """``jax.export`` with a symbolic dimension: no NumPy value has that shape, JAX binds it."""
    fn = jsa.scalify(lambda x: x * jnp.full_like(x, 3.0) + jnp.zeros(x.shape))
    (batch,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct((batch,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(exported.call(jnp.ones(5))), np.full(5, 3.0))


BOUNDARIES = {
    "jit": lambda x, eps: jax.jit(lambda a, b: a * b)(x, eps),
    "cond": lambda x, eps: jax.lax.cond(True, lambda: x * eps, lambda: x),
    "scan": lambda x, eps: jax.lax.fori_loop(0, 1, lambda i, y: y * eps, x),
    "while": lambda x, eps: jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, c[1] * eps), (0, x))[1],
}


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_a_folded_constant_keeps_its_exact_value_across_a_boundary(boundary):
    """``full_like(x, 1e-8)`` holds 0 in a float16 trace. Folded, it is a NumPy value with its
    exact value recorded, and it is passed unchanged into a jitted call, a branch or a loop body."""
    fn = lambda x: BOUNDARIES[boundary](x, jnp.full_like(x, 1e-8))  # noqa: E731
    out = jax.jit(jsa.scalify(fn, policy=jsa.RescalePolicy.static()))(_scaled(X, jnp.float16))
    _check_finite_pow2_scale(out)
    np.testing.assert_allclose(exact_value(out), np.asarray(X, np.float64) * 1e-8, rtol=_rtol(jnp.float16))


def _trace_counter(fn):
    calls = []

    def counted(*args):
        calls.append(None)
        return fn(*args)

    return counted, calls


def test_float32_programs_are_traced_once():
    fn, calls = _trace_counter(lambda x: x * 1e-8 + 0.0)
    jsa.scalify(fn)(_scaled(X, jnp.float32))
    assert len(calls) == 1


def test_narrow_programs_without_suspect_constants_are_traced_once():
    fn, calls = _trace_counter(lambda x: x * 2.0 + 0.5)
    jsa.scalify(fn)(_scaled(X, jnp.float16))
    assert len(calls) == 1


def test_narrow_program_with_a_lost_constant_is_traced_twice_then_cached():
    fn, calls = _trace_counter(lambda x: x * 1e-8)
    scalified = jsa.scalify(fn)
    scalified(_scaled(X, jnp.float16))
    scalified(_scaled(X, jnp.float16))
    assert len(calls) == 2


def test_unpaired_traces_raise_for_a_lost_constant():
    def fn(x):
        y = x * 1e-8
        if x.dtype == jnp.float32:  # the structure depends on the dtype: the traces do not pair
            y = jnp.sin(y)
        return y

    with pytest.raises(ValueError, match=r"1e-08.*became 0\.0.*float16") as info:
        jsa.scalify(fn)(_scaled(X, jnp.float16))
    assert "test_constants.py" in str(info.value)


@pytest.mark.slow  # for time: optax.ctc_loss's gradient op by op
def test_a_constant_beyond_the_data_range_in_unpaired_traces_raises_no_numpy_warning():
    """Looking for lost constants casts float32 literals to float16: ``optax.ctc_loss``'s
    ``log_epsilon = -1e5`` overflows there, which is what is checked, not a warning."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 8, 5)).astype(np.float32)
    label_paddings = np.zeros((2, 3), np.float32)
    label_paddings[1, 2] = 1.0
    labels = rng.integers(1, 5, (2, 3)).astype(np.int32)

    def loss(logits, logit_paddings, label_paddings):
        return optax.ctc_loss(logits, logit_paddings, labels, label_paddings).mean()

    args = (logits, np.zeros((2, 8), np.float32), label_paddings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jsa.scalify(jax.value_and_grad(loss))(*jsa.tree.astype(jsa.as_scaled_array(args), jnp.float16))
    value, grad = jax.value_and_grad(loss)(*args)
    np.testing.assert_allclose(exact_value(got[0]), value, rtol=1e-3)
    np.testing.assert_allclose(exact_value(got[1]), grad, rtol=1e-2, atol=1e-3)


def test_unpaired_traces_without_lost_constants_run():
    def fn(x):
        y = x * 2.0 + 0.0
        if x.dtype == jnp.float32:
            y = jnp.sin(y)
        return y

    out = jsa.scalify(fn)(_scaled(X, jnp.float16))
    np.testing.assert_allclose(exact_value(out), 2.0 * X)


def test_recover_pairs_extra_converts():
    def fn(x):  # a convert on float16 data, none on float32 data
        return x.astype(jnp.float32) * 2.0, x * 1e-8

    narrow = jax.make_jaxpr(fn)(jnp.ones(3, jnp.float16))
    found = constants.recover(narrow, lambda: jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((3,), jnp.float32)))
    recovered = [float(exact) for value, exact in found.exact.values() if np.asarray(value).dtype == np.float16]
    assert recovered == [pytest.approx(1e-8)]


def _batch_norm_grads(x, gain):
    def loss(x, gain):
        mean = jnp.mean(x, axis=(0, 1))
        var = jnp.var(x, axis=(0, 1))
        normed = (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain
        return jnp.mean(jnp.square(normed.astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1))(x, gain)


@pytest.mark.slow  # for time: op by op under disable_jit
def test_traces_whose_backward_passes_sum_in_another_order_pair_by_origin():
    """Under ``jax.disable_jit()`` ``jnp.var`` is inlined: the float16 trace's extra converts
    change the order of the transposed sums, so the traces only pair by origin; the eps of
    1e-5 (a float16 subnormal) must be recovered, not reported lost."""
    rng = np.random.default_rng(0)
    x, gain = jnp.asarray(rng.normal(size=(8, 4, 3)), jnp.float16), jnp.ones(3, jnp.float16)
    scaled = jsa.as_scaled_array((x, gain))
    with jax.disable_jit():
        got = jsa.scalify(_batch_norm_grads)(*scaled)
    expected = jsa.scalify(_batch_norm_grads)(*scaled)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(exact_value(g), exact_value(e), rtol=1e-2, atol=1e-3)


def test_widened_example():
    assert constants.widened_example(jnp.ones(2, jnp.bfloat16)).dtype == jnp.float32
    x = jnp.ones(2, jnp.int8)
    assert constants.widened_example(x) is x
    assert constants.is_narrow_float(jnp.float8_e5m2) and not constants.is_narrow_float(jnp.float32)


HUGE = float(np.finfo(np.float32).min)
PLACEMENTS = {
    "pad": lambda s: jnp.pad(s, 1, constant_values=HUGE)[1:-1, 1:-1],
    "concatenate": lambda s: jnp.concatenate([s, jnp.full((1, 4), HUGE, s.dtype)])[:-1],
    "dynamic_update_slice": lambda s: jax.lax.dynamic_update_slice(s, jnp.full((1, 4), HUGE, s.dtype), (0, 0))[1:],
    "scatter": lambda s: s.at[0].set(HUGE)[1:],
    "maximum": lambda s: jnp.maximum(s, HUGE),
    "clip": lambda s: jnp.clip(s, HUGE, -HUGE),
}


@pytest.mark.parametrize("place", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_float16_data_placed_beside_float32s_largest_constant_keep_their_values(place):
    """A constant that float16 data could share a scale with only at 2**113 (float32's min,
    a sentinel in float32 code) no longer sets the common scale: the data keep their values,
    the constant saturates (``jnp.clip`` at ``±float32 max`` keeps the data's own scale)."""
    x = np.random.RandomState(1).uniform(-5, 5, (4, 4)).astype(np.float16)
    fn = PLACEMENTS[place]
    scaled = _scaled(x, jnp.float16)
    out = _run(fn, scaled, jit=True)
    expected = np.asarray(fn(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(exact_value(out), expected, rtol=1e-3, atol=2.0**-9)
    if place in ("maximum", "clip"):
        np.testing.assert_array_equal(np.asarray(out.scale), np.asarray(scaled.scale))
