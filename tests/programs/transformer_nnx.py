"""A character transformer in Flax NNX with its layers stacked: Flax's "scan over layers" idiom.

The blocks are created by ``nnx.vmap`` over a constructor (``nnx.split_rngs`` gives each its
own initialisation) and applied by ``nnx.scan`` over the stack, each under ``nnx.remat``; a
block is pre-norm ``nnx.MultiHeadAttention`` with a causal mask from ``nnx.make_causal_mask``
and a GELU MLP; token and position ``nnx.Embed``. Optimizer:
``nnx.Optimizer(model, chain(clip_by_global_norm(1.0), adamw(warmup_cosine)), wrt=nnx.Param)``,
step ``nnx.value_and_grad`` + ``optimizer.update(model, grads)`` under ``nnx.jit``.

The attention has no biases (as in Llama-style models): with them, the key bias's true
gradient is 0 (a softmax ignores what it adds to every logit of a row) and its float32
round-off, which Adam scales up to full steps, would be all the invariance check measures.
The attention function is the weights of ``dot_product_attention_weights`` applied by an
einsum in the operands' dtype, what an NNX user passes on CPU for float16 (XLA:CPU has no
float16 x float16 -> float32 dot, which the default asks for).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention_weights

from . import data
from .harness import Program, nnx_call

WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 4, 4, 64, 16


def einsum_attention(query, key, value, mask=None, dtype=None, precision=None, **kwargs):
    weights = dot_product_attention_weights(query, key, mask=mask, dtype=dtype, precision=precision, **kwargs)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=WIDTH,
            use_bias=False,
            decode=False,
            attention_fn=einsum_attention,
            rngs=rngs,
        )
        self.mlp_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class CharTransformer(nnx.Module):
    def __init__(self, vocab: int, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(vocab, WIDTH, rngs=rngs)
        self.positions = nnx.Embed(SEQ, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_blocks(rngs: nnx.Rngs):
            return Block(rngs)

        self.blocks = create_blocks(rngs)
        self.final_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, vocab, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def through(x, block):
            return block(x, mask)

        return self.head(self.final_norm(through(x, self.blocks)))


def make_optimizer():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 300)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def init(seed, tx, fp8=False):
    _, vocab = data.shakespeare()
    model = CharTransformer(vocab, nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_step(model: CharTransformer, optimizer: nnx.Optimizer, tokens, targets):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


PROGRAM = Program(
    name="transformer_nnx",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=nnx.jit,
    call=nnx_call,
    batches=functools.partial(data.text_batches, batch=BATCH, length=SEQ),
    has_dense=False,
    fp16_steps=60,
)
