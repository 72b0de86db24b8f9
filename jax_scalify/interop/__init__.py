"""Interoperation with model libraries whose objects need more than ``jax.tree`` handling.

The modules here import their library lazily: the adapter registered below loads
:mod:`jax_scalify.interop.nnx` only once Flax NNX is imported by the user.
"""

import sys

from ..core.interpreter import register_call_adapter


def _nnx_call(fun, args, kwargs):
    """The functional form of a call with Flax NNX objects among its arguments, else None."""
    if "flax.nnx" not in sys.modules:  # no NNX object can exist before flax.nnx is imported
        return None
    from . import nnx

    return nnx.GraphCall.of(fun, args, kwargs)


register_call_adapter(_nnx_call)
