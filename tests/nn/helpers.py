"""Helpers shared by the training tests of ``tests/nn``."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa


def as_scaled_state(tree, dtype):
    """Floating leaves of an optimizer state as ``ScaledArray`` with ``dtype`` data.

    All-zero leaves (fresh moments) get scale 0, "this tensor is zero", so the first
    ``b * m + (1 - b) * g`` takes the gradient's scale; ``jsa.as_scaled_array`` would give
    them scale 1, which dominates that sum and flushes small gradients in FP16. Other
    floating leaves get ``jsa.as_scaled_array``'s unit-RMS scale; the rest pass through.
    """

    def leaf(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        if not np.any(np.asarray(x)):
            return jsa.ScaledArray(jnp.zeros(np.shape(x), dtype), jnp.float32(0.0))
        return jsa.as_scaled_array(jnp.asarray(x)).astype(dtype)

    return jax.tree.map(leaf, tree)


def init_mlp(rng, sizes) -> list:
    """Dense layers ``{"w", "b"}`` of the given sizes, weights of unit fan-in variance, zero biases."""
    return [
        {"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in zip(sizes[:-1], sizes[1:])
    ]
