"""Flax NNX's own training idiom under scalify: in-place updates reach the objects given.

``nnx.jit(jsa.scalify(train_step))(model, optimizer, x, y)`` with ``optimizer.update``,
BatchNorm statistics and Dropout RNG streams updates the model exactly as
``nnx.jit(train_step)`` does (float32), with plain or scaled model and optimizer states.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from tests.invariance import assert_pow2_scales

nnx = pytest.importorskip("flax.nnx")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 4)).astype(np.float32)
Y = np.tanh(X @ RNG.standard_normal((4, 2)).astype(np.float32))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.dense2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(jax.nn.relu(self.norm(self.dense1(x)))))


def make_model():
    model = Model(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def train_step(model, optimizer, x, y):
    """Flax's idiom, as it is."""

    def loss_fn(model):
        return jnp.mean(jnp.square(model(x) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def rescaled_train_step(model, optimizer, x, y):
    """For scaled states: gradients rescaled (the identity outside scalify) so scales do not drift."""

    def loss_fn(model):
        return jnp.mean(jnp.square(model(x) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, jsa.ops.dynamic_rescale_l2(grads))
    return loss


def scale_states(model, optimizer, dtype=jnp.float32):
    """The documented way: scale the floating arrays of the NNX states, write them back."""
    nnx.update(model, jsa.tree.astype(jsa.as_scaled_array(nnx.state(model)), dtype))
    nnx.update(optimizer, jsa.tree.astype(jsa.as_scaled_array(nnx.state(optimizer)), dtype))


def numeric_leaves(tree):
    leaves = jax.tree.leaves(jsa.asarray(tree, jnp.float32))
    return [x for x in leaves if not jnp.issubdtype(x.dtype, jax.dtypes.extended)]


def assert_same_state(got, expected, rtol=0.0, atol=0.0):
    got, expected = numeric_leaves(nnx.state(got)), numeric_leaves(nnx.state(expected))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


def test_nnx_jit_idiom_updates_the_model_as_the_plain_step():
    """Regression: the in-place updates were dropped (kernel unchanged, optimizer step 0)."""
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    kernel0 = np.asarray(model.dense1.kernel[...])
    step, ref_step = nnx.jit(jsa.scalify(train_step)), nnx.jit(train_step)
    for _ in range(30):
        loss, ref_loss = step(model, optimizer, X, Y), ref_step(ref_model, ref_optimizer, X, Y)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(optimizer.step[...]) == 30 and optimizer.step[...].dtype == ref_optimizer.step[...].dtype
    assert not np.allclose(model.dense1.kernel[...], kernel0)
    assert_same_state(model, ref_model, rtol=1e-6, atol=1e-7)  # params, batch statistics, RNG counts
    assert_same_state(optimizer, ref_optimizer, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def trained():
    """Ten steps from scaled states and the plain reference: (model, optimizer, ref_model, ref_optimizer)."""
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    scale_states(model, optimizer)
    assert optimizer.step[...].dtype == jnp.uint32  # the step counter stays an integer
    assert isinstance(model.dense1.kernel.get_value(), jsa.ScaledArray)
    step, ref_step = nnx.jit(jsa.scalify(rescaled_train_step)), nnx.jit(rescaled_train_step)
    x = jsa.as_scaled_array(X)
    for _ in range(10):
        loss, ref_loss = step(model, optimizer, x, Y), ref_step(ref_model, ref_optimizer, X, Y)
        np.testing.assert_allclose(loss.to_array(), ref_loss, rtol=1e-5)
    return model, optimizer, ref_model, ref_optimizer


def test_scaled_nnx_states_train_as_the_plain_step(trained):
    model, optimizer, ref_model, ref_optimizer = trained
    assert int(optimizer.step[...]) == 10 and optimizer.step[...].dtype == jnp.uint32
    kernel = model.dense1.kernel.get_value()
    assert isinstance(kernel, jsa.ScaledArray) and kernel.dtype == jnp.float32
    assert_pow2_scales(nnx.state(model))
    assert_same_state(model, ref_model, rtol=1e-5, atol=1e-6)  # params, batch statistics, RNG counts
    assert_same_state(optimizer, ref_optimizer, rtol=1e-5, atol=1e-6)


def test_eval_mode_uses_running_statistics_and_changes_nothing(trained):
    model, _, ref_model, _ = trained
    model.eval()
    ref_model.eval()
    try:
        before = numeric_leaves(nnx.state(model))
        predict = nnx.jit(jsa.scalify(lambda model, x: model(x)))
        out = predict(model, jsa.as_scaled_array(X))
        expected = nnx.jit(lambda m, x: m(x))(ref_model, X)
        np.testing.assert_allclose(jsa.asarray(out), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jsa.asarray(predict(model, jsa.as_scaled_array(X))), jsa.asarray(out), rtol=1e-6)
        for a, b in zip(before, numeric_leaves(nnx.state(model))):
            np.testing.assert_array_equal(a, b)
    finally:
        model.train()
        ref_model.train()
    assert not model.dropout.deterministic and not model.norm.use_running_average


@pytest.mark.slow  # for time: op by op; the jitted NNX idioms run by default
def test_eager_scalify_and_objects_nested_in_arguments():
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()

    def step(state, batch):
        return {"loss": train_step(*state, *batch), "model": state[0]}

    out = jsa.scalify(step)((model, optimizer), (X, Y))
    ref = step((ref_model, ref_optimizer), (X, Y))
    assert out["model"] is model  # a returned argument is the object given, updated
    np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-6)
    assert int(optimizer.step[...]) == 1
    assert_same_state(model, ref_model, rtol=1e-6, atol=1e-7)


def test_rngs_argument_streams_advance():
    rngs, ref_rngs = nnx.Rngs(params=3), nnx.Rngs(params=3)

    def draw(rngs, x):
        return x + jax.random.normal(rngs.params(), x.shape)

    for _ in range(2):
        out = nnx.jit(jsa.scalify(draw))(rngs, jsa.as_scaled_array(X))
        np.testing.assert_allclose(out.to_array(), draw(ref_rngs, X), rtol=1e-6, atol=1e-6)
    assert int(rngs.params.count[...]) == int(ref_rngs.params.count[...]) == 2


@pytest.mark.parametrize("change", ["eval", "new_param"])
def test_a_structural_change_that_cannot_be_carried_back_raises(change):
    model, _ = make_model()

    def f(model, x):
        if change == "eval":
            model.eval()
        else:
            model.extra = nnx.Param(jnp.ones(2))
        return model(x)

    with pytest.raises(ValueError, match="changed the structure of an NNX object"):
        jsa.scalify(f)(model, X)


def test_float16_scaled_nnx_training_is_finite_and_learns():
    model, optimizer = make_model()
    scale_states(model, optimizer, jnp.float16)
    assert model.dense1.kernel.get_value().dtype == jnp.float16
    assert optimizer.step[...].dtype == jnp.uint32
    step = nnx.jit(jsa.scalify(rescaled_train_step))
    x = jsa.tree.astype(jsa.as_scaled_array(X), jnp.float16)
    y = jsa.tree.astype(jsa.as_scaled_array(Y), jnp.float16)
    losses = [float(step(model, optimizer, x, y).to_array(jnp.float32)) for _ in range(20)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses
    assert model.dense1.kernel.get_value().dtype == jnp.float16 and int(optimizer.step[...]) == 20


def test_optimizer_created_from_the_scaled_model():
    """Optax's zero moments of ScaledArray parameters are ScaledArray zeros of scale 0."""
    model, ref_model = Model(nnx.Rngs(0, dropout=1)), Model(nnx.Rngs(0, dropout=1))
    nnx.update(model, jsa.as_scaled_array(nnx.state(model)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(ref_model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    momentum = jsa.tree.leaves(nnx.state(optimizer))
    assert all(float(m.scale) == 0.0 for m in momentum if isinstance(m, jsa.ScaledArray))
    step, ref_step = nnx.jit(jsa.scalify(rescaled_train_step)), nnx.jit(rescaled_train_step)
    for _ in range(3):
        step(model, optimizer, jsa.as_scaled_array(X), Y)
        ref_step(ref_model, ref_optimizer, X, Y)
    assert_same_state(model, ref_model, rtol=1e-5, atol=1e-6)
    assert_same_state(optimizer, ref_optimizer, rtol=1e-5, atol=1e-6)


def test_scalify_outside_nnx_jit():
    """``jsa.scalify(nnx.jit(step))``: nnx.jit's updates inside the trace are carried back too."""
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    scale_states(model, optimizer)
    step, ref_step = jsa.scalify(nnx.jit(rescaled_train_step)), nnx.jit(rescaled_train_step)
    loss = step(model, optimizer, jsa.as_scaled_array(X), Y)  # evaluated eagerly: one step is enough
    np.testing.assert_allclose(loss.to_array(), ref_step(ref_model, ref_optimizer, X, Y), rtol=1e-5)
    assert int(optimizer.step[...]) == 1
    assert_same_state(model, ref_model, rtol=1e-5, atol=1e-6)


def metrics_train_step(model, optimizer, metrics, x, y):
    """The NNX tutorials' step: the loss goes into an ``nnx.MultiMetric``, nothing is returned."""

    def loss_fn(model):
        return jnp.mean(jnp.square(model(x) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    metrics.update(loss=loss)
    optimizer.update(model, grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_unscaled_metrics_stay_plain_arrays_readable_outside_scalify(dtype):
    """Regression: the metric's running total came back a ScaledArray and ``metrics.compute()``
    raised (arithmetic outside scalify). Variables given plain are written back plain."""
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    scale_states(model, optimizer, dtype)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    ref_metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step, ref_step = nnx.jit(jsa.scalify(metrics_train_step)), nnx.jit(metrics_train_step)
    x = jsa.tree.astype(jsa.as_scaled_array(X), dtype)
    for _ in range(5):
        step(model, optimizer, metrics, x, Y)
        ref_step(ref_model, ref_optimizer, ref_metrics, X, Y)
    total = metrics.loss.total.get_value()
    assert isinstance(total, jax.Array) and total.dtype == ref_metrics.loss.total.get_value().dtype
    rtol = 1e-6 if dtype == jnp.float32 else 2e-3
    np.testing.assert_allclose(metrics.compute()["loss"], ref_metrics.compute()["loss"], rtol=rtol)
    assert int(metrics.loss.count.get_value()) == 5
    assert isinstance(model.dense1.kernel.get_value(), jsa.ScaledArray)  # scaled state stays scaled
