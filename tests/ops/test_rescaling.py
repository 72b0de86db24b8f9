import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from jax_scalify import ops
from jax_scalify.core.measure import rescale_scaled_arrays, rescaled_into_narrow, strided_sample
from tests.invariance import STATIC_POLICY, assert_pow2_scales

RESCALES = {"l1": ops.dynamic_rescale_l1, "l2": ops.dynamic_rescale_l2, "max": ops.dynamic_rescale_max}
GRAD_RESCALES = {
    "l1": ops.dynamic_rescale_l1_grad,
    "l2": ops.dynamic_rescale_l2_grad,
    "max": ops.dynamic_rescale_max_grad,
}
STATS = {
    "l1": lambda d: np.mean(np.abs(d)),
    "l2": lambda d: np.sqrt(np.mean(np.square(d))),
    "max": lambda d: np.max(np.abs(d)),
}


def _x(scale=24.0, shape=(4, 8)):
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32) * scale)


@pytest.mark.parametrize("norm", sorted(RESCALES))
def test_value_noop_outside_scalify(norm):
    fn, x = RESCALES[norm], _x()
    np.testing.assert_array_equal(fn(x), x)
    np.testing.assert_array_equal(jax.jit(fn)(x), x)
    np.testing.assert_array_equal(jax.vmap(fn)(x), x)
    np.testing.assert_array_equal(jax.grad(lambda a: jnp.sum(fn(a) * 3.0))(x), jnp.full_like(x, 3.0))
    np.testing.assert_array_equal(ops.dynamic_rescale(x, norm), x)


@pytest.mark.parametrize("norm", sorted(RESCALES))
def test_rescales_data_under_scalify(norm):
    x = _x()
    sx = jsa.ScaledArray(x / 4, jnp.float32(4.0))
    out = jsa.scalify(RESCALES[norm], policy=STATIC_POLICY)(sx)
    assert_pow2_scales(out)
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(x), rtol=1e-6)
    # Rounded down (default mode): the statistic of the new data lies in [1, 2).
    stat = STATS[norm](np.asarray(out.data))
    assert 1.0 <= stat < 2.0, stat
    assert float(out.scale) == 2.0 ** np.floor(np.log2(STATS[norm](np.asarray(x))))


def test_rounding_mode_up():
    x = _x()
    out = jsa.scalify(lambda a: ops.dynamic_rescale_l2(a, rounding_mode=jsa.Pow2RoundMode.UP), policy=STATIC_POLICY)(
        jsa.as_scaled_array(x)
    )
    assert 0.5 < STATS["l2"](np.asarray(out.data)) <= 1.0
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        out = jsa.scalify(ops.dynamic_rescale_max, policy=STATIC_POLICY)(jsa.as_scaled_array(x))
    assert 0.5 < STATS["max"](np.asarray(out.data)) <= 1.0


def test_custom_norm_callable_and_unknown_norm():
    x = _x()
    out = jsa.scalify(lambda a: ops.dynamic_rescale(a, norm=lambda d: jnp.float32(8.0)), policy=STATIC_POLICY)(
        jsa.ScaledArray(x, jnp.float32(1.0))
    )
    assert float(out.scale) == 8.0
    np.testing.assert_allclose(np.asarray(out.data), np.asarray(x) / 8)
    with pytest.raises(ValueError, match="'l1', 'l2', 'max'"):
        ops.dynamic_rescale(x, norm="l3")
    with pytest.raises(ValueError, match="'l1', 'l2', 'max'"):
        ops.dynamic_rescale_grad(x, norm="fro")


@pytest.mark.parametrize("norm", sorted(RESCALES))
def test_zero_and_non_finite_leave_x_unchanged(norm):
    fn = jsa.scalify(RESCALES[norm])
    zero = fn(jsa.ScaledArray(jnp.zeros(5), jnp.float32(2.0)))
    assert float(zero.scale) == 2.0 and np.all(np.asarray(zero.data) == 0)
    nan = fn(jsa.ScaledArray(jnp.array([1.0, jnp.nan]), jnp.float32(2.0)))
    assert float(nan.scale) == 2.0 and np.isnan(np.asarray(nan.data)[1])
    inf = fn(jsa.ScaledArray(jnp.array([1.0, jnp.inf]), jnp.float32(2.0)))
    assert float(inf.scale) == 2.0
    # A zero scale (asserted zero value) is never divided by.
    asserted = fn(jsa.ScaledArray(jnp.ones(3), jnp.float32(0.0)))
    assert float(asserted.scale) == 0.0 and np.all(np.isfinite(np.asarray(asserted.data)))


def test_floor_keeps_scale_from_collapsing():
    tiny = jsa.ScaledArray(jnp.full((4,), 2.0**-40, jnp.float32), jnp.float32(2.0**-100))
    out = jsa.scalify(ops.dynamic_rescale_max, policy=STATIC_POLICY)(tiny)
    # 2**-140 would be a float32 subnormal scale: it stops at the smallest normal.
    assert float(out.scale) == 2.0**-126
    np.testing.assert_array_equal(np.asarray(out.data), np.full((4,), 2.0**-14, np.float32))
    out = jsa.scalify(lambda a: ops.dynamic_rescale_max(a, min_scale=2.0**-110), policy=STATIC_POLICY)(tiny)
    assert float(out.scale) == 2.0**-110
    out = jsa.scalify(lambda a: ops.dynamic_rescale_max(a, min_scale=0.75 * 2.0**-110), policy=STATIC_POLICY)(tiny)
    assert float(out.scale) == 2.0**-110  # rounded up to a power of two
    with pytest.raises(ValueError, match="min_scale"):
        ops.dynamic_rescale_max(tiny.data, min_scale=0.0)


def test_large_data_does_not_overflow_the_statistic():
    big = jsa.ScaledArray(jnp.full((8,), 2.0**100, jnp.float32), jnp.float32(1.0))
    for fn in RESCALES.values():
        out = jsa.scalify(fn)(big)
        assert float(out.scale) == 2.0**100
        np.testing.assert_array_equal(np.asarray(out.data), np.ones(8, np.float32))


def test_low_precision_data():
    x = _x(scale=1000.0).astype(jnp.float16)
    out = jsa.scalify(ops.dynamic_rescale_l2)(jsa.as_scaled_array(x))
    assert out.dtype == jnp.float16 and out.scale.dtype == jnp.float32
    assert 1.0 <= STATS["l2"](np.asarray(out.data, np.float32)) < 2.0


def test_pytree_non_floating_leaves_pass_through_and_jit():
    tree = {"x": jsa.as_scaled_array(_x()), "i": jnp.arange(3), "empty": jsa.as_scaled_array(jnp.zeros((0,)))}
    out = jax.jit(jsa.scalify(ops.dynamic_rescale_l2))(tree)
    assert out["i"].dtype == jnp.int32 and np.array_equal(out["i"], np.arange(3))
    assert float(out["x"].scale) == 16.0
    assert out["empty"].shape == (0,)


def test_scaled_array_outside_scalify_is_rescaled_eagerly():
    sx = jsa.as_scaled_array(_x())
    out = ops.dynamic_rescale_l2({"a": sx, "b": _x()})
    assert float(out["a"].scale) == 16.0
    np.testing.assert_array_equal(out["b"], _x())


def test_vmap_inside_scalify_uses_one_scale():
    x = _x()
    out = jsa.scalify(jax.vmap(ops.dynamic_rescale_max))(jsa.as_scaled_array(x))
    assert out.scale.shape == ()
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(x), rtol=1e-6)
    assert_pow2_scales(out)


# --- _grad variants -------------------------------------------------------------------------


@pytest.mark.parametrize("norm", sorted(GRAD_RESCALES))
def test_grad_variant_is_identity_outside_scalify(norm):
    fn, x = GRAD_RESCALES[norm], _x()
    np.testing.assert_array_equal(fn(x), x)
    np.testing.assert_array_equal(jax.jit(fn)(x), x)
    g = jax.jit(jax.grad(lambda a: jnp.sum(fn(a) * 3.0)))(x)
    np.testing.assert_array_equal(g, jnp.full_like(x, 3.0))
    g = jax.vmap(jax.grad(lambda a: jnp.sum(fn(a) * 3.0)))(x)
    np.testing.assert_array_equal(g, jnp.full_like(x, 3.0))


def _names(jaxpr) -> list[str]:
    """Primitive names in order, sub-jaxprs expanded in place."""
    names = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names.extend(_names(sub))
    return names


def test_grad_variant_acts_on_backward_only():
    x = _x()
    fwd = _names(jax.make_jaxpr(ops.dynamic_rescale_l2_grad)(x))
    assert "dynamic_rescale" not in fwd
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(ops.dynamic_rescale_l2_grad(a) * 3.0)))(x)
    bwd = _names(grad_jaxpr)
    assert bwd.count("dynamic_rescale") == 1 and bwd[-1] == "dynamic_rescale"
    # The forward variant rescales the primal first; its cotangent is not rescaled.
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(ops.dynamic_rescale_l2(a) * 3.0)))(x)
    assert _names(grad_jaxpr).count("dynamic_rescale") == 1
    assert grad_jaxpr.jaxpr.eqns[0].primitive.name == "dynamic_rescale"


def test_a_tree_is_rescaled_by_one_equation_with_one_batch_of_statistics():
    tree = {"a": jsa.as_scaled_array(jnp.full((8, 4), 3.0)), "b": jsa.as_scaled_array(jnp.full((5,), 1e-3))}
    rescale = jsa.scalify(ops.dynamic_rescale_l2, policy=STATIC_POLICY)
    jaxpr = jax.make_jaxpr(ops.dynamic_rescale_l2)({"a": jnp.ones((8, 4)), "b": jnp.ones(5)})
    assert _names(jaxpr) == ["dynamic_rescale"]
    off = {k: jsa.ScaledArray(x.data / 2.0**20, x.scale * 2.0**20) for k, x in tree.items()}
    out = jax.jit(rescale)(off)
    for key in tree:
        np.testing.assert_allclose(np.asarray(out[key]), np.asarray(tree[key]))
        assert 1 <= float(jnp.sqrt(jnp.mean(jnp.square(out[key].data)))) < 2


@pytest.mark.parametrize("norm", sorted(GRAD_RESCALES))
def test_grad_variant_rescales_cotangent_under_scalify(norm):
    x = _x()
    w = _x(scale=1e-3, shape=x.shape)
    grad_fn = jax.grad(lambda a, b: jnp.sum(GRAD_RESCALES[norm](a) * b))
    g = jsa.scalify(grad_fn, policy=STATIC_POLICY)(x, w)  # plain inputs: only the cotangent gets a scale
    assert isinstance(g, jsa.ScaledArray)
    assert_pow2_scales(g)
    np.testing.assert_allclose(np.asarray(g.to_array()), np.asarray(w), rtol=1e-6)
    assert 1.0 <= STATS[norm](np.asarray(g.data)) < 2.0
    # The forward is untouched: the primal output of the function stays plain.
    y = jsa.scalify(GRAD_RESCALES[norm], policy=STATIC_POLICY)(x)
    assert not isinstance(y, jsa.ScaledArray)


def test_grad_variant_pytree_with_integer_leaves():
    tree = {"x": _x(), "i": jnp.arange(3)}

    def loss(t):
        t = ops.dynamic_rescale_grad(t, "max")
        return jnp.sum(t["x"]) + jnp.sum(t["i"])

    g = jax.grad(loss, allow_int=True)(tree)
    np.testing.assert_array_equal(g["x"], jnp.ones_like(tree["x"]))
    assert g["i"].dtype == jax.dtypes.float0


# --- the rescale policy's sampled statistics -----------------------------------------------------
@pytest.mark.parametrize("shape", [(20,), (1000,), (64,), (4, 256), (8, 8, 16)])
def test_policy_sample_reads_a_small_tensor_whole_in_axes_of_at_most_32(shape):
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    sample = np.asarray(strided_sample(jnp.asarray(data), 1024))
    assert all(n <= 32 for n in sample.shape)
    np.testing.assert_array_equal(sample.reshape(-1), data.reshape(-1))


def test_policy_sample_of_a_small_tensor_with_a_prime_factor_above_32_is_strided():
    data = np.arange(74, dtype=np.float32)  # 2 * 37: no axes of at most 32
    np.testing.assert_array_equal(np.asarray(strided_sample(jnp.asarray(data), 1024)), data[::3])


@pytest.mark.parametrize("shape", [(2000,), (784, 1024), (7, 5000), (4, 256, 768), (3, 3, 64, 128)])
def test_policy_sample_is_a_strided_grid_of_at_most_32_per_axis(shape):
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    sample = np.asarray(strided_sample(jnp.asarray(data), 1024))
    assert all(n <= 32 for n in sample.shape) and sample.size <= 1024
    strides = tuple(-(-dim // n) for dim, n in zip(shape, sample.shape))
    np.testing.assert_array_equal(sample, data[tuple(slice(None, None, s) for s in strides)])
    assert strided_sample(jnp.asarray(data), None).shape == shape


@pytest.mark.parametrize("exponent", [-100, -70, -40, 0, 40, 60, 100])
def test_policy_statistic_moves_any_float32_data_to_unit_size_without_overshooting(exponent):
    """Exact in one rescale for data within 2**-60 .. 2**50 (clamped terms), a bound beyond."""
    values = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * np.float32(2.0**exponent)
    x = jsa.ScaledArray(jnp.asarray(values), jnp.float32(1.0))
    rms = [STATS["l2"](values.astype(np.float64))]
    for _ in range(3):
        x = rescale_scaled_arrays([x], "l2", 1024)[0]
        rms.append(STATS["l2"](np.asarray(x.data, np.float64)))
        np.testing.assert_array_equal(np.asarray(x.data, np.float64) * float(x.scale), values)  # exact: powers of two
    if -60 <= exponent <= 50:
        assert 0.5 <= rms[1] < 2.0, rms
    for before, after in zip(rms, rms[1:]):
        assert abs(np.log2(after)) <= abs(np.log2(before)) + 1, rms  # towards unit size
        assert (after >= 0.5) if before >= 1 else (after < 2.0), rms  # never past it
    assert 0.5 <= rms[-1] < 2.0, rms


def test_policy_statistic_of_non_finite_or_zero_data_keeps_the_scale():
    xs = [
        jsa.ScaledArray(jnp.asarray([1.0, np.inf, 2.0], jnp.float32), jnp.float32(4.0)),
        jsa.ScaledArray(jnp.asarray([1.0, np.nan, 2.0], jnp.float32), jnp.float32(4.0)),
        jsa.ScaledArray(jnp.zeros(3, jnp.float32), jnp.float32(4.0)),
    ]
    for out in rescale_scaled_arrays(xs, "l2", 1024):
        assert float(out.scale) == 4.0


@pytest.mark.parametrize("norm", ["l1", "l2"])
@pytest.mark.parametrize("exponent", [-125, 120])
def test_policy_statistic_of_the_extremes_of_float32_is_finite_and_moves_the_data(norm, exponent):
    x = jsa.ScaledArray(jnp.full((64, 64), 2.0**exponent, jnp.float32), jnp.float32(1.0))
    out = rescale_scaled_arrays([x], norm, 1024)[0]
    assert np.isfinite(float(out.scale)) and float(out.scale) != 1.0
    np.testing.assert_array_equal(np.asarray(out.data, np.float64) * float(out.scale), np.asarray(x.data))


def test_dynamic_rescale_under_jax_enable_x64():
    """The exponent arithmetic shifts int32 fields by an int32 count: with x64 a Python ``23``
    became int64 and ``lax.shift_right_logical`` refused the mix (every policy rescale)."""
    x = jsa.as_scaled_array(jnp.asarray([1.0, 3.0, -0.5, 6.0], jnp.float32))
    with jax.enable_x64(True):
        out = jax.jit(jsa.scalify(jsa.ops.dynamic_rescale_l2))(x)
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.asarray(x.to_array()))
    assert float(out.scale) == 2.0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mode", [jsa.Pow2RoundMode.DOWN, jsa.Pow2RoundMode.UP])
@pytest.mark.parametrize("k", [-59, -3, 0, 1, 7, 49])
def test_policy_factor_is_the_rms_rounded_to_a_power_of_two_exactly(k, mode, jit):
    """Just below, at and just above ``2**k`` (squares and means exact in float32)."""
    rescale = lambda x: rescale_scaled_arrays([x], "l2", 1024, rounding_mode=mode)[0]
    rescale = jax.jit(rescale) if jit else rescale
    for mantissa, below, above in [(1 - 2.0**-10, k - 1, k), (1.0, k, k), (1 + 2.0**-10, k, k + 1)]:
        value = np.float32(mantissa * 2.0**k)
        out = rescale(jsa.ScaledArray(jnp.full((64, 48), value), jnp.float32(2.0)))
        expected = below if mode == jsa.Pow2RoundMode.DOWN else above
        assert float(out.scale) == 2.0 ** (expected + 1), (mantissa, float(out.scale))
        np.testing.assert_array_equal(np.asarray(out.data, np.float64) * float(out.scale), 2.0 * value)


@pytest.mark.parametrize("scale", [2.0**120, 2.0**-120])
def test_policy_rescale_keeps_the_new_scale_a_normal_float32(scale):
    """The factor is cut where the scale would leave float32's normal range; the value is kept."""
    data = jnp.full((16, 16), 2.0**20 if scale > 1 else 2.0**-20, jnp.float32)
    out = rescale_scaled_arrays([jsa.ScaledArray(data, jnp.float32(scale))], "l2", 1024)[0]
    assert float(out.scale) == (2.0**127 if scale > 1 else 2.0**-126)
    np.testing.assert_array_equal(
        np.asarray(out.data, np.float64) * float(out.scale), np.asarray(data, np.float64) * scale
    )


@pytest.mark.parametrize("scale", [0.0, 2.0**-140, np.inf])
def test_policy_rescale_leaves_a_zero_subnormal_or_infinite_scale(scale):
    data = jnp.full((8, 8), 4.0, jnp.float32)
    # A traced scale: a concrete infinite one is refused when the ScaledArray is built.
    out = jax.jit(lambda d, s: rescale_scaled_arrays([jsa.ScaledArray(d, s)], "l2", 1024)[0])(data, jnp.float32(scale))
    assert float(out.scale) == np.float32(scale)
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(data))


def test_policy_rescale_of_a_float16_scatter_into_zeros_keeps_entries_the_sample_misses_finite():
    """Only rows 0 and 5 are non-zero; the sample of the returned value holds row 0 (1e-4) and misses row 5 (1)."""
    rows = jsa.tree.astype(jsa.as_scaled_array(jnp.asarray([[1e-4] * 32, [1.0] * 32])), jnp.float16)
    scatter = lambda rows: jnp.zeros((4096, 32), jnp.float16).at[jnp.array([0, 5])].add(rows)
    out = jax.jit(jsa.scalify(scatter))(rows)
    assert np.isfinite(np.asarray(out.data)).all()
    assert np.max(np.abs(np.asarray(out.data, np.float32))) <= 2.0**14
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), scatter(rows.to_array(jnp.float16)), rtol=1e-3)


def test_sparse_embedding_gradient_in_float16_follows_float32():
    """An embedding lookup's gradient touches two of 4096 rows, weighted 1e-4 and 1: with float16
    data the row that the statistic's sample missed was inf, and an Adagrad step made it NaN."""
    table = jax.random.normal(jax.random.PRNGKey(0), (4096, 32)) * 0.1
    ids, weights = jnp.array([0, 5]), jnp.array([1e-4, 1.0])
    loss = lambda table, weights: jnp.sum(weights[:, None] * table[ids])
    tx = jsa.optim.scale_state(optax.adagrad(0.1), jnp.float16)

    def step(table, state, weights):
        grads = jax.grad(loss)(table, weights)
        updates, state = tx.update(grads, state, table)
        return optax.apply_updates(table, updates), state

    scaled_table = jsa.tree.astype(jsa.as_scaled_array(table), jnp.float16)
    scaled_weights = jsa.tree.astype(jsa.as_scaled_array(weights), jnp.float16)
    new_table, _ = jax.jit(jsa.scalify(step))(scaled_table, tx.init(scaled_table), scaled_weights)
    plain_tx = optax.adagrad(0.1)
    grads = jax.grad(loss)(table, weights)
    updates, _ = plain_tx.update(grads, plain_tx.init(table), table)
    expected = optax.apply_updates(table, updates)
    np.testing.assert_allclose(np.asarray(new_table.to_array(jnp.float32)), np.asarray(expected), atol=2e-3)


def _row_sparse_bias_and_update():
    """A zero-initialised bias that a lookup trains: a few rows non-zero, and an update whose
    only sampled row is 10^4 times smaller than the others (from a matrix factorisation run)."""
    bias = np.zeros(4096, np.float32)
    bias[[21, 46, 607, 609]] = [0.01, -0.02, 0.0717, 0.03]
    update = np.zeros(4096, np.float16)
    update[[0, 46, 607, 900, 1234]] = [2.0, -5000.0, 9088.0, 17968.0, 12000.0]
    return bias, jsa.ScaledArray(jnp.asarray(update), jnp.float32(2.0**-20))


@pytest.mark.parametrize("route", ["float16 data", "float32 data", "sample_size=None"])
def test_a_row_sparse_bias_stays_finite(route):
    """The returned sum's sample holds only the 2e-6 row: moved up to it, the other rows overflowed float16."""
    bias, update = _row_sparse_bias_and_update()
    params = jsa.as_scaled_array(jnp.asarray(bias))
    step = jsa.scalify(optax.apply_updates)
    if route != "float32 data":
        params = jsa.tree.astype(params, jnp.float16)
    if route == "sample_size=None":
        step = jsa.scalify(optax.apply_updates, policy=jsa.RescalePolicy(sample_size=None))
    out = np.asarray(jax.jit(step)(params, update).to_array(jnp.float32))
    expected = np.asarray(params.to_array(jnp.float32)) + np.asarray(update.to_array(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-9)


def test_matrix_factorisation_with_zero_initialised_biases_trains_in_float16():
    """Per-user and per-item biases start at zero and only lookups update them; Zipf-distributed
    ids and importance weights in 1e-4..1, Adagrad, the README recipe (was NaN from step 5)."""
    rng = np.random.default_rng(0)
    users, items, width, batch = 4096, 2048, 16, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {
        "U": 0.1 * jax.random.normal(keys[0], (users, width)),
        "I": 0.1 * jax.random.normal(keys[1], (items, width)),
        "bu": jnp.zeros(users),
        "bi": jnp.zeros(items),
    }
    truth_u, truth_i = rng.normal(size=(users, 4)), rng.normal(size=(items, 4))
    user_rows, item_rows = rng.permutation(users), rng.permutation(items)  # frequent ids at random rows

    def loss_fn(p, u, i, y, w):
        pred = jnp.sum(p["U"][u] * p["I"][i], axis=-1) + p["bu"][u] + p["bi"][i]
        return jnp.mean(w * (pred - y) ** 2)

    def make_step(tx):
        def step(p, state, u, i, y, w):
            loss, grads = jax.value_and_grad(loss_fn)(p, u, i, y, w)
            updates, state = tx.update(grads, state, p)
            return loss, optax.apply_updates(p, updates), state

        return step

    data = []
    for _ in range(12):
        u = user_rows[np.minimum(rng.zipf(1.3, batch) - 1, users - 1)]
        i = item_rows[np.minimum(rng.zipf(1.3, batch) - 1, items - 1)]
        y = np.sum(truth_u[u] * truth_i[i], axis=-1)
        w = 10.0 ** rng.uniform(-4, 0, batch)
        data.append(tuple(jnp.asarray(a, jnp.float32 if a.dtype.kind == "f" else jnp.int32) for a in (u, i, y, w)))

    tx32 = optax.adagrad(0.1)
    p32, s32, step32 = params, tx32.init(params), jax.jit(make_step(tx32))
    tx16 = jsa.optim.scale_state(optax.adagrad(0.1), jnp.float16)
    p16 = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    s16, step16 = tx16.init(p16), jax.jit(jsa.scalify(make_step(tx16)))
    for u, i, y, w in data:
        loss32, p32, s32 = step32(p32, s32, u, i, y, w)
        loss16, p16, s16 = step16(p16, s16, u, i, jsa.as_scaled_array(y), jsa.as_scaled_array(w))
    for name in ("bu", "bi"):
        got = np.asarray(p16[name].to_array(jnp.float32))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, np.asarray(p32[name]), atol=2e-3 * float(np.max(np.abs(p32[name]))))
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=1e-2)


@pytest.mark.parametrize("jit", [False, True])
def test_narrowing_takes_the_rms_of_all_the_data_and_bounds_its_peak(jit):
    """A float32 sum whose energy sits in one column that a strided sample skips (the input
    gradient of a GELU layer with one grown unit): the sampled RMS was 2**7 below the
    tensor's and left float16 data at 2**7-2**10, which the products after it overflowed."""
    data = np.full((128, 128), 1e-3, np.float32)
    data[:, 1] = 1.0  # column 1: between the sampled columns 0 and 4
    data[5, 1] = 3e4  # an entry 2**15 above the RMS: bounded, not inf
    narrow = lambda x: rescaled_into_narrow(x, jnp.float16, "l2")  # noqa: E731
    out = (jax.jit(narrow) if jit else narrow)(jsa.ScaledArray(jnp.asarray(data), jnp.float32(2.0**-20)))
    assert out.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out.data, np.float32)))
    assert np.abs(np.asarray(out.data, np.float32)).max() <= 2.0**14
    rms = np.sqrt(np.mean(np.square(np.asarray(out.data, np.float64))))
    assert 1 / 4 <= rms <= 4  # the whole tensor's RMS moved into the scale (bounded by the peak)
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), data * 2.0**-20, rtol=1e-3, atol=1e-6 * 2.0**-20)
