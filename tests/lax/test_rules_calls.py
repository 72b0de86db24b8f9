"""Rules of jit, closed_call, custom_jvp_call and custom_vjp_call."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa
from jax_scalify.lax import rules_calls
from tests.compiles import count_xla_compiles
from tests.invariance import Case, invariance_test, normal


@jax.custom_vjp
def clipped_square(x):
    return x * x


clipped_square.defvjp(lambda x: (x * x, x), lambda x, g: (jnp.clip(2 * x * g, -1.0, 1.0),))


@jax.custom_jvp
def soft_abs(x):
    return jnp.sqrt(x * x + 1.0)


soft_abs.defjvp(lambda primals, tangents: (soft_abs(primals[0]), primals[0] / soft_abs(primals[0]) * tangents[0]))


@functools.partial(jax.jit, static_argnames="power")
def jitted_poly(x, y, power=2):
    return x**power + jnp.where(y > 0, y, 0.0)


def _scan_product(x):
    def body(carry, row):
        return carry * 0.5 + row * carry, carry

    return jax.lax.scan(body, x[0], x)[0]


# The backward pass of a checkpointed scan holds a closed_call (partial evaluation of the scan).
_remat_scan = jax.checkpoint(_scan_product)

INVARIANCE_CASES = [
    Case("jit", lambda x, y: jitted_poly(x, y), [normal(3, 4), normal(3, 4)], grad=True),
    Case("jit_nested", jax.jit(lambda x: jax.jit(jnp.tanh)(x) * 2.0), [normal(5)], grad=True),
    Case("custom_jvp", soft_abs, [normal(6)], grad=True),
    Case("custom_vjp", clipped_square, [normal(6)], grad=True),
    Case("jax_nn_relu", jax.nn.relu, [normal(2, 3)], grad=True),
    Case("closed_call", _remat_scan, [normal(4, 3)], grad=True),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


def test_jit_keeps_name_and_inline():
    fn = jax.jit(jnp.sin, inline=True)
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda x: jax.jit(jnp.cos)(x) + fn(x)))(jsa.as_scaled_array(jnp.ones(3)))
    jits = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    names = [e.params["name"] for e in jits]
    assert "cos" in names and "sin" not in names  # the inline=True one was inlined


def test_custom_vjp_grad_inside_scalify_uses_the_custom_backward():
    x = jnp.array([3.0, -0.1, 0.2])
    expected = jax.grad(lambda a: jnp.sum(clipped_square(a)))(x)
    got = jsa.scalify(jax.grad(lambda a: jnp.sum(clipped_square(a))))(jsa.as_scaled_array(x))
    np.testing.assert_allclose(got.to_array(), expected)
    assert float(expected[0]) == 1.0  # clipped: the custom rule, not 2 * x


def test_repeated_eager_calls_reuse_the_compiled_jit():
    fn = jsa.scalify(lambda x: jnp.where(x > 0, x, 0.0))
    x = jsa.as_scaled_array(jnp.arange(4.0) - 1)
    fn(x)
    before = jsa.lax.rules_calls._jitted_body.cache_info().hits
    fn(x)
    assert jsa.lax.rules_calls._jitted_body.cache_info().hits > before


def test_eager_calls_around_a_jitted_step_compile_it_once():
    """``jsa.scalify(jax.jit(step))`` called without an outer jit: the step count and a learning
    rate passed as a JAX array change at every call and must not be baked into the jitted body
    (each call compiled it again: 15 s per step of an NNX transformer under ``nnx.jit``)."""
    tx = optax.adam(1e-2)

    def step(w, opt_state, lr, x):
        grads = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, jax.tree.map(lambda u: lr * u, updates)), opt_state

    scaled_step, plain_step = jsa.scalify(jax.jit(step)), jax.jit(step)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
    w = jnp.ones((16, 16)) / 4
    state = {"scaled": (jsa.as_scaled_array(w), tx.init(jsa.as_scaled_array(w))), "plain": (w, tx.init(w))}

    def call(lr):
        state["scaled"] = scaled_step(*state["scaled"], jnp.asarray(lr), x)
        state["plain"] = plain_step(*state["plain"], jnp.asarray(lr), x)
        return state["scaled"]

    counts = count_xla_compiles([functools.partial(call, lr) for lr in (1.0, 0.9, 0.8, 0.7)])
    assert counts[1:] == [0, 0, 0], counts
    np.testing.assert_allclose(np.asarray(state["scaled"][0].to_array()), np.asarray(state["plain"][0]), rtol=1e-5)


def test_jit_body_bakes_constant_scales():
    """A ScaledArray with a constant scale passes only its data into a jitted call."""
    inner = jax.jit(lambda v: v * 2.0)
    static = jsa.RescalePolicy.static()

    def fn(data):  # the scale is a trace-time constant of the traced function
        return jsa.scalify(lambda v: inner(v), policy=static)(jsa.ScaledArray(data, np.float32(4.0)))

    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert len(eqn.invars) == 1
    np.testing.assert_allclose(np.asarray(fn(jnp.ones(3)).to_array()), np.full(3, 8.0))


def test_a_constant_scale_leaves_a_jitted_call_as_a_constant():
    """A result whose scale is known inside the jitted body keeps it known after the call: the
    scale arithmetic that follows folds in Python (``jnp.take`` and ``jnp.where`` are jitted
    calls in every model) and the call returns its data alone."""
    inner = jax.jit(lambda v: v * 2.0)
    static = jsa.RescalePolicy.static()

    def fn(data):  # the scale is a trace-time constant of the traced function
        return jsa.scalify(lambda v: inner(v) + v, policy=static)(jsa.ScaledArray(data, np.float32(4.0)))

    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert len(eqn.outvars) == 1  # the data alone
    assert all(np.ndim(v.aval) > 0 for e in jaxpr.eqns for v in e.outvars)  # no scalar scale arithmetic
    np.testing.assert_allclose(np.asarray(fn(jnp.ones(3)).to_array()), np.full(3, 12.0))


def test_a_baked_scale_keeps_the_facts_of_its_value():
    value = jsa.ScaledArray(jnp.ones(3), np.float32(2.0)).marked(sparse=True, rescaled=True)
    leaves, treedef = jax.tree_util.tree_flatten(rules_calls._BakedScale(value))
    assert len(leaves) == 1  # the data; the scale is in the treedef
    back = jax.tree_util.tree_unflatten(treedef, leaves).value
    assert back.facts == value.facts and isinstance(back.scale, np.ndarray) and back.scale == 2.0


def test_closed_call_is_emitted_by_the_case():
    assert "closed_call" in str(
        jax.make_jaxpr(jax.grad(lambda x: jnp.sum(_remat_scan(x))))(np.ones((4, 3), np.float32))
    )


def test_call_rules_are_exported():
    assert "scaled_closed_call" in rules_calls.__all__


def _loop_in_a_nested_jit():
    inner = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, h: h * 3.0, x))
    return lambda x: inner(x)


def test_a_nested_jit_is_evaluated_under_the_policy_of_its_caller():
    # The scaled body of a jitted call is cached per sub-jaxpr: the policy (here: whether the
    # loop carry is rescaled) must be part of that cache, or the second policy reuses the first's.
    x = jsa.as_scaled_array(jnp.ones(8))
    shared = _loop_in_a_nested_jit()
    default_first = jsa.scalify(shared)(x)
    static_after = jsa.scalify(shared, policy=jsa.RescalePolicy.static())(x)
    static_alone = jsa.scalify(_loop_in_a_nested_jit(), policy=jsa.RescalePolicy.static())(x)
    assert float(static_after.scale) == float(static_alone.scale) == 256.0  # 3 = 4 * 0.75, four times
    assert float(default_first.scale) == 64.0  # the carry rescaled to its RMS, 81
    np.testing.assert_allclose(static_after.to_array(), 81.0)
