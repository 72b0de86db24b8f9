"""jsa.nn.dot_general / cast_dot_general: lax.dot_general with FP8 E4M3 operands and E5M2 gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import Case, assert_pow2_scales, invariance_test, normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8 = {"fwd_dtype": E4M3, "bwd_dtype": E5M2}
F32 = {"fwd_dtype": jnp.float32, "bwd_dtype": jnp.float32}

# (name, lhs shape, rhs shape, dimension numbers)
DIMS = [
    ("dense", (2, 3, 4), (4, 5), (((2,), (0,)), ((), ()))),
    ("bqd,bkd->bqk", (2, 3, 4), (2, 5, 4), (((2,), (2,)), ((0,), (0,)))),
    ("km,kn->mn", (6, 3), (6, 5), (((0,), (0,)), ((), ()))),
    # A batch axis in the middle of lhs, two contracting axes listed out of order on both sides.
    ("mixed", (4, 3, 5, 2), (5, 2, 6, 3), (((3, 1), (1, 3)), ((2,), (0,)))),
    # Two batch axes, listed out of order on lhs; free axes before the batch axes on rhs.
    ("two_batch", (3, 4, 2, 5), (6, 2, 5, 3), (((3,), (2,)), ((2, 0), (1, 3)))),
]

INVARIANCE_CASES = [
    Case(
        "nn_dot_general_batched",
        lambda a, b: nn.dot_general(a, b, DIMS[1][3], **F32),
        [normal(2, 3, 4), normal(2, 5, 4)],
        grad=True,
    ),
    Case(
        "nn_dot_general_mixed",
        lambda a, b: nn.dot_general(a, b, DIMS[3][3], **F32),
        [normal(4, 3, 5, 2), normal(5, 2, 6, 3)],
        grad=True,
    ),
]

test_invariance = invariance_test(INVARIANCE_CASES, max_examples=2)


def q(x, dtype):
    """``x`` rounded to ``dtype``, as float32."""
    return jnp.asarray(x).astype(dtype).astype(jnp.float32)


def operands(lhs_shape, rhs_shape, dims, seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal(lhs_shape).astype(np.float32)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    g = rng.standard_normal(jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs).shape)
    return lhs, rhs, g.astype(np.float32)


@pytest.mark.parametrize("name, lhs_shape, rhs_shape, dims", DIMS, ids=[d[0] for d in DIMS])
def test_values_and_gradients_match_the_cast_reference(name, lhs_shape, rhs_shape, dims):
    """Forward on E4M3 operands; gradients are the plain dot_general's VJP on them with an E5M2 cotangent."""
    lhs, rhs, g = operands(lhs_shape, rhs_shape, dims)
    out, vjp = jax.vjp(lambda a, b: nn.dot_general(a, b, dims, **FP8), lhs, rhs)
    grad_lhs, grad_rhs = vjp(g)
    ref_out, ref_vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), q(lhs, E4M3), q(rhs, E4M3))
    ref_lhs, ref_rhs = ref_vjp(q(g, E5M2))
    assert out.dtype == grad_lhs.dtype == grad_rhs.dtype == np.float32
    assert out.shape == ref_out.shape and grad_lhs.shape == lhs.shape and grad_rhs.shape == rhs.shape
    for got, want in ((out, ref_out), (grad_lhs, ref_lhs), (grad_rhs, ref_rhs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The gradients are accumulated in float32, not rounded to the forward format.
    assert not np.array_equal(grad_rhs, q(grad_rhs, E4M3))


@pytest.mark.parametrize("name, lhs_shape, rhs_shape, dims", DIMS, ids=[d[0] for d in DIMS])
def test_without_casts_is_lax_dot_general(name, lhs_shape, rhs_shape, dims):
    lhs, rhs, g = operands(lhs_shape, rhs_shape, dims, seed=1)
    out, vjp = jax.vjp(lambda a, b: nn.dot_general(a, b, dims), lhs, rhs)
    ref_out, ref_vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs)
    for got, want in zip((out, *vjp(g)), (ref_out, *ref_vjp(g))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_every_matmul_has_fp8_operands():
    lhs, rhs, g = operands(*DIMS[3][1:])
    loss = lambda a, b: jnp.sum(nn.dot_general(a, b, DIMS[3][3], **FP8) * g)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    dots = []

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                collect(getattr(sub, "jaxpr", sub))

    collect(jaxpr.jaxpr)
    assert sorted(sorted(str(v.aval.dtype) for v in e.invars) for e in dots) == [
        ["float8_e4m3fn", "float8_e4m3fn"],
        ["float8_e4m3fn", "float8_e5m2"],
        ["float8_e4m3fn", "float8_e5m2"],
    ]
    assert all(e.params["preferred_element_type"] == np.float32 for e in dots)


def test_precision_preferred_element_type_and_output_dtype():
    dims = DIMS[1][3]
    lhs, rhs, _ = operands(*DIMS[1][1:])
    fp8 = nn.cast_dot_general()
    bf16 = fp8(lhs, rhs, dims, lax.Precision.HIGHEST, preferred_element_type=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda a, b: fp8(a, b, dims, lax.Precision.HIGHEST, jnp.bfloat16))(lhs, rhs)
    (dot,) = [e for e in jaxpr.eqns[0].params["call_jaxpr"].eqns if e.primitive.name == "dot_general"]
    assert dot.params["preferred_element_type"] == jnp.bfloat16
    assert dot.params["precision"] == (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    # Without preferred_element_type: lax.dot_general's output dtype, accumulated in float32.
    lhs16, rhs16 = lhs.astype(jnp.float16), rhs.astype(jnp.float16)
    half = fp8(lhs16, rhs16, dims)
    assert half.dtype == jnp.float16
    expected = fp8(lhs16.astype(np.float32), rhs16.astype(np.float32), dims).astype(jnp.float16)
    np.testing.assert_array_equal(half, expected)


def test_under_scalify_the_casts_act_on_the_data():
    dims = DIMS[1][3]
    lhs, rhs, _ = operands(*DIMS[1][1:])
    a = jsa.ScaledArray(jnp.asarray(lhs), jnp.float32(2.0**30))  # values far outside E4M3's range
    b = jsa.ScaledArray(jnp.asarray(rhs), jnp.float32(2.0**-40))
    matmul = lambda a, b: nn.dot_general(a, b, dims, **FP8)  # noqa: E731
    out = jsa.scalify(matmul, policy=jsa.RescalePolicy(fp8_casts=False))(a, b)
    assert_pow2_scales(out)
    expected = lax.dot_general(q(lhs, E4M3), q(rhs, E4M3), dims) * 2.0**-10
    np.testing.assert_allclose(out.to_array(), expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    # Under the default policy the casts read data rescaled to unit RMS (fp8_casts): E4M3 rounding.
    rescaled = jsa.scalify(matmul)(a, b)
    exact = lax.dot_general(lhs, rhs, dims) * 2.0**-10
    np.testing.assert_allclose(rescaled.to_array(), exact, rtol=0, atol=0.1 * float(jnp.max(jnp.abs(exact))))


def test_cast_dot_general_is_hashable_and_compares_by_formats():
    assert nn.cast_dot_general() == nn.cast_dot_general(E4M3, E5M2)
    assert hash(nn.cast_dot_general()) == hash(nn.cast_dot_general(E4M3, E5M2))
    assert nn.cast_dot_general() != nn.cast_dot_general(E4M3, E4M3)


def test_bad_arguments_raise():
    lhs, rhs, _ = operands(*DIMS[0][1:])
    with pytest.raises(TypeError, match="fwd_dtype must be a floating dtype"):
        nn.cast_dot_general(jnp.int8)
    with pytest.raises(TypeError, match="bwd_dtype must be a floating dtype"):
        nn.dot_general(lhs, rhs, DIMS[0][3], bwd_dtype="not a dtype")
    with pytest.raises(TypeError, match="preferred_element_type must be a floating dtype"):
        nn.dot_general(lhs, rhs, DIMS[0][3], preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="expects floating lhs and rhs"):
        nn.dot_general(lhs.astype(np.int32), rhs, DIMS[0][3], **FP8)
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        nn.dot_general(lhs, rhs, ((2,), (0,)), **FP8)


# --- Flax layers trained under scalify ---------------------------------------------------------
flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 3, 8)).astype(np.float32)
Y = np.tanh(np.einsum("btd,de->bte", X, RNG.standard_normal((8, 2)).astype(np.float32) / 2))
OPT = optax.adam(0.02)
STEPS = 20


class LinenModel(linen.Module):
    """Dense, a token-mixing DenseGeneral (two contracting axes), Dense: each on ``dot_general``."""

    dot_general: object = lax.dot_general

    @linen.compact
    def __call__(self, x):
        h = jsa.nn.gelu(linen.Dense(16, dot_general=self.dot_general)(x))
        h = linen.DenseGeneral((3, 16), axis=(-2, -1), dot_general=self.dot_general)(h)
        return linen.Dense(2, dot_general=self.dot_general)(jsa.nn.gelu(h))


class NNXModel(nnx.Module):
    """nnx.Linear, nnx.Einsum (its einsum_op on the FP8 dot_general), nnx.LinearGeneral."""

    def __init__(self, dot_general, rngs):
        einsum = functools.partial(jnp.einsum, _dot_general=dot_general)
        self.dense = nnx.Linear(8, 16, dot_general=dot_general, rngs=rngs)
        self.mix = nnx.Einsum("btd,dh->bth", (16, 16), (16,), einsum_op=einsum, rngs=rngs)
        self.out = nnx.LinearGeneral(16, 2, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        return self.out(jsa.nn.gelu(self.mix(jsa.nn.gelu(self.dense(x)))))


def mse(pred, y):
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y.astype(jnp.float32)))


def train(loss_fn, params, dtype=None):
    """``STEPS`` Adam steps: plain float32 when ``dtype`` is None, else scalified with ``dtype`` state.

    The scaled runs keep Adam's moments with ``jsa.optim.scale_state`` (updated in float32):
    plain float16 moments lose the squares of the smallest gradients and divide by 0.
    """
    tx = OPT if dtype is None else jsa.optim.scale_state(OPT, dtype)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    opt_state, x, y = tx.init(params), X, Y
    if dtype is None:
        fn = jax.jit(step)
    else:
        fn = jax.jit(jsa.scalify(step))
        params = jsa.tree.astype(jsa.as_scaled_array(params), dtype)
        x, y = jsa.tree.astype(jsa.as_scaled_array((X, Y)), dtype)
    losses = []
    for _ in range(STEPS):
        loss, params, opt_state = fn(params, opt_state, x, y)
        losses.append(float(jsa.asarray(loss, jnp.float32)))
    return losses


def check_fp8_training(make_loss, params):
    """Plain float32 vs scalified FP8 with float16 state, and float32 invariance of the wrapper."""
    fp32 = train(make_loss(lax.dot_general), params)
    fp8 = train(make_loss(nn.cast_dot_general()), params, jnp.float16)
    fp32_cast = train(make_loss(nn.cast_dot_general(jnp.float32, jnp.float32)), params, jnp.float32)
    np.testing.assert_allclose(fp32_cast, fp32, rtol=1e-4)
    assert np.all(np.isfinite(fp8)), fp8
    assert fp8[-1] < 0.3 * fp8[0], fp8
    assert abs(fp8[-1] - fp32[-1]) < 0.25 * fp32[-1] + 0.01, (fp8[-1], fp32[-1])
    return fp32, fp8


@pytest.mark.slow  # about 15 s of compiles on 2 cores; the NNX FP8 training stays in the default run
def test_linen_dense_and_dense_general_train_in_fp8():
    params = LinenModel().init(jax.random.PRNGKey(0), X)

    def make_loss(dot_general):
        model = LinenModel(dot_general)
        return lambda params, x, y: mse(model.apply(params, x), y)

    check_fp8_training(make_loss, params)


@pytest.mark.slow  # training run; FP8 training stays in the default run through tests/nn/test_linear.py
def test_nnx_linear_einsum_and_linear_general_train_in_fp8():
    graphdef, params = nnx.split(NNXModel(lax.dot_general, nnx.Rngs(0)))

    def make_loss(dot_general):
        graph, _ = nnx.split(NNXModel(dot_general, nnx.Rngs(0)))
        return lambda params, x, y: mse(nnx.merge(graph, params)(x), y)

    check_fp8_training(make_loss, params)


# --- Equinox: eqx.nn.Linear has no dot_general hook; a small module and eqx.tree_at ------------
eqx = pytest.importorskip("equinox")


class CastLinear(eqx.Module):
    """``eqx.nn.Linear``'s computation (``weight[out, in] @ x[in] + bias``) on a cast ``dot_general``."""

    weight: jax.Array
    bias: jax.Array | None
    dot_general: nn.CastDotGeneral  # not an array: eqx.filter(..., eqx.is_inexact_array) leaves it out

    def __call__(self, x, *, key=None):
        y = self.dot_general(self.weight, x, (((1,), (0,)), ((), ())))
        return y if self.bias is None else y + self.bias


def with_cast_linears(model, dot_general):
    """``model`` with every ``eqx.nn.Linear`` replaced by a :class:`CastLinear` of the same parameters."""
    is_linear = lambda node: isinstance(node, eqx.nn.Linear)  # noqa: E731

    def linears(tree):
        return [node for node in jax.tree.leaves(tree, is_leaf=is_linear) if is_linear(node)]

    return eqx.tree_at(linears, model, [CastLinear(m.weight, m.bias, dot_general) for m in linears(model)])


@pytest.mark.slow  # about 10 s of compiles on 2 cores
def test_equinox_mlp_with_cast_linears_trains_in_fp8():
    mlp = eqx.nn.MLP(8, 2, 16, depth=2, activation=jsa.nn.gelu, key=jax.random.PRNGKey(0))
    fp8_mlp = with_cast_linears(mlp, nn.cast_dot_general())
    assert [type(layer) for layer in fp8_mlp.layers] == [CastLinear] * 3
    uncast = with_cast_linears(mlp, nn.cast_dot_general(None, None))
    x = X.reshape(-1, 8)
    np.testing.assert_allclose(jax.vmap(uncast)(x), jax.vmap(mlp)(x), rtol=1e-6, atol=1e-6)

    # The dot_general is not an array: the parameters are the same pytree whichever it is.
    params = eqx.filter(with_cast_linears(mlp, lax.dot_general), eqx.is_inexact_array)

    def make_loss(dot_general):
        static = eqx.filter(with_cast_linears(mlp, dot_general), eqx.is_inexact_array, inverse=True)
        return lambda params, x, y: mse(jax.vmap(jax.vmap(eqx.combine(params, static)))(x), y)

    check_fp8_training(make_loss, params)
