"""JAX idioms of training code as users write it, each a float32 invariance case.

Each was first run as a probe of code nobody here had written (see the commit history);
they are kept so that a change to a rule or to the interpreter cannot break them silently.
The Flax and Equinox idioms live in ``tests/interop`` and ``tests/programs``.

They are not in the registry-wide sweeps (``INVARIANCE_CASES``): at the extreme input scales
of ``tests/properties/test_extreme_scales.py`` (every input at its own 2**±100..120) two of
them come out NaN where the float64 reference is finite: the fori-loop SGD steps (plain
float32 is NaN there too) and the SAM gradient (plain float32 is finite: an open finding).
"""

import jax
import jax.numpy as jnp

from tests.invariance import Case, invariance_test, normal


def _mlp_loss(w0, w1, x, y):
    return jnp.mean(jnp.square(jnp.tanh(x @ w0) @ w1 - y))


def sgd_steps_in_fori_loop(w0, w1, x, y):
    """Several training steps in one compiled call."""

    def step(_, ws):
        grads = jax.grad(_mlp_loss, argnums=(0, 1))(*ws, x, y)
        return tuple(w - 0.1 * g for w, g in zip(ws, grads))

    return jax.lax.fori_loop(0, 3, step, (w0, w1))


def per_example_gradients(w0, w1, x, y):
    """``vmap`` of ``grad`` over the batch (DP-SGD, influence functions)."""
    grad = jax.grad(_mlp_loss, argnums=(0, 1))
    return jax.vmap(grad, in_axes=(None, None, 0, 0))(w0, w1, x[:, None], y[:, None])


def rematerialised_gradient(w0, w1, x, y):
    """``jax.checkpoint`` with a saving policy."""
    layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=jax.checkpoint_policies.dots_saveable)
    return jax.grad(lambda w0, w1: jnp.mean(jnp.square(layer(w0, x) @ w1 - y)), argnums=(0, 1))(w0, w1)


def causal_attention(q, k, v):
    """``jax.nn.dot_product_attention`` (the XLA implementation on the CPU)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@jax.custom_vjp
def _reverse_gradient(x):
    return x


_reverse_gradient.defvjp(lambda x: (x, None), lambda _, g: (-g,))


def gradient_reversal(w0, x):
    """A user ``custom_vjp`` (domain-adversarial training's gradient reversal)."""
    return jnp.tanh(_reverse_gradient(x @ w0))


def hessian_vector_product(w0, w1, x, y):
    """Forward-over-reverse, as curvature-aware optimisers compute it."""
    grad = jax.grad(_mlp_loss, argnums=(0, 1))
    return jax.jvp(lambda w0, w1: grad(w0, w1, x, y), (w0, w1), (w0, w1))[1]


def sharpness_aware_gradient(w0, w1, x, y):
    """SAM: the gradient at weights moved along the normalised gradient."""
    grads = jax.grad(_mlp_loss, argnums=(0, 1))(w0, w1, x, y)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
    moved = [w + 0.05 * g / norm for w, g in zip((w0, w1), grads)]
    return jax.grad(_mlp_loss, argnums=(0, 1))(*moved, x, y)


MLP_ARGS = [normal(8, 16), normal(16, 4), normal(32, 8), normal(32, 4)]
IDIOM_CASES = [
    Case("sgd_steps_in_fori_loop", sgd_steps_in_fori_loop, MLP_ARGS),
    Case("per_example_gradients", per_example_gradients, MLP_ARGS),
    Case("rematerialised_gradient", rematerialised_gradient, MLP_ARGS),
    Case("causal_dot_product_attention", causal_attention, [normal(2, 16, 4, 8)] * 3, grad=True),
    Case("custom_vjp_gradient_reversal", gradient_reversal, [normal(8, 16), normal(32, 8)], grad=True),
    Case("hessian_vector_product", hessian_vector_product, MLP_ARGS),
    Case("sharpness_aware_gradient", sharpness_aware_gradient, MLP_ARGS),
]

test_invariance = invariance_test(IDIOM_CASES, max_examples=4)
