"""Scalify configuration: power-of-two rounding mode and scale dtype.

The configuration is read at trace time by the scale rules. It is a frozen dataclass
that doubles as a context manager, so a block of code can trace with other settings::

    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        out = jsa.scalify(fn)(x)
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any

import numpy as np


class Pow2RoundMode(enum.IntEnum):
    """How a scale is turned into a power of two.

    - ``NONE``: no rounding; scales are whatever the rule computes (not powers of two). While
      it is in force, ``ScaledArray`` and ``scalify`` accept any positive finite scale (or 0)
      instead of requiring a power of two.
    - ``DOWN``: round down, ``2**floor(log2(s))`` (the default: the Scalify paper found it
      keeps data closest to unit scale).
    - ``UP``: round up, ``2**ceil(log2(s))``.
    - ``STOCHASTIC``: reserved; not implemented yet (using it raises).
    """

    NONE = 0
    DOWN = 1
    UP = 2
    STOCHASTIC = 3


_ALLOWED_SCALE_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class ScalifyConfig:
    """Settings used by the scale rules while a function is traced under ``scalify``.

    Args:
        rounding_mode: how computed scales are rounded to powers of two.
        scale_dtype: dtype of the scales created by rules and by promotion of unscaled
            values. Float32 by default (the paper simulates E8M0 scales in float32); it is
            never silently the data dtype (``None``, which meant the data dtype in
            jax-scalify 0.1, gives the float32 default).
        guard_traced_scales: keep the traced (run-time) scales of products and quotients
            (``mul``, ``div``, ``dot_general``, ``conv``, sums' ``sqrt(K)`` factors,
            ``integer_pow``) within the scale dtype's normal range, moving the excess into
            the data, as is always done for trace-time scales. Off by default: it costs five
            scalar operations and one data multiply per product, a large addition to compile
            time (see ``docs/benchmarks.md``). Turn it on for programs whose scales approach
            ``2**±127``.

    Use as a context manager to change the settings for the code traced inside it.
    """

    rounding_mode: Pow2RoundMode = Pow2RoundMode.DOWN
    scale_dtype: Any = np.float32
    guard_traced_scales: bool = False

    def __post_init__(self):
        if not isinstance(self.rounding_mode, Pow2RoundMode):
            raise ValueError(
                f"ScalifyConfig.rounding_mode must be a jsa.Pow2RoundMode, got {self.rounding_mode!r}. "
                f"Use one of {[m.name for m in Pow2RoundMode]}, e.g. jsa.Pow2RoundMode.DOWN."
            )
        if self.rounding_mode == Pow2RoundMode.STOCHASTIC:
            raise NotImplementedError(
                "Pow2RoundMode.STOCHASTIC is not implemented yet; use Pow2RoundMode.DOWN (default) or UP."
            )
        if self.scale_dtype is None:  # jax-scalify 0.1's "scale dtype of the data": see docs/migration.md
            object.__setattr__(self, "scale_dtype", np.float32)
        try:
            dtype = np.dtype(self.scale_dtype)
        except TypeError as err:
            raise ValueError(f"ScalifyConfig.scale_dtype {self.scale_dtype!r} is not a dtype.") from err
        if dtype.name not in _ALLOWED_SCALE_DTYPES:
            raise ValueError(
                f"ScalifyConfig.scale_dtype must be one of {_ALLOWED_SCALE_DTYPES}, got {dtype.name}. "
                "Scales need the exponent range of a 16-bit or wider float; float32 is the default."
            )
        object.__setattr__(self, "scale_dtype", dtype)
        if not isinstance(self.guard_traced_scales, bool):
            raise ValueError(
                f"ScalifyConfig.guard_traced_scales must be True or False, got {self.guard_traced_scales!r}."
            )

    def __enter__(self) -> ScalifyConfig:
        _config_stack().append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _config_stack().pop()


class _ConfigState(threading.local):
    def __init__(self):
        self.stack = [ScalifyConfig()]


_state = _ConfigState()


def _config_stack() -> list:
    return _state.stack


def get_scalify_config() -> ScalifyConfig:
    """The configuration in force (the innermost ``with ScalifyConfig(...)``)."""
    return _state.stack[-1]
