"""A score-based diffusion model (denoising score matching, VE noise scales) in Flax Linen, AdaBelief.

The data: a mixture of eight Gaussians on a circle (2-D). The network takes the noisy
point and the log noise level (Gaussian Fourier features) and predicts the score; the
loss is the usual ``sigma**2``-weighted denoising score-matching loss, with the noise
drawn inside the training step from a PRNG key passed with the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import recipe
from .harness import Program, functional_call

BATCH = 128
SIGMA_MIN, SIGMA_MAX = 0.01, 4.0


class FourierFeatures(nn.Module):
    features: int = 16
    scale: float = 4.0

    @nn.compact
    def __call__(self, t):
        w = self.param("w", nn.initializers.normal(self.scale), (1, self.features // 2))
        angles = 2 * jnp.pi * t[:, None] * w
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ScoreNet(nn.Module):
    width: int = 128
    depth: int = 3
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, x, sigma):
        h = jnp.concatenate([x, FourierFeatures()(jnp.log(sigma) / 4.0)], axis=-1)
        for _ in range(self.depth):
            h = nn.silu(nn.Dense(self.width, dot_general=self.dot_general)(h))
        return nn.Dense(x.shape[-1], dot_general=self.dot_general)(h) / sigma[:, None]


def make_optimizer():
    return optax.adabelief(2e-3)


def make_train_step(tx, fp8=False):
    model = ScoreNet(dot_general=recipe.fp8_dot_general if fp8 else lax.dot_general)

    def loss_fn(params, x, key):
        sigma_key, noise_key = jax.random.split(key)
        u = jax.random.uniform(sigma_key, (x.shape[0],))
        sigma = SIGMA_MIN * (SIGMA_MAX / SIGMA_MIN) ** u
        noise = jax.random.normal(noise_key, x.shape)
        score = model.apply(params, x + sigma[:, None] * noise, sigma)
        return jnp.mean(jnp.sum((sigma[:, None] * score + noise) ** 2, axis=-1))

    def train_step(params, opt_state, x, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    model = ScoreNet(dot_general=recipe.fp8_dot_general if fp8 else lax.dot_general)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 2)), jnp.ones((1,)))
    return params, tx.init(params)


def gaussian_mixture(seed: int, count: int) -> list[tuple[np.ndarray, jax.Array]]:
    """Batches of points from eight Gaussians on a circle of radius 2, each with a PRNG key."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), count)
    out = []
    for i in range(count):
        angle = 2 * np.pi * rng.integers(0, 8, BATCH) / 8
        centres = 2.0 * np.stack([np.cos(angle), np.sin(angle)], -1)
        out.append(((centres + 0.1 * rng.standard_normal(centres.shape)).astype(np.float32), keys[i]))
    return out


PROGRAM = Program(
    name="diffusion_linen",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=jax.jit,
    call=functional_call,
    batches=gaussian_mixture,
)
