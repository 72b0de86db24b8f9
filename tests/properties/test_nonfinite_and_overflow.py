"""Non-finite inputs, and values whose squares overflow float32, give plain JAX's answer.

Every rule's invariance case (see ``tests/invariance.py``) runs, in the default
configuration, under ``jax.jit(jsa.scalify(fn))`` on

- ``nonfinite``: its inputs with an ``inf``, a ``-inf`` and a ``nan`` entry mixed into the
  data (scale ``2**3``);
- ``overflow``: its inputs times ``2**67 .. 2**100`` (``1.5e20 .. 1.3e30``: their squares
  leave float32), made scaled with ``jsa.as_scaled_array`` as users do.

Each floating output entry must be plain JAX's answer in float32 (the same value, or the
same ``nan``/``±inf``), or the exact answer (the function in float64) where float32 holds
it: scales keep magnitudes that float32 data cannot, so ``x * rsqrt(mean(x * x))`` of
``1e20`` values is exactly computable where plain float32 gives 0. A ``nan`` is accepted
only where plain JAX has one. Integer and boolean outputs equal plain JAX's or the exact
run's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from tests.invariance import float64_reference
from tests.properties.test_rule_coverage import _all_cases

CASES = _all_cases()

# Cases not run, with the reason.
NOT_RUN = {
    "nonfinite": {"while_batched_predicate": "halving inf never ends the loop (plain JAX loops forever too)"},
    "overflow": {},
}
# Cases whose values are not compared, with the reason (they must still run without error).
NOT_COMPARED = {
    "nonfinite": {},
    "overflow": {
        # sin/cos of values near 1e25: one ulp of the argument changes the result (plain float32
        # and float64 disagree as much).
        "fori_loop_static": "periodic function of values beyond 2**24",
        "fori_loop_dynamic": "periodic function of values beyond 2**24",
        "custom_scale_in_program": "test-defined custom_scale rule",
    },
}
# Cases where, under the default unguarded traced scales (ScalifyConfig(guard_traced_scales=False)),
# a product of two scales passes 2**127 and reads inf: entries whose data lies below 1 there,
# finite in plain float32 (values near its top), read ±inf with the exact sign, never nan, and
# the operands aligned with that product keep their values (the common scale is the largest
# finite one). test_guarded_scales_keep_aligned_operands: exact with the guard.
OVERFLOWED_SCALE = {"cumsum", "scan_reverse_unroll"}


def _is_float(x) -> bool:
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


def _with_nonfinite(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``a`` with up to three entries replaced by ``inf``, ``-inf`` and ``nan``."""
    out = np.array(a, copy=True)
    flat = out.reshape(-1)
    positions = rng.permutation(flat.size)[:3]
    flat[positions] = np.array([np.inf, -np.inf, np.nan], out.dtype)[: len(positions)]
    return out


def _inputs(case, kind: str) -> tuple[list, list]:
    """Scalify's inputs and the plain values they stand for."""
    rng = np.random.default_rng(0)
    args = [make(rng) for make in case.args]
    flags = case.scaled if case.scaled is not None else [_is_float(a) for a in args]
    inputs, values = [], []
    for a, flag in zip(args, flags):
        if not (flag and _is_float(a)):
            inputs.append(jnp.asarray(a))
            values.append(a)
        elif kind == "nonfinite":
            data = _with_nonfinite(np.asarray(a), rng)
            inputs.append(jsa.ScaledArray(jnp.asarray(data), jnp.float32(8)))
            values.append((data * np.float32(8)).astype(data.dtype))
        else:
            value = (np.asarray(a, np.float64) * 2.0 ** int(rng.integers(67, 101))).astype(np.asarray(a).dtype)
            inputs.append(jsa.as_scaled_array(jnp.asarray(value)))
            values.append(value)
    return inputs, values


def _agrees(got: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Per entry: the same non-finite value, or finite values close to each other."""
    same_nonfinite = (np.isnan(got) & np.isnan(ref)) | (np.isinf(ref) & (got == ref))
    finite = np.isfinite(got) & np.isfinite(ref)
    magnitude = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
    floor = 2 * float(np.finfo(np.float32).tiny)
    with np.errstate(invalid="ignore", over="ignore"):
        close = finite & (np.abs(got - ref) <= np.maximum(atol * magnitude, floor) + rtol * np.abs(ref))
    return same_nonfinite | close


def _assert_plain_or_exact(got, plain, exact, rtol: float, atol: float, inf_allowed: bool = False) -> None:
    got_leaves = jax.tree.leaves(jsa.asarray(got))
    plain_leaves, exact_leaves = jax.tree.leaves(plain), jax.tree.leaves(exact)
    assert len(got_leaves) == len(plain_leaves) == len(exact_leaves)
    for i, (g, p, e) in enumerate(zip(got_leaves, plain_leaves, exact_leaves)):
        g, p, e = np.asarray(g), np.asarray(p), np.asarray(e)
        assert g.shape == p.shape, (i, g.shape, p.shape)
        if not _is_float(p):
            assert np.array_equal(g, p) or np.array_equal(g, e), f"output {i}: {g} is neither {p} nor {e}"
            continue
        g, p, e = (np.asarray(v, np.float64) for v in (g, p, e))
        with np.errstate(over="ignore", invalid="ignore"):
            rounded = e.astype(np.float32).astype(np.float64)  # beyond float32: ±inf with the exact sign
        ok = _agrees(g, p, rtol, atol) | (~np.isnan(e) & _agrees(g, rounded, rtol, atol))
        if inf_allowed:
            ok |= np.isinf(g) & (np.sign(g) == np.sign(e))
        bad = np.flatnonzero(~ok)
        assert not bad.size, (
            f"output {i}: {bad.size} of {g.size} entries are neither plain JAX's nor exact, e.g. at flat index "
            f"{bad[:4]}: scalify {g.reshape(-1)[bad[:4]]}, plain {p.reshape(-1)[bad[:4]]}, exact {e.reshape(-1)[bad[:4]]}"
        )


# The overflow form runs in the slow run (-m slow), for the default run's time.
@pytest.mark.parametrize("kind", ["nonfinite", pytest.param("overflow", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nonfinite_and_overflowing_inputs(case, kind):
    if case.name in NOT_RUN[kind]:
        pytest.skip(NOT_RUN[kind][case.name])
    inputs, values = _inputs(case, kind)
    got = jsa.scalify(case.fn)(*inputs)
    if case.name in NOT_COMPARED[kind]:
        return
    plain = case.fn(*[jnp.asarray(v) for v in values])
    inf_allowed = kind == "overflow" and case.name in OVERFLOWED_SCALE
    _assert_plain_or_exact(got, plain, float64_reference(case.fn, values), case.rtol, case.atol, inf_allowed)


def test_variance_and_rms_norm_of_1e20_values():
    """Issue 38, point 2: ``jnp.var`` of ``1e20`` values was nan under scalify (plain float32:
    inf), and an RMSNorm ``x * rsqrt(mean(x * x) + eps)`` nan (plain float32: 0; exact:
    ``x / rms(x)``)."""
    x = jnp.array([1e20, 2e20, -1e20, 3e20], jnp.float32)
    scaled = jsa.as_scaled_array(x)

    def rms_norm(x):
        return x * lax.rsqrt(jnp.mean(x * x) + 1e-6)

    var = np.asarray(jsa.asarray(jax.jit(jsa.scalify(jnp.var))(scaled)))
    assert var == np.inf or np.isclose(var, np.var(np.asarray(x, np.float64)), rtol=1e-6)
    out = np.asarray(jsa.asarray(jax.jit(jsa.scalify(rms_norm))(scaled)))
    exact = np.asarray(x, np.float64) / np.sqrt(np.mean(np.asarray(x, np.float64) ** 2))
    assert np.array_equal(out, np.asarray(rms_norm(x))) or np.allclose(out, exact, rtol=1e-6), out


@pytest.mark.parametrize("name", ["stack", *sorted(OVERFLOWED_SCALE)])
def test_guarded_scales_keep_aligned_operands(name):
    """With ``guard_traced_scales`` the product's scale stays finite (excess in the data), and its
    entries whose data lie below 1 are exact where the default reads ±inf (``OVERFLOWED_SCALE``)."""
    (case,) = [c for c in CASES if c.name == name]
    inputs, values = _inputs(case, "overflow")
    with jsa.ScalifyConfig(guard_traced_scales=True):
        got = jsa.scalify(case.fn)(*inputs)
    plain = case.fn(*[jnp.asarray(v) for v in values])
    _assert_plain_or_exact(got, plain, float64_reference(case.fn, values), case.rtol, case.atol)
