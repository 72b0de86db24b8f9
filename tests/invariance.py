"""The invariance harness: in float32, ``scalify(f)`` on scaled inputs equals ``f`` on values.

A :class:`Case` names a function and how to draw its inputs. :func:`check_case` draws
inputs and power-of-two scales from a Hypothesis ``data`` object, runs ``f`` on the plain
values and ``scalify(f)`` on the scaled inputs, and checks that

- the values agree to float32 round-off,
- every output scale is an exact power of two,
- with ``grad=True``, the same holds for ``jax.grad`` of ``sum(f)`` taken inside scalify.

Every test module with rules defines ``INVARIANCE_CASES``; ``tests/properties`` runs them
all and checks that together they exercise every registered rule.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jax_scalify as jsa
from jax_scalify.core.array import unscaled

ArgMaker = Callable[[np.random.Generator], Any]

STATIC_POLICY = jsa.RescalePolicy.static()
"""The paper's static propagation, for tests of the scales that rules compute."""


@dataclasses.dataclass(frozen=True)
class Case:
    """An invariance case.

    Attributes:
        name: test id.
        fn: the plain JAX function, of positional array arguments.
        args: one maker per argument: ``maker(rng) -> np.ndarray`` (use the helpers below).
        scaled: per argument, whether it is passed as a ``ScaledArray`` (default: all
            floating arguments).
        grad: also check ``jax.grad(lambda *a: sum(fn(*a)))`` w.r.t. the first argument.
        rtol, atol: tolerance of the value comparison (atol relative to the largest |value|).
        max_scale_exponent: input scales are drawn from ``2**-k .. 2**k`` with this ``k``.
    """

    name: str
    fn: Callable[..., Any]
    args: Sequence[ArgMaker]
    scaled: Sequence[bool] | None = None
    grad: bool = False
    rtol: float = 2e-5
    atol: float = 1e-6
    max_scale_exponent: int = 20


def scaled(data, exponent: int, dtype=jnp.float32) -> jsa.ScaledArray:
    """``data`` as ``dtype`` data with the scale ``2**exponent`` (no rebalancing)."""
    return jsa.ScaledArray(jnp.asarray(data, dtype), jnp.float32(2.0**exponent))


def value_at_scale(x, exponent: int) -> jsa.ScaledArray:
    """The value ``x`` as a float32 ``ScaledArray`` with scale ``2**exponent`` (data ``x / 2**exponent``)."""
    data = np.asarray(x, np.float64) / 2.0**exponent
    return jsa.ScaledArray(jnp.asarray(data, np.float32), jnp.float32(2.0**exponent))


def exact_value(x) -> np.ndarray:
    """The value of a scaled (or plain) array in float64: ``data * scale`` without rounding."""
    if isinstance(x, jsa.ScaledArray):
        return np.asarray(x.data, np.float64) * np.asarray(x.scale, np.float64)
    return np.asarray(x, np.float64)


def scale_of(x: jsa.ScaledArray) -> float:
    return float(np.asarray(x.scale))


def normal(*shape: int) -> ArgMaker:
    return lambda rng: rng.standard_normal(shape).astype(np.float32)


def positive(*shape: int, low: float = 0.1, high: float = 4.0) -> ArgMaker:
    return lambda rng: rng.uniform(low, high, shape).astype(np.float32)


def integers(*shape: int, low: int = 0, high: int = 4, dtype=np.int32) -> ArgMaker:
    return lambda rng: rng.integers(low, high, shape).astype(dtype)


def booleans(*shape: int) -> ArgMaker:
    return lambda rng: rng.random(shape) < 0.5


def scale_exponents(max_abs: int = 20):
    return st.integers(min_value=-max_abs, max_value=max_abs)


def _is_float(x) -> bool:
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


def assert_pow2_scales(tree: Any) -> None:
    """Every ``ScaledArray`` scale in ``tree`` is a positive power of two (or exactly 0)."""
    for leaf in jax.tree.leaves(tree, is_leaf=jsa.is_scaled_leaf):
        if isinstance(leaf, jsa.ScaledArray):
            scale = np.asarray(leaf.scale, np.float64)
            ok = (scale == 0) | (scale == np.asarray(jsa.core.pow2_round_down(scale)))
            assert np.all(ok) and np.all(scale >= 0), f"scale {scale} is not a power of two"


def assert_close_values(got: Any, expected: Any, rtol: float, atol: float) -> None:
    # In the data dtype (readouts default to float32): the rule must give the dtype plain JAX gives.
    got_leaves = jax.tree.leaves(jax.tree.map(unscaled, got, is_leaf=jsa.is_scaled_leaf))
    exp_leaves = jax.tree.leaves(expected)
    assert len(got_leaves) == len(exp_leaves)
    for g, e in zip(got_leaves, exp_leaves):
        g, e = np.asarray(g), np.asarray(e)
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        if _is_float(e):
            scale = max(float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)), 1e-30)
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol * scale)
        else:
            np.testing.assert_array_equal(g, e)


def float64_reference(fn, values):
    """``fn`` on the values in float64: the reference that float32 cannot compute at these scales.

    Functions that do not run in float64 (index dtypes fixed to int32, ...) fall back to the
    plain float32 run.
    """
    try:
        with jax.enable_x64(True):
            wide = [jnp.asarray(np.asarray(v, np.float64)) if _is_float(v) else jnp.asarray(v) for v in values]
            return jax.tree.map(np.asarray, fn(*wide))
    except TypeError:
        narrow = [jnp.asarray(np.asarray(v, np.float32)) if _is_float(v) else jnp.asarray(v) for v in values]
        return fn(*narrow)


def draw_inputs(case: Case, data: st.DataObject) -> tuple[list, list]:
    """Plain inputs and their scaled counterparts (random power-of-two scales)."""
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    plain = [make(rng) for make in case.args]
    scaled_flags = case.scaled or [_is_float(x) for x in plain]
    scaled = []
    for x, flag in zip(plain, scaled_flags):
        if flag and _is_float(x):
            exponent = data.draw(scale_exponents(case.max_scale_exponent), label="scale exponent")
            scale = np.float32(2.0**exponent)
            scaled.append(jsa.ScaledArray(jnp.asarray(x / scale), jnp.asarray(scale)))
        else:
            scaled.append(jnp.asarray(x))
    return [jnp.asarray(x) for x in plain], scaled


def check_case(case: Case, data: st.DataObject) -> None:
    plain, scaled = draw_inputs(case, data)
    expected = case.fn(*plain)
    got = jsa.scalify(case.fn)(*scaled)
    assert_pow2_scales(got)
    assert_close_values(got, expected, case.rtol, case.atol)
    if case.grad:
        grad_fn = jax.grad(lambda *a: jnp.sum(jnp.asarray(case.fn(*a), jnp.float32)))
        expected_grad = grad_fn(*plain)
        got_grad = jsa.scalify(grad_fn)(*scaled)
        assert_pow2_scales(got_grad)
        assert_close_values(got_grad, expected_grad, case.rtol, case.atol)


def primitive_names(fn: Callable[..., Any], *args) -> set[str]:
    """Names of the primitives (sub-jaxprs included) in the jaxpr of ``fn(*args)``."""
    names: set[str] = set()
    _collect(jax.make_jaxpr(fn)(*args).jaxpr, names)
    return names


def primitives_of(case: Case) -> set[str]:
    """Names of the primitives (sub-jaxprs included) that ``case`` exercises."""
    rng = np.random.default_rng(0)
    args = [jnp.asarray(make(rng)) for make in case.args]
    fns = [case.fn]
    if case.grad:
        fns.append(jax.grad(lambda *a: jnp.sum(jnp.asarray(case.fn(*a), jnp.float32))))
    names: set[str] = set()
    for fn in fns:
        _collect(jax.make_jaxpr(fn)(*args).jaxpr, names)
    return names


def _collect(jaxpr, names: set[str]) -> None:
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _collect(getattr(sub, "jaxpr", sub), names)


def examples(max_examples: int) -> int:
    """Hypothesis examples per case: half of ``max_examples`` (at least 2) in the default run.

    ``JSA_THOROUGH=1`` in the environment runs all of them (the project's own full checks).
    """
    if os.environ.get("JSA_THOROUGH") == "1":
        return max_examples
    return max(2, max_examples // 2)


def invariance_test(cases: Sequence[Case], max_examples: int = 8):
    """A pytest test running :func:`check_case` on every case (assign it to ``test_invariance``).

    Each case draws :func:`examples` ``(max_examples)`` random inputs and power-of-two scales.
    """

    @pytest.mark.parametrize("case", cases, ids=lambda c: c.name)
    @given(data=st.data())
    @settings(max_examples=examples(max_examples), deadline=None)
    def test_invariance(case, data):
        check_case(case, data)

    return test_invariance
