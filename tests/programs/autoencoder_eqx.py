"""An Equinox convolutional autoencoder on the digits: ``eqx.nn.Sequential`` of strided
``Conv2d``, ``GroupNorm``, ``AvgPool2d``, ``ConvTranspose2d`` and ``eqx.nn.Lambda``
activations (JAX's default tanh GELU among them), Adam, a mean squared reconstruction error.

The GELU sits after a convolution and a pooling with no normalisation between: its inputs'
data drift from unit size under static scales, and the derivative of the tanh GELU
multiplies its input three times (``x * 3 * x ** 2``) with the cotangent. In float16 that
product overflowed (NaN gradients at the fourth step) until the rescaled base of the cube
was also the ``x`` its derivative reads.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import data
from .harness import Program, functional_call

BATCH = 32


def autoencoder(key) -> eqx.nn.Sequential:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 8, kernel_size=3, stride=2, padding=1, key=k1),  # 8x8 -> 4x4
            eqx.nn.GroupNorm(groups=2, channels=8),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(8, 16, kernel_size=3, padding=1, key=k2),
            eqx.nn.AvgPool2d(kernel_size=2, stride=2),  # 4x4 -> 2x2
            eqx.nn.Lambda(jax.nn.gelu),
            eqx.nn.ConvTranspose2d(16, 8, kernel_size=3, stride=2, padding=1, output_padding=1, key=k3),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.ConvTranspose2d(8, 1, kernel_size=3, stride=2, padding=1, output_padding=1, key=k4),
        ]
    )


def loss_fn(model, images):
    reconstructions = jax.vmap(model)(images[:, None])
    return jnp.mean((reconstructions[:, 0] - images) ** 2)


def make_optimizer():
    return optax.adam(3e-3)


def make_train_step(tx, fp8=False):
    def train_step(model, opt_state, images, labels):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, images)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    model = autoencoder(jax.random.PRNGKey(seed))
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


PROGRAM = Program(
    name="autoencoder_eqx",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=eqx.filter_jit,
    call=functional_call,
    batches=functools.partial(data.digit_batches, batch=BATCH),
    has_dense=False,
    fp16_steps=30,
    slow_steps=150,
)
