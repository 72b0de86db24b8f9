"""Layers with custom scale rules (the Scalify paper's appendix C).

Every function is the plain JAX function outside ``scalify`` (same values and derivative
as its ``jax.nn`` counterpart) and uses its own scale rule under ``scalify``:

- activations: :func:`relu`, :func:`gelu`, :func:`silu` keep the input's scale;
  :func:`softmax` (output scale ``1/n``), :func:`log_softmax`, :func:`logsumexp` are
  computed on the max-subtracted values in float32;
- normalisation: :func:`layer_norm`, :func:`rms_norm` normalise the data (output scale 1,
  unit-RMS data), :func:`layer_norm_grad_rescale` also rescales its input gradient;
- :func:`linear`: ``x @ w + b`` with separate forward and backward dtypes (FP8 E4M3 / E5M2);
- :func:`dot_general`: ``lax.dot_general`` (any contracting and batch axes) with the same
  forward / backward casts; :func:`cast_dot_general` returns one with fixed formats for
  Flax's ``dot_general=`` arguments (``nn.Dense``, ``nnx.Linear``, ``nnx.LinearGeneral``...);
- :func:`cross_entropy`: integer-label softmax cross-entropy, exact power-of-two split of the loss.
"""

from .activations import gelu, log_softmax, logsumexp, relu, silu, softmax
from .cast_dot import CastDotGeneral, cast_dot_general, dot_general
from .linear import linear
from .losses import cross_entropy
from .normalization import layer_norm, layer_norm_grad_rescale, rms_norm

__all__ = [
    "CastDotGeneral",
    "cast_dot_general",
    "cross_entropy",
    "dot_general",
    "gelu",
    "layer_norm",
    "layer_norm_grad_rescale",
    "linear",
    "log_softmax",
    "logsumexp",
    "relu",
    "rms_norm",
    "silu",
    "softmax",
]
