"""The rescale policy: where ``jsa.scalify`` moves a statistic of the data into the scale by itself.

The scale rules (``jax_scalify.lax``) propagate scales statically, as if every input were
unit-scaled and independent. :class:`RescalePolicy` says at which typed sites of a step
(:mod:`jax_scalify.core.sites`) that estimate is replaced by a measurement; its default is
what ``jsa.scalify`` applies. Rescaling is exact, so values are the same under every
policy: only the data/scale split differs. See ``docs/rescale_policy.md``.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Jaxpr

from ..core import sites
from .analyses import backward_product_residuals, gradient_boundary

_NORMS = ("l1", "l2", "max")
_COMPONENTS = ("gradients", "loop_carries", "outputs", "contractions", "self_products", "fp8_casts")


@dataclasses.dataclass(frozen=True)
class RescalePolicy(sites.ScalePolicy):
    """Where ``jsa.scalify`` inserts dynamic rescales by itself; each flag switches one family of sites.

    Args:
        gradients: the backward pass. The gradients leaving it (every value defined by a
            transposed equation and used by forward code or returned; a use that only reads
            the value, ``stop_scaling``, does not count) are rescaled together before their
            first forward use. Inside it: a plain array promoted where
            it meets scaled data (the loss's cotangent times plain inputs) gets its
            statistic as scale; sums of float16/FP8 data (``reduce_sum``, ``cumsum``,
            ``scatter-add``; not collectives) are accumulated in float32 and narrowed with
            their statistic; an elementwise sum of two operands with run-time scales, not
            both chosen from their data, is taken at the smaller operand scale and rescaled;
            each float16/FP8 forward value a backward product reads is rescaled once, those
            defined so far together, before the first backward equation that reads one.
        loop_carries: the scaled carries of ``scan``/``while`` bodies, at every iteration.
        outputs: the floating scaled values the scalified function returns (the next step's
            state), together; values whose scale was just chosen (gradients, stored optimizer
            state, casts of either) or set with ``jsa.lax.set_scaling`` are left as they are.
        contractions: the result of every forward ``dot_general``/``conv_general_dilated``
            with traced data (trained weights and positive activations are correlated: their
            sums grow like ``K``, not the ``sqrt(K)`` of the static rule).
        self_products: products of two operands sharing one scale (``x * x``, slices of one
            array, as an associative scan's combine), the operands of such a contraction
            (``x @ x.T``) and the base of ``x ** y`` with ``|y| >= 3``: squaring compounds a
            departure from unit size. Narrow data are multiplied in float32 and narrowed with
            the largest entry bounded.
        fp8_casts: a cast of wider data into an 8-bit float, by the statistic of all its
            data with its largest entry at most half the format's largest power of two (as
            per-tensor FP8 recipes take an amax).
        norm: the statistic: ``"l2"`` (root mean square, default), ``"l1"`` (mean absolute
            value) or ``"max"``; rounded to a power of two with the configured rounding mode.
        sample_size: a tensor of at most this many elements is read whole; a larger one on a
            strided sample of at most about this many elements (at most 32 along any axis);
            ``None`` reads every tensor whole. An all-zero sample leaves the scale unchanged.

    ``RescalePolicy()`` is the default of ``jsa.scalify``; :meth:`RescalePolicy.static` is
    the paper's pure static propagation.
    """

    gradients: bool = True
    loop_carries: bool = True
    outputs: bool = True
    contractions: bool = True
    self_products: bool = True
    fp8_casts: bool = True
    norm: str = "l2"
    sample_size: int | None = 1024

    def __post_init__(self):
        for field in _COMPONENTS:
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"RescalePolicy.{field} must be True or False, got {getattr(self, field)!r}.")
        if self.norm not in _NORMS:
            raise ValueError(f"RescalePolicy.norm must be one of {_NORMS}, got {self.norm!r}.")
        size = self.sample_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"RescalePolicy.sample_size must be a positive int or None, got {size!r}.")

    @classmethod
    def static(cls) -> RescalePolicy:
        """The paper's pure static propagation: no automatic rescale anywhere."""
        return cls(**dict.fromkeys(_COMPONENTS, False))

    def gradient_values(self, jaxpr: Jaxpr) -> frozenset:
        return gradient_boundary(jaxpr) if self.gradients else frozenset()

    def residual_values(self, jaxpr: Jaxpr) -> frozenset:
        return backward_product_residuals(jaxpr) if self.gradients else frozenset()


DEFAULT_POLICY = RescalePolicy()
STATIC_POLICY = RescalePolicy.static()
sites.set_default_policy(DEFAULT_POLICY)

__all__ = ["RescalePolicy"]
