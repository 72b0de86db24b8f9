"""The scalify transform: tracing, composition with JAX transforms, promotion of constants."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import primitives

import jax_scalify as jsa
from jax_scalify.core import registry
from tests.invariance import STATIC_POLICY, assert_pow2_scales

X = np.array([1.0, -2.0, 3.0, 0.5], np.float32)


def scaled(x, scale):
    return jsa.as_scaled_array(np.asarray(x, np.float32), scale=np.float32(scale))


def f(x, y):
    return {"sum": x + y, "prod": x * y, "pair": (jnp.sin(x), y)}


def test_pytrees_in_and_out_and_kwargs():
    x, y = scaled(X, 4.0), scaled(X, 0.5)
    out = jsa.scalify(f)(x, y=y)
    assert set(out) == {"sum", "prod", "pair"}
    expected = f(X, X)
    for got, exp in zip(jax.tree.leaves(jsa.asarray(out)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, exp, rtol=1e-6)
    assert_pow2_scales(out)


def test_plain_inputs_stay_plain():
    out = jsa.scalify(lambda a, b: a * b + 1)(jnp.asarray(X), jnp.asarray(X))
    assert not isinstance(out, jsa.ScaledArray)


def test_plain_inputs_stay_plain_through_a_backward_pass_that_casts_to_float16():
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))

    def loss(w):
        return jnp.sum((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32) ** 2)

    grad = jsa.scalify(jax.grad(loss))(w)
    assert not isinstance(grad, jsa.ScaledArray)
    np.testing.assert_array_equal(grad, jax.grad(loss)(w))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda fn: jax.jit(jsa.scalify(fn, policy=STATIC_POLICY)),
        lambda fn: jsa.scalify(jax.jit(fn), policy=STATIC_POLICY),
        lambda fn: jax.jit(jsa.scalify(jax.jit(fn), policy=STATIC_POLICY)),
        lambda fn: jsa.scalify(jsa.scalify(fn, policy=STATIC_POLICY), policy=STATIC_POLICY),
    ],
    ids=["jit_outside", "jit_inside", "jit_both", "idempotent"],
)
def test_composes_with_jit_and_itself(wrap):
    out = wrap(f)(scaled(X, 4.0), scaled(X, 0.25))
    np.testing.assert_allclose(out["prod"].to_array(), X * X, rtol=1e-6)
    assert float(out["prod"].scale) == 1.0


def test_jit_inside_stays_a_jitted_call():
    jaxpr = jax.make_jaxpr(jsa.scalify(jax.jit(f), policy=STATIC_POLICY))(scaled(X, 4.0), scaled(X, 0.25))
    calls = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "jit"]
    assert len(calls) == 1 and calls[0].params["name"] == "f"
    others = [eqn for eqn in jaxpr.eqns if eqn.primitive.name != "jit"]  # the check of the traced scales
    assert all(v.aval.size <= 2 for eqn in others for v in eqn.outvars), others


def test_scalify_is_idempotent_object():
    once = jsa.scalify(f)
    assert jsa.scalify(once) is once


@pytest.mark.parametrize("transform", [jax.grad, jax.jacrev, jax.hessian, jax.vmap, jax.checkpoint])
def test_a_transformation_of_a_scalified_function_is_scalified_again(transform):
    """JAX's transformations copy the attributes of the function they wrap: scalify must not
    take ``transform(scalify(f))`` for a function it returned and leave it unscalified."""

    def loss(w):
        return jnp.sum(jnp.tanh(w) ** 2)

    w = np.random.default_rng(0).standard_normal(5).astype(np.float32)
    got = jsa.scalify(transform(jsa.scalify(loss)))(scaled(w, 2.0**-6))
    np.testing.assert_allclose(jsa.asarray(got), transform(loss)(w), rtol=2e-5, atol=1e-7)


def test_nested_scalify_call_inside_traced_code():
    inner = jsa.scalify(lambda a: a * 2)
    out = jsa.scalify(lambda a: inner(a) + a)(scaled(X, 8.0))
    np.testing.assert_allclose(out.to_array(), 3 * X)


def test_grad_vjp_vmap_inside():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    xs = np.random.default_rng(1).standard_normal((5, 2, 4)).astype(np.float32)

    def program(w, xs):
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs)
        _, vjp = jax.vjp(lambda w: loss(w, xs[0]), w)
        return grads, vjp(jnp.float32(1.0))[0]

    expected = program(w, xs)
    got = jsa.scalify(program)(scaled(w, 2.0**-10), scaled(xs, 2.0**12))
    for g, e in zip(jax.tree.leaves(jsa.asarray(got)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=1e-6 * np.abs(e).max())


def test_zero_constant_takes_any_scale_across_jit_boundaries():
    # jnp.where is jitted and receives the literal 0.0 as an argument.
    x = jsa.ScaledArray(jnp.asarray(X, jnp.float16), jnp.float32(2.0**-40))
    out = jsa.scalify(lambda a: jnp.where(a > 0, a, 0.0))(x)
    assert float(out.scale) == 2.0**-40
    np.testing.assert_array_equal(out.to_array(jnp.float32), np.where(X > 0, X, 0) * 2.0**-40)
    relu = jsa.scalify(jax.nn.relu)(x)
    assert float(relu.scale) == 2.0**-40


def test_scalar_constants_fold_into_the_scale():
    out = jsa.scalify(lambda a: a * 3.0)(scaled(X, 1.0))  # 3 = 0.75 * 2**2, the nearest power of two
    assert float(out.scale) == 4.0
    np.testing.assert_array_equal(out.data, X * 0.75)
    out = jsa.scalify(lambda a: a * 0.999)(scaled(X, 1.0))  # a decay rate keeps the scale
    assert float(out.scale) == 1.0
    out = jsa.scalify(lambda a: a / jnp.full(a.shape, 8.0))(scaled(X, 1.0))
    assert float(out.scale) == 0.125
    np.testing.assert_array_equal(out.data, X)


@pytest.mark.parametrize("lr, expected_scale", [(1e-3, 2.0**-10), (3e-3, 2.0**-8), (0.0, 0.0), (np.inf, 1.0)])
def test_traced_scalars_are_split_at_run_time(lr, expected_scale):
    """A learning rate known only at run time carries its magnitude into the scale."""
    fn = jax.jit(jsa.scalify(lambda a, lr: a * lr))
    out = fn(scaled(X, 1.0), np.float32(lr))
    assert float(out.scale) == expected_scale
    np.testing.assert_array_equal(out.to_array(), X * np.float32(lr))


def _first_optax_step(opt):
    """A weight of RMS ~0.75 * 2**-6 and the same weight after one scalified ``opt`` step on itself.

    The RMS is away from a power of two, so the default policy's sampled statistic of the
    returned weight rounds to the same power of two as the whole weight's.
    """
    w = jsa.as_scaled_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) * 0.75 * 2**-6)

    @jax.jit
    @jsa.scalify
    def step(w, state):
        updates, state = opt.update(w, state, w)
        return optax.apply_updates(w, updates), state

    return w, step(w, opt.init(w.to_array()))[0]


def test_scheduled_learning_rate_keeps_the_weight_scale():
    """``w + (-lr * u)`` with a scheduled ``lr`` keeps ``w``'s scale (regression: it became 1)."""
    w, new_w = _first_optax_step(optax.sgd(optax.linear_schedule(1e-4, 1e-3, 10)))
    assert float(new_w.scale) == float(w.scale) <= 2.0**-6
    np.testing.assert_allclose(new_w.to_array(), w.to_array() * (1 - 1e-4), rtol=1e-6)


def test_zero_learning_rate_keeps_the_weight_scale():
    """A warmup schedule starts at lr = 0: the zero update must not move the weights' scale."""
    w, new_w = _first_optax_step(optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)))
    assert float(new_w.scale) == float(w.scale)
    np.testing.assert_array_equal(new_w.to_array(), w.to_array())


def test_static_arguments_are_baked_in():
    out = jsa.scalify(lambda a, dtype: a.astype(dtype), policy=STATIC_POLICY)(scaled(X, 2.0), jnp.float16)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0


def test_jaxpr_of_scalified_function_is_reusable_under_jit():
    fn = jax.jit(jsa.scalify(lambda a, b: a @ b, policy=STATIC_POLICY))
    a = scaled(np.ones((4, 16)), 2.0)
    b = scaled(np.ones((16, 2)), 0.5)
    out = fn(a, b)
    assert float(out.scale) == 4.0  # 2 * 0.5 * pow2(sqrt(16))
    np.testing.assert_array_equal(out.to_array(), np.full((4, 2), 16.0))


# --- the missing-rule error names the user's line, also under jax.jit -----------------------
def _unruled_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("unruled_for_location_test")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x, multiple_results=False))
    return prim


UNRULED = _unruled_primitive()


def user_step(x):
    return UNRULED.bind(x * 2.0)


@pytest.mark.parametrize(
    "wrap",
    [
        jsa.scalify,
        lambda f: jax.jit(jsa.scalify(f)),
        lambda f: jsa.scalify(jax.jit(f)),
        lambda f: jax.jit(jsa.scalify(jax.jit(f))),
    ],
    ids=["eager", "jit(scalify)", "scalify(jit)", "jit(scalify(jit))"],
)
def test_missing_rule_error_names_the_user_line_under_jit(wrap):
    with pytest.raises(NotImplementedError, match=r"from:   .*test_interpreter.py:\d+ \(user_step\)"):
        wrap(user_step)(scaled(X, 2.0))


def test_missing_rule_in_a_jitted_library_function_names_the_call_site():
    """A jitted function with no user frame inside (here the primitive's own bind) points at the caller."""
    with pytest.raises(NotImplementedError) as info:
        jsa.scalify(jax.jit(UNRULED.bind))(scaled(X, 2.0))
    (line,) = [ln for ln in str(info.value).splitlines() if ln.strip().startswith("from:")]
    assert "test_interpreter.py" in line and "test_missing_rule_in_a_jitted_library_function" in line
    assert "jax_scalify" not in line.replace("test_interpreter", "")


def test_missing_rule_in_a_library_function_names_the_user_line_that_called_it(restore_registry):
    """``jnp.fft.rfft`` is a jitted JAX function: its ``fft`` equation has no user frame, the call has."""
    del registry._RULES[primitives.fft_p]  # its rule removed for the test

    def spectrum_loss(x):
        return jnp.sum(jnp.abs(jnp.fft.rfft(x)))  # the line the error names

    with pytest.raises(NotImplementedError) as info:
        jax.jit(jsa.scalify(spectrum_loss))(scaled(X, 2.0))
    (line,) = [ln for ln in str(info.value).splitlines() if ln.strip().startswith("from:")]
    assert "test_interpreter.py" in line and "spectrum_loss)" in line, line


def test_a_loss_gradient_seed_keeps_its_constant_factors_in_the_scale():
    """``jax.grad``'s seed times the mean's ``1/N`` and a loss weight is a known constant.

    It is computed from literals (plain values), and reaches the scaled backward pass where
    it meets the first scaled residual: known exactly, it is split into a power-of-two scale
    there, instead of entering float16 data as ``7e-9`` (zero in float16).
    """
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float16)
    h = jnp.asarray(rng.normal(size=(8, 16)), jnp.float16)

    def loss(w, h):
        h = h + jnp.tanh(h @ w)
        return jnp.mean(jnp.square(h.astype(jnp.float32))) * 1e-6

    expected = jax.grad(loss)(w.astype(jnp.float32), h.astype(jnp.float32))
    plain = np.asarray(jax.grad(loss)(w, h), np.float32)
    assert np.mean(plain == 0) > 0.8  # plain float16: most entries flushed to zero
    got = jax.jit(jsa.scalify(jax.grad(loss)))(jsa.as_scaled_array(w), jsa.as_scaled_array(h))
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(got.to_array(jnp.float32)),
        np.asarray(expected),
        rtol=0.05,
        atol=1e-3 * float(jnp.max(jnp.abs(expected))),
    )


@pytest.mark.parametrize(
    "fn, error",
    [
        (lambda x: x if x[0] > 0 else -x, jax.errors.TracerBoolConversionError),
        (lambda x: x * int(x[0]), jax.errors.ConcretizationTypeError),
        (lambda x: x[x > 0], jax.errors.NonConcreteBooleanIndexError),
    ],
    ids=["if", "int", "bool_index"],
)
def test_value_dependent_python_in_eager_scalify_is_explained(fn, error):
    """Plain eager JAX runs `if x[0] > 0`; eager scalify traces, and JAX's error pointed into the interpreter."""
    x = jsa.as_scaled_array(jnp.array([1.0, 2.0, 3.0]))
    fn(x.to_array())  # plain eager JAX runs it
    with pytest.raises(error, match=r"traces the function to a jaxpr, as jax.jit does, also when it is called eagerly"):
        jsa.scalify(fn)(x)
    with pytest.raises(error, match="also when it is called eagerly") as info:  # nested: explained once
        jsa.scalify(lambda x: jsa.scalify(fn)(x))(x)
    assert isinstance(info.value.__cause__, error) and "traces the function" not in str(info.value.__cause__)


def test_vmap_of_a_scalified_function_forms_documented_in_pytrees_md():
    """docs/pytrees.md: jax.vmap(jsa.scalify(f))(x) fails in JAX itself; these forms run."""
    x = jsa.as_scaled_array(jnp.arange(1.0, 7.0).reshape(2, 3))
    want = np.sin(np.arange(1.0, 7.0).reshape(2, 3)) * 2

    def f(v):
        return jnp.sin(v) * 2

    with pytest.raises(ValueError, match="rank should be at least 1"):
        jax.vmap(jsa.scalify(f))(x)
    np.testing.assert_allclose(jsa.scalify(jax.vmap(f))(x).to_array(), want, rtol=1e-6)
    axes = jax.tree.unflatten(jax.tree.structure(x), [0, None])
    y = jax.vmap(jsa.scalify(f), in_axes=(axes,))(x)  # a scale per example (the output rescale is mapped)
    np.testing.assert_allclose(np.asarray(y.data) * np.asarray(y.scale)[:, None], want, rtol=1e-6)
