"""Indexing rules: reads keep the scale, writes align operands, sort compares data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, integers, invariance_test, normal

# Five indices into 4 rows: duplicates are likely, so scatter combiners are exercised.
_ROWS = integers(5, low=0, high=4)
_OOB = integers(5, low=-2, high=7)  # some out of bounds (negative ones wrap, large ones fill/drop)


def _sort_pairs(k, v):
    return lax.sort((k, v), dimension=1, num_keys=1)


def _sort_two_keys(k1, k2, v):
    return lax.sort((k1, k2, v), dimension=0, num_keys=2)


def _sort_int_key(k, v):
    return lax.sort((k, v), dimension=1, num_keys=1)


INVARIANCE_CASES = [
    Case("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)), [normal(4, 5), integers()], grad=True),
    Case(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 2)),
        [normal(4, 5), normal(2, 3), integers()],
        grad=True,
    ),
    Case("gather_index", lambda x, i: x[i], [normal(4, 3), _ROWS], grad=True),
    Case("gather_take", lambda x, i: jnp.take(x, i, axis=1), [normal(3, 7), _OOB], grad=True),
    Case("gather_fill", lambda x, i: jnp.take(x, i, axis=1, mode="fill", fill_value=3.0), [normal(3, 5), _OOB]),
    Case("gather_clip", lambda x, i: jnp.take(x, i, axis=0, mode="clip"), [normal(4, 3), _OOB], grad=True),
    Case("scatter", lambda x, i, u: x.at[i].set(u), [normal(4, 3), integers(2), normal(2, 3)], grad=True),
    Case("scatter_zero", lambda x, i: x.at[i].set(0.0), [normal(4, 3), _ROWS], grad=True),
    Case("scatter_add", lambda x, i, u: x.at[i].add(u), [normal(4, 3), _ROWS, normal(5, 3)], grad=True),
    Case("scatter_sub", lambda x, i, u: x.at[i].subtract(u), [normal(4, 3), _ROWS, normal(5, 3)], grad=True),
    Case("scatter_add_drop", lambda x, i, u: x.at[i].add(u, mode="drop"), [normal(4, 3), _OOB, normal(5, 3)]),
    Case("scatter_mul", lambda x, i, u: x.at[i].mul(u), [normal(4, 3), _ROWS, normal(5, 3)], grad=True),
    Case("scatter_mul_const", lambda x, i: x.at[i].mul(4.0), [normal(4, 3), _ROWS], grad=True),
    Case("scatter_min", lambda x, i, u: x.at[i].min(u), [normal(4, 3), _ROWS, normal(5, 3)], grad=True),
    Case("scatter_max", lambda x, i, u: x.at[i].max(u), [normal(4, 3), _ROWS, normal(5, 3)], grad=True),
    Case("sort", lambda x: jnp.sort(x, axis=-1), [normal(3, 6)], grad=True),
    Case("argsort", lambda x: jnp.argsort(x, axis=0), [normal(5, 3)]),
    Case("sort_pairs", _sort_pairs, [normal(3, 6), normal(3, 6)], grad=True),
    Case("sort_two_keys", _sort_two_keys, [integers(6, 2, high=2, dtype=np.float32), normal(6, 2), normal(6, 2)]),
    Case("sort_int_key", _sort_int_key, [integers(3, 6, high=3), normal(3, 6)]),
    Case("top_k", lambda x: lax.top_k(x, 3), [normal(4, 6)]),
    Case("top_k_values", lambda x: lax.top_k(x, 2)[0], [normal(4, 6)], grad=True),
    Case("approx_max_k", lambda x: lax.approx_max_k(x, 2), [normal(4, 6)]),
    Case("approx_min_k_values", lambda x: lax.approx_min_k(x, 3)[0], [normal(4, 6)], grad=True),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


def _scaled(values, exponent, dtype=np.float32):
    return jsa.ScaledArray(jnp.asarray(np.asarray(values, dtype)), jnp.float32(2.0**exponent))


def _value(x) -> np.ndarray:
    return np.asarray(x.to_array(np.float32), np.float64)


_IDX = jnp.array([3, 0, 0, 2], jnp.int32)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)),
        lambda x: x[_IDX],
        lambda x: jnp.take(x, _IDX, axis=1),
        lambda x: jnp.sort(x, axis=1),
        lambda x: lax.top_k(x, 2)[0],
    ],
    ids=["dynamic_slice", "gather", "take", "sort", "top_k"],
)
def test_float16_tiny_scale_survives(fn):
    x = _scaled(np.random.default_rng(1).uniform(-2, 2, (4, 6)), -40, np.float16)
    out = jsa.scalify(fn)(x)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**-40
    np.testing.assert_array_equal(_value(out), np.asarray(fn(x.to_array(jnp.float32)), np.float64))


def test_float16_scatter_aligns_far_apart_scales():
    """Operand at 2**-40 and updates at 2**-36: both far below float16's range, scale 2**-36."""
    x, u = _scaled(np.ones((4, 3)), -40, np.float16), _scaled(np.full((2, 3), 1.5), -36, np.float16)
    out = jsa.scalify(lambda a, b: a.at[jnp.array([1, 3])].set(b))(x, u)
    assert float(out.scale) == 2.0**-36
    expected = np.ones((4, 3)) * 2.0**-40
    expected[[1, 3]] = 1.5 * 2.0**-36
    np.testing.assert_array_equal(_value(out), expected)


def test_dynamic_update_slice_into_zeros_takes_update_scale():
    u = _scaled([[1.0, -2.0]], 12)
    out = jax.jit(jsa.scalify(lambda b: lax.dynamic_update_slice(jnp.zeros((3, 2)), b, (1, 0)), policy=STATIC_POLICY))(
        u
    )
    assert float(out.scale) == 2.0**12
    np.testing.assert_array_equal(out.to_array(), [[0, 0], [2.0**12, -(2.0**13)], [0, 0]])


def test_scatter_add_aligns_to_largest():
    x, u = _scaled(np.ones((3, 2)), -3), _scaled(np.ones((4, 2)), 5)
    out = jsa.scalify(lambda a, b: a.at[jnp.array([0, 0, 0, 2])].add(b))(x, u)
    assert float(out.scale) == 2.0**5
    np.testing.assert_array_equal(out.to_array(), [[3 * 32 + 0.125] * 2, [0.125] * 2, [32.125] * 2])


@pytest.mark.parametrize("lookups", [2**12, 2**16])
def test_lookup_gradient_with_many_lookups_per_row_is_summed_in_float32(lookups):
    """The gradient of ``jnp.take`` is a scatter-add into the table's rows; with float16 data it
    is accumulated in float32 in the backward pass. Summed in float16 (plain float16 JAX too)
    a row stops taking contributions at about 2**11 of them: with 8,192 lookups per row the
    gradient was half its value."""
    rng = np.random.default_rng(0)
    table = rng.uniform(-1e-4, 1e-4, (8, 2)).astype(np.float32)
    ids = jnp.asarray(rng.integers(0, 8, lookups).astype(np.int32))
    target = rng.uniform(0.2, 0.8, (lookups, 2)).astype(np.float32)

    def loss(table, target):
        return jnp.mean((jnp.take(table, ids, axis=0) - target) ** 2)

    args = jsa.tree.astype(jsa.as_scaled_array((jnp.asarray(table), jnp.asarray(target))), jnp.float16)
    grad = jax.jit(jsa.scalify(jax.grad(loss)))(*args)
    rounded = [np.asarray(jnp.asarray(a, jnp.float16), np.float32) for a in (table, target)]
    expected = np.asarray(jax.grad(loss)(*rounded))
    np.testing.assert_allclose(np.asarray(grad.to_array(jnp.float32)), expected, rtol=2e-3)


def test_scatter_mul_exact_with_repeated_and_missing_indices():
    """Row 0 is hit twice, row 1 never: the operand's scale is kept, updates applied by value."""
    x, u = _scaled(np.full((3, 2), 1.5), -20), _scaled(np.full((3, 2), 1.25), 3)
    out = jsa.scalify(lambda a, b: a.at[jnp.array([0, 0, 2])].mul(b), policy=STATIC_POLICY)(x, u)
    assert float(out.scale) == 2.0**-20
    np.testing.assert_array_equal(_value(out), np.array([[1.5 * 10 * 10], [1.5], [1.5 * 10]]).repeat(2, 1) * 2.0**-20)


def test_gather_fill_value_is_a_value():
    x = _scaled(np.ones((2, 3)), -10)
    fn = lambda a: jnp.take(a, jnp.array([2, 5, -9]), axis=1, mode="fill", fill_value=3.0)  # noqa: E731
    out = jsa.scalify(fn, policy=STATIC_POLICY)(x)
    assert float(out.scale) == 2.0**-10
    np.testing.assert_array_equal(out.to_array(), [[2.0**-10, 3.0, 3.0]] * 2)


def test_sort_payload_keeps_its_own_scale():
    k, v = _scaled([[3.0, -1.0, 2.0]], 30), _scaled([[1.0, 2.0, 3.0]], -30)
    ks, vs = jsa.scalify(lambda a, b: lax.sort((a, b), num_keys=1), policy=STATIC_POLICY)(k, v)
    assert float(ks.scale) == 2.0**30 and float(vs.scale) == 2.0**-30
    np.testing.assert_array_equal(ks.data, [[-1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(vs.data, [[2.0, 3.0, 1.0]])


def test_top_k_indices_plain():
    x = _scaled([[0.5, -3.0, 7.0, 1.0]], 8)
    values, indices = jsa.scalify(lambda a: lax.top_k(a, 2), policy=STATIC_POLICY)(x)
    assert isinstance(values, jsa.ScaledArray) and not isinstance(indices, jsa.ScaledArray)
    assert float(values.scale) == 2.0**8
    np.testing.assert_array_equal(indices, [[2, 3]])
    assert_pow2_scales(values)


def test_rules_registered_with_summaries():
    rules = {prim.name: entry for prim, entry in jsa.extend.registered_rules().items()}
    names = ["dynamic_slice", "dynamic_update_slice", "gather", "scatter", "scatter-add", "scatter-mul"]
    for name in names + ["scatter-min", "scatter-max", "sort", "top_k", "approx_top_k"]:
        assert name in rules and rules[name].summary, name
