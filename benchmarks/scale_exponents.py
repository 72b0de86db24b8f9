"""Scales as float32 powers of two against int32 exponents (as OCP MX's E8M0), on one scaled program.

Run: ``python -m benchmarks.scale_exponents`` (``--layers 16 --width 256 --rounds 20``).

The same scaled residual MLP forward pass is written twice, with only the scale arithmetic
differing: ``float32`` scales (what jax_scalify stores: products, quotients, ``max``, a
bit-level ``pow2_round_down`` of a statistic) and ``int32`` exponents (sums, differences,
``max``, the exponent field read from the bits, and ``2**e`` built from the bits wherever a
factor meets the data). Each layer does what a scalified layer does: a matmul of float16 data
(output scale ``s_x * s_w / r``, ``r = pow2(sqrt(width))``), a residual sum (common scale
``max``, both operands rescaled to it) and a dynamic rescale (the power of two below the RMS
of the data moved into the scale). Every weight comes with its own traced scale. Both read
exponents from the bits for normal numbers only (jax_scalify's own rounding also handles
subnormals, 0, inf and nan, at a few more equations), so that they do the same work.

Printed, for each representation: the number of equations, the trace time (``make_jaxpr``),
the compile CPU time (trace + lower + compile, cold caches) and the run time, medians.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxprs_in_params

from benchmarks.common import compile_times, interleaved_compile_medians, interleaved_medians


class Float32Scales:
    """Scales as float32 powers of two (jax_scalify's representation)."""

    name = "float32 scale"
    dtype = np.float32

    @staticmethod
    def from_pow2(k: int):
        return np.float32(2.0**k)

    @staticmethod
    def mul(a, b):
        return a * b

    @staticmethod
    def factor(a, b):
        """``a / b`` as a float32 factor for the data."""
        return a / b

    @staticmethod
    def below(stat):
        """The power of two at or below a positive normal statistic: its exponent bits."""
        bits = lax.bitcast_convert_type(stat, jnp.int32)
        return lax.bitcast_convert_type(lax.bitwise_and(bits, np.int32(0x7F800000)), jnp.float32)

    @staticmethod
    def as_float(s):
        return s


class Int32Exponents:
    """Scales as int32 exponents ``e`` (the scale is ``2**e``), like the E8M0 scales of OCP MX."""

    name = "int32 exponent"
    dtype = np.int32

    @staticmethod
    def from_pow2(k: int):
        return np.int32(k)

    @staticmethod
    def mul(a, b):
        return a + b

    @staticmethod
    def factor(a, b):
        return Int32Exponents.as_float(a - b)

    @staticmethod
    def below(stat):
        """The exponent of a positive normal statistic, read from its bits."""
        bits = lax.bitcast_convert_type(stat, jnp.int32)
        return lax.shift_right_logical(bits, np.int32(23)) - np.int32(127)

    @staticmethod
    def as_float(e):
        """``2**e`` from the bits (normal range: ``e`` clamped to [-126, 127])."""
        biased = lax.clamp(np.int32(1), e + np.int32(127), np.int32(254))
        return lax.bitcast_convert_type(lax.shift_left(biased, np.int32(23)), jnp.float32)


def _times(data, factor):
    return (data.astype(jnp.float32) * factor).astype(data.dtype)


def scaled_mlp(algebra, h, s, weights, weight_scales):
    """A residual MLP on ``(data, scale)`` pairs; returns the value of the output in float32."""
    width = h.shape[-1]
    log_r = int(np.log2(np.sqrt(width)))
    for w, sw in zip(weights, weight_scales):
        y = jnp.maximum(jnp.dot(h, w, preferred_element_type=jnp.float32) * np.float32(2.0**-log_r), 0)
        y = y.astype(h.dtype)
        sy = algebra.mul(algebra.mul(s, sw), algebra.from_pow2(log_r))
        common = lax.max(sy, s)
        summed = _times(y, algebra.factor(sy, common)).astype(jnp.float32) + _times(h, algebra.factor(s, common))
        rms = jnp.sqrt(jnp.mean(summed * summed))
        e = algebra.below(jnp.where(rms > 0, rms, np.float32(1)))
        unit = algebra.from_pow2(0)
        h = (summed * algebra.factor(unit, e)).astype(h.dtype)
        s = algebra.mul(common, e)
    return h.astype(jnp.float32) * algebra.as_float(s)


def make_inputs(algebra, layers: int, width: int, batch: int):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((batch, width)), jnp.float16)
    weights = [jnp.asarray(rng.standard_normal((width, width)), jnp.float16) for _ in range(layers)]
    scale = lambda k: jnp.asarray(algebra.from_pow2(k))  # noqa: E731  traced scales, as in a training step
    return h, scale(0), weights, [scale(-4) for _ in range(layers)]


def _count(jaxpr) -> int:
    return sum(1 + sum(_count(getattr(s, "jaxpr", s)) for s in jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def measure(layers: int, width: int, batch: int, rounds: int, compile_rounds: int) -> list[dict]:
    algebras = [Float32Scales, Int32Exponents]
    fns = {a.name: functools.partial(scaled_mlp, a) for a in algebras}
    inputs = {a.name: make_inputs(a, layers, width, batch) for a in algebras}
    reference = np.asarray(jax.jit(fns[Float32Scales.name])(*inputs[Float32Scales.name]))
    other = np.asarray(jax.jit(fns[Int32Exponents.name])(*inputs[Int32Exponents.name]))
    np.testing.assert_array_equal(other, reference)  # the two representations compute the same values

    def trace_seconds(name):
        jax.clear_caches()
        start = time.perf_counter()
        jax.make_jaxpr(fns[name])(*inputs[name])
        return time.perf_counter() - start

    traces = {n: statistics.median(trace_seconds(n) for _ in range(7)) for n in fns}
    compiles = interleaved_compile_medians(
        {n: functools.partial(compile_times, fns[n], *inputs[n]) for n in fns}, compile_rounds
    )
    jitted = {n: jax.jit(fns[n]) for n in fns}
    runs = interleaved_medians({n: functools.partial(jitted[n], *inputs[n]) for n in fns}, rounds)
    return [
        {
            "scales": n,
            "equations": _count(jax.make_jaxpr(fns[n])(*inputs[n]).jaxpr),
            "trace_ms": 1e3 * traces[n],
            "compile_cpu_s": compiles[n][1],
            "run_ms": 1e3 * runs[n],
        }
        for n in fns
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--compile-rounds", type=int, default=3)
    args = parser.parse_args()
    rows = measure(args.layers, args.width, args.batch, args.rounds, args.compile_rounds)
    print(
        f"jax {jax.__version__}, {jax.default_backend()}; {args.layers} layers, width {args.width}, batch {args.batch}"
    )
    print(f"{'scales':<16}{'eqns':>6}{'trace ms':>10}{'compile cpu s':>15}{'run ms':>9}")
    for r in rows:
        print(
            f"{r['scales']:<16}{r['equations']:>6}{r['trace_ms']:>10.1f}{r['compile_cpu_s']:>15.3f}{r['run_ms']:>9.3f}"
        )


if __name__ == "__main__":
    main()
