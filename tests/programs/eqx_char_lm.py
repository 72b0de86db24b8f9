"""What the Equinox character LMs of the suite share: their training step and their :class:`Program`.

A model class ``model_class(vocab, key)`` maps a ``(SEQ,)`` token sequence to ``(SEQ, vocab)``
logits; the step is the usual Equinox one (``eqx.filter_value_and_grad`` of the mean
cross-entropy over a ``vmap`` of the model, then the Optax update), under ``eqx.filter_jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import optax

from . import data
from .harness import Program, functional_call


def make_train_step(tx, fp8=False):
    def train_step(model, opt_state, tokens, targets):
        def loss_fn(model):
            logits = jax.vmap(model)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return loss, eqx.apply_updates(model, updates), opt_state

    return train_step


def program(
    name: str,
    model_class: Callable,
    make_optimizer: Callable[[], optax.GradientTransformation],
    batch: int,
    length: int,
    fp16_steps: int,
) -> Program:
    """The :class:`Program` of a character LM ``model_class`` trained on batches of ``batch`` x ``length`` tokens."""

    def init(seed, tx, fp8=False):
        _, vocab = data.shakespeare()
        model = model_class(vocab, jax.random.PRNGKey(seed))
        return model, tx.init(eqx.filter(model, eqx.is_inexact_array))

    return Program(
        name=name,
        make_optimizer=make_optimizer,
        init=init,
        make_train_step=make_train_step,
        jit=eqx.filter_jit,
        call=functional_call,
        batches=functools.partial(data.text_batches, batch=batch, length=length),
        has_dense=False,
        fp16_steps=fp16_steps,
    )
