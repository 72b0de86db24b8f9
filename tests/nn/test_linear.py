"""jsa.nn.linear: x @ w + b with FP8 E4M3 forward and E5M2 backward formats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import Case, assert_pow2_scales, invariance_test, normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8 = {"fwd_dtype": E4M3, "bwd_dtype": E5M2}

INVARIANCE_CASES = [
    Case("nn_linear", nn.linear, [normal(4, 6), normal(6, 6), normal(6)], grad=True),
    Case("nn_linear_batched", lambda x, w: nn.linear(x, w), [normal(2, 3, 4), normal(4, 6)], grad=True),
]

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 6)).astype(np.float32)
W = (RNG.standard_normal((6, 6)) / 4).astype(np.float32)
B = RNG.standard_normal(6).astype(np.float32)
G = RNG.standard_normal((4, 6)).astype(np.float32)  # output cotangent


def all_eqns(jaxpr):
    """The equations of ``jaxpr`` and of its sub-jaxprs (e.g. the custom_vjp_call's body)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(getattr(sub, "jaxpr", sub))


def q(x, dtype):
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=2)


def test_without_casts_is_a_plain_matmul():
    np.testing.assert_allclose(nn.linear(X, W, B), X @ W + B, rtol=1e-6, atol=1e-6)
    grads = jax.grad(lambda x, w, b: jnp.sum(nn.linear(x, w, b) * G), argnums=(0, 1, 2))(X, W, B)
    expected = jax.grad(lambda x, w, b: jnp.sum((x @ w + b) * G), argnums=(0, 1, 2))(X, W, B)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(nn.linear, in_axes=(0, None))(X, W), X @ W, rtol=1e-6, atol=1e-6)


def test_fp8_forward_and_backward_values():
    y = nn.linear(X, W, B, **FP8)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, q(X, E4M3) @ q(W, E4M3) + B, rtol=1e-5, atol=1e-5)
    gx, gw, gb = jax.grad(lambda x, w, b: jnp.sum(nn.linear(x, w, b, **FP8) * G), argnums=(0, 1, 2))(X, W, B)
    assert gx.dtype == gw.dtype == gb.dtype == np.float32
    np.testing.assert_allclose(gx, q(G, E5M2) @ q(W, E4M3).T, rtol=1e-5, atol=1e-5)
    # The weight gradient is accumulated in float32 and not rounded to E4M3.
    np.testing.assert_allclose(gw, q(X, E4M3).T @ q(G, E5M2), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(gw, q(gw, E4M3))
    np.testing.assert_allclose(gb, G.sum(0), rtol=1e-6)


def test_both_casts_are_in_the_jaxpr_of_the_gradient():
    loss = lambda x, w: jnp.sum(nn.linear(x, w, **FP8) * G)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(X, W).jaxpr
    eqns = list(all_eqns(jaxpr))
    casts = [e.params["new_dtype"] for e in eqns if e.primitive.name == "convert_element_type"]
    assert E4M3 in casts and E5M2 in casts
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    in_dtypes = sorted(tuple(sorted(str(v.aval.dtype) for v in e.invars)) for e in dots)
    assert in_dtypes == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
        ("float8_e4m3fn", "float8_e5m2"),
    ]
    assert all(e.params["preferred_element_type"] == np.float32 for e in dots)


def test_preferred_element_type_and_dtypes():
    y = nn.linear(X.astype(jnp.bfloat16), W, preferred_element_type=jnp.bfloat16, fwd_dtype=E4M3)
    assert y.dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda x: nn.linear(x, W, fwd_dtype=E4M3, preferred_element_type=jnp.bfloat16))(X)
    dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert [e.params["preferred_element_type"] for e in dots] == [jnp.bfloat16]
    gw = jax.grad(lambda w: jnp.sum(nn.linear(X.astype(jnp.float16), w, **FP8).astype(jnp.float32)))(W)
    assert gw.dtype == np.float32


def test_under_scalify_fp8_matmul_on_scaled_data():
    x = jsa.ScaledArray(jnp.asarray(X * 2**20), jnp.float32(2.0**-20))  # data far outside E4M3's range
    w = jsa.as_scaled_array(jnp.asarray(W * 2.0**-30))
    layer = lambda x, w: nn.linear(x, w, **FP8)  # noqa: E731
    out = jsa.scalify(layer, policy=jsa.RescalePolicy(fp8_casts=False))(x, w)  # the casts act on the data
    assert_pow2_scales(out)
    expected = q(X * 2**20, E4M3) * 2.0**-20 @ (np.asarray(w.data.astype(E4M3), np.float32) * float(w.scale))
    np.testing.assert_allclose(out.to_array(), expected, rtol=1e-5, atol=1e-5 * np.max(np.abs(expected)))
    rescaled = jsa.scalify(layer)(x, w)  # fp8_casts: on the data rescaled to unit RMS first
    exact = X @ (W * 2.0**-30)
    np.testing.assert_allclose(rescaled.to_array(), exact, rtol=0, atol=0.1 * np.max(np.abs(exact)))


def _mlp(params, x, **kwargs):
    h = nn.gelu(nn.linear(x, params["w1"], params["b1"], **kwargs))
    return nn.linear(h, params["w2"], params["b2"], **kwargs)


def test_fp8_mlp_trains_under_scalify():
    rng = np.random.default_rng(1)
    teacher = rng.standard_normal((16, 4)).astype(np.float32) / 4
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = np.tanh(x @ teacher)
    params = {
        "w1": rng.standard_normal((16, 32)) / 4,
        "b1": np.zeros(32),
        "w2": rng.standard_normal((32, 4)) / np.sqrt(32),
        "b2": np.zeros(4),
    }
    params = jsa.tree.astype(jsa.as_scaled_array(jax.tree.map(jnp.float32, params)), jnp.float16)

    def step(params, x, y):
        loss_fn = lambda p: jnp.mean(jnp.square(_mlp(p, x, **FP8).astype(jnp.float32) - y))  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jsa.ops.dynamic_rescale_l2(grads)
        return loss, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    step = jax.jit(jsa.scalify(step))
    xs, ys = jsa.as_scaled_array((jnp.asarray(x, jnp.float16), jnp.asarray(y, jnp.float16)))
    losses = []
    for _ in range(30):
        loss, params = step(params, xs, ys)
        losses.append(float(loss.to_array(jnp.float32)))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"x of shape \(..., K\) and w of shape \(K, N\)"):
        nn.linear(X, W[:3])
    with pytest.raises(TypeError, match="fwd_dtype must be a floating dtype"):
        nn.linear(X, W, fwd_dtype=jnp.int8)


def test_the_e5m2_cast_of_a_mean_loss_gradient_sees_unit_data_in_a_jitted_step():
    """A mean over 4,096 rows puts ``1/4096`` into the loss's cotangent, a plain array.

    The default policy promotes it with its statistic where it enters the backward pass,
    also inside the nested jits of a jitted step (``log_softmax``, ``one_hot``), so the
    output gradient reaches the E5M2 cast near unit size (at scale 1 its data would sit
    near 2^-13, and a larger batch would flush it to zero).
    """
    rng = np.random.default_rng(1)
    x = jsa.as_scaled_array(jnp.asarray(rng.standard_normal((4096, 64)), jnp.float16))
    w = jsa.as_scaled_array(jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float16))
    labels = jnp.asarray(rng.integers(0, 32, 4096))

    def loss(w, x, labels):
        logits = nn.linear(x, w, **FP8).astype(jnp.float32)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 32), -1))

    with jsa.analysis.ScaleRecorder() as recorder:
        jsa.scalify(jax.grad(loss))(w, x, labels)
    casts = [r for r in recorder.report(None).select("backward", op="convert_element_type") if r.dtype == "float8_e5m2"]
    assert casts
    for cast in casts:
        assert -3 < cast.log2_rms_data < 3 and cast.frac_underflow < 0.01
