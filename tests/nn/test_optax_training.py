"""Optax inside a scalified update: FP16 master weights, gradients and Adam moments vs FP32.

The recipe (what a user does to train with any Optax optimizer in scaled FP16):

- parameters: ``jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)``;
- optimizer state: the zero-initialised moments get scale 0 (``ScaledArray(0, 0)``: "this
  tensor is zero"), so the first ``b * m + (1 - b) * g`` takes the gradient's scale.
  ``jsa.as_scaled_array`` gives all-zero arrays scale 1, which makes the zero moment
  dominate that sum and flushes ``(1 - b2) * g**2`` to 0 in FP16;
- the step: ``jsa.ops.dynamic_rescale_l2`` on the gradients (as the paper does) and on the
  new optimizer state. The rules fold a decay such as ``0.999`` as ``1.998 * 2**-1``, so an
  EMA's scale halves at each step while the incoming term is small and its data grow
  until they overflow FP16; rescaling the state each step keeps them at unit RMS;
- Adam's ``eps`` must be representable in FP16: the function is traced on FP16 data, so
  the literal ``1e-8`` becomes 0 (as in plain FP16) and moments flushed to 0 give 0/0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import assert_close_values, assert_pow2_scales
from tests.nn.helpers import as_scaled_state, init_mlp


def mlp(params, x):
    for layer in params[:-1]:
        x = nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean(jnp.square(mlp(params, x).astype(jnp.float32) - y.astype(jnp.float32)))


def make_step(opt: optax.GradientTransformation):
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jsa.ops.dynamic_rescale_l2(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), jsa.ops.dynamic_rescale_l2(opt_state)

    return step


def task(sizes, seed=0):
    """A fixed regression: a random teacher MLP labels Gaussian inputs (targets of size ~1)."""
    rng = np.random.default_rng(seed)
    teacher = init_mlp(np.random.default_rng(seed + 1), (sizes[0], 32, sizes[-1]))
    x = rng.standard_normal((256, sizes[0])).astype(np.float32)
    return init_mlp(rng, sizes), x, np.asarray(mlp(teacher, x))


def train_fp32_and_scaled_fp16(sizes, opt, steps):
    params, x, y = task(sizes)
    step = make_step(opt)
    fp32 = jax.jit(step)
    p, s = params, opt.init(params)
    for _ in range(steps):
        loss32, p, s = fp32(p, s, x, y)
    scaled = jax.jit(jsa.scalify(step))
    p = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    s = as_scaled_state(opt.init(params), jnp.float16)
    xs, ys = jsa.tree.astype(jsa.as_scaled_array((x, y)), jnp.float16)
    losses16 = []
    for _ in range(steps):
        loss16, p, s = scaled(p, s, xs, ys)
        losses16.append(float(loss16.to_array(jnp.float32)))
    return float(loss32), losses16, p, s


def check_fp16_state(params, opt_state):
    for leaf in jax.tree.leaves((params, opt_state), is_leaf=jsa.is_scaled_leaf):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert isinstance(leaf, jsa.ScaledArray) and leaf.dtype == jnp.float16
            assert np.all(np.isfinite(np.asarray(leaf.data, np.float32)))
    assert_pow2_scales((params, opt_state))


def test_adam_fp16_weights_grads_and_moments_match_fp32():
    opt = optax.adam(1e-2, eps=1e-6)
    loss32, losses16, params, opt_state = train_fp32_and_scaled_fp16((16, 32, 4), opt, steps=200)
    check_fp16_state(params, opt_state)
    loss16 = losses16[-1]
    assert abs(loss16 - loss32) <= 0.05 * loss32, f"scaled FP16 Adam loss {loss16:.6g} vs FP32 loss {loss32:.6g}"
    assert loss16 < 0.05 * losses16[0], f"scaled FP16 Adam loss {losses16[0]:.6g} -> {loss16:.6g}"


@pytest.mark.slow
def test_adam_fp16_deeper_mlp_matches_fp32():
    opt = optax.adam(3e-3, eps=1e-6)
    loss32, losses16, params, opt_state = train_fp32_and_scaled_fp16((16, 64, 64, 4), opt, steps=200)
    check_fp16_state(params, opt_state)
    loss16 = losses16[-1]
    assert abs(loss16 - loss32) <= 0.05 * loss32, f"scaled FP16 Adam loss {loss16:.6g} vs FP32 loss {loss32:.6g}"


@pytest.mark.parametrize(
    "name, opt",
    [
        ("adamw", optax.adamw(1e-2, weight_decay=1e-2)),
        ("lion_clipped", optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_optimizers_under_scalify_match_plain_in_float32(name, opt):
    params, x, y = task((4, 8, 2))
    x, y = x[:16], y[:16]

    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    scaled = jsa.scalify(step)
    p, s = params, opt.init(params)
    sp, ss = jsa.as_scaled_array(params), as_scaled_state(opt.init(params), jnp.float32)
    for _ in range(2):
        loss, p, s = step(p, s)
        sloss, sp, ss = scaled(sp, ss)
    assert_pow2_scales((sp, ss))
    assert_close_values((sloss, sp), (loss, p), rtol=1e-5, atol=1e-6)
