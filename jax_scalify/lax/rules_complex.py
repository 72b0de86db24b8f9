"""Scale rules of the primitives that make complex values from real ones: ``complex``, ``fft``.

A ``ScaledArray`` holds real data, so complex values inside scalify are plain arrays, as a
cast of a scaled value to a complex dtype already gives (``convert_element_type``), and as
``eig``'s outputs are. Operations on complex values are then plain JAX, and a real value
coming back from them (``real``, ``imag``, ``abs``, ``irfft``) enters the scaled operations
as any plain floating array does. What needs a rule is the step from real scaled inputs to
a complex output:

- ``complex`` (``jax.lax.complex``, ``x + 1j * y``): the complex value of the two inputs;
- ``fft`` with a real input: ``rfft`` in the forward pass, and the transform that transposes
  ``irfft`` in the backward pass. The transform is linear, ``fft(d * s) = fft(d) * s``,
  and XLA's FFT takes float32 or float64 only, so the rule transforms the value.

Both work on the float32 value of narrow data (exact for a power-of-two scale; JAX has no
complex type narrower than complex64, and ``jnp.fft`` already requires float32 input), so
the output has complex64's range whatever the input scales.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import primitives as P

from ..core.array import ScaledArray
from ..core.registry import register_scaled_lax_op
from ..core.scaling import to_float32_value


def _value(x: Any) -> Any:
    return to_float32_value(x) if isinstance(x, ScaledArray) else x


@register_scaled_lax_op
def scaled_complex(real: Any, imag: Any, **params) -> Any:
    """Plain complex output from the values of the real and imaginary parts."""
    return P.complex_p.bind(_value(real), _value(imag), **params)


@register_scaled_lax_op
def scaled_fft(x: ScaledArray, **params) -> Any:
    """Plain complex output: the FFT of the input's value (only a real input can be scaled)."""
    return P.fft_p.bind(_value(x), **params)


__all__ = ["scaled_complex", "scaled_fft"]
