"""The rescale policy of ``scalify``: where it rescales by itself, and that values never change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from jax_scalify.core import sites
from jax_scalify.policy import analyses
from tests.invariance import exact_value, scaled, value_at_scale

STATIC = jsa.RescalePolicy.static()
RNG = np.random.default_rng(0)
W = RNG.standard_normal((3, 8, 8)).astype(np.float32) / np.sqrt(8)
X = RNG.standard_normal((4, 8)).astype(np.float32)


def data_rms(x: jsa.ScaledArray) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x.data, np.float64)))))


def mlp_loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


def sgd_step(ws, x):
    loss, grads = jax.value_and_grad(mlp_loss)(ws, x)
    return loss, grads, ws - 0.1 * grads


# --- the policy object -----------------------------------------------------------------------
def test_default_and_static_presets():
    default = jsa.RescalePolicy()
    assert default.gradients and default.loop_carries and default.outputs and default.norm == "l2"
    assert not default.is_static
    assert default.contractions and default.self_products and default.fp8_casts
    assert STATIC.is_static and not (
        STATIC.gradients
        or STATIC.loop_carries
        or STATIC.outputs
        or STATIC.contractions
        or STATIC.self_products
        or STATIC.fp8_casts
    )
    assert jsa.RescalePolicy is jsa.policy.RescalePolicy


def test_bad_policy_arguments_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="norm must be one of"):
        jsa.RescalePolicy(norm="l3")
    with pytest.raises(TypeError, match="True or False"):
        jsa.RescalePolicy(outputs=1)
    with pytest.raises(TypeError, match="jsa.RescalePolicy"):
        jsa.scalify(jnp.sin, policy="static")
    with pytest.raises(TypeError, match="expects a function"):
        jsa.scalify(STATIC)


def test_scalify_as_a_decorator_with_a_policy():
    @jsa.scalify(policy=STATIC)
    def double(x):
        return x * 2.0

    out = double(scaled(X[0], 3))
    assert float(out.scale) == 2.0**4  # static: the multiplication rule's scale, no rescale
    np.testing.assert_array_equal(exact_value(out), 2 * X[0] * 2.0**3)


# --- outputs ---------------------------------------------------------------------------------
def test_static_policy_keeps_the_rule_scale_and_default_rescales_outputs():
    x, w = scaled(X, 5), scaled(W[0], -2)
    static = jsa.scalify(jnp.matmul, policy=STATIC)(x, w)
    default = jsa.scalify(jnp.matmul)(x, w)
    assert float(static.scale) == 2.0**4  # the matmul rule: 2**5 * 2**-2 * pow2(sqrt(8)), a function of input scales
    np.testing.assert_array_equal(exact_value(static), exact_value(default))
    assert 1.0 <= data_rms(default) < 2.0  # RMS rounded down to a power of two moved into the scale


@pytest.mark.parametrize("norm, stat", [("max", np.max), ("l1", np.mean)])
def test_policy_norm_selects_the_statistic(norm, stat):
    out = jsa.scalify(lambda a: a * 3.0, policy=jsa.RescalePolicy(norm=norm))(scaled(X, 7))
    assert 1.0 <= float(stat(np.abs(np.asarray(out.data)))) < 2.0
    np.testing.assert_allclose(exact_value(out), 3 * X * 2.0**7, rtol=1e-6)


def test_integer_and_any_scale_outputs_are_left_alone():
    def fn(x):
        return jnp.argmax(x, axis=-1), jnp.zeros_like(x)

    idx, zeros = jsa.scalify(fn)(scaled(X, 4))
    assert not isinstance(idx, jsa.ScaledArray)
    assert jsa.extend.is_any_scale(zeros) or not isinstance(zeros, jsa.ScaledArray) or float(zeros.scale) in (0.0, 1.0)


# --- self products ---------------------------------------------------------------------------
DECAYS = RNG.uniform(0.9, 0.999, (8,)).astype(np.float32)  # an LRU-style decay per channel
INPUTS = RNG.standard_normal((256, 8)).astype(np.float32)


def linear_recurrence(decays, inputs):
    """``h[t] = a * h[t-1] + x[t]`` as a parallel scan (S5, LRU, Mamba), and the decays' running products."""
    a = jnp.broadcast_to(decays, inputs.shape)
    return jax.lax.associative_scan(
        lambda left, right: (left[0] * right[0], right[0] * left[1] + right[1]), (a, inputs), axis=0
    )


@pytest.mark.slow  # 10-20 s of compilation; test_only_products_of_operands_sharing_a_scale_are_rescaled runs by default
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_parallel_scan_of_products_stays_finite_from_the_recipe_state(jit):
    """``as_scaled_array`` gives decays in (0.9, 1) data in [1.8, 2) and scale 1/2; the scan
    squares slices of one array at each of its 8 levels, so statically the running products'
    data reach 2**237 (inf) and, traced, their scale 2**-256 (0): NaN where plain float32 is
    finite. Rescaling the products of operands sharing one scale keeps them exact."""
    fn = jsa.scalify(jax.value_and_grad(lambda a, x: jnp.mean(linear_recurrence(a, x)[1] ** 2)))
    fn = jax.jit(fn) if jit else fn
    value, grad = fn(jsa.as_scaled_array(DECAYS), jsa.as_scaled_array(INPUTS))
    expected_value, expected_grad = jax.value_and_grad(lambda a, x: jnp.mean(linear_recurrence(a, x)[1] ** 2))(
        DECAYS, INPUTS
    )
    np.testing.assert_allclose(np.asarray(jsa.asarray(value)), expected_value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jsa.asarray(grad)), expected_grad, rtol=1e-4)
    products = jsa.scalify(jax.jit(linear_recurrence))(jsa.as_scaled_array(DECAYS), jsa.as_scaled_array(INPUTS))[0]
    np.testing.assert_allclose(
        np.asarray(jsa.asarray(products)), np.cumprod(np.broadcast_to(DECAYS, INPUTS.shape), 0), rtol=1e-4
    )


SELF_PRODUCTS_ONLY = jsa.RescalePolicy(gradients=False, loop_carries=False, outputs=False)


def test_running_products_of_selective_decays_stay_finite_in_float16():
    """Mamba's decays ``exp(dt * A)`` with ``dt * A`` spread over orders of magnitude are mostly
    near 0 and a few near 1: each level of the parallel scan squares how far the largest entries
    stand above the RMS, and rescaled from a sample of their RMS, a product of two overflowed
    float16 (NaN in a Mamba-style LM at step 32). Computed in float32 and narrowed with the
    largest entry bounded, the running products follow float32."""
    rng = np.random.default_rng(3)
    decays = np.exp(-(10.0 ** rng.uniform(-3, 1.5, (64, 512)))).astype(np.float32)
    inputs = rng.standard_normal((64, 512)).astype(np.float32)

    def scan(a, x):
        return jax.lax.associative_scan(lambda lo, hi: (lo[0] * hi[0], hi[0] * lo[1] + hi[1]), (a, x), axis=0)

    recipe = lambda t: jsa.tree.astype(jsa.as_scaled_array(t), jnp.float16)  # noqa: E731
    products, states = jax.jit(jsa.scalify(scan))(recipe(decays), recipe(inputs))
    expected_products, expected_states = scan(decays, inputs)
    products, states = np.asarray(jsa.asarray(products), np.float32), np.asarray(jsa.asarray(states), np.float32)
    assert np.isfinite(products).all() and np.isfinite(states).all()
    np.testing.assert_allclose(products, expected_products, rtol=0, atol=2e-3)
    np.testing.assert_allclose(states, expected_states, rtol=0, atol=2e-2 * np.abs(expected_states).max())


def test_only_products_of_operands_sharing_a_scale_are_rescaled():
    x, w = scaled(8 * X, -6), scaled(8 * X[:, ::-1], -6)  # data RMS 8: a square's is about 110
    square = jsa.scalify(lambda x: x * x, policy=SELF_PRODUCTS_ONLY)(x)
    assert float(square.scale) >= 2.0**-6 and 1 <= data_rms(square) < 2  # its RMS moved into the scale
    independent = jsa.scalify(lambda x, w: x * w, policy=SELF_PRODUCTS_ONLY)(x, w)
    assert float(independent.scale) == 2.0**-12  # the static product of the two scales
    static = jsa.scalify(lambda x: x * x, policy=STATIC)(x)
    assert float(static.scale) == 2.0**-12
    np.testing.assert_array_equal(exact_value(square), exact_value(static))


def test_the_cube_of_float16_data_far_from_unit_size_does_not_overflow():
    """Data of RMS 48 under one scale (a departure of 2**5.6, as a parallel-scan state reaches
    under static scales) cube to inf in float16 (the tanh GELU's ``x ** 3``); the policy
    rescales the base first. A square is computed in float32 and keeps the static scale
    ``s**2`` unless its largest entry would overflow float16, which raises it."""
    x = jsa.ScaledArray(jnp.asarray(48 * X, jnp.float16), jnp.float32(2.0**-6))
    cube = lambda policy: jsa.scalify(lambda x: x**3, policy=policy)(x)  # noqa: E731
    assert not np.all(np.isfinite(np.asarray(cube(STATIC).data, np.float32)))
    got = np.asarray(cube(SELF_PRODUCTS_ONLY).to_array(jnp.float32), np.float64)
    np.testing.assert_allclose(got, exact_value(x) ** 3, rtol=4e-3, atol=1e-6)
    for policy in (STATIC, SELF_PRODUCTS_ONLY):
        square = jsa.scalify(lambda x: x**2, policy=policy)(x)
        assert float(square.scale) in (2.0**-12, 2.0**-11)
        got = np.asarray(square.to_array(jnp.float32), np.float64)
        np.testing.assert_allclose(got, exact_value(x) ** 2, rtol=1e-3, atol=1e-6)


def newton_schulz(x, steps=5):
    """Muon's quintic Newton-Schulz orthogonalisation, as its reference code writes it."""
    x = x / (jnp.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x


@pytest.mark.parametrize("exponent", [-12, 0, 8, 12])
def test_iterated_gram_products_of_data_far_from_unit_size_stay_invariant(exponent):
    """Data of RMS 1e-2 * 2**-exponent: each ``x @ x.T`` squared the departure and summed 32
    such squares, so the static scales left float32 after three iterations (NaN). The
    operands of a contraction with itself are rescaled first."""
    g = 1e-2 * RNG.standard_normal((16, 32)).astype(np.float32)
    expected = np.asarray(jax.jit(newton_schulz)(g))
    got = jax.jit(jsa.scalify(newton_schulz))(value_at_scale(g, exponent))
    np.testing.assert_allclose(np.asarray(got.to_array()), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    static = jax.jit(jsa.scalify(newton_schulz, policy=STATIC))(value_at_scale(g, exponent))
    assert not np.all(np.isfinite(np.asarray(static.to_array())))  # what the rescale prevents


def test_a_hand_written_muon_trains_in_float16_with_the_recipe():
    """A user's Muon (momentum, then Newton-Schulz on it) wrapped by ``scale_state``: the FP16
    recipe follows float32 (it was NaN from the second step)."""

    def muon(lr):
        def update(grads, momentum, params=None):
            momentum = jax.tree.map(lambda m, g: 0.95 * m + g, momentum, grads)
            return jax.tree.map(lambda m: -lr * newton_schulz(m), momentum), momentum

        return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def train(tx, params, x, y, scalify):
        def step(p, s, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            u, s = tx.update(g, s, p)
            return loss, optax.apply_updates(p, u), s

        step = jax.jit(jsa.scalify(step) if scalify else step)
        state = tx.init(params)
        for _ in range(5):
            loss, params, state = step(params, state, x, y)
        return float(loss)

    params = {"w1": jnp.asarray(W[0] / 2), "w2": jnp.asarray(W[1, :, :4])}
    x = jnp.asarray(RNG.standard_normal((32, 8)), jnp.float32)
    y = jnp.sin(x[:, :4])
    expected = train(muon(0.02), params, x, y, scalify=False)
    fp16 = lambda tree: jsa.tree.astype(jsa.as_scaled_array(tree), jnp.float16)  # noqa: E731
    got = train(jsa.optim.scale_state(muon(0.02), jnp.float16), fp16(params), fp16(x), y, scalify=True)
    assert got == pytest.approx(expected, rel=2e-3)


def test_float32_gelu_layers_sharing_a_weight_at_a_drifted_scale_stay_invariant():
    """The weight's scale 2**8 off its data compounds through three layers (data 2**-26) and
    the cube of the tanh GELU takes it to 2**-78: the derivative then underflowed the data
    and overflowed the scale (NaN). The cube's base is rescaled in float32 too."""
    w, x = W[0] / 2, X[:, :8]

    def loss(w, x):
        for _ in range(3):
            x = jax.nn.gelu(x @ w)
        return jnp.mean(x**2)

    grad = jax.grad(loss)
    expected = np.asarray(grad(w, x))
    got = jax.jit(jsa.scalify(grad))(jsa.ScaledArray(w / 2**8, np.float32(2**8)), jsa.as_scaled_array(x))
    np.testing.assert_allclose(np.asarray(got.to_array()), expected, rtol=1e-5, atol=1e-7 * np.abs(expected).max())


def test_an_operand_rescaled_by_a_rule_is_read_rescaled_by_later_equations():
    """The tanh GELU's derivative multiplies ``x`` three times (``x * 3 * x ** 2``) and the
    cotangent: float16 data of RMS 16 for both overflowed (an Equinox conv autoencoder, NaN
    at step 5), though the cube itself had its base rescaled. The later uses of ``x`` now
    read that rescaled base."""
    x, ct = 16 * RNG.standard_normal((2, 64, 64))
    x = jsa.ScaledArray(jnp.asarray(x, jnp.float16), jnp.float32(2.0**-4))
    ct = jsa.ScaledArray(jnp.asarray(ct, jnp.float16), jnp.float32(2.0**-4))
    grad = jax.grad(lambda x, ct: jnp.sum(jax.nn.gelu(x) * ct))
    got = np.asarray(jsa.scalify(grad, policy=SELF_PRODUCTS_ONLY)(x, ct).to_array(jnp.float32))
    expected = grad(exact_value(x).astype(np.float32), exact_value(ct).astype(np.float32))
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-3 * np.max(np.abs(expected)))


# --- gradients -------------------------------------------------------------------------------
def test_a_backward_sum_keeps_the_operand_that_holds_the_value():
    """The tanh GELU's derivative adds ``ct * cdf`` (the value) to a term at the scale of
    ``x ** 3`` whose data are near 0 where tanh saturates: at that static scale the first
    operand was flushed in float16, and the gradient at inputs of a few hundred or more was 0
    instead of 1. The backward sum is now taken in float32 and rescaled from its result."""
    x = 3000 * RNG.standard_normal(1024).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))
    expected = np.asarray(grad(x))
    scaled_x = jsa.tree.astype(jsa.as_scaled_array(x), jnp.float16)
    got = np.asarray(jax.jit(jsa.scalify(grad))(scaled_x).to_array(jnp.float32))
    large = np.abs(x) > 64  # entries far below the tensor's RMS lose their precision in its float16 data
    assert large.sum() > 900
    np.testing.assert_allclose(got[large], expected[large], atol=1e-3)


def test_backward_sums_of_a_transposed_loop_are_unit_scaled():
    """A transposed ``fori_loop`` starts the cotangents of its carries at zero, with scale 0 at
    run time: taken as the smaller operand scale, that 0 put the first sum at ``2**-60`` of the
    other operand's scale, beyond the range of one statistic, and left its float16 data at
    ``2**10`` (a deep-equilibrium model's products then overflowed)."""
    w = jnp.asarray(0.3 * W[0])
    y = jnp.asarray(RNG.standard_normal((256, 8)), jnp.float32)

    def loss(w, y):
        def body(i, carry):
            total, t = carry
            t = t @ w
            return total + t, t

        total, _ = jax.lax.fori_loop(0, 4, body, (y, y))
        return jnp.sum(total) * 1e-3

    fp16 = lambda x: jsa.tree.astype(jsa.as_scaled_array(x), jnp.float16)  # noqa: E731
    report = jsa.analysis.record_scales(jax.grad(loss), fp16(w), fp16(y))
    sums = [r for r in report.records if r.op == "add_any"]
    assert len(sums) >= 4
    assert max(r.log2_rms_data for r in sums) < 2
    got = jax.jit(jsa.scalify(jax.grad(loss)))(fp16(w), fp16(y))
    expected = np.asarray(jax.grad(loss)(w, y))
    np.testing.assert_allclose(
        np.asarray(got.to_array(jnp.float32)), expected, rtol=0, atol=3e-3 * np.abs(expected).max()
    )


def deq_loss(params, x, y):
    """A deep-equilibrium layer ``z = tanh(z @ W + x @ U + b)`` through ``jax.lax.custom_root``.

    Fixed-point iterations find ``z``; the tangent solve sums a Neumann series, so reverse
    mode runs a transposed ``fori_loop`` whose cotangent carry grows in any row where the
    layer's Jacobian is not contracting.
    """
    injected = x @ params["U"] + params["b"]
    residual = lambda z: jnp.tanh(z @ params["W"] + injected) - z  # noqa: E731

    def fixed_point(f, z0):
        return jax.lax.fori_loop(0, 30, lambda i, z: f(z) + z, z0)

    def neumann_solve(g, rhs):
        def term(i, carry):
            total, t = carry
            t = g(t) + t
            return total + t, t

        return -jax.lax.fori_loop(0, 30, term, (rhs, rhs))[0]

    z = jax.lax.custom_root(residual, jnp.zeros_like(injected), fixed_point, neumann_solve)
    return jnp.mean((z @ params["head"] - y[:, None]) ** 2)


@pytest.mark.slow
def test_a_deep_equilibrium_layer_trains_in_float16():
    """At step 128 one batch row's Neumann series diverged (x1.6 per term) while the others
    decayed; each backward sum of the transposed loop was rescaled from all its data, then
    the loop-carry rescale re-estimated it from a sample that read none of that row's
    entries, moved its data 2**10 up, and it overflowed (NaN at step 129). A carry that a
    rule has just rescaled is not rescaled again."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "W": jax.random.normal(keys[0], (32, 32)) * 0.3 / np.sqrt(32),
        "U": jax.random.normal(keys[1], (8, 32)) / np.sqrt(8),
        "b": jnp.zeros(32),
        "head": jax.random.normal(keys[2], (32, 1)) / np.sqrt(32),
    }
    rng, direction = np.random.default_rng(1), np.random.default_rng(3).standard_normal(8).astype(np.float32)
    batches = []
    for _ in range(160):
        x = rng.standard_normal((256, 8)).astype(np.float32)
        batches.append((x, np.sin(x @ direction) + 0.1 * rng.standard_normal(256).astype(np.float32)))

    def train(tx, params, fp16):
        def step(params, state, x, y):
            loss, grads = jax.value_and_grad(deq_loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return loss, optax.apply_updates(params, updates), state

        step = jax.jit(jsa.scalify(step) if fp16 else step)
        to16 = lambda t: jsa.tree.astype(jsa.as_scaled_array(t), jnp.float16)  # noqa: E731
        params = to16(params) if fp16 else params
        state, losses = tx.init(params), []
        for x, y in batches:
            loss, params, state = step(params, state, to16(jnp.asarray(x)) if fp16 else x, y)
            losses.append(float(loss))
        return np.asarray(losses)

    # The float32 run starts from the weights the float16 run starts from (rounded to float16):
    # from the float32 ones, float32 itself ends 1-2% away at step 99 (measured).
    rounded = jax.tree.map(lambda w: w.astype(jnp.float16).astype(jnp.float32), params)
    expected = train(optax.adam(3e-3), rounded, fp16=False)
    got = train(jsa.optim.scale_state(optax.adam(3e-3), jnp.float16), params, fp16=True)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:100], expected[:100], rtol=2e-2)


def test_the_backward_pass_of_a_jvp_rescales_the_forward_values_it_multiplies():
    """A Jacobian penalty differentiates a ``jvp``: its backward pass multiplies the cotangent
    by ``x``, the tangent, ``exp(-x**2 / 2)`` and ``2 * x`` in a row (the exact GELU's second
    derivative), and each static product added its factor's departure from unit size. Float16
    data 2**3 to 2**6 off, as a two-layer MLP's tangent path leaves them, overflowed (NaN
    from the second step of training). Each forward value a backward product reads is
    rescaled once."""
    gelu = lambda z: jax.nn.gelu(z, approximate=False)  # noqa: E731

    def tangent_dot(x, t, c):
        return jnp.sum(c * jax.jvp(gelu, (x,), (t,))[1])

    x, t, c = (RNG.standard_normal((128, 64)).astype(np.float32) for _ in range(3))
    values = (x, 0.25 * t, 2.0**-14 * c)
    drifted = [
        jsa.ScaledArray(jnp.asarray(v / 2.0**-k, jnp.float16), np.float32(2.0**-k)) for v, k in zip(values, (3, 5, 20))
    ]
    expected = np.asarray(jax.grad(tangent_dot)(*values))
    got = jax.jit(jsa.scalify(jax.grad(tangent_dot)))(*drifted)
    np.testing.assert_allclose(
        np.asarray(got.to_array(jnp.float32)), expected, rtol=0, atol=1e-2 * np.abs(expected).max()
    )
    static = jax.jit(jsa.scalify(jax.grad(tangent_dot), policy=STATIC))(*drifted)
    assert not np.all(np.isfinite(np.asarray(static.to_array(jnp.float32))))


@pytest.mark.slow
def test_a_jacobian_norm_penalty_through_four_gelu_layers_trains_in_float16():
    """The README recipe on a classifier whose loss adds ``mean(|J v|**2)`` from ``jax.jvp``:
    the tanh GELU's derivative squares its input in the tangent path, and float16 tangents
    that drift 2**8 from unit size squared to inf (step 35) before squares were computed
    in float32 and narrowed within range."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    sizes = [(20, 64), (64, 64), (64, 64), (64, 64), (64, 5)]
    params = [
        {"w": rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0]), "b": np.zeros(s[1], np.float32)} for s in sizes
    ]
    mix = rng.standard_normal((20, 5)).astype(np.float32)

    def net(params, x):
        for layer in params[:-1]:
            x = jax.nn.gelu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def loss_fn(params, x, y, v):
        logits, jv = jax.jvp(lambda x: net(params, x), (x,), (v,))
        penalty = jnp.mean(jnp.sum(jv**2, axis=-1))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + 0.1 * penalty

    def batch(i):
        r = np.random.default_rng(100 + i)
        x = r.standard_normal((128, 20)).astype(np.float32)
        v = r.standard_normal((128, 20)).astype(np.float32)
        return x, np.argmax(np.tanh(x) @ mix, -1), v / np.linalg.norm(v, axis=1, keepdims=True)

    def train(tx, params, as_input):
        def step(p, o, x, y, v):
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y, v)
            updates, o = tx.update(grads, o, p)
            return loss, optax.apply_updates(p, updates), o

        step = jax.jit(jsa.scalify(step)) if as_input else jax.jit(step)
        opt_state, losses = tx.init(params), []
        for i in range(60):
            x, y, v = batch(i)
            if as_input:
                x, v = as_input(x), as_input(v)
            loss, params, opt_state = step(params, opt_state, x, y, v)
            losses.append(float(loss))
        return np.array(losses)

    expected = train(optax.adam(1e-3), params, None)
    half = lambda t: jsa.tree.astype(jsa.as_scaled_array(jax.tree.map(jnp.asarray, t)), jnp.float16)  # noqa: E731
    got = train(jsa.optim.scale_state(optax.adam(1e-3), jnp.float16), half(params), half)
    assert np.all(np.isfinite(got))
    assert abs(got[-10:].mean() / expected[-10:].mean() - 1) < 0.01, (got[-10:].mean(), expected[-10:].mean())


def test_fp8_casts_of_activations_that_outgrow_their_static_scale_are_rescaled():
    """Positive, correlated ReLU activations add up like ``K`` where the static rule expects
    ``sqrt(K)``: their data grew 2**4 per layer (20, 383, 7672) and the fourth E4M3 cast was
    NaN in every entry (``float8_e4m3fn`` has no inf), while plain FP8 casts of the same
    values (at most 1.2) are finite. Under ``fp8_casts`` each cast is rescaled from all its
    data, its largest entry bounded. (The ``contractions`` component, rescaling each layer's
    result, also keeps them finite; without either, the casts overflow.)"""
    k = 256
    x = np.maximum(RNG.standard_normal((32, k)), 0).astype(np.float32)
    ws = [((0.5 * RNG.standard_normal((k, k)) + 0.85) / (0.68 * k)).astype(np.float32) for _ in range(4)]

    def net(x, ws):
        for w in ws:
            x = jax.nn.relu(jsa.nn.linear(x, w, fwd_dtype=jnp.float8_e4m3fn, bwd_dtype=jnp.float8_e5m2))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    expected = jax.value_and_grad(net, argnums=1)(x, ws)
    inputs = (
        jsa.tree.astype(jsa.as_scaled_array(x), jnp.float16),
        [jsa.ScaledArray(jnp.asarray(w * 2.0**8, jnp.float16), np.float32(2.0**-8)) for w in ws],
    )
    loss, grads = jax.jit(jsa.scalify(jax.value_and_grad(net, argnums=1)))(*inputs)
    np.testing.assert_allclose(float(loss), float(expected[0]), rtol=0.1)
    for got, want in zip(grads, expected[1]):
        got = np.asarray(got.to_array(jnp.float32))
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=0, atol=0.15 * np.abs(want).max())
    no_guard = jax.jit(jsa.scalify(net, policy=jsa.RescalePolicy(fp8_casts=False, contractions=False)))(*inputs)
    assert not np.isfinite(float(no_guard.to_array(jnp.float32)))


def chain_loss(x, ws):
    h = x
    for w in ws:
        h = h @ w
    return jnp.mean((x + h) ** 2)


def test_a_chain_of_layers_with_weights_far_from_unit_data_stays_invariant_in_float32():
    """Seven chained layers, a residual and the mean of a square (an RMSNorm's statistic),
    each weight given at scale ``2**8`` (data ``2**-11``): a static contraction keeps its
    operands' departure from unit size, the data sank to ``2**-77`` and the square underflowed
    float32 (loss NaN). Each forward contraction is rescaled from its result (``contractions``)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    ws = [(rng.standard_normal((64, 64)) / 8).astype(np.float32) for _ in range(7)]
    expected = jax.jit(jax.value_and_grad(chain_loss, argnums=1))(x, ws)
    grad = jax.jit(jsa.scalify(jax.value_and_grad(chain_loss, argnums=1)))
    loss, grads = grad(x, [scaled(w * 2.0**-8, 8) for w in ws])
    np.testing.assert_allclose(exact_value(loss), expected[0], rtol=1e-5)
    for got, want in zip(grads, expected[1]):
        np.testing.assert_allclose(exact_value(got), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    without = jax.jit(jsa.scalify(chain_loss, policy=jsa.RescalePolicy(contractions=False)))
    with np.errstate(invalid="ignore"):  # its data 0 at scale inf
        assert not np.isfinite(exact_value(without(x, [scaled(w * 2.0**-8, 8) for w in ws])))


def test_products_of_projections_with_correlated_terms_do_not_overflow_float16():
    """``x @ w`` with positive inputs and weights of positive mean sums ``K = 1024`` same-sign
    terms: value about 1, but the static scale assumes ``sqrt(K)`` growth, so its data are
    ``2**5`` too large; the product of three such projections overflowed float16 (inf where
    plain float16 gives 0.998)."""
    rng = np.random.default_rng(2)
    x = 1 + 0.1 * rng.standard_normal((32, 1024))
    ws = [(1 + 0.1 * rng.standard_normal((1024, 16))) / 1024 for _ in range(3)]

    def loss(x, ws):
        a, b, c = (x @ w for w in ws)
        return jnp.mean(a * b * c)

    def recipe(tree):
        return jsa.tree.astype(jsa.as_scaled_array(jax.tree.map(np.float32, tree)), jnp.float16)

    expected = loss(np.float32(x), [np.float32(w) for w in ws])
    got = jax.jit(jsa.scalify(loss))(recipe(x), recipe(ws))
    np.testing.assert_allclose(exact_value(got), expected, rtol=2e-3)
    without = jax.jit(jsa.scalify(loss, policy=jsa.RescalePolicy(contractions=False)))(recipe(x), recipe(ws))
    assert not np.isfinite(exact_value(without))


def test_contractions_of_the_backward_pass_and_of_constants_stay_static(monkeypatch):
    calls = []
    real = sites.rescale_by_policy
    monkeypatch.setattr(sites, "rescale_by_policy", lambda x, *a: calls.append(x.shape) or real(x, *a))
    only_contractions = jsa.RescalePolicy(
        gradients=False, loop_carries=False, outputs=False, self_products=False, fp8_casts=False
    )
    jax.jit(jsa.scalify(jax.grad(mlp_loss), policy=only_contractions))(scaled(W, 0), scaled(X, 0))
    assert calls == [(4, 8)] * 3  # the three forward x @ w, none of the backward ones
    calls.clear()
    jsa.scalify(lambda w: jnp.ones((4, 8)) @ w, policy=only_contractions)(scaled(W[0], 0))
    assert calls == [(4, 8)]  # traced weight: rescaled
    calls.clear()
    jsa.scalify(lambda: jnp.ones((4, 8)) @ W[0], policy=only_contractions)()
    assert calls == []


def test_a_zero_cotangent_through_deep_gelu_layers_keeps_a_finite_scale():
    """A zero-initialised output layer sends an all-zero cotangent back; each GELU multiplied
    its static scale by that of ``x ** 2`` (``2**20`` for activations near ``2**10``), inf
    after ten layers and NaN gradients under scalify where plain JAX gives zeros."""
    rng = np.random.default_rng(1)
    ws = [jnp.asarray(rng.standard_normal((32, 32)) * np.sqrt(2 / 32), jnp.float32) for _ in range(10)]
    head = jnp.zeros((32, 4))

    def loss(ws, head, x):
        h = jax.nn.relu(x @ ws[0])
        for w in ws[1:]:
            h = h + jax.nn.gelu(h @ w)
        return jnp.mean((h @ head) ** 2)

    x = jnp.asarray(30 * rng.standard_normal((16, 32)), jnp.float32)
    scaled = jsa.tree.astype(jsa.as_scaled_array((ws, head, x)), jnp.float16)
    grads = jax.jit(jsa.scalify(jax.grad(loss)))(*scaled)
    for g in grads:
        assert np.all(np.asarray(g.to_array(jnp.float32)) == 0) and np.isfinite(float(g.scale))


def test_float32_adam_through_deep_gelu_layers_with_a_zero_initialised_head_is_invariant():
    """A 12-block residual GELU MLP without normalisation, inputs of unit RMS, float32: the
    head's zero cotangent took the ``x ** 3`` scale of every GELU (``2**76`` at the first
    layer's gradient); Adam's first moment kept it, and at the next step the first real
    gradient added to that moment was flushed (the update dropped), then NaN. Backward sums
    in float32 are taken at the smaller operand scale and rescaled from their result too."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(2)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((32, 32)) / np.sqrt(32), jnp.float32) for i in range(12)}
    params["head"] = jnp.zeros((32, 10), jnp.float32)
    x, y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32), jnp.arange(32) % 10

    def loss(p, x, y):
        h = jax.nn.relu(x @ p["w0"])
        for i in range(1, 12):
            h = h + jax.nn.gelu(h @ p[f"w{i}"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()

    tx = optax.adam(1e-3)

    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return value, optax.apply_updates(p, updates), s

    plain, scalified = jax.jit(step), jax.jit(jsa.scalify(step))
    state, scaled_state = (params, tx.init(params)), jsa.as_scaled_array((params, tx.init(params)))
    for _ in range(3):
        expected = plain(*state, x, y)
        got = scalified(*scaled_state, jsa.as_scaled_array(x), y)
        for g, e in zip(jax.tree.leaves(jsa.asarray(got)), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4 * np.abs(e).max())
        state, scaled_state = expected[1:], got[1:]


def test_bfloat16_backward_sums_keep_their_dtype():
    """A backward sum is taken in float32; bfloat16 has float32's range (nothing to guard when
    narrowing) but its data must come back as bfloat16: the product rule of ``tanh(x * w) * x``
    returned float32 data from ``add_any`` (an error on every bfloat16 step with a GELU, a
    residual or a weight used twice)."""
    f = lambda x, w: jnp.sum(jnp.tanh(x * w) * x)  # noqa: E731
    x, w = np.linspace(0.1, 1.0, 8, dtype=np.float32), np.linspace(-1.0, 2.0, 8, dtype=np.float32)
    scaled_inputs = jsa.tree.astype(jsa.as_scaled_array((jnp.asarray(x), jnp.asarray(w))), jnp.bfloat16)
    got = jax.jit(jsa.scalify(jax.grad(f, argnums=(0, 1))))(*scaled_inputs)
    for g, e in zip(got, jax.grad(f, argnums=(0, 1))(x, w)):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g.to_array(jnp.float32)), e, rtol=3e-2, atol=1e-2)


def test_gradient_boundary_is_the_values_leaving_the_backward_pass():
    closed = jax.make_jaxpr(sgd_step)(W, X)
    boundary = analyses.gradient_boundary(closed.jaxpr)
    loss, grads, _ = closed.jaxpr.outvars
    assert grads in boundary and loss not in boundary
    definers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    assert all("transpose(" in str(definers[v].source_info.name_stack) for v in boundary)
    assert len(boundary) == 1  # the gradient, used by the update and returned; nothing inside the backward pass


def test_gradients_read_only_as_values_are_not_at_the_boundary():
    """A gradient only ``stop_scaling`` reads (an optimizer widening it to float32) is not rescaled:
    its split between data and scale does not change the value read; one also used otherwise is."""
    loss = lambda w: jnp.sum(jnp.tanh(X @ w) ** 2)  # noqa: E731
    read = jax.make_jaxpr(lambda w: jsa.lax.stop_scaling(jax.grad(loss)(w), jnp.float32))(W).jaxpr
    assert analyses.gradient_boundary(read) == frozenset()
    both = jax.make_jaxpr(lambda w: (jsa.lax.stop_scaling(g := jax.grad(loss)(w), jnp.float32), g * 2))(W).jaxpr
    assert len(analyses.gradient_boundary(both)) == 1
    w16 = jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(W)), jnp.float16)
    got = jsa.scalify(jax.jit(lambda w: jsa.lax.stop_scaling(jax.grad(loss)(w), jnp.float32)))(w16)
    np.testing.assert_allclose(
        np.asarray(got), jax.grad(loss)(jnp.asarray(w16.to_array(jnp.float32))), rtol=2e-2, atol=1e-4
    )


def test_gradients_are_rescaled_once_in_one_batch_after_the_backward_pass(monkeypatch):
    batches = []
    original = sites.rescale_scaled_arrays
    monkeypatch.setattr(
        sites,
        "rescale_scaled_arrays",
        lambda xs, *a, **k: batches.append([x.shape for x in xs]) or original(xs, *a, **k),
    )
    ws, x = scaled(W * 2.0**-8, 8), scaled(X * 2.0**8, -8)

    def relu_loss(ws, x):  # no sum in its backward pass: every gradient comes out of a matmul
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.sum(x**2)

    def step(ws, x):
        loss, (gw, gx) = jax.value_and_grad(relu_loss, argnums=(0, 1))(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, gw)], x - 0.1 * gx

    layers = [scaled(w * 2.0**-8, 8) for w in W]
    jsa.scalify(step, policy=jsa.RescalePolicy(loop_carries=False, outputs=False, contractions=False))(layers, x)
    assert [sorted(b) for b in batches] == [
        sorted([W.shape[1:]] * 3 + [X.shape])
    ]  # all gradients, together, before the update uses them
    batches.clear()
    _, grads, _ = jsa.scalify(sgd_step)(ws, x)
    # The stacked weights' gradient is the last of the backward sums (an add_any, rescaled from
    # its result: the value carries that mark), so it is not rescaled again after the backward
    # pass; then the returned loss and new weights (the gradients not a second time).
    assert batches[-1] == [(), W.shape]
    assert [W.shape] not in batches and [(), W.shape] not in batches[:-1]
    assert 0.5 <= data_rms(grads) < 2.0


def test_outputs_rescaled_with_the_policys_statistic_and_cast_are_not_rescaled_again(monkeypatch):
    """A state stored as ``scale_state`` stores it (rescaled with the policy's statistic, then
    narrowed) leaves the step as it is; another statistic (``max``) is still followed by the policy's."""
    from jax_scalify.ops import rescaling

    batches = []
    original = sites.rescale_scaled_arrays
    for module in (sites, rescaling):  # the policy's sites and jsa.ops.dynamic_rescale
        monkeypatch.setattr(
            module,
            "rescale_scaled_arrays",
            lambda xs, *a, **k: batches.append([x.shape for x in xs]) or original(xs, *a, **k),
        )
    x = scaled(X * 2.0**-8, 8)
    stored = jsa.scalify(lambda x: jsa.ops.dynamic_rescale(2 * x, "l2").astype(jnp.float16))(x)
    assert batches == [[X.shape]]  # the rescale of the function; none by the policy's outputs
    assert stored.dtype == jnp.float16 and 0.5 <= data_rms(stored) < 2.0
    batches.clear()
    jsa.scalify(lambda x: jsa.ops.dynamic_rescale(2 * x, "max").astype(jnp.float16))(x)
    assert batches == [[X.shape], [X.shape]]


def test_gradient_scales_follow_the_values_with_inputs_off_by_2_pow_8():
    ws, x = scaled(W * 2.0**-8, 8), scaled(X * 2.0**8, -8)
    _, static_grads, _ = jsa.scalify(sgd_step, policy=STATIC)(ws, x)
    _, grads, new_ws = jsa.scalify(sgd_step)(ws, x)
    np.testing.assert_array_equal(exact_value(grads), exact_value(static_grads))
    assert data_rms(static_grads) < 2.0**-6  # the static estimate is far above the value
    assert 0.5 <= data_rms(grads) < 2.0 and 0.5 <= data_rms(new_ws) < 2.0
    expected = jax.jit(sgd_step)(W, X)
    np.testing.assert_allclose(exact_value(new_ws), expected[2], rtol=1e-5, atol=1e-6)


def test_manual_rescales_compose_with_the_default_policy():
    def step(ws, x):
        loss, grads = jax.value_and_grad(lambda w, a: mlp_loss(w, jsa.ops.dynamic_rescale_l2_grad(a)))(ws, x)
        return loss, jsa.ops.dynamic_rescale_max(grads)

    ws, x = scaled(W * 2.0**-3, 3), scaled(X * 2.0**-2, 2)
    loss, grads = jsa.scalify(step)(ws, x)
    exp_loss, exp_grads = jax.jit(step)(W, X)
    np.testing.assert_allclose(exact_value(grads), exp_grads, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(exact_value(loss), exp_loss, rtol=1e-6)


def test_a_float16_sum_of_same_signed_terms_in_the_backward_pass_does_not_overflow():
    """The gradient of a broadcast parameter sums its per-row contributions: 1,024 terms of data
    4,000 share a sign, so the sum is 32 times what the static ``sqrt(K)`` scale expects and
    overflows float16 data (inf under the static policy). Summed in float32 and rescaled from
    its result, it is exact. (Found as the decay gradient of a parallel-scan recurrence,
    1,024 terms: NaN at the second step of an FP16 LRU. A static ``K`` scale instead pushed
    a GPT's uncorrelated backward sums down to data of ``2**-16``.)"""
    bias = jsa.tree.astype(jsa.as_scaled_array(jnp.ones(64)), jnp.float16)
    terms = jsa.ScaledArray(jnp.full((1024, 64), 4000.0, jnp.float16), jnp.float32(1.0))

    def grad_of_bias(policy):
        grad = jax.grad(lambda b, c: jnp.sum((jnp.broadcast_to(b, c.shape) * c).astype(jnp.float32)))
        return jax.jit(jsa.scalify(grad, policy=policy))(bias, terms).to_array(jnp.float32)  # 4e6: beyond float16

    np.testing.assert_array_equal(np.asarray(grad_of_bias(jsa.RescalePolicy())), 1024 * 4000.0)
    assert not np.any(np.isfinite(np.asarray(grad_of_bias(STATIC))))


def test_policy_is_active_only_while_scalify_evaluates():
    seen = []
    with jsa.extend.observe_equations(lambda *_: seen.append(sites.active_policy())):
        jsa.scalify(lambda a: a * 2.0, policy=jsa.RescalePolicy(norm="max"))(scaled(X, 1))
    assert seen and all(p.norm == "max" for p in seen)
    assert sites.active_policy().is_static


@pytest.mark.parametrize("policy", [STATIC, jsa.RescalePolicy()], ids=["static", "default"])
def test_float32_invariance_holds_under_every_policy(policy):
    ws, x = scaled(W * 2.0**-8, 8), scaled(X * 2.0**8, -8)
    got = jax.jit(jsa.scalify(sgd_step, policy=policy))(ws, x)
    expected = jax.jit(sgd_step)(W, X)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(exact_value(g), e, rtol=1e-5, atol=1e-7)


def test_a_plain_cotangent_entering_the_backward_pass_is_promoted_with_its_statistic():
    """Cross-entropy with one-hot labels: the mean's 1/1024 enters the backward pass in a plain array.

    The default policy promotes it with its statistic as scale, so the weight gradient's
    data is unit-sized inside the backward pass; the static policy keeps it at scale 1.
    """
    rng = np.random.default_rng(0)
    w = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float16))
    x = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(1024, 64)), jnp.float16))
    labels = jnp.asarray(rng.integers(0, 32, 1024))

    def loss(w, x, labels):
        logits = (x @ w).astype(jnp.float32)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 32), -1))

    def weight_gradient_data(policy):
        # The recorder runs the jitted program: the backward equations of nested jits
        # (jax.nn.one_hot, log_softmax) lose their transpose( name stack, and the
        # interpreter still knows they are part of the backward pass.
        with jsa.analysis.ScaleRecorder() as recorder:
            jsa.scalify(jax.grad(loss), policy=policy)(w, x, labels)
        (record,) = [r for r in recorder.report(None).select("backward", op="dot_general")]
        return record.log2_rms_data

    assert -2 < weight_gradient_data(jsa.RescalePolicy()) < 2
    assert weight_gradient_data(STATIC) < -8


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_square_x_times_x_of_float16_data_far_from_unit_size_is_finite(jit):
    """Float16 data of about 300 (values 300 * 2**-20, as a quotient left them in odeint's step
    size estimate): the data product overflowed before the product was rescaled, and the sum of
    squares was inf where plain float32 gives 5.4e-6."""
    values = np.linspace(200.0, 400.0, 60, dtype=np.float32)
    x = jsa.ScaledArray(jnp.asarray(values, jnp.float16), jnp.float32(2.0**-20))
    sum_of_squares = lambda x: jnp.sum(x * x)
    fn = jsa.scalify(sum_of_squares)
    out = (jax.jit(fn) if jit else fn)(x)
    expected = np.sum(np.square(values.astype(np.float64) * 2.0**-20))
    np.testing.assert_allclose(float(out), expected, rtol=2e-3)


@pytest.mark.slow  # for time: an adaptive solver's whole adjoint; the other self-product tests run by default
def test_neural_ode_gradient_in_float16_follows_float32():
    """``jax.experimental.ode.odeint`` (adaptive steps, adjoint gradients) of a small MLP in float16:
    the step-size estimate squares the flattened adjoint state (``x * x``), whose few large entries
    the statistic's sample missed; its gradients were NaN."""
    from jax.experimental.ode import odeint

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(keys[0], (2, 32)) * 0.5,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(keys[1], (32, 32)) / np.sqrt(32),
        "b2": jnp.zeros(32),
        "w3": jax.random.normal(keys[2], (32, 2)) * 0.1,
    }

    def dynamics(y, t, p):
        h = jnp.tanh((y**3) @ p["w1"] + p["b1"])
        return jnp.tanh(h @ p["w2"] + p["b2"]) @ p["w3"]

    ts, y0 = jnp.linspace(0.0, 2.0, 16), jnp.array([2.0, 0.0])
    target = odeint(lambda y, t: (y**3) @ jnp.array([[-0.1, 2.0], [-2.0, -0.1]]), y0, ts)
    loss = lambda p, y0, ts, target: jnp.mean(jnp.abs(odeint(dynamics, y0, ts, p, rtol=1e-3, atol=1e-4) - target))
    expected = jax.grad(loss)(params, y0, ts, target)
    scaled_args = jsa.tree.astype(jsa.as_scaled_array((params, y0, ts, target)), jnp.float16)
    grads = jax.jit(jsa.scalify(jax.grad(loss)))(*scaled_args)
    for name, g in expected.items():
        got = np.asarray(grads[name].to_array(jnp.float32))
        assert np.isfinite(got).all(), name
        # Float16 rounding moves the adaptive solver's accepted steps: over seeds 4-11 of this
        # model the worst leaf is 0.2% to 1.3% of its largest entry off float32's gradient.
        np.testing.assert_allclose(got, np.asarray(g), atol=2e-2 * float(np.max(np.abs(g))))


@pytest.mark.parametrize("position", [0, 31, 63])
def test_a_gradient_with_one_large_entry_is_right_in_float16_wherever_the_entry_is(position):
    """``grad(sum(x * x))`` with 63 entries of about 1e-3 and one of 5e3: float16 holds the 1e4
    gradient entry. The gradient's statistic reads a tensor of at most ``sample_size`` entries
    whole; a strided sample (every other entry) missed an entry at an odd index, moved the
    data to the small entries' size and the large one to inf. (One scale for both sizes puts
    the small entries among float16's subnormals: 0.7% off, where plain float16 is exact.)"""
    values = np.full(64, 1e-3, np.float32)
    values[position] = 5e3
    x = jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(values)), jnp.float16)
    grads = jax.jit(jsa.scalify(jax.grad(lambda x: jnp.sum(x * x))))(x)
    got = np.asarray(grads.to_array(jnp.float32))
    np.testing.assert_allclose(got, 2 * np.asarray(jnp.asarray(values, jnp.float16), np.float32), rtol=1e-2)
