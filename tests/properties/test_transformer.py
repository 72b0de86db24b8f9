"""A GPT-style decoder training step under scalify: float32 invariance, float16 training, debug prints.

The program (``tests/models.py``) is plain JAX: token embedding lookup (``gather``, with a
``scatter-add`` in its gradient), learned positions, ``lax.scan`` over stacked layer
parameters (pre-LayerNorm in plain jnp, causal multi-head attention with batched einsums
and a ``jnp.where`` mask, GELU MLP), a final LayerNorm, a tied or untied output projection,
``log_softmax`` cross-entropy on integer targets, ``jax.value_and_grad`` and an
``optax.adam`` update whose state goes through scalify as ``ScaledArray`` leaves.

Random input scales. Every floating input (parameters, Adam moments) gets the scale
``jsa.as_scaled_array`` would give it times a random ``2**k``, so its data is ``2**-k``
times unit size. Scale rules are static: they assume unit-sized data and never look at
it, so an input whose data is ``2**-k`` off passes that offset on to everything computed
from it, and offsets add up along products, forward and backward (a LayerNorm's backward
multiplies by its ``var**-1.5`` residual, the GELU's derivative by ``x**2``, Adam squares
the gradient). That is exact in float32 until some data or scale leaves float32's
exponent range. Without LayerNorm rescaling, with |k| <= 10 on all ~30 inputs, the
gradients' data reached 2**-96 and Adam's second moment overflowed its scale (inf) in
about one draw in ten; with every input at k = +6 the gradients underflowed. The paper's
answer is dynamic rescaling where statistics drift, which is the identity on values:

- the main test's model rescales each LayerNorm input, forward and backward
  (``GPTConfig(rescale_norms=True)``), and the step rescales the gradients before Adam
  (``jsa.ops.dynamic_rescale_l2``), as the library's typical step does. It holds for
  |k| <= 10 (100 random draws and the corners k = +-10 and alternating: every output scale
  within 2**+-20);
- the second test runs the bare program (no rescaling, an untied head, a -1e9 mask and
  debug prints) with |k| <= 2: output scales up to 2**28 over 40 random draws and 2**74 at
  the worst corner (k = +2 on every input); with k = +3 on every input it fails.
"""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import jax_scalify as jsa
from tests.invariance import assert_close_values, assert_pow2_scales, examples
from tests.models import (
    GPTConfig,
    gpt_batch,
    gpt_loss,
    hypothesis_exponents,
    init_gpt,
    make_adam_step,
    numpy_exponents,
    random_adam_state,
    random_pow2_scaling,
)

# Tolerance of the float32 invariance. The scaled step computes the same float32 operations
# on data that differ from the values by exact powers of two, except where a rule reorders
# arithmetic (sqrt(K) factors applied before or after a sum, operands rebalanced before an
# add, non-linear maps evaluated on data * scale): each is one more float32 rounding
# (2**-24 ~ 6e-8 relative). Over 100 random draws, the worst element (of those above 1% of
# their leaf's largest) of the loss, new parameters and new moments was 1.1e-5 relative:
# Adam's division by sqrt(nu) amplifies the round-off of small moments. 1e-4 keeps a margin
# and still catches any wrong scale (a wrong power of two is an error of 50% or more).
RTOL, ATOL = 1e-4, 1e-6

# vocab 32, seq 8, width 16, 2 heads, 2 layers; tied embeddings, a -inf mask, dynamic rescaling of
# every LayerNorm input (forward and backward).
CFG = GPTConfig(rescale_norms=True)
CFG_UNTIED = GPTConfig(tied=False, mask_value=-1e9)  # untied head; a finite large negative mask
ADAM = optax.adam(1e-2)

adam_step = make_adam_step(functools.partial(gpt_loss, cfg=CFG), ADAM, rescale_grads=True)


def bare_untied_step(params, opt_state, tokens, targets):
    """The bare step (no rescaling anywhere), with debug prints of the loss and gradient norm."""

    def loss_fn(p):
        loss = gpt_loss(p, tokens, targets, CFG_UNTIED)
        jax.debug.print("loss={loss}", loss=loss)  # in the forward pass, under value_and_grad
        return loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    jax.debug.print("grad_norm={g}", g=optax.tree.norm(grads))
    updates, opt_state = ADAM.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


# Created once: Hypothesis examples reuse the compilations.
plain_step = jax.jit(adam_step)
scalified_step = jax.jit(jsa.scalify(adam_step))
plain_untied_step = jax.jit(bare_untied_step)
scalified_untied_step = jax.jit(jsa.scalify(bare_untied_step))


def _problem(seed: int, cfg: GPTConfig):
    rng = np.random.default_rng(seed)
    params = init_gpt(rng, cfg)
    return params, random_adam_state(rng, params), *gpt_batch(rng, cfg)


def _check_invariance(data, cfg, plain, scalified, max_exponent):
    params, opt_state, tokens, targets = _problem(data.draw(st.integers(0, 2**31 - 1), label="seed"), cfg)
    expected = plain(params, opt_state, tokens, targets)
    exponents = hypothesis_exponents(data, -max_exponent, max_exponent)
    scaled_params, scaled_state = random_pow2_scaling((params, opt_state), exponents)
    got = scalified(scaled_params, scaled_state, tokens, targets)
    assert isinstance(got[0], jsa.ScaledArray)
    for x in jax.tree.leaves(got[1:], is_leaf=jsa.is_scaled_leaf):  # floating outputs scaled, the count plain
        assert isinstance(x, jsa.ScaledArray) or jnp.issubdtype(x.dtype, jnp.integer)
    assert_pow2_scales(got)
    assert_close_values(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.slow  # for time: test_rescale_policy's GPT Adam step checks invariance by default
@settings(max_examples=examples(5), deadline=None)
@given(data=st.data())
def test_gpt_adam_step_invariance(data):
    """Loss, new params and new Adam state equal the plain step's, for input scales 2**k * unit, |k| <= 10.

    The model rescales its LayerNorm inputs and the step its gradients (identity on values).
    """
    _check_invariance(data, CFG, plain_step, scalified_step, max_exponent=10)


@pytest.mark.slow  # a variant of test_gpt_adam_step_invariance
@settings(max_examples=examples(3), deadline=None)
@given(data=st.data())
def test_gpt_bare_adam_step_untied_head_finite_mask_invariance(data):
    """No rescaling at all (|k| <= 2, see the module docstring); untied head; a -1e9 mask; debug prints.

    The finite mask is a constant with a scale of its own (2**29): ``select_n`` aligns the
    scores to it, a case the -inf mask (any scale) does not exercise.
    """
    _check_invariance(data, CFG_UNTIED, plain_untied_step, scalified_untied_step, max_exponent=2)


def test_scaled_state_in_and_out_keeps_its_structure():
    params, opt_state, tokens, targets = _problem(0, CFG)
    scaled_state = jsa.as_scaled_array(opt_state)
    _, new_params, new_state = scalified_step(jsa.as_scaled_array(params), scaled_state, tokens, targets)
    is_leaf = jsa.is_scaled_leaf
    assert jax.tree.structure(new_state, is_leaf=is_leaf) == jax.tree.structure(scaled_state, is_leaf=is_leaf)
    assert jax.tree.structure(new_params, is_leaf=is_leaf) == jax.tree.structure(
        jsa.as_scaled_array(params), is_leaf=is_leaf
    )
    assert int(new_state[0].count) == int(opt_state[0].count) + 1  # the integer count stays plain
    assert_pow2_scales((new_params, new_state))


# --- float16 ---------------------------------------------------------------------------------
def _float16_problem(seed: int = 1):
    """float16 parameters (so float16 activations and gradients) and float32 Adam moments.

    The step casts the gradients to float32 before Adam (see ``make_adam_step``).
    """
    rng = np.random.default_rng(seed)
    params = init_gpt(rng, CFG)
    tokens, targets = gpt_batch(rng, CFG, batch=4)
    opt_state = ADAM.init(params)  # zero moments, as at the start of training
    params16 = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    return params, opt_state, params16, jsa.as_scaled_array(opt_state), tokens, targets


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jsa.asarray(tree, jnp.float32)))


@pytest.mark.slow  # compiles a float16 GPT step; tests/experiments/test_gpt_smoke.py trains one by default
def test_gpt_float16_training_reduces_the_loss():
    """Six float16 steps: float16 outputs with power-of-two scales, the first loss within 1% of
    float32's (float16 rounds to 11 bits, ~5e-4 relative per operation), the loss falls and
    follows the float32 run's to 2%."""
    params32, state32, params, state, tokens, targets = _float16_problem()
    losses, losses32 = [], []
    for step in range(6):
        loss, params, state = scalified_step(params, state, tokens, targets)
        loss32, params32, state32 = plain_step(params32, state32, tokens, targets)
        if step == 0:
            assert loss.dtype == jnp.float16
            assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(params, is_leaf=jsa.is_scaled_leaf))
            assert_pow2_scales((loss, params, state))
            np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(loss32), rtol=1e-2)
        losses.append(float(loss.to_array(jnp.float32)))
        losses32.append(float(loss32))
    assert _all_finite((params, state))
    assert losses[-1] < 0.5 * losses[0], losses  # Adam at lr 1e-2 on one batch: 10.2 -> 1.9
    np.testing.assert_allclose(losses, losses32, rtol=2e-2)


# --- debug print -----------------------------------------------------------------------------
def _printed(capsys) -> tuple[list[float], list[float]]:
    jax.effects_barrier()
    out = capsys.readouterr().out
    return [float(v) for v in re.findall(r"loss=([-0-9.e+]+)", out)], [
        float(v) for v in re.findall(r"grad_norm=([-0-9.e+]+)", out)
    ]


@pytest.mark.slow  # a GPT step compiled for one print; tests/ops/test_debug.py covers debug_print by default
def test_debug_print_inside_the_scalified_step(capsys):
    """``jax.debug.print`` in the loss (under value_and_grad) and after it prints values, as the plain step does."""
    params, opt_state, tokens, targets = _problem(2, CFG_UNTIED)
    _printed(capsys)  # drain prints of earlier tests
    plain_loss, _, _ = plain_untied_step(params, opt_state, tokens, targets)
    (expected_loss,), (expected_norm,) = _printed(capsys)
    np.testing.assert_allclose(expected_loss, float(plain_loss), rtol=1e-5)

    scaled = random_pow2_scaling((params, opt_state), numpy_exponents(np.random.default_rng(2), -3, 3))
    loss, _, _ = scalified_untied_step(*scaled, tokens, targets)
    printed_loss, printed_norm = _printed(capsys)
    assert len(printed_loss) == 1 and len(printed_norm) == 1, (printed_loss, printed_norm)
    np.testing.assert_allclose(printed_loss[0], float(loss.to_array()), rtol=1e-5)  # values, not data
    np.testing.assert_allclose(printed_loss[0], expected_loss, rtol=1e-5)
    np.testing.assert_allclose(printed_norm[0], expected_norm, rtol=1e-5)
