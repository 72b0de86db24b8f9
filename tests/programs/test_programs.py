"""The real-program suite: eleven training programs, as their libraries' users write them, under scalify.

For each program (see the modules of this package):

- float32 invariance: two steps under ``jit(jsa.scalify(step))`` with every floating input
  leaf at a random power-of-two scale in ``2**-8 .. 2**8`` match the plain float32 steps to
  a relative error of at most ``1e-4`` (every output leaf: losses, parameters, optimizer
  and model state);
- FP16: training with the recipe of :mod:`tests.programs.recipe` (scaled float16 state and
  inputs) ends at most 5% above the float32 loss (below is no failure, see
  :func:`~tests.programs.harness.relative_excess`); plain float16 (the same code on float16
  arrays) runs beside it and its loss is reported, not checked;
- FP8 (programs with dense layers): the FP8 recipe of ``jsa.nn.linear`` (E4M3 forward, E5M2
  gradients) in every dense layer, on scaled float16 state, ends at most 10% above float32.

The invariance checks of seven programs and the short FP16 run of the NNX CNN (``DEFAULT_FP16``)
are part of the default test run; the invariance of the four programs of ``SLOW_INVARIANCE``,
the other short FP16 runs, the FP8 runs and the long FP16 runs are marked ``slow`` (run them
with ``-m slow``), as are the checks of
``MORE_PROGRAMS`` (a Linen ResNet with BatchNorm statistics, a Linen LSTM, NNX LoRA, an
Equinox parallel-scan recurrence, an Equinox selective state-space LM, an NNX transformer
whose layers are stacked by ``nnx.vmap`` and run by ``nnx.scan``; an Equinox
convolutional autoencoder runs by default) and
of the RealNVP flow.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import jax_scalify as jsa

from . import (
    autoencoder_eqx,
    cnn_eqx,
    cnn_nnx,
    conv_eqx,
    diffusion_linen,
    examples_0_1,
    flow_linen,
    gpt_linen,
    gru_eqx,
    lora_nnx,
    lru_eqx,
    lstm_linen,
    mamba_eqx,
    mlp_jax,
    recipe,
    resnet_linen,
    seq2seq_linen,
    transformer_jax,
    transformer_nnx,
)
from .harness import Program, _as_jax, _leaf_errors, final_loss, invariance_errors, relative_excess, train

PROGRAMS = [m.PROGRAM for m in (gpt_linen, cnn_nnx, gru_eqx, conv_eqx, diffusion_linen, mlp_jax)] + [
    # A Haiku-style transformer in plain JAX (LayerNorm through
    # jnp.var, clipped Adam), an Equinox CNN with a stride-1 MaxPool2d, a Linen LSTM
    # encoder-decoder whose step closes over a typed PRNG key, and jax-scalify 0.1's MNIST
    # examples (an MLP from scratch with SGD and its FP8 casts, a Linen MLP with Adam).
    transformer_jax.PROGRAM,
    cnn_eqx.PROGRAM,
    seq2seq_linen.PROGRAM,
    examples_0_1.SGD_PROGRAM,
    examples_0_1.ADAM_PROGRAM,
]
# More idioms (invariance and short FP16 training): Linen BatchNorm with a mutable
# batch_stats collection, Linen's nn.RNN over an LSTM cell, NNX LoRA, an Equinox linear
# recurrence computed by jax.lax.associative_scan, a Mamba-style selective scan, an NNX
# transformer stacked by nnx.vmap and run by nnx.scan under nnx.remat (these six in the slow
# run only), and an Equinox convolutional autoencoder with a tanh GELU (small: in the
# default run too).
MORE_PROGRAMS = [
    m.PROGRAM for m in (resnet_linen, lstm_linen, lora_nnx, lru_eqx, mamba_eqx, transformer_nnx, autoencoder_eqx)
]
DEFAULT_MORE = ("autoencoder_eqx",)
MORE = [p if p.name in DEFAULT_MORE else pytest.param(p, marks=pytest.mark.slow) for p in MORE_PROGRAMS]
DENSE_PROGRAMS = [p for p in PROGRAMS if p.has_dense]
INVARIANCE_TOLERANCE = 1e-4
FP16_TOLERANCE = 0.05
FP8_TOLERANCE = 0.10

by_name = functools.partial(pytest.mark.parametrize, "program", ids=lambda p: p.name)


@functools.cache
def losses(program: Program, mode: str, steps: int) -> np.ndarray:
    """Training losses, computed once per session (the FP16 and FP8 tests share the FP32 run)."""
    return train(program, mode, steps)


# The GPT's invariance compiles the largest steps (tests/properties/test_rescale_policy.py checks
# a GPT Adam step's invariance in the default run); the transformer's, the encoder-decoder's
# and the Linen MLP's take 10-25 s each; the NNX CNN trains in float16 in the default run.
SLOW_INVARIANCE = ("gpt_linen", "transformer_jax", "seq2seq_linen", "mlp_adam_linen_0_1", "cnn_nnx")


@pytest.mark.parametrize(
    "program",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_INVARIANCE else p for p in PROGRAMS],
    ids=lambda p: p.name,
)
def test_float32_invariance(program: Program, record_property):
    errors = invariance_errors(program, steps=2)
    worst = max(errors, key=errors.get)
    record_property("worst_relative_error", errors[worst])
    print(f"\n{program.name}: float32 invariance, worst relative error {errors[worst]:.3g} at {worst}")
    assert errors[worst] <= INVARIANCE_TOLERANCE, (
        f"{program.name}: scalified float32 differs from plain float32 by {errors[worst]:.3g} (relative) at {worst}; "
        f"errors above tolerance: { {k: v for k, v in errors.items() if v > INVARIANCE_TOLERANCE} }"
    )


def check_fp16(program: Program, steps: int, record_property, summary=final_loss) -> None:
    final = {mode: summary(losses(program, mode, steps)) for mode in ("fp32", "fp16_scalify", "fp16_plain")}
    for mode, loss in final.items():
        record_property(f"final_loss_{mode}", loss)
    print(
        f"\n{program.name}, {steps} steps, {summary.__name__}: " + ", ".join(f"{m} {v:.4f}" for m, v in final.items())
    )
    assert np.isfinite(final["fp32"]), f"{program.name}: the float32 run itself diverged"
    excess = relative_excess(final["fp16_scalify"], final["fp32"])
    assert excess <= FP16_TOLERANCE, (
        f"{program.name}: scalified FP16 ends at {final['fp16_scalify']:.4f}, {excess:.1%} above FP32's "
        f"{final['fp32']:.4f} (plain FP16: {final['fp16_plain']:.4f})"
    )


def check_fp8(program: Program, steps: int, record_property, summary=final_loss) -> None:
    fp32, fp8 = (summary(losses(program, mode, steps)) for mode in ("fp32", "fp8_scalify"))
    record_property("final_loss_fp8_scalify", fp8)
    print(f"\n{program.name}, {steps} steps, {summary.__name__}: fp32 {fp32:.4f}, fp8_scalify {fp8:.4f}")
    excess = relative_excess(fp8, fp32)
    assert excess <= FP8_TOLERANCE, (
        f"{program.name}: scalified FP8 ends at {fp8:.4f}, {excess:.1%} above FP32's {fp32:.4f}"
    )


# Training compiles three steps (FP32, scalified FP16, plain FP16) per program: the default
# run trains the NNX CNN, whose SGD momentum drifted under static scales; the other short FP16
# runs are slow-marked with the long ones (the README recipe test trains an MLP by default).
DEFAULT_FP16 = ("cnn_nnx",)
FP16_SHORT = [p if p.name in DEFAULT_FP16 else pytest.param(p, marks=pytest.mark.slow) for p in PROGRAMS]


@pytest.mark.parametrize("program", FP16_SHORT, ids=lambda p: p.name)
def test_fp16_short(program: Program, record_property):
    check_fp16(program, program.fp16_steps, record_property)


# bfloat16: float32's exponent range, so what the recipe adds is the scale propagation's
# exactness; the plain-JAX MLP in the default run, every program in the slow one.
DEFAULT_BF16 = ("mlp_jax",)


@pytest.mark.parametrize(
    "program",
    [p if p.name in DEFAULT_BF16 else pytest.param(p, marks=pytest.mark.slow) for p in PROGRAMS],
    ids=lambda p: p.name,
)
def test_bf16_short(program: Program, record_property):
    fp32, bf16 = (final_loss(losses(program, mode, program.fp16_steps)) for mode in ("fp32", "bf16_scalify"))
    record_property("final_loss_bf16_scalify", bf16)
    print(f"\n{program.name}, {program.fp16_steps} steps: fp32 {fp32:.4f}, bf16_scalify {bf16:.4f}")
    excess = relative_excess(bf16, fp32)
    assert excess <= FP16_TOLERANCE, f"{program.name}: scalified bfloat16 ends {excess:.1%} above FP32's {fp32:.4f}"


@pytest.mark.slow
@by_name(DENSE_PROGRAMS)
def test_fp8_short(program: Program, record_property):
    check_fp8(program, program.fp16_steps, record_property)


@pytest.mark.slow
@by_name(PROGRAMS)
def test_fp16_long(program: Program, record_property):
    check_fp16(program, program.slow_steps, record_property, program.slow_summary)


@pytest.mark.slow
@by_name(DENSE_PROGRAMS)
def test_fp8_long(program: Program, record_property):
    check_fp8(program, program.slow_steps, record_property, program.slow_summary)


@by_name(MORE)
def test_more_programs_float32_invariance(program: Program):
    errors = invariance_errors(program, steps=2)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= INVARIANCE_TOLERANCE, f"{program.name}: {errors[worst]:.3g} at {worst}"


@by_name(MORE)
def test_more_programs_fp16(program: Program, record_property):
    check_fp16(program, program.fp16_steps, record_property)


@pytest.mark.slow
def test_lora_base_weights_stay_exactly_where_they_were_in_fp16():
    """Only the adapters train: the frozen float16 base weights keep their values exactly."""
    program = lora_nnx.PROGRAM
    tx = recipe.optimizer(program.make_optimizer())
    model, optimizer = recipe.scale_state(program.init(0, tx, False))
    base_before = recipe.value(model.hidden1.kernel.get_value())
    step = recipe.compile_step(program.make_train_step(tx, False), program.jit)
    for batch in program.batches(0, 5):
        step(model, optimizer, *recipe.scale_batch(_as_jax(batch)))
    np.testing.assert_array_equal(np.asarray(recipe.value(model.hidden1.kernel.get_value())), np.asarray(base_before))
    adapter = recipe.value(model.hidden1.lora.lora_b.get_value())
    assert np.any(np.asarray(adapter) != 0), "the adapter did not train"


@pytest.mark.slow
@pytest.mark.parametrize("steps", [flow_linen.PROGRAM.fp16_steps, flow_linen.PROGRAM.slow_steps])
def test_realnvp_flow_fp16(steps, record_property):
    """A program outside the suite (see :mod:`tests.programs.flow_linen` for why): FP16 only."""
    check_fp16(flow_linen.PROGRAM, steps, record_property)


@pytest.mark.slow  # 45 s of compilation (24 dense layers)
def test_realnvp_flow_float32_from_recipe_state_equals_plain():
    """The flow's invariance from the state ``jsa.as_scaled_array`` gives (unit-sized data)."""
    program = flow_linen.PROGRAM
    tx = program.make_optimizer()
    state, batch = program.init(0, tx, False), _as_jax(program.batches(0, 1)[0])
    expected = jax.jit(program.make_train_step(tx))(*state, *batch)
    got = jax.jit(jsa.scalify(program.make_train_step(tx)))(*jsa.as_scaled_array(state), *jsa.as_scaled_array(batch))
    errors = _leaf_errors(jsa.asarray(got), expected)
    assert max(errors.values()) <= INVARIANCE_TOLERANCE, {k: v for k, v in errors.items() if v > INVARIANCE_TOLERANCE}


@pytest.mark.slow
def test_prodigy_learns_its_rate_with_float16_weights(record_property):
    """Prodigy starts at a rate of ``d0 = 1e-6`` and raises it from the distance between the
    weights and their initial values. Its first updates are far below half a unit in the last
    place of float16 weights: rounded away, the distance stayed 0, the rate at 1e-6, and the
    MLP's loss at 2.38 after 60 steps (FP32 0.167). ``scale_state`` carries what the weights
    round away and gives Prodigy the carried weights: it ends with FP32."""
    program = dataclasses.replace(
        mlp_jax.PROGRAM, name="mlp_jax_prodigy", make_optimizer=lambda: optax.contrib.prodigy(1.0)
    )
    check_fp16(program, 60, record_property)
