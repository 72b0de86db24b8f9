"""Interoperation with model libraries whose objects need more than ``jax.tree`` handling.

The modules here import their library lazily: :func:`jax_scalify.scalify` loads
:mod:`jax_scalify.interop.nnx` only when Flax NNX is already imported by the user.
"""
