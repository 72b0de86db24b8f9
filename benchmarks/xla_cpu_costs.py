"""What XLA:CPU charges at compile time for the shapes of code that scale arithmetic produces.

Run: ``python -m benchmarks.xla_cpu_costs``. Compiles small programs of ``n`` independent
elementwise "rescale" kernels (``x * k + i`` on a 256x1024 array, ``k`` a scalar) and
reports the compile CPU time per kernel when ``k`` is

- ``param``: a scalar read from an input (the cheapest possible scale);
- ``divide``: the quotient of two input scalars. XLA treats a scalar ``divide`` (like
  ``sqrt``) as expensive and does not duplicate it into the kernel that broadcasts it, so
  it becomes a kernel of its own;
- ``chain-L``: ``L`` cheap scalar operations (multiply-add) on input scalars. XLA
  duplicates cheap scalar chains into every kernel that consumes them.

These costs, measured on the machine at hand, explain where the compile-time overhead of a
scalified step goes (``docs/benchmarks.md``): a scale rule that divides costs a kernel; one
that does not costs its chain of operations again in every kernel that uses the scale.

Two more tables: what ``n`` kernels cost when they are identical (same shapes, same
constants, only their operands differ: XLA:CPU compiles one and reuses it) against the
same kernels on ``n`` different shapes; and what the rescale policy's ``outputs`` rescale
costs per returned tensor (``p - 0.01 * g`` on ``n`` tensors of different shapes, scalified
with the static policy and with ``outputs`` alone).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

import jax_scalify as jsa

from .common import compile_times


def _program(n: int, kind: str, chain: int):
    def fn(x, s):
        outs = []
        for i in range(n):
            if kind == "param":
                k = s[i]
            elif kind == "divide":
                k = s[i] / s[i + 1]
            else:
                k = s[i]
                for j in range(chain // 2):
                    k = k * s[i + j + 1] + 1.0
            outs.append(x * k + i)
        return outs

    return fn


def _scaled_kernels(xs, ks):
    return [x * k + 1.0 for x, k in zip(xs, ks)]


def _sgd_update(params, grads):
    return [p - 0.01 * g for p, g in zip(params, grads)]


def _distinct_shapes(n: int) -> list:
    return [jnp.ones((256 + i, 1024), jnp.float32) for i in range(n)]


def compile_cpu_seconds(fn, *args, rounds: int) -> float:
    """Median compile CPU time (trace + lower + compile, cold caches) over ``rounds``."""
    return statistics.median(compile_times(fn, *args)[1] for _ in range(rounds))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=32, help="number of rescale kernels")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.kernels
    x = jnp.ones((256, 1024), jnp.float32)
    s = jnp.ones(2 * n + 200, jnp.float32)
    base = compile_cpu_seconds(_program(0, "param", 0), x, s, rounds=args.rounds)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {n} kernels of x * k + i, x 256x1024 float32")
    print(f"{'k':<12}{'compile cpu s':>15}{'ms per kernel':>15}")
    per_param = None
    for kind, chain in [("param", 0), ("divide", 0), ("chain", 10), ("chain", 40), ("chain", 160)]:
        seconds = compile_cpu_seconds(_program(n, kind, chain), x, s, rounds=args.rounds)
        per_kernel = 1e3 * (seconds - base) / n
        label = kind if kind != "chain" else f"chain-{chain}"
        extra = ""
        if kind == "param":
            per_param = per_kernel
        elif kind == "chain":
            extra = f"   ({(per_kernel - per_param) / chain:.2f} ms per scalar op per kernel)"
        else:
            extra = f"   ({per_kernel - per_param:.2f} ms for the divide's own kernel)"
        print(f"{label:<12}{seconds:>15.3f}{per_kernel:>15.2f}{extra}")

    ks = [jnp.float32(1.0)] * n
    print(f"\n{n} kernels x * k + 1 (k a scalar input)")
    print(f"{'shapes':<20}{'compile cpu s':>15}{'ms per kernel':>15}")
    for label, xs in [("one shape", [x] * n), ("n different shapes", _distinct_shapes(n))]:
        seconds = compile_cpu_seconds(_scaled_kernels, xs, ks, rounds=args.rounds)
        print(f"{label:<20}{seconds:>15.3f}{1e3 * (seconds - base) / n:>15.2f}")

    params = jsa.as_scaled_array(_distinct_shapes(n))
    grads = jsa.as_scaled_array(_distinct_shapes(n))
    outputs_only = jsa.RescalePolicy(gradients=False, loop_carries=False, self_products=False)
    print(f"\np - 0.01 * g on {n} tensors of different shapes, scalified")
    print(f"{'policy':<20}{'compile cpu s':>15}{'ms per tensor':>15}")
    static, rescaled = (
        compile_cpu_seconds(jsa.scalify(_sgd_update, policy=policy), params, grads, rounds=args.rounds)
        for policy in (jsa.RescalePolicy.static(), outputs_only)
    )
    print(f"{'static':<20}{static:>15.3f}{1e3 * (static - base) / n:>15.2f}")
    extra = f"   ({1e3 * (rescaled - static) / n:.2f} ms per rescaled tensor)"
    print(f"{'outputs only':<20}{rescaled:>15.3f}{1e3 * (rescaled - base) / n:>15.2f}{extra}")


if __name__ == "__main__":
    main()
