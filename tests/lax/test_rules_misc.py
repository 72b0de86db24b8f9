"""name (checkpoint_name) and device_put."""

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa
from jax_scalify.lax import rules_misc
from tests.invariance import Case, assert_pow2_scales, invariance_test, normal
from tests.invariance import scaled as _scaled

SHAPE = (3, 4)


def _named_mlp(x, w):
    h = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x @ w), "hidden")
    return jnp.sum(h * h, axis=-1)


_remat_mlp = jax.checkpoint(_named_mlp, policy=jax.checkpoint_policies.save_only_these_names("hidden"))


INVARIANCE_CASES = [
    Case("name", lambda x: jax.ad_checkpoint.checkpoint_name(x * 2.0, "scaled"), [normal(*SHAPE)], grad=True),
    Case("name_in_checkpoint", _remat_mlp, [normal(*SHAPE), normal(4, 4)], grad=True),
    Case("device_put", lambda x: jax.device_put(x * 2.0, jax.devices()[0]), [normal(*SHAPE)], grad=True),
    Case(
        "optimization_barrier",
        lambda x, y: jax.lax.optimization_barrier((x * 2.0, y, jnp.arange(3))),
        [normal(*SHAPE), normal(2)],
    ),
    Case("optimization_barrier_grad", lambda x: jax.lax.optimization_barrier(x * 2.0) * x, [normal(*SHAPE)], grad=True),
    Case("device_put_tree", lambda x, y: jax.device_put((x, y, jnp.arange(3))), [normal(*SHAPE), normal(2)]),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


def test_name_keeps_the_scale_and_names_data_and_traced_scale():
    x = _scaled([1.5, -1.0], -30)
    out = jsa.scalify(lambda a: jax.ad_checkpoint.checkpoint_name(a, "n"))(x)
    assert float(out.scale) == 2.0**-30
    np.testing.assert_array_equal(out.data, x.data)
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda a: jax.ad_checkpoint.checkpoint_name(a, "n")))(x)
    assert sum(eqn.primitive.name == "name" for eqn in jaxpr.eqns) == 2  # data and (traced) scale


def test_name_policy_saves_the_named_value_under_scalify():
    """With grad inside scalify, the remat policy still sees the name (no recomputation error)."""
    x, w = _scaled(np.ones(SHAPE), -8), _scaled(np.eye(4), 0)
    grad = jax.grad(lambda a, b: jnp.sum(_remat_mlp(a, b)), argnums=1)
    got = jsa.scalify(grad)(x, w)
    assert_pow2_scales(got)
    np.testing.assert_allclose(jsa.asarray(got), grad(x.to_array(), w.to_array()), rtol=1e-5)


def test_device_put_moves_data_and_scale():
    device = jax.devices()[0]
    x = _scaled([1.5, 2.0], 12)
    out = jsa.scalify(lambda a: jax.device_put(a, device))(x)
    assert float(out.scale) == 2.0**12
    assert out.data.devices() == {device} and out.scale.devices() == {device}


def test_device_put_named_sharding_replicates_the_scale_under_jit():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    x = _scaled(np.arange(4.0), -3)
    fn = jsa.scalify(lambda a: jax.device_put(a * 2.0, sharding))
    (put,) = [eqn for eqn in jax.make_jaxpr(fn)(x).eqns if eqn.primitive.name == "device_put"]
    assert [d.spec for d in put.params["devices"]] == [jax.sharding.PartitionSpec("x"), jax.sharding.PartitionSpec()]
    out = jax.jit(fn)(x)
    np.testing.assert_array_equal(jsa.asarray(out), np.arange(4.0) * 2.0**-2)


def test_device_put_keeps_constant_scales_constant():
    # jnp.full_like(., 2.0) is split into mantissa and a scale known at trace time: no device_put for it.
    def fn(a):
        return jax.device_put(jnp.full_like(a, 4.0)) * a

    jaxpr = jax.make_jaxpr(jsa.scalify(fn))(_scaled([1.0, 1.5], 3))
    puts = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "device_put"]
    assert all(len(eqn.invars) == 1 for eqn in puts)
    np.testing.assert_array_equal(jsa.asarray(jsa.scalify(fn)(_scaled([1.0, 1.5], 3))), [32.0, 48.0])


def test_misc_rules_are_exported():
    assert {"scaled_name", "scaled_device_put"} <= set(rules_misc.__all__)
