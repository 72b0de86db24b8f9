"""Sub-jaxpr evaluation and the fixed point of which outputs are scaled (shared by the call,
control-flow and shard_map rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.lax import subjaxpr


def test_fixed_point_grows_the_scaled_set_until_the_trace_succeeds():
    calls = []

    def run(scaled, owner):
        calls.append(scaled)
        outs = [jsa.ScaledArray(jnp.ones(2), np.float32(1.0)) if i in (0, 2) else jnp.ones(2) for i in range(3)]
        subjaxpr.check_structure(owner, outs, scaled)
        return "traced"

    scaled, result = subjaxpr.fixed_point(run, [False, False, False])
    assert result == "traced" and scaled == (True, False, True)
    assert calls == [(False, False, False), (True, False, True)]


def test_fixed_point_leaves_a_nested_fixed_points_retries_to_it():
    def inner(scaled, owner):
        subjaxpr.check_structure(owner, [jsa.ScaledArray(jnp.ones(2), np.float32(1.0))], scaled)
        return scaled

    def outer(scaled, owner):
        inner_scaled, _ = subjaxpr.fixed_point(inner, [False])
        return inner_scaled

    assert subjaxpr.fixed_point(outer, [False]) == ((False,), (True,))


def test_a_retry_of_another_owner_propagates():
    def run(scaled, owner):
        raise subjaxpr.StructureGrew(object(), (True,))

    with pytest.raises(subjaxpr.StructureGrew):
        subjaxpr.fixed_point(run, [False])


def test_eval_sub_jaxpr_keeps_constant_arguments_constant():
    """A literal 0.0 passed to a sub-jaxpr stays a known constant: it adopts the scaled operand's scale."""
    closed = jax.make_jaxpr(lambda x, zero: jnp.maximum(x, zero))(np.ones(3, np.float32), np.float32(0))
    x = jsa.ScaledArray(jnp.asarray([1.0, -2.0, 3.0]), jnp.float32(2.0**20))
    (out,) = subjaxpr.eval_sub_jaxpr(closed.jaxpr, closed.consts, [x, np.float32(0.0)])
    assert out.scale is x.scale or float(out.scale) == 2.0**20
    np.testing.assert_array_equal(np.asarray(out.to_array()), [2.0**20, 0.0, 3 * 2.0**20])
