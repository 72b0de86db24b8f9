"""Training steps of small models under scalify: float32 invariance with random power-of-two scales.

Each program (``tests/models.py``) is plain JAX: a CNN (convolutions, max and average
pooling, dense head), a scanned RNN, an MLP with dropout and a rematerialised block, a
function mixing ``fori_loop``, ``while_loop``, ``cond`` and ``switch``, and optax updates
(Adam, AdamW, global-norm clipping chained with Adam, SGD with momentum) of an MLP. Every
floating input gets the scale ``jsa.as_scaled_array`` would give it times a random ``2**k``,
``|k| <= 10`` (so its data is ``2**-k`` off unit size); integer inputs (labels, counts,
PRNG keys) stay plain. ``jax.jit(jsa.scalify(step))`` must give the values of
``jax.jit(step)``.

Tolerances. The scaled program runs the same float32 operations on data that differ from
the values by exact powers of two; it differs only where a rule reorders arithmetic (a
sqrt(K) factor applied before or after a sum, operands rebalanced before an add, a
non-linear map evaluated on ``data * scale``), one float32 rounding (6e-8) each. The
harness default (``rtol=2e-5``, ``atol=1e-6`` of the largest value) holds with a wide margin
for the CNN, dropout, control-flow and single-transform optimizer steps (worst element seen
over 30 draws: ~2e-7). The RNN's gradient sums six steps of backpropagation through tanh,
and the clipped Adam step divides by a global norm summed over every gradient: there the
worst element seen was 1.4e-5 and 5e-6, so they use ``rtol=1e-4``. A wrong scale anywhere
is an error of at least 50%.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from jax import lax

import jax_scalify as jsa
from tests.invariance import assert_close_values, assert_pow2_scales, examples
from tests.invariance import primitive_names as _primitive_names
from tests.models import (
    cnn_batch,
    cnn_loss,
    control_flow_loss,
    dropout_remat_loss,
    hypothesis_exponents,
    init_cnn,
    init_control_flow_model,
    init_dropout_model,
    init_mlp,
    init_rnn,
    make_adam_step,
    mlp_batch,
    mlp_loss,
    random_pow2_scaling,
    rnn_batch,
    rnn_loss,
    sgd_step,
    warm_optimizer_state,
)

TIGHT = dict(rtol=2e-5, atol=1e-6)
LOOSE = dict(rtol=1e-4, atol=1e-6)


def _seed_rng(data) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def _check(data, plain, scalified, scaled_args: tuple, plain_args: tuple = (), tol=TIGHT):
    """``scalified(*scaled(scaled_args), *plain_args)`` equals ``plain(*scaled_args, *plain_args)``."""
    expected = plain(*scaled_args, *plain_args)
    scaled = random_pow2_scaling(scaled_args, hypothesis_exponents(data))
    got = scalified(*scaled, *plain_args)
    assert_pow2_scales(got)
    for x in jax.tree.leaves(got, is_leaf=jsa.is_scaled_leaf):  # every floating output is scaled
        assert isinstance(x, jsa.ScaledArray) or not jnp.issubdtype(x.dtype, jnp.floating)
    assert_close_values(got, expected, **tol)
    return got


def _jit_pair(fn):
    """``jax.jit(fn)`` and ``jax.jit(jsa.scalify(fn))``, created once at import time."""
    return jax.jit(fn), jax.jit(jsa.scalify(fn))


# --- CNN -------------------------------------------------------------------------------------
cnn_step = _jit_pair(sgd_step(cnn_loss, lr=0.1))


@settings(max_examples=examples(4), deadline=None)
@given(data=st.data())
def test_cnn_sgd_step_invariance(data):
    """conv_general_dilated, reduce_window max (select_and_scatter_add in the gradient) and sum."""
    rng = _seed_rng(data)
    images, labels = cnn_batch(rng)
    _check(data, *cnn_step, (init_cnn(rng), images), (labels,))


def test_cnn_step_primitives():
    """The CNN step exercises what it claims to (guards against a silently simpler program)."""
    rng = np.random.default_rng(0)
    names = _primitive_names(sgd_step(cnn_loss), init_cnn(rng), *cnn_batch(rng))
    assert {"conv_general_dilated", "reduce_window_max", "reduce_window_sum", "select_and_scatter_add"} <= names


# --- RNN -------------------------------------------------------------------------------------
rnn_grad = _jit_pair(jax.value_and_grad(rnn_loss))


@settings(max_examples=examples(4), deadline=None)
@given(data=st.data())
def test_scanned_rnn_gradient_invariance(data):
    rng = _seed_rng(data)
    _check(data, *rnn_grad, (init_rnn(rng), *rnn_batch(rng)), tol=LOOSE)


def _layers_scanned(ws, x):
    return jnp.sum(lax.scan(lambda h, w: ((h * h) @ w, None), x, ws)[0])


def _layers_unrolled(ws, x):
    for i in range(ws.shape[0]):
        x = (x * x) @ ws[i]
    return jnp.sum(x)


def test_scan_gradient_has_the_scales_of_the_unrolled_loop():
    """Regression: the backward scan sees each forward residual with its own iteration's scale.

    The residual ``h`` of ``(h * h) @ w`` has a scale that grows at every iteration. The
    scan used to stack it rebalanced to the largest scale, so the backward pass divided
    the early slices' data by the spread and carried it as a scale offset: here the input
    gradient came out with scale 2**12 instead of the unrolled loop's 2**7 (in a 2-layer
    transformer, 2**33 too large, with data near float32's underflow).
    """
    rng = np.random.default_rng(0)
    ws = jsa.as_scaled_array(jnp.asarray(0.5 * rng.standard_normal((3, 4, 4)), jnp.float32), scale=1.0)
    x = jsa.as_scaled_array(jnp.asarray(rng.standard_normal((2, 4)), jnp.float32), scale=1.0)
    grads = [jax.jit(jsa.scalify(jax.grad(f, argnums=1)))(ws, x) for f in (_layers_scanned, _layers_unrolled)]
    assert float(grads[0].scale) == float(grads[1].scale)
    expected = jax.grad(_layers_scanned, argnums=1)(ws.to_array(), x.to_array())
    for g in grads:
        np.testing.assert_allclose(np.asarray(g.to_array()), np.asarray(expected), rtol=1e-6)


def test_dynamic_rescale_in_a_scanned_body_under_grad_and_jit():
    """Regression: ``dynamic_rescale_l2`` in a scan body, differentiated, under ``jax.jit``.

    ``grad`` hoists the fallback constants of the rescale's ``jnp.where``s out of the scan
    into traced arguments of its jitted helper. The ``jit`` rule used to promote them to
    scale 1 at the call boundary, which made the helper's clipping-bound arithmetic
    (2**-126, 2**127) scaled; aligning those scales underflowed, the rescale factor came out
    0 and the gradient NaN. (Without ``jax.jit`` the constants were known and stayed plain.)
    """

    def loss(x):
        body = lambda c, _: (jnp.tanh(jsa.ops.dynamic_rescale_l2(c)) * c, None)  # noqa: E731
        return jnp.sum(lax.scan(body, x, None, length=2)[0])

    x = jnp.asarray(np.random.default_rng(1).standard_normal(4), jnp.float32)
    scaled = jsa.as_scaled_array(x)
    for run in (jsa.scalify(jax.grad(loss)), jax.jit(jsa.scalify(jax.grad(loss)))):
        got = run(scaled)
        assert_pow2_scales(got)
        assert_close_values(got, jax.grad(loss)(x), **TIGHT)


# --- dropout + checkpoint ------------------------------------------------------------------------
dropout_step = _jit_pair(sgd_step(dropout_remat_loss))


@settings(max_examples=examples(4), deadline=None)
@given(data=st.data(), typed_key=st.booleans())
def test_dropout_and_checkpoint_step_invariance(data, typed_key):
    """``jax.random`` on a plain key (the same for both runs), dropout masks, ``jax.checkpoint``."""
    rng = _seed_rng(data)
    seed = int(rng.integers(0, 2**16))
    key = jax.random.key(seed) if typed_key else jax.random.PRNGKey(seed)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    _check(data, *dropout_step, (init_dropout_model(rng), x, y), (key,))


def test_dropout_step_primitives():
    rng = np.random.default_rng(0)
    args = (init_dropout_model(rng), np.ones((8, 6), np.float32), np.ones((8, 3), np.float32), jax.random.PRNGKey(0))
    assert {"remat2", "random_bits", "select_n"} <= _primitive_names(sgd_step(dropout_remat_loss), *args)


# --- control flow ------------------------------------------------------------------------------
control_flow_step = _jit_pair(sgd_step(control_flow_loss))


@settings(max_examples=examples(4), deadline=None)
@given(data=st.data())
def test_control_flow_in_a_differentiated_function_invariance(data):
    rng = _seed_rng(data)
    x = (2.0 * rng.standard_normal((5, 4))).astype(np.float32)
    _check(data, *control_flow_step, (init_control_flow_model(rng), x))


def test_control_flow_step_primitives():
    rng = np.random.default_rng(0)
    names = _primitive_names(sgd_step(control_flow_loss), init_control_flow_model(rng), np.ones((5, 4), np.float32))
    assert {"scan", "while", "cond"} <= names


def test_while_loop_under_forward_mode_differentiation():
    """A while loop whose carry is differentiated: forward mode (``jax.jvp``) under scalify."""

    def f(x, w, n):
        return lax.fori_loop(0, n, lambda i, c: jnp.tanh(c * w) + c, x)  # dynamic bounds: a while loop

    rng = np.random.default_rng(3)
    x, w, t = (jnp.asarray(rng.standard_normal(4), jnp.float32) for _ in range(3))

    def jvp(x, w, t, n):
        return jax.jvp(lambda x: f(x, w, n), (x,), (t,))

    expected = jvp(x, w, t, 3)
    scaled = jsa.as_scaled_array((x, w, t))
    scaled = [jsa.ScaledArray(s.data * 4.0, s.scale / 4.0) for s in scaled]
    got = jax.jit(jsa.scalify(jvp))(*scaled, 3)
    assert_pow2_scales(got)
    assert_close_values(got, expected, **TIGHT)


# --- optax ---------------------------------------------------------------------------------------
OPTIMIZERS = {
    "adam": (optax.adam(1e-2), TIGHT),
    "adamw": (optax.adamw(1e-2, weight_decay=0.1), TIGHT),
    # max_norm below the gradients' global norm: the clipping branch is the one taken.
    "clip_adam": (optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)), LOOSE),
    "sgd_momentum": (optax.sgd(0.1, momentum=0.9), TIGHT),
}
optimizer_steps = {name: _jit_pair(make_adam_step(mlp_loss, opt)) for name, (opt, _) in OPTIMIZERS.items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(max_examples=examples(3), deadline=None)
@given(data=st.data())
def test_optax_mlp_step_invariance(name, data):
    """value_and_grad of an MLP, then the optax update; state warmed up (non-zero moments, count 2)."""
    optimizer, tol = OPTIMIZERS[name]
    rng = _seed_rng(data)
    params = init_mlp(rng)
    state = warm_optimizer_state(optimizer, params, rng)
    x, labels = mlp_batch(rng)
    loss, new_params, new_state = _check(data, *optimizer_steps[name], (params, state, x), (labels,), tol=tol)
    assert isinstance(loss, jsa.ScaledArray)


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)], ids=["adam", "sgd_momentum"])
def test_optax_update_on_scaled_params_and_state_gives_pow2_scaled_outputs(optimizer):
    rng = np.random.default_rng(5)
    params = jsa.as_scaled_array(init_mlp(rng))
    state = jsa.scalify(optimizer.init)(params)  # zeros: plain arrays (nothing scaled met them)
    state = jsa.as_scaled_array(state)  # as a training loop would keep it

    def update(grads, state, params):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = jsa.as_scaled_array(jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), init_mlp(rng)))
    new_params, new_state = jax.jit(jsa.scalify(update))(grads, state, params)
    new_params, new_state = jax.jit(jsa.scalify(update))(grads, new_state, new_params)  # non-zero state
    for x in jax.tree.leaves((new_params, new_state), is_leaf=jsa.is_scaled_leaf):
        assert isinstance(x, jsa.ScaledArray) or jnp.issubdtype(x.dtype, jnp.integer), x
    assert_pow2_scales((new_params, new_state))
    expected = update(jsa.asarray(grads), jsa.asarray(state), jsa.asarray(params))
    expected = update(jsa.asarray(grads), expected[1], expected[0])
    assert_close_values((new_params, new_state), expected, **TIGHT)


# --- helpers -----------------------------------------------------------------------------------
