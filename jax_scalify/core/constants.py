"""Constants known at trace time, and the exact values of those a narrow-float trace rounded.

**A known constant is its value.** A plain value known at trace time is a Python number or a
NumPy value repeating one element (:func:`known_scalar`). The interpreter folds the plain
equations of scalar-preserving primitives on such values into new NumPy values
(:func:`fold`), so a constant stays one wherever it is passed (a sub-jaxpr, a loop body, a
branch, a jitted call): nothing has to be carried beside it.

**Exact values.** ``scalify`` traces the user function on the *data* of its inputs. With
float16 data JAX casts a Python constant to float16 while tracing, so ``x * 1e-8`` holds the
literal ``0`` and ``x * 1e5`` the literal ``inf`` before any scale rule sees them (and Adam's
``eps=1e-8`` turns ``m / (sqrt(v) + eps)`` into ``0 / 0``).

When the data trace holds narrow floating constants (and only then), the function is traced a
second time with every narrow floating input widened to float32 (:func:`recover`). The two
traces run the same Python code, so their equations pair up one to one (the widened trace
may hold extra ``convert_element_type`` equations, e.g. for ``x.astype(jnp.float16)``, and
the narrow one extra converts to float32). A narrow literal (or size-1 constant) is given the
value of its float32 counterpart when that value rounds to it: ``0:f16`` paired with
``1e-8:f32`` is ``1e-8``, ``65504:f16`` paired with float32 max is left alone (float32 max
does not round to 65504: the code chose a dtype-dependent value).

Exact values are recorded against the value objects (a literal's value, a folded value), in
the :func:`known_constants` scope of an evaluation, and :func:`known_scalar` reports them:
they are used only where a constant meets a scaled operand, where promotion splits the exact
value into a power-of-two scale and a mantissa. Plain equations still compute with the
values as traced, so they give exactly what JAX gives.

If the traces do not pair up (code whose structure depends on the dtype), the constants
that the narrow trace lost (a finite non-zero float32 value that became 0 or ±inf) are
detected by comparing the literals of both traces; the narrow literals that may stand for
one of them raise an error naming the source line if they meet scaled data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxprs_in_params
from jax.extend.core import primitives as _primitives

_CONVERT = _primitives.convert_element_type_p
_NARROW_BITS = 16


def is_narrow_float(dtype: Any) -> bool:
    """A floating dtype of 16 bits or fewer (float16, bfloat16, the float8 types)."""
    return _is_float(dtype) and np.dtype(dtype).itemsize * 8 <= _NARROW_BITS


def _is_float(dtype: Any) -> bool:
    """A floating dtype (``None``, a Python number's, counts as one); extended dtypes (PRNG keys) are not."""
    return not jnp.issubdtype(dtype, jax.dtypes.extended) and bool(jnp.issubdtype(dtype, jnp.floating))


@dataclasses.dataclass(eq=False)
class ExactConstants:
    """Exact values of constants, keyed by the identity of the value object (held, so ids stay unique).

    ``exact``: ``id(value) -> (value, exact 0-d value)`` for literal values and constants of
    a narrow trace, and for the values folded in a :func:`known_constants` scope; ``lost``: ``id(value) -> (value, message)`` for narrow literals that
    may stand for a constant that over- or underflowed and could not be recovered.
    """

    exact: dict[int, tuple[Any, np.ndarray]] = dataclasses.field(default_factory=dict)
    lost: dict[int, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    _conflicts: set[int] = dataclasses.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.exact or self.lost)

    def offer(self, narrow_value: Any, wide_value: Any) -> None:
        """Record ``wide_value`` as the exact value of ``narrow_value`` if it rounds to it.

        Otherwise the narrow value stands for itself; it is recorded too, so that a value
        object shared by several literals with different exact values is detected.
        """
        narrow = _as_narrow_scalar(narrow_value)
        if narrow is None:
            return
        exact = _exact_counterpart(narrow, wide_value)
        exact = narrow if exact is None else exact
        key = id(narrow_value)
        if key in self._conflicts:
            return
        known = self.exact.get(key)
        if known is not None and not (known[1].dtype == exact.dtype and _same(known[1], exact)):
            # One value object shared by literals with different exact values: keep the traced one.
            del self.exact[key]
            self._conflicts.add(key)
            return
        self.exact[key] = (narrow_value, exact)


def _as_scalar(value: Any) -> np.ndarray | None:
    """The value as a 0-d NumPy float array if it is a trace-time floating number, else None."""
    if not hasattr(value, "dtype") or getattr(value, "size", None) != 1 or not _is_float(value.dtype):
        return None
    try:
        return np.asarray(value).reshape(())
    except Exception:  # a tracer: not a trace-time number
        return None


def _exact_counterpart(narrow: np.ndarray, wide_value: Any) -> np.ndarray | None:
    """The wide value if it is wider than the narrow one, rounds to it, and differs from it."""
    wide = _as_scalar(wide_value)
    if wide is None:
        return None
    if wide.dtype.itemsize <= narrow.dtype.itemsize or np.isnan(wide):
        return None
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        rounded = wide.astype(narrow.dtype)
        rounds_to_narrow = rounded == narrow or (np.isnan(rounded) and np.isnan(narrow))
        same = np.float64(wide) == np.float64(narrow)
    return wide.copy() if rounds_to_narrow and not same else None


# --- when the second trace is needed -----------------------------------------------------------
def has_narrow_constants(closed: ClosedJaxpr) -> bool:
    """True if the trace (sub-jaxprs included) holds a narrow floating literal or size-1 constant
    that may be a lost constant (0, subnormal, ±inf or nan: see :func:`_is_suspect`)."""
    if any(_suspect(c) for c in closed.consts):
        return True
    return _jaxpr_has_narrow_constants(closed.jaxpr, set())


def _as_narrow_scalar(value: Any) -> np.ndarray | None:
    scalar = _as_scalar(value)
    return scalar if scalar is not None and is_narrow_float(scalar.dtype) else None


def _is_suspect(narrow: np.ndarray) -> bool:
    """A narrow value that a finite non-zero constant may have become: 0, subnormal, ±inf or nan.

    (A float8 type without infinities turns an overflow into nan.) Other narrow values are
    within one rounding of the constant, a rounding that promotion repeats anyway when it
    stores the constant's mantissa in the data dtype.
    """
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(np.float64(narrow))
        return bool(not np.isfinite(magnitude) or magnitude < float(jnp.finfo(narrow.dtype).tiny))


def _suspect(value: Any) -> bool:
    narrow = _as_narrow_scalar(value)
    return narrow is not None and _is_suspect(narrow)


def _jaxpr_has_narrow_constants(jaxpr: Jaxpr, seen: set[int]) -> bool:
    if id(jaxpr) in seen:
        return False
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Literal) and _suspect(v.val):
                return True
        for sub in jaxprs_in_params(eqn.params):
            consts = sub.consts if isinstance(sub, ClosedJaxpr) else ()
            if any(_suspect(c) for c in consts):
                return True
            if _jaxpr_has_narrow_constants(_open(sub), seen):
                return True
    return False


def _open(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def widened_example(x: Any) -> Any:
    """``x`` as a float32 shape-and-dtype stand-in if it is a narrow floating array, else ``x``."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not is_narrow_float(dtype) or isinstance(x, (int, float, bool)):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), np.float32)


def recover(narrow: ClosedJaxpr, trace_widened: Callable[[], ClosedJaxpr]) -> ExactConstants:
    """The exact values of ``narrow``'s narrow constants, from a second trace on float32 inputs.

    ``trace_widened()`` traces the same function with the narrow floating inputs widened. If
    it fails (code that only runs on narrow inputs), nothing is recovered: the trace is used
    as it is.
    """
    found = ExactConstants()
    try:
        # Warnings of this trace concern the float32 stand-ins, not the user's program (e.g.
        # JAX's FutureWarning on a float32 update scattered into a float16 array): the
        # user's own trace has already given the program's warnings.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wide = trace_widened()
    except Exception:  # the function does not trace on float32 inputs: the data trace is used as it is
        return found
    _pair_jaxprs(narrow.jaxpr, narrow.consts, wide.jaxpr, wide.consts, found)
    return found


# --- pairing the two traces --------------------------------------------------------------------
def _pair_jaxprs(
    narrow: Jaxpr, narrow_consts: Sequence[Any], wide: Jaxpr, wide_consts: Sequence[Any], found: ExactConstants
) -> None:
    pairs = _pair_equations(narrow.eqns, wide.eqns)
    if pairs is None:
        _mark_lost(narrow, wide, found)
        return
    narrow_const = dict(zip(narrow.constvars, narrow_consts))
    wide_const = dict(zip(wide.constvars, wide_consts))
    for en, ew in pairs:
        for vn, vw in zip(en.invars, ew.invars):
            narrow_value = vn.val if isinstance(vn, Literal) else narrow_const.get(vn)
            wide_value = vw.val if isinstance(vw, Literal) else wide_const.get(vw)
            if narrow_value is not None and wide_value is not None:
                found.offer(narrow_value, wide_value)
        subs_n, subs_w = list(jaxprs_in_params(en.params)), list(jaxprs_in_params(ew.params))
        if len(subs_n) != len(subs_w):
            continue
        for sn, sw in zip(subs_n, subs_w):
            cn = sn.consts if isinstance(sn, ClosedJaxpr) else ()
            cw = sw.consts if isinstance(sw, ClosedJaxpr) else ()
            _pair_jaxprs(_open(sn), cn, _open(sw), cw, found)


def _pair_equations(narrow: Sequence[JaxprEqn], wide: Sequence[JaxprEqn]) -> list | None:
    """Equations of both traces in pairs (same primitive, same arity), extra converts skipped.

    In order first; if the orders differ (a backward pass transposed from a graph with the
    narrow trace's extra converts, where nested jits are inlined, e.g. under
    ``jax.disable_jit()``, can emit its sums in another order), by origin:
    :func:`_pair_by_origin`. None if the two sequences do not pair up either way.
    """
    pairs = _pair_in_order(narrow, wide)
    return pairs if pairs is not None else _pair_by_origin(narrow, wide)


def _pair_in_order(narrow: Sequence[JaxprEqn], wide: Sequence[JaxprEqn]) -> list | None:
    pairs = []
    i = j = 0
    while i < len(narrow) and j < len(wide):
        en, ew = narrow[i], wide[j]
        if en.primitive is ew.primitive and len(en.invars) == len(ew.invars):
            pairs.append((en, ew))
            i, j = i + 1, j + 1
        elif ew.primitive is _CONVERT:
            j += 1
        elif en.primitive is _CONVERT:
            i += 1
        else:
            return None
    rest = list(narrow[i:]) + list(wide[j:])
    return pairs if all(e.primitive is _CONVERT for e in rest) else None


def _origin(eqn: JaxprEqn) -> tuple:
    return eqn.primitive, len(eqn.invars), str(eqn.source_info.name_stack), source_info_util.summarize(eqn.source_info)


def _by_origin(eqns: Sequence[JaxprEqn]) -> dict[tuple, list[JaxprEqn]]:
    groups: dict[tuple, list[JaxprEqn]] = {}
    for eqn in eqns:
        if eqn.primitive is not _CONVERT:
            groups.setdefault(_origin(eqn), []).append(eqn)
    return groups


def _pair_by_origin(narrow: Sequence[JaxprEqn], wide: Sequence[JaxprEqn]) -> list | None:
    """Equations paired by origin (primitive, arity, name stack, source line), in order within each.

    Only when both traces hold the same origins the same number of times (converts aside);
    a pair of unrelated literals is harmless anyway: a wide value is only taken as exact if
    it rounds to the narrow one (:meth:`ExactConstants.offer`).
    """
    by_narrow, by_wide = _by_origin(narrow), _by_origin(wide)
    if by_narrow.keys() != by_wide.keys() or any(len(by_narrow[k]) != len(by_wide[k]) for k in by_narrow):
        return None
    return [pair for key, eqns in by_narrow.items() for pair in zip(eqns, by_wide[key])]


def _literals(jaxpr: Jaxpr, seen: set[int] | None = None) -> Iterator[tuple[Any, JaxprEqn]]:
    """Every literal value (sub-jaxprs included) with the equation that uses it."""
    seen = set() if seen is None else seen
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Literal):
                yield v.val, eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _literals(_open(sub), seen)


def _mark_lost(narrow: Jaxpr, wide: Jaxpr, found: ExactConstants) -> None:
    """Traces that do not pair up: flag the narrow 0/±inf literals that may be lost constants.

    A constant is lost when the widened trace holds a finite non-zero literal that rounds to
    0 or ±inf in a narrow dtype of the data trace, and the data trace holds more literals of
    that rounded value than the widened trace does (the extra ones are the lost constants,
    but which ones cannot be told apart).
    """
    narrow_lits = [(_as_narrow_scalar(val), val, eqn) for val, eqn in _literals(narrow)]
    narrow_lits = [(s, val, eqn) for s, val, eqn in narrow_lits if s is not None]
    wide_lits = [s for s in (_as_scalar(val) for val, _ in _literals(wide)) if s is not None]
    for dtype in {s.dtype for s, _, _ in narrow_lits}:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            lost = [w for w in wide_lits if np.isfinite(w) and w != 0 and _is_suspect(w.astype(dtype))]
        for w in lost:
            with np.errstate(over="ignore", under="ignore"):
                rounded = w.astype(dtype)
            n_narrow = [(val, eqn) for s, val, eqn in narrow_lits if s.dtype == dtype and _same(s, rounded)]
            n_wide = sum(1 for v in wide_lits if _same(v, np.float64(rounded)))
            if len(n_narrow) <= n_wide:
                continue
            for val, eqn in n_narrow:
                where = source_info_util.summarize(eqn.source_info)
                found.lost[id(val)] = (val, _lost_message(w, rounded, dtype, where))


def _same(a: np.ndarray, b: Any) -> bool:
    a, b = np.float64(a), np.float64(b)
    return bool(a == b or (np.isnan(a) and np.isnan(b)))


def _lost_message(wide: np.ndarray, rounded: np.ndarray, dtype: np.dtype, where: str) -> str:
    return (
        f"scalify: the constant {float(wide):.7g} became {float(rounded)!r} when traced on {dtype} data "
        f"and meets a scaled value here:\n  from:   {where}\n"
        "Its exact value could not be recovered (the function does not trace the same way on float32 "
        "inputs). Write the constant so that it does not depend on the data dtype, e.g. compute it "
        "in float32 (jnp.float32(1e-8)) or scale it into the data dtype's range."
    )


# --- constants known at trace time --------------------------------------------------------------
class _State(threading.local):
    def __init__(self):
        self.active: list[ExactConstants] = []


_state = _State()


@contextlib.contextmanager
def known_constants(found: ExactConstants | None = None) -> Iterator[None]:
    """Scope in which :func:`known_scalar` reports exact values: those of ``found``, and those
    that :func:`fold` records inside it. Without ``found``, an enclosing scope is kept.

    Records go to a fresh table of the scope, never into ``found`` (which a trace cache keeps).
    """
    if found is None and _state.active:
        yield
        return
    scopes = [ExactConstants()] if found is None else [found, ExactConstants()]
    _state.active.extend(scopes)
    try:
        yield
    finally:
        for scope in scopes:
            _state.active.remove(scope)


def _recorded_exact(value: Any) -> np.ndarray | None:
    key = id(value)
    for found in _state.active:
        entry = found.exact.get(key)
        if entry is not None and entry[0] is value:
            return entry[1]
    return None


def _repeated_element(value: Any) -> np.ndarray | None:
    """The one element that a trace-time value repeats (0-d, its dtype), or None."""
    if isinstance(value, (bool, int, float)):  # Python numbers (and JAX's weak-typed literals)
        return np.asarray(value)
    if isinstance(value, np.ndarray):  # NumPy arrays, JAX's array literals, folded values
        repeated = value.size == 1 or all(stride == 0 for stride, n in zip(value.strides, value.shape) if n > 1)
        return np.asarray(value[(0,) * value.ndim]) if value.size and repeated else None
    if isinstance(value, np.generic):
        return np.asarray(value)
    return None


def known_scalar(value: Any) -> np.ndarray | None:
    """The scalar that a value known at trace time repeats, at its exact value; None otherwise.

    Known values are Python numbers and NumPy values (a jaxpr's literals and the values
    :func:`fold` computes) whose elements are one scalar (size 1, or broadcast: zero
    strides). A JAX array is not, even a concrete one: called without an outer ``jax.jit``,
    scalify evaluates its jaxpr on the concrete arrays passed in, and taking those as
    constants would fold a step count or a learning rate into every jitted call inside the
    step (``jsa.scalify(nnx.jit(step))``), compiling it again at each new value. The scalar is the exact value
    recorded for the value object (a constant of a narrow-float trace, a folded constant),
    else its own element. A value passed on unchanged (into a sub-jaxpr, a loop body, a
    branch) stays known: nothing has to be carried beside it.
    """
    exact = _recorded_exact(value) if _state.active else None
    return exact if exact is not None else _repeated_element(value)


def spreads_out_of_range(invals: Sequence[Any]) -> bool:
    """Operands all known at trace time, one of them narrow and out of its dtype's range (:func:`out_of_range`).

    ``1e-6 / 128`` (a loss factor over a batch, in a cotangent) is 0 as float16: a plain
    equation that is not folded (the ``pad`` or ``scatter-add`` that transposes a slice or a
    label lookup) would spread the rounded value. The interpreter evaluates such an equation
    with its scale rule instead, the constant promoted at its exact value. An equation with
    a plain operand that is not known computes what JAX computes (plain data stay plain).
    """
    floating = [x for x in invals if _is_float(getattr(x, "dtype", None))]
    return any(map(out_of_range, floating)) and all(known_scalar(x) is not None for x in floating)


def out_of_range(value: Any) -> bool:
    """A known narrow-float value whose exact scalar its dtype holds only as a subnormal, 0 or inf."""
    exact = _recorded_exact(value) if _state.active else None
    if exact is None or not is_narrow_float(getattr(value, "dtype", None)):
        return False
    magnitude = abs(float(exact))
    info = jnp.finfo(value.dtype)
    return 0 < magnitude < np.inf and not float(info.smallest_normal) <= magnitude <= float(info.max)


def exact_scalar(op: Callable[..., Any]) -> Callable[..., Any]:
    """A ``scalar_fn`` for :func:`fold` computing ``op`` of floating constants in float64.

    The result keeps at least float32's range: a constant such as the ``1 / N`` of a mean's
    gradient times a loss weight stays known exactly even where the data dtype could not
    hold it, and is split into a power-of-two scale where it meets scaled data. ``op`` must
    round correctly once its float64 result is rounded to float32 (IEEE arithmetic and
    ``sqrt`` do), so that the folded value is the one XLA computes.
    """

    def scalar_fn(*scalars, **params):
        scalars = [np.asarray(x) for x in scalars]
        if not all(_is_float(x.dtype) for x in scalars):
            return None
        with np.errstate(all="ignore"):
            exact = op(*(x.astype(np.float64) for x in scalars))
            return exact.astype(np.result_type(*(x.dtype for x in scalars), np.float32))

    return scalar_fn


def fold(eqn: JaxprEqn, scalar_fn: Callable[..., Any] | None, invals: Sequence[Any]) -> list | None:
    """The output of a plain equation on known operands, computed at trace time; None if it is not one.

    ``scalar_fn`` (see ``register_scaled_op(scalar_preserving=...)``) maps the scalars of
    operands that each repeat one scalar to the scalar of the output. The output is that
    scalar computed from the operands' own (traced) elements, cast to the output dtype and
    broadcast without a copy to the output shape: the value JAX computes, as a NumPy
    constant, which every trace takes as one (XLA receives a scalar and a broadcast). When
    ``scalar_fn`` of the operands' exact values (:func:`known_scalar`) differs from it, the
    exact value is recorded for the output, so promotion splits the intended constant (a
    ``1e-8`` that a float16 trace holds as 0, a product of constants below float16's range).
    """
    if scalar_fn is None or eqn.primitive.multiple_results or not invals:
        return None
    aval = eqn.outvars[0].aval
    if not all(isinstance(d, int) for d in getattr(aval, "shape", (None,))):  # symbolic (export) shapes
        return None
    exact_in = [known_scalar(x) for x in invals]
    if any(s is None for s in exact_in):
        return None
    traced_in = [_repeated_element(x).astype(v.aval.dtype) for x, v in zip(invals, eqn.invars)]
    with np.errstate(all="ignore"):
        exact, traced = scalar_fn(*exact_in, **eqn.params), scalar_fn(*traced_in, **eqn.params)
        if exact is None or traced is None or np.size(exact) != 1 or np.size(traced) != 1:
            return None
        traced = np.asarray(traced).reshape(()).astype(aval.dtype)
    return [constant_value(traced, aval.shape, np.asarray(exact).reshape(()))]


def constant_value(element: np.ndarray, shape: Sequence[int], exact: np.ndarray) -> np.ndarray:
    """A NumPy value repeating ``element`` (0-d) over ``shape``, known at the exact value ``exact``.

    The value is a broadcast view (no copy). ``exact`` is recorded for it in the innermost
    :func:`known_constants` scope when it differs from ``element``.
    """
    value = np.broadcast_to(element, tuple(shape))
    if not (exact.dtype == element.dtype and bool(exact == element)):  # (a nan is recorded: harmless)
        if not _state.active:
            raise RuntimeError("internal to jax_scalify: a constant was folded outside a known_constants scope")
        _state.active[-1].exact[id(value)] = (value, exact)
    return value


def check_not_lost(eqn: JaxprEqn) -> None:
    """Raise if a literal of ``eqn`` (which has scaled operands) may be a lost constant."""
    for v in eqn.invars:
        if not isinstance(v, Literal):
            continue
        for found in _state.active:
            entry = found.lost.get(id(v.val))
            if entry is not None and entry[0] is v.val:
                raise ValueError(entry[1])


__all__ = [
    "ExactConstants",
    "check_not_lost",
    "constant_value",
    "fold",
    "has_narrow_constants",
    "is_narrow_float",
    "known_constants",
    "known_scalar",
    "recover",
    "widened_example",
]
