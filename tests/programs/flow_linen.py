"""A RealNVP normalizing flow in Flax Linen on two moons, trained by maximum likelihood with Adam.

Six affine coupling layers (each a 2-64-64 ReLU network giving a tanh-bounded log-scale and
a shift), the exact log-likelihood ``log N(z) + sum(log-scales)``, Adam with global-norm
clipping. The network has no normalization layer: 24 dense layers in a row.

Its gradients span a wide range within one tensor (nearly dead ReLU units next to active
ones), so Adam's second moment spans the square of that range: this program found that a
float16 second moment rounded its small entries to 0 beside a first moment that was not, and
Adam stepped by ``mu / eps`` (:func:`jax_scalify.optim.scale_state` now keeps them at the
smallest subnormal).

It is not one of the suite's :data:`~tests.programs.test_programs.PROGRAMS`: their float32
invariance check gives every input leaf a random scale ``2**k``, ``|k| <= 8``, with the data
``value / 2**k``, and in 24 dense layers without a normalization the static rules carry the
data's departures from unit size from layer to layer (each weight's data is off by ``k``
and by its own ``1 / sqrt(fan_in)``, and an add takes the larger scale of its operands, a
bias of zeros included), until the squared latent of the log-likelihood leaves float32's
range (data at ``2**-124``, measured even for ``|k| <= 2``). From ``jsa.as_scaled_array``
state, as the recipe starts, float32 invariance holds (relative error 1e-6 after one step).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import make_moons

from .harness import Program, functional_call

BATCH = 256
COUPLINGS = 6


class Coupling(nn.Module):
    flip: bool
    width: int = 64

    @nn.compact
    def __call__(self, x):
        kept, moved = (x[:, 1:], x[:, :1]) if self.flip else (x[:, :1], x[:, 1:])
        h = nn.relu(nn.Dense(self.width)(kept))
        h = nn.relu(nn.Dense(self.width)(h))
        log_scale = jnp.tanh(nn.Dense(1)(h))
        moved = moved * jnp.exp(log_scale) + nn.Dense(1)(h)
        y = jnp.concatenate([moved, kept] if self.flip else [kept, moved], axis=1)
        return y, jnp.sum(log_scale, axis=1)


class RealNVP(nn.Module):
    @nn.compact
    def __call__(self, x):
        log_det = jnp.zeros(x.shape[0])
        for i in range(COUPLINGS):
            x, ld = Coupling(flip=i % 2 == 1)(x)
            log_det = log_det + ld
        return x, log_det


model = RealNVP()


def loss_fn(params, x):
    z, log_det = model.apply({"params": params}, x)
    log_prob = jax.scipy.stats.norm.logpdf(z).sum(axis=1) + log_det
    return -jnp.mean(log_prob)


def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))


def make_train_step(tx, fp8=False):
    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 2)))["params"]
    return params, tx.init(params)


def batches(seed, count, batch=BATCH):
    return [
        (make_moons(batch, noise=0.05, random_state=seed * 100_000 + i)[0].astype(np.float32),) for i in range(count)
    ]


PROGRAM = Program(
    name="flow_linen",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=jax.jit,
    call=functional_call,
    batches=batches,
    has_dense=False,  # not in the FP8 checks: see the module docstring
    fp16_steps=40,  # the float16 second moment's zeros made Adam step by mu / eps and the loss NaN by step 39
    slow_steps=200,
)
