"""sharding_constraint under scalify: the data constrained, a traced scale replicated."""

import jax
import numpy as np
from jax import lax

import jax_scalify as jsa
from jax_scalify.extend import registered_rules
from jax_scalify.lax import rules_sharding
from tests.invariance import Case, invariance_test, normal, value_at_scale

_ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def with_sharding(x, w):
    return lax.with_sharding_constraint(x * w, _ONE_DEVICE) + 1.0


INVARIANCE_CASES = [Case("sharding_constraint", with_sharding, [normal(4), normal(4)], grad=True)]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


scaled = value_at_scale  # the value x at scale 2**exponent


RNG = np.random.default_rng(0)
X4 = RNG.standard_normal(4).astype(np.float32)
W4 = RNG.standard_normal(4).astype(np.float32)


def value(x):
    return np.asarray(x.to_array(np.float32) if isinstance(x, jsa.ScaledArray) else x, np.float64)


# --- sharding_constraint ---------------------------------------------------------------------
def test_sharding_constraint_applies_to_data_and_replicates_scale():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    fn = lambda x, w: lax.with_sharding_constraint(x * w, sharding)  # noqa: E731
    jaxpr = jax.make_jaxpr(jsa.scalify(fn))(scaled(X4, 1), scaled(W4, 2))
    constraints = [e.params["sharding"] for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert constraints[0] == sharding and constraints[1].spec == jax.sharding.PartitionSpec()
    got = jax.jit(jsa.scalify(fn))(scaled(X4, 1), scaled(W4, 2))
    np.testing.assert_allclose(value(got), X4 * W4, rtol=1e-6)


def test_rule_registered_with_summary():
    rules = registered_rules()
    assert rules_sharding.sharding_constraint_p in rules and rules[rules_sharding.sharding_constraint_p].summary
