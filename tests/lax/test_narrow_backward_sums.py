"""Backward-pass sums of float16 data whose reducer is typed: max-pool gradients, generic reduces.

In the backward pass a sum of float16/FP8 data is accumulated in float32 (see
``core.scaling.unit_scaled_sum``). Max-pool gradients (``select_and_scatter_add``) and
``reduce`` / ``reduce_window`` with an ``add`` reducer and a non-zero init carry something
typed in the data dtype (the pooled operand, the reduction jaxpr) that must follow the
float32 data. Each test runs the way users reach it, ``jax.jit(jsa.scalify(jax.grad(f)))`` on
float16 scaled data, and compares with plain JAX in float32.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa

F16_RTOL = 2e-3  # float16 data: a few units of its 2**-11 precision


def _input(shape) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _check_grad_f16(loss, x32: np.ndarray) -> None:
    """``jit(scalify(grad(loss)))`` on float16 scaled data equals plain ``grad(loss)`` in float32."""
    expected = np.asarray(jax.grad(loss)(jnp.asarray(x32)))
    x = jsa.as_scaled_array(jnp.asarray(x32, jnp.float16))
    got = jax.jit(jsa.scalify(jax.grad(loss)))(x)
    assert isinstance(got, jsa.ScaledArray) and got.dtype == jnp.float16
    got = np.asarray(jsa.asarray(got, jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=F16_RTOL, atol=F16_RTOL * np.max(np.abs(expected)))


@pytest.mark.parametrize("strides", [(1, 1, 1), (1, 2, 2)], ids=["overlapping", "disjoint"])
def test_max_pool_gradient_of_float16_data(strides):
    """Issue 39, point 2: ``reduce_window(x, -inf, max, ...)`` under ``grad`` raised ``TypeError: pad
    operand and padding_value must be same dtype: got float16 and float32``: the transposed pool
    (``select_and_scatter_add``) got float32 cotangents beside the float16 pooled operand."""

    def loss(x):
        pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2), strides, "VALID")
        return jnp.sum(pooled.astype(jnp.float32) * jnp.arange(pooled.shape[-1], dtype=jnp.float32))

    _check_grad_f16(loss, _input((3, 8, 8)))


def test_max_pool_gradient_with_padding_of_float16_data():
    """A padded max pool (``SAME``): the selection pads the operand with the identity of max."""

    def loss(x):
        return jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3), (1, 2, 2), "SAME").astype(jnp.float32) ** 2)

    _check_grad_f16(loss, _input((2, 7, 7)))


def test_equinox_max_pool_2d_gradient_of_float16_data():
    pool = eqx.nn.MaxPool2d(kernel_size=2, stride=1)

    def loss(x):
        return jnp.sum(pool(x).astype(jnp.float32) ** 2)

    _check_grad_f16(loss, _input((4, 9, 9)))


def test_flax_linen_max_pool_gradient_of_float16_data():
    def loss(x):
        pooled = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        return jnp.sum(pooled.astype(jnp.float32) ** 2)

    _check_grad_f16(loss, _input((2, 8, 8, 3)))


def _with_backward(bwd):
    """The identity, whose backward pass is ``bwd`` of the cotangent."""

    @jax.custom_vjp
    def f(x):
        return x * 1

    f.defvjp(lambda x: (x * 1, None), lambda _, g: (bwd(g),))
    return f


@pytest.mark.parametrize(
    "bwd",
    [
        lambda g: jnp.broadcast_to(lax.reduce(g, jnp.ones((), g.dtype), lax.add, (1,))[:, None], g.shape),
        lambda g: lax.reduce_window(g, jnp.ones((), g.dtype), lax.add, (1, 2, 2), (1, 1, 1), "SAME"),
    ],
    ids=["reduce", "reduce_window"],
)
def test_generic_add_reduction_in_backward_pass_of_float16_data(bwd):
    """A ``reduce``/``reduce_window`` with an ``add`` reducer and init 1 in a backward pass: its
    reduction jaxpr, typed float16, failed to lower on the float32 accumulation."""
    f = _with_backward(bwd)

    def loss(x):
        return jnp.sum(f(x).astype(jnp.float32) * jnp.arange(6, dtype=jnp.float32))

    _check_grad_f16(loss, _input((2, 6, 6)))
