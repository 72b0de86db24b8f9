"""An Equinox GRU classifier: ``eqx.nn.GRUCell`` run over the sequence with ``jax.lax.scan``, Adam.

The task: tell clockwise from anticlockwise arcs of noisy spirals (2-D points, 16 time steps).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .harness import Program, functional_call

LENGTH, BATCH = 16, 32
TURN, NOISE = 0.5 * np.pi, 0.8  # a quarter turn under noise that keeps the task from being solved exactly


class RNNClassifier(eqx.Module):
    cell: eqx.nn.GRUCell
    readout: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)

    def __init__(self, in_size, hidden_size, *, key):
        cell_key, readout_key = jax.random.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=cell_key)
        self.readout = eqx.nn.Linear(hidden_size, 2, key=readout_key)

    def __call__(self, sequence):
        def step(hidden, point):
            return self.cell(point, hidden), None

        hidden, _ = jax.lax.scan(step, jnp.zeros(self.hidden_size), sequence)
        return self.readout(hidden)


def loss_fn(model, sequences, labels):
    logits = jax.vmap(model)(sequences)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_optimizer():
    return optax.adam(3e-3)


def make_train_step(tx, fp8=False):
    def train_step(model, opt_state, sequences, labels):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, sequences, labels)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    model = RNNClassifier(2, 32, key=jax.random.PRNGKey(seed))
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


def spirals(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of noisy spiral arcs ``(B, LENGTH, 2)`` and their direction (0 anticlockwise, 1 clockwise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        labels = rng.integers(0, 2, BATCH)
        start = rng.uniform(0, 2 * np.pi, (BATCH, 1))
        angle = start + np.linspace(0, TURN, LENGTH)[None] * np.where(labels == 1, -1.0, 1.0)[:, None]
        radius = np.linspace(0.2, 1.0, LENGTH)[None]
        points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], -1)
        points += NOISE * rng.standard_normal(points.shape)
        out.append((points.astype(np.float32), labels.astype(np.int32)))
    return out


PROGRAM = Program(
    name="gru_eqx",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=eqx.filter_jit,
    call=functional_call,
    batches=spirals,
    has_dense=False,
)
