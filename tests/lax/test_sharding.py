"""SPMD under scalify: NamedSharding through jit, shard_map and its collectives (8 CPU devices).

``tests/conftest.py`` gives the test session eight host devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scalify as jsa
from tests.invariance import STATIC_POLICY, Case, assert_close_values, assert_pow2_scales, invariance_test, normal

N = 8
pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices (tests/conftest.py sets them)")

MESH = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,)) if jax.device_count() >= N else None
MESH_2D = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2) if jax.device_count() >= N else None


def smap(in_specs, out_specs, check_vma=True, mesh=None):
    """Decorator: ``jax.shard_map`` over the 8-device mesh."""
    return functools.partial(
        jax.shard_map, mesh=mesh or MESH, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )


def jit_smap(in_specs, out_specs, check_vma=True):
    """Decorator: a jitted ``shard_map`` (compiled once per input types, also under scalify)."""
    return lambda fn: jax.jit(smap(in_specs, out_specs, check_vma)(fn))


RING = [(i, (i + 1) % N) for i in range(N)]


# --- programs (plain JAX) ----------------------------------------------------------------------
@jit_smap((P("x"), P()), P())
def dp_linear_psum(x, w):
    """Data parallel: per-device partial matmul-sum, summed over devices."""
    return jax.lax.psum(jnp.sum(jnp.tanh(x @ w), axis=0), "x")


@jit_smap((P("x"), P()), P(), check_vma=False)
def dp_linear_psum_unchecked(x, w):
    return jax.lax.psum(jnp.sum(jnp.tanh(x @ w), axis=0), "x")


@jit_smap(P("x"), (P(), P()))
def pmax_pmin(x):
    return jax.lax.pmax(x, "x"), jax.lax.pmin(x, "x")


@jit_smap(P("x"), P("x"))
def all_gather_tiled(x):
    return jax.lax.all_gather(x, "x", tiled=True) * 2.0


@jit_smap(P("x"), P("x"))
def all_to_all(x):
    return jax.lax.all_to_all(x, "x", 0, 0, tiled=True)


@jit_smap(P("x"), P("x"))
def ring_shift(x):
    return jax.lax.ppermute(x, "x", RING) + x


@jit_smap(P("x"), P("x"))
def psum_scatter(x):
    return jax.lax.psum_scatter(x, "x", tiled=True)


@jit_smap(P(), P())
def psum_of_replicated(x):
    """psum of an invariant value: JAX inserts pvary, then psum_invariant."""
    return jax.lax.psum(x, "x")


@jit_smap((P("x"), P()), P())
def pmean_grad_step(x, w):
    """A data-parallel gradient, averaged over devices with pmean."""
    grad = jax.grad(lambda w: jnp.mean(jnp.square(jnp.tanh(x @ w))))(w)
    return jax.lax.pmean(grad, "x")


def vmap_batch_norm(x):
    """Collectives over a ``jax.vmap`` axis name (Equinox's BatchNorm idiom): JAX turns them
    into psum over a positional axis of the batched data."""

    def per_example(row):
        centred = row - jax.lax.pmean(row, "batch")
        return centred * jax.lax.rsqrt(jax.lax.pmean(jnp.square(centred), "batch") + 1e-5)

    return jax.vmap(per_example, axis_name="batch")(x)


def vmap_range(x):
    """pmax and pmin over a ``jax.vmap`` axis name (no derivative in JAX)."""
    return jax.vmap(lambda row: jax.lax.pmax(row, "batch") - jax.lax.pmin(row, "batch"), axis_name="batch")(x)


INVARIANCE_CASES = [
    Case("vmap_axis_name_psum", vmap_batch_norm, [normal(16, 3)], grad=True),
    Case("vmap_axis_name_pmax_pmin", vmap_range, [normal(16, 3)]),
    Case("shard_map_psum", dp_linear_psum, [normal(16, 4), normal(4, 3)], grad=True),
    Case("shard_map_psum_unchecked", dp_linear_psum_unchecked, [normal(16, 4), normal(4, 3)], grad=True),
    Case("pmax_pmin", pmax_pmin, [normal(16, 3)]),
    Case("all_gather", all_gather_tiled, [normal(16, 3)], grad=True),
    Case("all_to_all", all_to_all, [normal(64, 2)], grad=True),
    Case("ppermute", ring_shift, [normal(16, 3)], grad=True),
    Case("psum_scatter", psum_scatter, [normal(64, 2)], grad=True),
    Case("psum_of_replicated", psum_of_replicated, [normal(5)], grad=True),
    Case("pmean_grad_step", pmean_grad_step, [normal(16, 4), normal(4, 3)]),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=3)


# --- unit scaling and per-device scales --------------------------------------------------------
def scaled(x, scale, dtype=jnp.float32):
    return jsa.ScaledArray(jnp.asarray(np.asarray(x) / scale, dtype), jnp.float32(scale))


def test_psum_unit_scaling():
    """A psum over 8 devices of unit-scale blocks: scale * pow2(sqrt(8)) = 2, data / 2."""
    x = scaled(np.full((16, 3), 2.0**-3), 2.0**-3)  # data 1
    out = jsa.scalify(smap(P("x"), P())(lambda v: jax.lax.psum(v, "x")), policy=STATIC_POLICY)(x)
    assert float(out.scale) == 2.0**-3 * 2
    np.testing.assert_array_equal(np.asarray(out.data), np.full((2, 3), 4.0))
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.full((2, 3), 1.0))


@pytest.mark.parametrize("check_vma", [True, False])
def test_collectives_align_per_device_scales(check_vma):
    """Blocks rescaled to device-local scales (dynamic_rescale) are aligned before combining."""

    @smap(P("x"), (P(), P(), P("x"), P("x")), check_vma=check_vma)
    def fn(x):
        x = jsa.ops.dynamic_rescale_max(x * (2.0 ** jax.lax.axis_index("x")))  # local scales differ
        gathered = jax.lax.all_gather(x, "x", tiled=True)
        return jax.lax.psum(x, "x"), jax.lax.pmax(x, "x"), gathered, jax.lax.ppermute(x, "x", RING)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    expected = fn(x)
    got = jax.jit(jsa.scalify(fn))(scaled(x, 2.0**5))
    assert_pow2_scales(got)
    assert_close_values(got, expected, rtol=1e-6, atol=1e-6)


def test_fp16_psum_of_large_values():
    """float16 blocks whose sum overflows float16: the scale carries the range."""

    @smap(P("x"), P())
    def fn(x):
        return jax.lax.psum(x, "x")

    x = scaled(np.full((16, 2), 2.0**20), 2.0**20, jnp.float16)
    out = jsa.scalify(fn)(x)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), np.full((2, 2), 2.0**23))


def test_shard_map_keeps_specs_and_options():
    fn = smap((P("x"), P()), P())(lambda x, w: jax.lax.psum(x @ w, "x"))
    args = (scaled(np.ones((16, 4)), 1.0), scaled(np.ones((4, 3)), 1.0))
    jaxpr = jax.make_jaxpr(jsa.scalify(fn))(*args)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert eqn.params["in_specs"] == (P("x"), P(), P(), P())  # data, scale, data, scale
    assert eqn.params["out_specs"] == (P(), P())
    assert eqn.params["check_vma"] is True


@pytest.mark.slow  # for time: compiles several shard_map programs; test_invariance[shard_map_psum] runs by default
def test_shard_map_with_plain_and_integer_arguments():
    @smap((P("x"), P("x"), P()), (P("x"), P("x")))
    def fn(x, idx, plain):
        return x[idx[0]] * plain, idx + 1

    x = np.arange(32.0, dtype=np.float32).reshape(16, 2)
    idx = np.zeros((16,), np.int32)
    plain = np.float32(3.0)
    expected = fn(x, idx, plain)
    got = jsa.scalify(fn)(scaled(x, 4.0), idx, plain)
    assert_close_values(got, expected, rtol=1e-6, atol=1e-6)


# --- NamedSharding through jit -----------------------------------------------------------------
def mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean(jnp.square(h @ params["w2"] - y))


def sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _mlp_problem(rng):
    params = {
        "w1": rng.standard_normal((8, 32)).astype(np.float32) / np.sqrt(8),
        "b1": np.zeros((32,), np.float32),
        "w2": rng.standard_normal((32, 4)).astype(np.float32) / np.sqrt(32),
    }
    return params, rng.standard_normal((64, 8)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32)


def _put(tree, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _scaled_put(tree, mesh, specs):
    """ScaledArray leaves with their data placed with ``specs`` and scales replicated."""

    def put(x, spec):
        s = jsa.as_scaled_array(x)
        return jsa.ScaledArray(
            jax.device_put(s.data, NamedSharding(mesh, spec)), jax.device_put(s.scale, NamedSharding(mesh, P()))
        )

    return jax.tree.map(put, tree, specs)


@pytest.mark.parametrize(
    "name, param_specs, x_spec",
    [
        ("data_parallel", {"w1": P(), "b1": P(), "w2": P()}, P("dp")),
        ("tensor_parallel", {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}, P()),
        ("both", {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}, P("dp")),
    ],
)
def test_named_sharding_through_jit(name, param_specs, x_spec):
    """Scalified step under jit: shardings of the outputs are those of the plain step, values match."""
    params, x, y = _mlp_problem(np.random.default_rng(1))
    plain_in = (_put(params, MESH_2D, param_specs), *_put((x, y), MESH_2D, (x_spec, x_spec)))
    scaled_in = (_scaled_put(params, MESH_2D, param_specs), *_scaled_put((x, y), MESH_2D, (x_spec, x_spec)))
    expected = jax.jit(sgd_step)(*plain_in)
    got = jax.jit(jsa.scalify(sgd_step))(*scaled_in)
    assert_pow2_scales(got)
    unsharded = sgd_step(params, x, y)
    assert_close_values(got, unsharded, rtol=1e-5, atol=1e-6)
    for g, e in zip(jax.tree.leaves(got[1], is_leaf=jsa.is_scaled_leaf), jax.tree.leaves(expected[1])):
        assert g.data.sharding.is_equivalent_to(e.sharding, g.data.ndim), (name, g.data.sharding, e.sharding)
        assert g.scale.sharding.is_fully_replicated


def test_tensor_parallel_matmul_keeps_output_sharding():
    """A weight sharded on its output dim: the scalified matmul's data keeps that sharding."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 32)).astype(np.float32)
    w_sharding = NamedSharding(MESH, P(None, "x"))
    xs = _scaled_put(x, MESH, P())
    ws = _scaled_put(w, MESH, P(None, "x"))
    out = jax.jit(jsa.scalify(lambda a, b: jnp.tanh(a @ b)))(xs, ws)
    expected = jax.jit(lambda a, b: jnp.tanh(a @ b))(x, jax.device_put(w, w_sharding))
    assert out.data.sharding.is_equivalent_to(expected.sharding, 2)
    assert out.data.sharding.spec == P(None, "x")
    np.testing.assert_allclose(np.asarray(out.to_array()), np.tanh(x @ w), rtol=1e-5, atol=1e-6)


def test_shard_map_training_step_matches_unsharded():
    """Data-parallel SGD inside shard_map, under jit.

    With ``check_vma=True`` the gradient of a replicated parameter is already summed over the
    devices (the transpose of ``pvary`` is ``psum``): dividing by the device count gives the
    gradient of the global mean loss.
    """

    @smap((P(), P("x"), P("x")), (P(), P()))
    def step(params, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        return jax.lax.pmean(loss, "x"), jax.tree.map(lambda p, g: p - 0.1 * g / N, params, grads)

    params, x, y = _mlp_problem(np.random.default_rng(3))
    expected = sgd_step(params, x, y)
    assert_close_values(jax.jit(step)(params, x, y), expected, rtol=1e-5, atol=1e-6)
    got = jax.jit(jsa.scalify(step))(jsa.as_scaled_array(params), jsa.as_scaled_array(x), jsa.as_scaled_array(y))
    assert_pow2_scales(got)
    assert_close_values(got, expected, rtol=1e-5, atol=1e-6)


# --- explicit sharding (sharding in types, the default of jax.make_mesh) -----------------------
EXPLICIT = jax.make_mesh((N,), ("d",)) if jax.device_count() >= N else None  # Explicit axes by default


def fsdp_loss(params, x):
    """FSDP style: parameters stored sharded, gathered (resharded to replicated) for the compute."""
    w = jax.sharding.reshard(params["w"], P())
    b = jax.sharding.reshard(params["b"], P())
    return jnp.mean(jnp.tanh(x @ w + b) ** 2)


def fsdp_step(params, x):
    loss, grads = jax.value_and_grad(fsdp_loss)(params, x)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.parametrize("fan_in", [16, 496])
def test_reshard_fsdp_step_on_an_explicit_mesh(fan_in):
    """``fan_in=496``: the rescale policy's strided sample of the sharded ``w`` (rows 0, 16, ...,
    31 of them) could not be typed on 8 devices; it now takes a stride that divides each
    device's 62 rows."""
    assert EXPLICIT.axis_types == (AxisType.Explicit,)
    rng = np.random.default_rng(0)
    with jax.set_mesh(EXPLICIT):
        sharded = NamedSharding(EXPLICIT, P("d"))
        w = rng.standard_normal((fan_in, 8)).astype(np.float32) / np.sqrt(fan_in)
        params = jax.device_put({"w": w, "b": np.full((8,), 0.01, np.float32)}, sharded)
        x = jax.device_put(rng.standard_normal((32, fan_in)).astype(np.float32), sharded)
        ref_loss, ref_params = jax.jit(fsdp_step)(params, x)
        scaled_params = jsa.device_put(jsa.as_scaled_array(params), sharded)
        loss, new = jax.jit(jsa.scalify(fsdp_step))(scaled_params, jsa.as_scaled_array(x))
    np.testing.assert_allclose(loss.to_array(), ref_loss, rtol=1e-6)
    for key in params:
        assert new[key].data.sharding.spec == ref_params[key].sharding.spec
        assert new[key].scale.sharding.spec == P()
        np.testing.assert_allclose(new[key].to_array(), ref_params[key], rtol=1e-5, atol=1e-7)
    assert_pow2_scales(new)


def test_reshard_rule_keeps_the_scale_and_moves_the_data():
    with jax.set_mesh(EXPLICIT):
        x = jsa.device_put(scaled(np.arange(16.0).reshape(8, 2), 2.0**-4), NamedSharding(EXPLICIT, P("d")))
        rule = jsa.scalify(lambda v: jax.sharding.reshard(v, P(None, None)), policy=jsa.RescalePolicy.static())
        out = jax.jit(rule)(x)
        jaxpr = jax.make_jaxpr(jsa.scalify(lambda v: jax.sharding.reshard(v, P()), policy=jsa.RescalePolicy.static()))(
            x
        )
    assert out.data.sharding.spec == P(None, None) and float(out.scale) == 2.0**-4
    np.testing.assert_array_equal(out.to_array(), np.arange(16.0).reshape(8, 2))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("reshard") == 1 and names[-1] == "reshard"  # the data only: the scale is not moved


# --- jsa.device_put and jsa.scaled_shardings ---------------------------------------------------
def test_plain_device_put_of_a_scaled_tree_fails_and_jsa_device_put_works():
    tree = jsa.as_scaled_array({"w": np.ones((16, 4), np.float32), "b": np.ones((8,), np.float32)})
    sharding = NamedSharding(MESH, P("x"))
    with pytest.raises(ValueError):  # JAX applies P("x") to the 0-d scales too
        jax.device_put(tree, sharding)
    placed = jsa.device_put(tree, sharding)
    for leaf in placed.values():
        assert leaf.data.sharding.spec == P("x") and leaf.scale.sharding.spec == P()
        assert (
            len(leaf.data.addressable_shards) == N
            and leaf.data.addressable_shards[0].data.shape[0] == leaf.shape[0] // N
        )


def test_scaled_shardings_for_jit_in_and_out_shardings():
    tree = {"w": jsa.as_scaled_array(np.ones((16, 4), np.float32)), "step": np.int32(0)}
    specs = {"w": NamedSharding(MESH, P("x")), "step": NamedSharding(MESH, P())}
    shardings = jsa.scaled_shardings(tree, specs)
    assert shardings["w"].data.spec == P("x") and shardings["w"].scale.spec == P() and shardings["step"].spec == P()
    step = jax.jit(
        jsa.scalify(lambda t: {"w": t["w"] * 3.0, "step": t["step"] + 1}),
        in_shardings=(shardings,),
        out_shardings=shardings,
    )
    out = step(jsa.device_put(tree, specs))
    assert out["w"].data.sharding.spec == P("x") and out["w"].scale.sharding.spec == P()
    np.testing.assert_array_equal(out["w"].to_array(), np.full((16, 4), 3.0))
    assert int(out["step"]) == 1
    with pytest.raises(ValueError, match="structure of the value tree"):
        jsa.scaled_shardings(tree, {"w": specs["w"]})
    with pytest.raises(TypeError, match="NamedSharding"):
        jsa.scaled_shardings(tree, {"w": P("x"), "step": None})


@pytest.mark.parametrize(
    "axis_type, specs",
    [
        (AxisType.Auto, {"w1": P("x", None), "b1": P(), "w2": P("x", None)}),  # FSDP: parameters sharded
        (AxisType.Explicit, {"w1": P(), "b1": P(), "w2": P()}),  # data parallel, sharding in types
    ],
    ids=["auto_fsdp", "explicit_data_parallel"],
)
def test_default_rescale_policy_under_sharding(axis_type, specs):
    """Gradients and outputs rescaled by the default policy with the batch (and parameters) sharded on 8 devices."""
    mesh = jax.make_mesh((N,), ("x",), axis_types=(axis_type,))
    params, x, y = _mlp_problem(np.random.default_rng(2))
    scaled_in = (_scaled_put(params, mesh, specs), *_scaled_put((x, y), mesh, (P("x"), P("x"))))
    step = jax.jit(jsa.scalify(sgd_step))
    got = step(*scaled_in)
    assert_close_values(got, sgd_step(params, x, y), rtol=1e-5, atol=1e-6)
    plain = jax.jit(sgd_step)(_put(params, mesh, specs), *_put((x, y), mesh, (P("x"), P("x"))))
    for new, expected in zip(jax.tree.leaves(got[1], is_leaf=jsa.is_scaled_leaf), jax.tree.leaves(plain[1])):
        # The weights keep the plain step's sharding (GSPMD may shard the small bias differently).
        assert new.data.ndim == 1 or new.data.sharding.is_equivalent_to(expected.sharding, new.data.ndim)
        assert new.scale.sharding.is_fully_replicated
        assert 0.5 <= float(np.sqrt(np.mean(np.square(np.asarray(new.data))))) < 2.0
    hlo = step.lower(*scaled_in).compile().as_text()
    static_hlo = jax.jit(jsa.scalify(sgd_step, policy=jsa.RescalePolicy.static())).lower(*scaled_in).compile().as_text()
    # The statistics add a few all-reduces (XLA combines many of them), not one per tensor.
    assert hlo.count("all-reduce(") <= static_hlo.count("all-reduce(") + 6


def _fsdp_adam_all_reduces(layers: int) -> int:
    """All-reduces of a scalified FSDP step (Adam in FP16 state, default policy) of a ``layers``-deep MLP."""
    import optax

    mesh = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = [
        {"w": rng.normal(size=(32, 32)).astype(np.float32) / 6, "b": np.zeros(32, np.float32)} for _ in range(layers)
    ]
    specs = [{"w": P("x", None), "b": P()} for _ in range(layers)]

    def loss(p, x):
        for layer in p:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean(jnp.square(x))

    tx = jsa.optim.scale_state(optax.adam(1e-3))

    def step(p, s, x):
        grads = jax.grad(loss)(p, x)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    p = jsa.as_scaled_array(_put(params, mesh, specs))
    x = jsa.as_scaled_array(jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), NamedSharding(mesh, P("x"))))
    hlo = jax.jit(jsa.scalify(step)).lower(p, tx.init(p), x).compile().as_text()
    return hlo.count("all-reduce(")


def test_rescale_statistics_cost_a_few_all_reduces_whatever_the_number_of_tensors():
    """The policy's and scale_state's statistics of a sharded step: one all-reduce per batch, not one per tensor.

    One tensor each would add 8 all-reduces per layer (gradient, two moments and parameter,
    for ``w`` and ``b``). What grows with depth is what one layer needs before the next can
    run: the backward pass's own sums, each rescaled from its result in turn (the tanh's
    derivative, a product rule), and the forward contraction's result (``contractions``),
    whose rows are sharded: two scalar all-reduces per layer. Each factor waits for its whole
    batch's statistics (``_joined`` in ``core/measure.py``): without that, XLA scheduled each
    statistic's all-reduce on its own instead of combining it with the batch's.
    """
    two, four = _fsdp_adam_all_reduces(2), _fsdp_adam_all_reduces(4)
    assert two <= 10 and four - two == 4
