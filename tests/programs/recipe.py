"""How a user turns a float32 training program into a scaled FP16 / FP8 one: the whole recipe.

This is the only module of the suite that knows the library's API for low precision: the
programs are written without scalify in mind, and the harness calls these functions. When
the recommended recipe changes (an optimizer-state wrapper, a rescale policy), change it here.

The recipe is the README's: the optimizer is wrapped with ``jsa.optim.scale_state`` (its
state stored in float16 with scales, updated in float32), every floating leaf of the
parameters becomes a ``ScaledArray`` with float16 data (``jsa.as_scaled_array`` then
``jsa.tree.astype``), so do the floating inputs of each batch, and the step runs as
``jit(jsa.scalify(step))`` with scalify's default rescale policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

FP16 = jnp.float16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_LINEAR = dict(fwd_dtype=E4M3, bwd_dtype=E5M2)  # the keyword arguments of ``jsa.nn.linear``


def is_floating_array(x: Any) -> bool:
    """A JAX or NumPy array of a floating dtype (PRNG keys, integers and non-arrays are not)."""
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def optimizer(tx: optax.GradientTransformation, dtype=FP16) -> optax.GradientTransformation:
    """The optimizer as the scaled runs use it: its state stored in ``dtype`` with scales.

    ``jsa.optim.scale_state`` keeps ``tx`` and its hyperparameters unchanged; its ``init``
    returns ``ScaledArray`` leaves, which :func:`scale_state` leaves alone. A second moment
    ``nu`` is kept in float16 when ``dtype`` has fewer mantissa bits (bfloat16: its EMA would
    stall, as ``scale_state`` warns).
    """
    fields = {"nu": FP16} if jnp.finfo(dtype).nmant < jnp.finfo(FP16).nmant else None
    return jsa.optim.scale_state(tx, dtype, field_dtypes=fields)


def scale_state(state: Any, dtype=FP16) -> Any:
    """Parameters and optimizer state: each floating array a unit-scaled ``ScaledArray`` of ``dtype``.

    ``ScaledArray`` leaves (the optimizer state ``scale_state`` stores), non-floating leaves and
    floating scalars are returned unchanged: the README casts the parameters, not the state
    ``tx.init`` returns, whose float32 scalars (``optax.inject_hyperparams``' hyperparameters)
    a cast would round.
    """

    def scale(x):
        return _scaled(x, dtype) if is_floating_array(x) and np.ndim(x) > 0 else x

    return jax.tree.map(scale, state, is_leaf=jsa.is_scaled_leaf)


def scale_batch(batch: Any, dtype=FP16) -> Any:
    """The floating inputs of a batch as ``ScaledArray`` of ``dtype``; labels, tokens, keys unchanged."""
    return scale_state(batch, dtype)


def _scaled(x, dtype) -> jsa.ScaledArray:
    return jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(x)), dtype)


def compile_step(step: Callable, jit: Callable[[Callable], Callable]) -> Callable:
    """The user's step under scalify, compiled with the program's own ``jit``."""
    return jit(jsa.scalify(step))


def value(x: Any) -> Any:
    """Plain float32 arrays from a (possibly) scaled result (a float16 loss above 65,504 is not inf)."""
    return jsa.asarray(x, jnp.float32)


# The ``dot_general`` that the Flax programs give their ``Dense``/``Linear`` layers for the FP8
# runs: ``jsa.nn.linear``'s recipe (E4M3 operands, E5M2 gradients) for any dimension numbers.
fp8_dot_general = jsa.nn.cast_dot_general(fwd_dtype=E4M3, bwd_dtype=E5M2)
