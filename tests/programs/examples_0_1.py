"""The training programs of jax-scalify 0.1's MNIST examples, rewritten in their idiom on the digits.

- ``mlp_sgd_0_1``: an MLP "from scratch": parameters a list of ``(w, b)`` tuples drawn as
  ``0.1 * randn``, ReLU, log-probabilities through a hand-written log-sum-exp whose maximum
  is a ``stop_gradient``, a loss against float one-hot targets, and plain SGD written as a
  list comprehension (``w - step_size * dw``). Its FP8 variant (0.1's
  ``mnist_classifier_from_scratch_fp8``) casts the weights and activations of each matmul
  to E4M3 on the forward pass (``jsa.ops.cast_on_forward``) and its output gradient to E5M2
  on the backward pass (``jsa.ops.cast_on_backward``). (0.1 left the last layer's weights
  in float16; JAX no longer promotes an FP8 operand with a float16 one implicitly.)
- ``mlp_adam_linen_0_1``: the same MLP as a Flax Linen module (``nn.Dense`` layers), Adam
  with ``eps=2**-16`` (as 0.1's Flax example chose it for a float16 state).

As programs of the suite they are trained with the README's recipe by the harness;
``tests/test_migration.py`` trains them as 0.1's examples did (``jsa.as_scaled_array(params,
scale=0.1)``, the whole Adam state cast to float16).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jax_scalify as jsa

from . import data, recipe
from .harness import Program, functional_call

SIZES = (64, 128, 128, 10)
BATCH = 64
PARAM_SCALE = 0.1
STEP_SIZE = 0.1


def logsumexp(a, axis):
    amax = lax.stop_gradient(jnp.max(a, axis=axis, keepdims=True))
    return jnp.log(jnp.sum(jnp.exp(a - amax), axis=axis, keepdims=True)) + amax


def init_random_params(seed, scale=PARAM_SCALE, sizes=SIZES):
    rng = np.random.RandomState(seed)
    return [
        (jnp.asarray(scale * rng.randn(m, n), jnp.float32), jnp.asarray(scale * rng.randn(n), jnp.float32))
        for m, n in zip(sizes[:-1], sizes[1:])
    ]


def predict(params, inputs, fp8=False):
    forward = (lambda x: jsa.ops.cast_on_forward(x, recipe.E4M3)) if fp8 else (lambda x: x)
    backward = (lambda x: jsa.ops.cast_on_backward(x, recipe.E5M2)) if fp8 else (lambda x: x)
    activations = inputs
    for w, b in params[:-1]:
        # An FP8 matmul returns FP8 unless asked otherwise: ask for the bias's dtype.
        outputs = backward(jnp.dot(forward(activations), forward(w), preferred_element_type=b.dtype)) + b
        activations = jax.nn.relu(outputs)
    final_w, final_b = params[-1]
    logits = backward(jnp.dot(forward(activations), forward(final_w), preferred_element_type=final_b.dtype)) + final_b
    return logits - logsumexp(logits, axis=1)


def sgd_loss(params, inputs, targets, fp8=False):
    return -jnp.mean(jnp.sum(predict(params, inputs, fp8) * targets, axis=1))


def make_sgd_step(tx, fp8=False):
    def update(params, inputs, targets):
        loss, grads = jax.value_and_grad(sgd_loss)(params, inputs, targets, fp8)
        return loss, [(w - STEP_SIZE * dw, b - STEP_SIZE * db) for (w, b), (dw, db) in zip(params, grads)]

    return update


def one_hot_batches(seed, count, batch=BATCH):
    """Flattened images ``(B, 64)`` and float32 one-hot targets ``(B, 10)``, as 0.1's data stream gave."""
    return [
        (images.reshape(len(images), -1), np.eye(10, dtype=np.float32)[labels])
        for images, labels in data.digit_batches(seed, count, batch)
    ]


class MLP(nn.Module):
    dot_general: object = lax.dot_general

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128, dot_general=self.dot_general)(x))
        x = nn.relu(nn.Dense(128, dot_general=self.dot_general)(x))
        x = nn.Dense(10, dot_general=self.dot_general)(x)
        return x - logsumexp(x, axis=1)


def make_adam():
    return optax.adam(1e-3, eps=2.0**-16)


def init_linen(seed, tx, fp8=False):
    model = MLP(recipe.fp8_dot_general if fp8 else lax.dot_general)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, SIZES[0])))
    return params, tx.init(params)


def make_linen_step(tx, fp8=False):
    model = MLP(recipe.fp8_dot_general if fp8 else lax.dot_general)

    def loss(params, inputs, targets):
        return -jnp.mean(jnp.sum(model.apply(params, inputs) * targets, axis=1))

    def update(model_state, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(model_state, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, model_state)
        return value, optax.apply_updates(model_state, updates), opt_state

    return update


SGD_PROGRAM = Program(
    name="mlp_sgd_0_1",
    make_optimizer=optax.identity,  # SGD is written in the step
    init=lambda seed, tx, fp8=False: (init_random_params(seed),),
    make_train_step=make_sgd_step,
    jit=jax.jit,
    call=functional_call,
    batches=one_hot_batches,
    fp16_steps=40,
    slow_steps=200,
)

ADAM_PROGRAM = Program(
    name="mlp_adam_linen_0_1",
    make_optimizer=make_adam,
    init=init_linen,
    make_train_step=make_linen_step,
    jit=jax.jit,
    call=functional_call,
    batches=one_hot_batches,
    fp16_steps=40,
    slow_steps=200,
)
