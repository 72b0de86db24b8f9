"""The optimizer's update at model size: plain Optax, the README recipe, and a hand-written floor.

Run from the repository root: ``python -m benchmarks.update_floor`` (12 layers of
:mod:`benchmarks.cost_at_scale`'s GPT-2-shaped model; ``--layers N``, ``--tiny``, ``--json PATH``).

What is compiled is the update alone, as a training step runs it after the gradients::

    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

with the model's optimizer (``gpt_linen.make_optimizer``: global-norm clipping, AdamW with a
warmup-cosine schedule) on the model's parameters, in these variants:

- ``plain_fp16``: Optax on float16 parameters, gradients and state, no scalify (the baseline);
- ``recipe``: the README recipe: ``jsa.optim.scale_state`` around the same transformation,
  float16 ``ScaledArray`` state, parameters and gradients, the update under ``jsa.scalify``
  (default rescale policy);
- ``recipe_static``: the same under ``jsa.RescalePolicy.static()``;
- ``recipe_static_uncompensated``: the same with ``scale_state(..., compensate=False)``;
- ``floor``: the recipe's job written by hand in plain JAX, with no scale rules, no policy and
  no checks (:func:`floor_update`): the stored float16 state read back into float32, Optax's
  update on float32 values, each new state array stored with its largest entry measured (one
  reduction each) and moved to ``2**14``, each update moved to unit root mean square (one
  reduction each) and narrowed to float16, and each parameter updated at its own fixed scale
  with the part that float16 rounds away carried in a float16 residual. It does less than the
  recipe (a parameter's scale never moves; nothing guards a non-finite or zero statistic), so
  its cost is a lower bound of what storing the state scaled costs with one measurement per
  tensor per step, whatever the library.

Columns: ``eqns`` (jaxpr equations, nested ones included), ``reductions`` (reduction
equations), ``fusions``, ``HLO instrs`` (instructions of the optimised XLA:CPU module, every
computation), ``trace s``, ``lower s``, ``compile s`` (CPU seconds, cold caches) and ``x
plain``: their sum against ``plain_fp16``'s. Counts are exact; times compare only within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa
from tests.programs import gpt_linen, recipe

from . import cost_at_scale
from .common import hlo_opcode_count, markdown_table, stage_times, write_json

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
STORAGE_EXPONENT = 14  # the largest stored entry in (2**13, 2**14], as scale_state stores float16
RESIDUAL_EXPONENT = -11  # a residual is at most half a float16 ulp of data in [1, 2): 2**-11


class Stored(NamedTuple):
    """A float16 array ``data`` standing for ``data * scale``, ``scale`` a float32 power of two (the floor's state)."""

    data: jax.Array
    scale: jax.Array


def _is_stored(x: Any) -> bool:
    return isinstance(x, Stored)


def _biased_exponent(x: jax.Array, round_up: bool) -> jax.Array:
    """The float32 exponent field of ``x >= 0`` (plus one if ``round_up`` and ``x`` is not a power of two)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exponent = (bits >> 23) & 255
    return exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32) if round_up else exponent


def _pow2(biased: jax.Array) -> jax.Array:
    """``2**(biased - 127)``, the exponent clipped to the normal float32 range."""
    return jax.lax.bitcast_convert_type(jnp.clip(biased, 1, 254) << 23, jnp.float32)


def _value(x: Stored) -> jax.Array:
    return x.data.astype(F32) * x.scale


def _stored_at_max(x: jax.Array) -> Stored:
    """``x`` with its largest magnitude moved into ``(2**13, 2**14]`` and cast to float16; scale 0 if all zero."""
    largest = jnp.max(jnp.abs(x))
    exponent = _biased_exponent(largest, round_up=True) - STORAGE_EXPONENT
    data = (x * _pow2(254 - exponent)).astype(F16)
    return Stored(data, jnp.where(largest > 0, _pow2(exponent), 0.0))


def _stored_at_unit_rms(x: jax.Array) -> Stored:
    """``x`` over its root mean square rounded down to a power of two, cast to float16."""
    half = (_biased_exponent(jnp.mean(x * x), round_up=False) - 127) >> 1
    return Stored((x * _pow2(127 - half)).astype(F16), _pow2(127 + half))


def _read(state: Any) -> Any:
    """Stored leaves as float32 values; a stored zero of the second moment ``nu`` read as float16's smallest subnormal."""

    def read(path, x):
        if not _is_stored(x):
            return x
        if any(getattr(k, "name", None) == "nu" for k in path):
            x = Stored(jnp.where(x.data == 0, jnp.finfo(F16).smallest_subnormal, x.data), x.scale)
        return _value(x)

    return jax.tree_util.tree_map_with_path(read, state, is_leaf=_is_stored)


def _store(state: Any) -> Any:
    """Floating arrays of at least one dimension stored at their largest entry; other leaves as they are."""
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0  # noqa: E731
    return jax.tree.map(lambda x: _stored_at_max(x) if floating(x) else x, state)


class FloorState(NamedTuple):
    inner: Any  # the Optax state, its floating arrays Stored
    residual: Any  # per parameter, float16 data at scale param.scale * 2**RESIDUAL_EXPONENT


def floor_init(tx: optax.GradientTransformation, params: Any) -> FloorState:
    """The floor's state for ``params`` (a tree of ``Stored``)."""
    values = jax.tree.map(_value, params, is_leaf=_is_stored)
    residual = jax.tree.map(lambda p: jnp.zeros_like(p.data), params, is_leaf=_is_stored)
    return FloorState(_store(tx.init(values)), residual)


def _applied(param: Stored, update: Stored, residual: jax.Array) -> tuple[Stored, jax.Array]:
    """``param + update + residual`` rounded to float16 at the parameter's scale, and what rounding left."""
    residual_scale = param.scale * 2.0**RESIDUAL_EXPONENT
    total = _value(update) + residual.astype(F32) * residual_scale
    inverse = _pow2(254 - _biased_exponent(param.scale, round_up=False))
    data = (param.data.astype(F32) + total * inverse).astype(F16)
    left = total - (data.astype(F32) - param.data.astype(F32)) * param.scale
    return Stored(data, param.scale), (left * (inverse * 2.0**-RESIDUAL_EXPONENT)).astype(F16)


def floor_update(tx: optax.GradientTransformation) -> Callable:
    """``update(grads, state, params) -> (params, state)`` of the floor (module docstring), in plain JAX."""

    def update(grads: Any, state: FloorState, params: Any) -> tuple[Any, FloorState]:
        values = lambda tree: jax.tree.map(_value, tree, is_leaf=_is_stored)  # noqa: E731
        params32 = jax.tree.map(
            lambda p, r: _value(p) + r.astype(F32) * (p.scale * 2.0**RESIDUAL_EXPONENT),
            params,
            state.residual,
            is_leaf=_is_stored,
        )
        updates, inner = tx.update(values(grads), _read(state.inner), params32)
        updates = jax.tree.map(_stored_at_unit_rms, updates)
        pairs = jax.tree.map(_applied, params, updates, state.residual, is_leaf=_is_stored)
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and _is_stored(x[0])  # noqa: E731
        new_params = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=is_pair)
        residual = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=is_pair)
        return new_params, FloorState(_store(inner), residual)

    return update


def _optax_update(tx: optax.GradientTransformation) -> Callable:
    def update(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


VARIANTS = ("plain_fp16", "recipe", "recipe_static", "recipe_static_uncompensated", "floor")


def build(name: str, params32: Any) -> tuple[Callable, tuple]:
    """The variant's update before ``jax.jit`` and its arguments ``(grads, state, params)`` (gradients: the parameters)."""
    tx = gpt_linen.make_optimizer()
    if name == "plain_fp16":
        params = jax.tree.map(lambda x: x.astype(F16), params32)
        return _optax_update(tx), (params, tx.init(params), params)
    params = recipe.scale_state(params32, F16)
    if name == "floor":
        stored = jax.tree.map(lambda x: Stored(x.data, x.scale), params, is_leaf=jsa.is_scaled_leaf)
        return floor_update(tx), (stored, floor_init(tx, stored), stored)
    scaled_tx = jsa.optim.scale_state(tx, F16, compensate=name != "recipe_static_uncompensated")
    policy = {} if name == "recipe" else {"policy": jsa.RescalePolicy.static()}
    return jsa.scalify(_optax_update(scaled_tx), **policy), (params, scaled_tx.init(params), params)


def measure(name: str, fn: Callable, args: tuple) -> dict:
    stages = stage_times(fn, *args)
    counts = cost_at_scale.jaxpr_counts(stages.traced.jaxpr)
    hlo = stages.compiled.as_text()
    return {
        "variant": name,
        "eqns": counts["eqns"],
        "reductions": counts["reductions"],
        "fusions": hlo_opcode_count(hlo, "fusion"),
        "hlo_instructions": len(re.findall(r"^\s+(?:ROOT )?%?\S+ = ", hlo, re.M)),
        **{f"{stage}_cpu_s": s for stage, s in stages.cpu.items()},
        "total_cpu_s": sum(stages.cpu.values()),
    }


def run(shape: cost_at_scale.Shape, layers: int, names: list[str], log: Callable[[str], None] = print) -> list[dict]:
    """One row per variant (module docstring); ``ratio`` against ``plain_fp16`` where it was measured."""
    params32 = cost_at_scale.init_params(shape, layers)
    log(f"{layers} layers: {len(jax.tree.leaves(params32))} parameter tensors")
    rows = []
    for name in names:
        rows.append(measure(name, *build(name, params32)))
        log(f"  {name}: compiled")
    base = next((r["total_cpu_s"] for r in rows if r["variant"] == "plain_fp16"), None)
    for row in rows:
        row["layers"] = layers
        row["ratio"] = row["total_cpu_s"] / base if base else None
    return rows


COLUMNS = (
    ("layers", "layers", "d"),
    ("variant", "variant", "s"),
    ("eqns", "eqns", "d"),
    ("reductions", "reductions", "d"),
    ("fusions", "fusions", "d"),
    ("HLO instrs", "hlo_instructions", "d"),
    ("trace s", "trace_cpu_s", ".2f"),
    ("lower s", "lower_cpu_s", ".2f"),
    ("compile s", "compile_cpu_s", ".2f"),
    ("x plain", "ratio", ".2f"),
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12], help="model depths (default: 12)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model: {cost_at_scale.TINY}")
    parser.add_argument("--json", help="write the configuration and the rows to this file")
    args = parser.parse_args(argv)
    shape = cost_at_scale.TINY if args.tiny else cost_at_scale.GPT2
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {shape}")
    rows = [row for layers in args.layers for row in run(shape, layers, args.variants, lambda s: print(s, flush=True))]
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(args.json, rows, **dataclasses.asdict(shape))
    return rows


if __name__ == "__main__":
    main()
