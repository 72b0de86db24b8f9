"""Helpers shared by the training tests of ``tests/nn``."""
import jax
import jax.numpy as jnp

import jax_scalify as jsa


def as_scaled_state(tree, dtype):
    """Floating leaves of an optimizer state as ``ScaledArray`` with ``dtype`` data.

    ``jsa.as_scaled_array`` gives all-zero leaves (fresh moments) scale 0, "this tensor is
    zero", so the first ``b * m + (1 - b) * g`` takes the gradient's scale; other floating
    leaves get its unit-RMS scale; the rest pass through.
    """

    def leaf(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        return jsa.as_scaled_array(jnp.asarray(x)).astype(dtype)

    return jax.tree.map(leaf, tree)
