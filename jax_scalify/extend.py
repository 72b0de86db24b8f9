"""The engine of jax_scalify, for authors of scale rules (as ``jax.extend`` is for JAX's).

Users need none of this: ``jax_scalify`` and its ``ops``, ``nn``, ``tree``, ``quantization``
and ``analysis`` namespaces hold the user API. A rule author finds here, in one place:

- the registry: :func:`register_scaled_op` (one call with all of a rule's metadata:
  when it runs, whether its inputs are promoted, whether the primitive preserves broadcast
  scalars), :func:`register_scaled_lax_op`, :func:`registered_rule`, :class:`RegisteredRule`;
- the interpreter's entry points: :func:`eval_scaled_jaxpr` and :func:`eval_closed_jaxpr`
  (a sub-jaxpr evaluated with the rules), :func:`observe_equations`;
- what is known about a value: :func:`known_scalar` (the scalar a plain value known at trace
  time repeats: a constant is its NumPy value), :class:`ScaleFacts` (``any_scale``, ``slices``: pytree aux
  data of a ``ScaledArray``), :func:`any_scale_array`, :func:`is_any_scale`, :func:`promote`,
  and the power-of-two contract :func:`scales_are_pow2`;
- sub-jaxprs (from :mod:`jax_scalify.lax.subjaxpr`): :func:`eval_sub_jaxpr` on an open
  jaxpr and :func:`fixed_point` / :func:`check_structure` for bodies whose scaled outputs
  must be fixed before they are traced (loop carries, branches, ``shard_map``);
- the scale arithmetic the built-in rules share (from :mod:`jax_scalify.core.scaling`):
  exact power-of-two rescaling (:func:`rescale`, :func:`mul_data`), common scales
  (:func:`largest_scale`, :func:`align_to_largest`), scale products kept within range
  (:func:`scaled_product`, :func:`scaled_power`), values in float32 (:func:`value_of`,
  :func:`scaled_from_value`), unit-scaled sums and exact roots;
- ``custom_scale_call_p``, the primitive behind :func:`jax_scalify.custom_scale`.

Example, a rule for a primitive that keeps its operand's scale::

    from jax_scalify import extend as jsx

    @jsx.register_scaled_op(my_p, scalar_preserving=True)
    def scaled_my_op(x: jsx.ScaledArray, **params) -> jsx.ScaledArray:
        \"\"\"Scale kept, my_op applied to the data.\"\"\"
        return jsx.bind_keep_scale(my_p, x, **params)
"""

from .core import scaling
from .core.array import ScaledArray, ScaleFacts, is_floating_dtype
from .core.constants import known_scalar
from .core.custom_scale import custom_scale_call_p
from .core.interpreter import eval_closed_jaxpr, eval_scaled_jaxpr, observe_equations
from .core.pow2 import scales_are_pow2
from .core.promotion import promote
from .core.registry import (
    RegisteredRule,
    ScaledPrimitiveType,
    ScaledRule,
    find_registered_scaled_op,
    lax_primitive,
    primitive_of,
    register_scaled_lax_op,
    register_scaled_op,
    registered_rule,
    registered_rules,
)
from .core.scaling import *  # noqa: F401,F403  (its __all__: the shared scale arithmetic)
from .lax import subjaxpr
from .lax.subjaxpr import *  # noqa: F401,F403  (its __all__: sub-jaxprs and their scaled outputs)

__all__ = (
    [
        "RegisteredRule",
        "ScaleFacts",
        "ScaledArray",
        "ScaledPrimitiveType",
        "ScaledRule",
        "custom_scale_call_p",
        "eval_closed_jaxpr",
        "eval_scaled_jaxpr",
        "find_registered_scaled_op",
        "is_floating_dtype",
        "known_scalar",
        "lax_primitive",
        "observe_equations",
        "primitive_of",
        "promote",
        "register_scaled_lax_op",
        "register_scaled_op",
        "registered_rule",
        "registered_rules",
        "scales_are_pow2",
    ]
    + scaling.__all__
    + subjaxpr.__all__
)
