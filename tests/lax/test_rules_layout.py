"""Layout rules: scale-preserving ops keep the scale, concatenate and pad align operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify.lax import rules_layout
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal

_PAD_CONFIG = ((1, 2, 0), (-1, 1, 1))  # edge padding, cropping and interior padding


def _lax_pad_zero(x):
    return lax.pad(x, jnp.zeros((), x.dtype), _PAD_CONFIG)


INVARIANCE_CASES = [
    Case("broadcast_in_dim", lambda x: jnp.broadcast_to(x, (3, 4, 5)), [normal(4, 5)], grad=True),
    Case("expand_dims", lambda x: jnp.expand_dims(x, (0, 2)), [normal(4, 5)], grad=True),
    Case("reshape", lambda x: x.reshape(5, 2, 2), [normal(4, 5)], grad=True),
    Case("squeeze", lambda x: jnp.squeeze(x, 1), [normal(4, 1, 5)], grad=True),
    Case("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), [normal(2, 3, 4)], grad=True),
    Case("slice", lambda x: x[1:3, ::2], [normal(4, 5)], grad=True),
    Case("rev", lambda x: x[::-1, ::-1], [normal(4, 5)], grad=True),
    Case("split", lambda x: jnp.split(x, [1, 3], axis=1), [normal(4, 5)]),
    Case("split_equal", lambda x: jnp.split(x, 2, axis=0), [normal(4, 5)], grad=True),
    Case("concatenate", lambda x, y: jnp.concatenate([x, y], axis=0), [normal(2, 5), normal(3, 5)], grad=True),
    Case("stack", lambda x, y: jnp.stack([x, y, x * y], axis=1), [normal(4, 5), normal(4, 5)], grad=True),
    Case("stack_zeros", lambda x: jnp.stack([jnp.zeros(5), x]), [normal(5)], grad=True),
    Case("unstack", lambda x: jnp.unstack(x, axis=1), [normal(4, 3)]),
    Case(
        "unstack_weighted",
        lambda x: sum((i + 1.0) * u for i, u in enumerate(jnp.unstack(x))),
        [normal(3, 4)],
        grad=True,
    ),
    Case("concatenate_zeros", lambda x: jnp.concatenate([jnp.zeros((1, 5)), x], axis=0), [normal(2, 5)], grad=True),
    Case("pad_zero", lambda x: jnp.pad(x, ((1, 2), (0, 1))), [normal(4, 5)], grad=True),
    Case("pad_lax", _lax_pad_zero, [normal(4, 5)], grad=True),
    Case("pad_constant", lambda x: jnp.pad(x, 1, constant_values=3.0), [normal(4, 5)], grad=True),
    Case("pad_value_operand", lambda x, v: lax.pad(x, v, _PAD_CONFIG), [normal(4, 5), normal()], grad=True),
    Case("pad_edge", lambda x: jnp.pad(x, 2, mode="edge"), [normal(3, 4)]),
    Case("tile", lambda x: jnp.tile(x, (2, 3)), [normal(2, 3)], grad=True),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


def _tiny_f16(shape=(4, 6), exponent=-40):
    """float16 data in [1, 2) with scale 2**exponent: values far below float16's range."""
    data = np.random.default_rng(0).uniform(1, 2, shape).astype(np.float16)
    return jsa.ScaledArray(jnp.asarray(data), jnp.float32(2.0**exponent))


def _value(x) -> np.ndarray:
    return np.asarray(x.to_array(np.float32), np.float64)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.reshape(3, 8),
        lambda x: x.T,
        lambda x: jnp.broadcast_to(x, (2, 4, 6)),
        lambda x: jnp.expand_dims(x, 1),
        lambda x: x[1:3, ::-2],
        lambda x: jnp.split(x, 3, axis=1)[1],
        lambda x: jnp.concatenate([x, x[:1]]),
        lambda x: jnp.pad(x, 1),
        _lax_pad_zero,
    ],
)
def test_float16_tiny_scale_survives(fn):
    x = _tiny_f16()
    out = jsa.scalify(fn, policy=STATIC_POLICY)(x)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**-40
    expected = fn(jnp.asarray(_value(x), jnp.float64) if jax.config.jax_enable_x64 else x.to_array(jnp.float32))
    np.testing.assert_array_equal(_value(out), np.asarray(expected, np.float64))
    assert np.all(np.asarray(fn(x.to_array(jnp.float16))) == 0)  # plain float16 underflows


def test_concatenate_different_scales_aligns_to_largest():
    x = jsa.as_scaled_array(np.array([1.0, -1.5], np.float32), scale=np.float32(2.0**-6))
    y = jsa.as_scaled_array(np.array([3.0, 0.25, 8.0], np.float32), scale=np.float32(2.0**4))
    out = jsa.scalify(lambda a, b: jnp.concatenate([a, b]), policy=STATIC_POLICY)(x, y)
    assert float(out.scale) == 2.0**4
    np.testing.assert_array_equal(out.to_array(), [1.0, -1.5, 3.0, 0.25, 8.0])
    assert_pow2_scales(out)


@pytest.mark.parametrize(
    "fn",
    [lambda x: jnp.pad(x, 2), _lax_pad_zero, lambda x: jnp.pad(x, 1, constant_values=-np.inf)],
    ids=["jnp_pad", "lax_pad", "pad_neg_inf"],
)
def test_pad_with_zero_or_inf_keeps_scale(fn):
    x = _tiny_f16(exponent=30)
    out = jax.jit(jsa.scalify(fn, policy=STATIC_POLICY))(x)
    assert float(out.scale) == 2.0**30
    np.testing.assert_array_equal(_value(out), np.asarray(fn(x.to_array(jnp.float32)), np.float64))


def test_pad_with_nonzero_value_aligns_to_largest():
    """A constant fill counts, as in a select, at the smallest scale at which its data dtype
    holds it (far below 2**-8 for 3.0 in float32): the operand keeps its scale."""
    x = jsa.as_scaled_array(np.ones((2, 2), np.float32), scale=np.float32(2.0**-8))
    out = jsa.scalify(lambda a: jnp.pad(a, 1, constant_values=3.0), policy=STATIC_POLICY)(x)
    assert float(out.scale) == 2.0**-8
    np.testing.assert_array_equal(out.to_array(), np.pad(np.ones((2, 2), np.float32), 1, constant_values=3.0))


def test_split_keeps_scale():
    x = _tiny_f16(exponent=-20)
    outs = jsa.scalify(lambda a: jnp.split(a, [1, 4], axis=1))(x)
    assert [o.shape for o in outs] == [(4, 1), (4, 3), (4, 2)]
    assert all(float(o.scale) == 2.0**-20 for o in outs)
    np.testing.assert_array_equal(np.concatenate([_value(o) for o in outs], axis=1), _value(x))


def test_broadcast_scalar_constant_recognised_through_layout_ops():
    """`jnp.full(..., 3.0).T.reshape(...)` is still the scalar 3 = 0.75 * 2**2 when it meets x."""
    x = jsa.as_scaled_array(np.ones((2, 3), np.float32), scale=np.float32(2.0**-10))
    out = jsa.scalify(
        lambda a: jnp.concatenate([a, jnp.full((3, 2), 3.0).T[::-1, 2:].reshape(2, 1)], axis=1), policy=STATIC_POLICY
    )(x)
    assert float(out.scale) == 4.0
    np.testing.assert_array_equal(out.data[:, -1], [0.75, 0.75])
    np.testing.assert_array_equal(out.to_array()[:, -1], [3.0, 3.0])


def test_non_scalar_scale_is_folded():
    """scalify rejects non-scalar input scales; the rules still fold one they meet (defensive)."""
    x = jsa.ScaledArray(jnp.ones((2, 3)), jnp.array([[2.0], [0.5]], jnp.float32))
    out = rules_layout.scaled_reshape(x, new_sizes=(6,), dimensions=None, sharding=None)
    assert np.ndim(out.scale) == 0 and float(out.scale) == 2.0
    np.testing.assert_array_equal(out.to_array(), [2, 2, 2, 0.5, 0.5, 0.5])


def test_rules_registered_with_summaries():
    rules = {prim.name: entry for prim, entry in jsa.extend.registered_rules().items()}
    for name in ["broadcast_in_dim", "reshape", "squeeze", "transpose", "slice", "rev", "split", "concatenate", "pad"]:
        assert name in rules and rules[name].summary, name
