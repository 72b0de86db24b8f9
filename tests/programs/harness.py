"""The checks every program of the suite goes through.

A :class:`Program` describes a training program as its users write it: how to build the
optimizer, the initial state and the (undecorated) training step, which ``jit`` the library
uses, how the training loop calls the step, and its batches. The harness then

- :func:`invariance_errors`: runs a few steps in float32 plainly and under
  ``jit(jsa.scalify(step))`` with every floating input leaf (parameters, optimizer state,
  batch) a ``ScaledArray`` at a random power-of-two scale in ``2**-8 .. 2**8`` (same values),
  and returns the relative error of every output leaf (losses and final state);
- :func:`train`: trains in float32, in FP16 with the recipe of :mod:`tests.programs.recipe`
  under scalify, in plain FP16 (the same code on float16 state and inputs) and, for
  programs with dense layers, with FP8 matmuls under scalify.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

from . import recipe

State = Any
Batch = tuple
MAX_SCALE_EXPONENT = 8
MODES = ("fp32", "fp16_scalify", "fp16_plain", "fp8_scalify", "bf16_scalify")
RECIPE_DTYPES = {"fp16_scalify": jnp.float16, "fp8_scalify": jnp.float16, "bf16_scalify": jnp.bfloat16}

REPO = Path(__file__).resolve().parents[2]
# CI keeps shared data next to the repository; a git worktree sits one level further down.
DATA_DIRS = (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data")


def shared_data_file(name: str) -> Path | None:
    """``name`` in the shared data folder next to the repository (or its worktree's parent), or None."""
    for folder in DATA_DIRS:
        if (folder / name).is_file():
            return folder / name
    return None


def final_loss(losses: Sequence[float]) -> float:
    """The mean training loss of the last tenth of the run (at least 5 steps): one batch's loss is noisy."""
    losses = np.asarray(losses)
    return float(np.mean(losses[-max(5, len(losses) // 10) :]))


def mean_loss(losses: Sequence[float]) -> float:
    """The mean training loss of the whole run: how fast and how far it trained, one number.

    Where a run's path is chaotic its last losses depend on every rounding (the NNX CNN at
    100 steps, 12 seeds: the final loss of float32 itself moves by up to 3.7% when its
    initial weights move by one float16 rounding step, and scalified FP16 ends 12% from
    float32 (standard deviation over seeds), either way); the mean over the run does not
    (scalified FP16 within 1.4% of float32 for each of the 12 seeds), and a run that stalls
    or diverges half-way still shows in it.
    """
    return float(np.mean(np.asarray(losses)))


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A training program as its library's users write it.

    Attributes:
        name: test id.
        make_optimizer: ``() -> optax transformation``.
        init: ``(seed, tx, fp8) -> state``, the float32 training state (``fp8``: the model's
            dense layers take the FP8 recipe, for programs with ``has_dense``).
        make_train_step: ``(tx, fp8) -> step``, the step before any ``jit``.
        jit: the library's ``jit`` (``jax.jit``, ``eqx.filter_jit``, ``nnx.jit``).
        call: ``(compiled_step, state, batch) -> (loss, state)``: one iteration of the loop.
        batches: ``(seed, count) -> [batch, ...]``: tuples of NumPy arrays (and PRNG keys).
        has_dense: whether the model has dense layers the FP8 recipe applies to.
        fp16_steps, slow_steps: training lengths of the fast and the slow FP16/FP8 runs.
        slow_summary: the number a slow run's losses are compared by: :func:`final_loss`, or
            :func:`mean_loss` where the end of a run moves by several percent with the
            rounding alone.
    """

    name: str
    make_optimizer: Callable[[], optax.GradientTransformation]
    init: Callable[[int, optax.GradientTransformation, bool], State]
    make_train_step: Callable[[optax.GradientTransformation, bool], Callable]
    jit: Callable[[Callable], Callable]
    call: Callable[[Callable, State, Batch], tuple[Any, State]]
    batches: Callable[[int, int], list[Batch]]
    has_dense: bool = True
    fp16_steps: int = 20
    slow_steps: int = 300
    slow_summary: Callable[[Sequence[float]], float] = final_loss


def functional_call(compiled: Callable, state: tuple, batch: Batch) -> tuple[Any, tuple]:
    """The loop of a functional program: ``loss, *state = step(*state, *batch)``."""
    loss, *new_state = compiled(*state, *batch)
    return loss, tuple(new_state)


def nnx_call(compiled: Callable, state: tuple, batch: Batch) -> tuple[Any, tuple]:
    """The loop of a Flax NNX program: ``loss = step(model, optimizer, *batch)`` updates both in place."""
    model, optimizer = state
    return compiled(model, optimizer, *batch), (model, optimizer)


# --- compiled steps, shared between tests ------------------------------------------------------
@functools.cache
def _setup(program: Program, mode: str) -> tuple[optax.GradientTransformation, Callable]:
    """The optimizer and the compiled step of ``program`` in ``mode`` (compiled once per session)."""
    tx = program.make_optimizer()
    scalified = mode in RECIPE_DTYPES
    if scalified:
        tx = recipe.optimizer(tx, RECIPE_DTYPES[mode])
    step = program.make_train_step(tx, mode == "fp8_scalify")
    return tx, (recipe.compile_step(step, program.jit) if scalified else program.jit(step))


@functools.cache
def _scalified_float32(program: Program) -> tuple[optax.GradientTransformation, Callable]:
    """The plain optimizer and the float32 step under scalify, for the invariance check."""
    tx = program.make_optimizer()
    return tx, recipe.compile_step(program.make_train_step(tx, False), program.jit)


def release_compiled_steps() -> None:
    """Drops the compiled steps shared between tests (they are compiled again on next use)."""
    _setup.cache_clear()
    _scalified_float32.cache_clear()


# --- float32 invariance ------------------------------------------------------------------------
def random_pow2_scaled(tree: Any, rng: np.random.Generator, max_exponent: int = MAX_SCALE_EXPONENT) -> Any:
    """Every floating array leaf as ``ScaledArray(value / s, s)``, ``s = 2**k``, ``k`` uniform in ``[-m, m]``."""

    def scale_leaf(x):
        if not recipe.is_floating_array(x):
            return x
        scale = np.float32(2.0 ** int(rng.integers(-max_exponent, max_exponent + 1)))
        return jsa.ScaledArray(jnp.asarray(np.asarray(x) / scale, x.dtype), jnp.asarray(scale))

    return jax.tree.map(scale_leaf, tree)


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """``max |got - expected| / max |expected|`` (inf if either is not finite)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if not (np.all(np.isfinite(got)) and np.all(np.isfinite(expected))):
        return float("inf") if not np.array_equal(got, expected, equal_nan=True) else 0.0
    norm = np.max(np.abs(expected), initial=0.0)
    diff = np.max(np.abs(got - expected), initial=0.0)
    return float(diff / norm) if norm > 0 else float(diff)


def invariance_errors(program: Program, steps: int = 2, seed: int = 0) -> dict[str, float]:
    """Relative error of every floating output leaf, scalified (random input scales) vs plain float32.

    Both runs start from the same state and see the same batches; the scalified run gets
    fresh random scales for the state and for every batch. Non-floating leaves (step
    counts, PRNG keys) must be equal; a mismatch is reported as an infinite error.
    """
    rng = np.random.default_rng(seed)
    tx, plain_step = _setup(program, "fp32")
    _, scaled_step = _scalified_float32(program)
    batches = program.batches(seed, steps)
    plain_state = program.init(seed, tx, False)
    scaled_state = random_pow2_scaled(program.init(seed, tx, False), rng)
    plain_losses, scaled_losses = [], []
    for batch in batches:
        loss, plain_state = program.call(plain_step, plain_state, _as_jax(batch))
        plain_losses.append(loss)
        loss, scaled_state = program.call(scaled_step, scaled_state, random_pow2_scaled(_as_jax(batch), rng))
        scaled_losses.append(loss)
    expected = {"losses": plain_losses, "state": plain_state}
    got = recipe.value({"losses": scaled_losses, "state": scaled_state})
    return _leaf_errors(got, expected)


def _leaf_errors(got: Any, expected: Any) -> dict[str, float]:
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    exp_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [p for p, _ in got_leaves] == [p for p, _ in exp_leaves], "scalified and plain outputs differ in structure"
    errors = {}
    for (path, g), (_, e) in zip(got_leaves, exp_leaves):
        name = jax.tree_util.keystr(path)
        if recipe.is_floating_array(e):
            errors[name] = relative_error(g, e)
        elif isinstance(e, jax.Array) and jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            errors[name] = 0.0 if np.array_equal(jax.random.key_data(g), jax.random.key_data(e)) else float("inf")
        elif isinstance(e, (jax.Array, np.ndarray)):
            errors[name] = 0.0 if np.array_equal(np.asarray(g), np.asarray(e)) else float("inf")
    return errors


# --- training runs -------------------------------------------------------------------------------
def _as_jax(batch: Batch) -> Batch:
    return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, batch)


def _cast_floating(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if recipe.is_floating_array(x) else x, tree)


def train(program: Program, mode: str, steps: int, seed: int = 0) -> np.ndarray:
    """The training losses (float64) of ``steps`` steps of ``program`` in ``mode`` (one of :data:`MODES`).

    - ``fp32``: the program as written;
    - ``fp16_scalify``: the recipe (:mod:`tests.programs.recipe`) in float16;
    - ``fp16_plain``: the code of ``fp32``, on float16 state and inputs (no scalify);
    - ``fp8_scalify``: as ``fp16_scalify``, the dense layers taking the FP8 recipe;
    - ``bf16_scalify``: the recipe in bfloat16 (state, moments and inputs).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    tx, step = _setup(program, mode)
    state = program.init(seed, tx, mode == "fp8_scalify")
    prepare = lambda tree: tree  # noqa: E731
    if mode == "fp16_plain":
        prepare = functools.partial(_cast_floating, dtype=jnp.float16)
        state = prepare(state)
    elif mode != "fp32":
        prepare = functools.partial(recipe.scale_batch, dtype=RECIPE_DTYPES[mode])
        state = recipe.scale_state(state, RECIPE_DTYPES[mode])
    losses = []
    for batch in program.batches(seed, steps):
        loss, state = program.call(step, state, prepare(_as_jax(batch)))
        losses.append(float(np.asarray(recipe.value(loss), np.float64)))
    return np.asarray(losses)


def relative_excess(loss: float, reference: float) -> float:
    """How much ``loss`` ends above ``reference``, relative to it (0 if below, inf if not finite).

    The training checks ask that a low-precision run trains as well as float32: ending above
    it is a failure, ending below it is not. Near the end of a long run the loss is small and
    two runs whose rounding differs follow different trajectories: their final losses differ
    by several percent either way (see :func:`mean_loss` for a program where they differ by
    more than the 5% the checks allow).
    """
    if not np.isfinite(loss):
        return float("inf")
    return max(0.0, (loss - reference) / abs(reference))
