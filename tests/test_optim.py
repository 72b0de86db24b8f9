"""``jsa.optim.scale_state``: Optax state stored in FP16/FP8 with scales, updated in float32."""

import warnings

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from experiments.optim_state import make_optimizer as optimizer_with_defaults
from jax_scalify.optim import scale_state
from tests.compiles import count_xla_compiles
from tests.invariance import assert_close_values, assert_pow2_scales, scaled
from tests.nn.helpers import init_mlp

STEPS = 40
LEARNING_RATES = {"adam": 1e-2, "adamw": 1e-2, "adabelief": 1e-2, "sgd_momentum": 1e-1, "lion": 3e-3}
OPTIMIZERS = tuple(LEARNING_RATES)


def make_optimizer(name: str, schedule: bool) -> optax.GradientTransformation:
    """``name`` with Optax's default hyperparameters (eps, betas, weight decay)."""
    lr = LEARNING_RATES[name]
    if schedule:
        lr = optax.warmup_cosine_decay_schedule(0.0, lr, STEPS // 10, STEPS, lr / 10)
    return optimizer_with_defaults(name, lr)


ALL_OPTIMIZERS = pytest.mark.parametrize(
    "name, schedule",
    [(n, True) for n in OPTIMIZERS] + [pytest.param(n, False, marks=pytest.mark.slow) for n in OPTIMIZERS],
    ids=lambda v: {True: "schedule", False: "constant"}.get(v, v),
)


# --- a small regression task --------------------------------------------------------------------
def mlp(params, x):
    for layer in params[:-1]:
        x = jsa.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean(jnp.square(mlp(params, x).astype(jnp.float32) - y.astype(jnp.float32)))


def task(sizes=(16, 32, 4), n=128, seed=0):
    """A random teacher MLP labels Gaussian inputs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, sizes[0])).astype(np.float32)
    y = np.asarray(mlp(init_mlp(np.random.default_rng(seed + 1), (sizes[0], 32, sizes[-1])), x))
    return init_mlp(rng, sizes), x, y


def make_step(tx: optax.GradientTransformation):
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def train(step, params, opt_state, x, y, steps):
    step = jax.jit(step)
    losses = []
    for _ in range(steps):
        loss, params, opt_state = step(params, opt_state, x, y)
        losses.append(float(jsa.asarray(loss)))
    return losses, params, opt_state


# --- (a) float32 storage: the same optimizer -----------------------------------------------------
def bowl_loss(params, targets):
    """A quadratic bowl per leaf: gradients at each leaf's own scale, for any scale."""
    return sum(jnp.mean(jnp.square(p - t)) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))


@ALL_OPTIMIZERS
def test_float32_state_under_scalify_equals_the_plain_optimizer(name, schedule):
    """Params at random power-of-two scales; 4 steps of the wrapped optimizer == the plain one."""
    rng = np.random.default_rng(1)
    shapes = {"w": (8, 4), "b": (4,), "v": (3, 5)}
    exponents = {k: int(rng.integers(-12, 13)) for k in shapes}
    data = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
    pow2 = {k: np.float32(2.0**e) for k, e in exponents.items()}
    targets = {k: rng.standard_normal(shape).astype(np.float32) * pow2[k] for k, shape in shapes.items()}
    params = {k: data[k] * pow2[k] for k in shapes}
    scaled_params = {k: scaled(data[k], exponents[k]) for k in shapes}
    inner = make_optimizer(name, schedule)
    tx = scale_state(inner, jnp.float32)

    def step(tx):
        def fn(params, opt_state):
            loss, grads = jax.value_and_grad(bowl_loss)(params, targets)
            updates, opt_state = tx.update(grads, opt_state, params)
            return loss, optax.apply_updates(params, updates), opt_state

        return fn

    plain_step, scaled_step = jax.jit(step(inner)), jax.jit(jsa.scalify(step(tx)))
    p, s = params, inner.init(params)
    sp, ss = scaled_params, tx.init(scaled_params)
    for _ in range(4):
        loss, p, s = plain_step(p, s)
        sloss, sp, ss = scaled_step(sp, ss)
        assert_close_values((sloss, sp), (loss, p), rtol=2e-5, atol=2e-6)
    assert_pow2_scales((sp, ss))
    assert_close_values(ss.inner, s, rtol=2e-5, atol=2e-6)


# --- (b) float16 storage: training matches FP32, plain FP16 does not -----------------------------
def train_fp32_and_fp16(name: str, schedule: bool, plain_fp16: bool = False) -> dict[str, list[float]]:
    """Losses of the plain optimizer in FP32, of ``scale_state(opt, float16)`` with scaled FP16
    weights and gradients, and (``plain_fp16``) of the plain optimizer in FP16 without scalify."""
    params, x, y = task()
    inner = make_optimizer(name, schedule)
    losses = {"fp32": train(make_step(inner), params, inner.init(params), x, y, STEPS)[0]}
    if plain_fp16:
        params16, xy16 = jsa.tree.astype((params, (x, y)), jnp.float16)
        losses["plain fp16"] = train(make_step(inner), params16, inner.init(params16), *xy16, STEPS)[0]
    tx = scale_state(inner, jnp.float16)
    sparams = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    sxy = jsa.tree.astype(jsa.as_scaled_array((x, y)), jnp.float16)
    losses["scaled fp16"], sp, ss = train(jsa.scalify(make_step(tx)), sparams, tx.init(sparams), *sxy, STEPS)
    check_fp16_state(sp, ss)
    return losses


def check_fp16_state(params, opt_state):
    for leaf in jax.tree.leaves((params, opt_state), is_leaf=jsa.is_scaled_leaf):
        if isinstance(leaf, jsa.ScaledArray):
            assert leaf.dtype == jnp.float16
            assert np.all(np.isfinite(np.asarray(leaf.data, np.float32)))
    assert_pow2_scales((params, opt_state))


ADAM_FAMILY = ("adam", "adamw", "adabelief")


def check_fp16_training(name: str, schedule: bool) -> None:
    """Scaled FP16 ends within 5% of FP32; plain FP16 Adam-family training is NaN from the first steps
    (eps = 1e-8 or 1e-16 is 0 in FP16 and a zero gradient entry gives 0/0)."""
    losses = train_fp32_and_fp16(name, schedule, plain_fp16=name in ADAM_FAMILY)
    fp32, scaled16 = losses["fp32"][-1], losses["scaled fp16"][-1]
    assert scaled16 < 0.7 * losses["scaled fp16"][0], f"{name}: scaled FP16 did not train: {losses['scaled fp16']}"
    assert abs(scaled16 - fp32) <= 0.05 * fp32, f"{name}: scaled FP16 loss {scaled16:.5g} vs FP32 {fp32:.5g}"
    if name in ADAM_FAMILY:
        assert not np.all(np.isfinite(losses["plain fp16"][:3])), f"{name}: plain FP16 {losses['plain fp16'][:3]}"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float16_state_trains_like_float32_with_a_schedule(name):
    check_fp16_training(name, schedule=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float16_state_trains_like_float32_with_a_constant_rate(name):
    check_fp16_training(name, schedule=False)


def test_plain_float16_training_without_scalify_works_with_the_wrapper():
    """Plain FP16 weights and gradients, no scalify: Adam is NaN, scale_state(Adam) matches FP32."""
    params, x, y = task()
    inner = make_optimizer("adam", schedule=True)
    fp32 = train(make_step(inner), params, inner.init(params), x, y, STEPS)[0]
    tx = scale_state(inner, jnp.float16)
    params16, xy16 = jsa.tree.astype((params, (x, y)), jnp.float16)
    losses, params16, state = train(make_step(tx), params16, tx.init(params16), *xy16, STEPS)
    assert all(p.dtype == jnp.float16 and not isinstance(p, jsa.ScaledArray) for p in jax.tree.leaves(params16))
    check_fp16_state({}, state)
    assert abs(losses[-1] - fp32[-1]) <= 0.05 * fp32[-1], f"FP16 + scale_state {losses[-1]:.5g} vs FP32 {fp32[-1]:.5g}"


# --- (c) state layout ---------------------------------------------------------------------------
def test_init_zero_moments_get_scale_zero_and_counts_stay_integers():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = scale_state(optax.adam(1e-3), jnp.float16).init(params)
    adam_state = state.inner[0]
    assert adam_state.count.dtype == jnp.int32 and not isinstance(adam_state.count, jsa.ScaledArray)
    for moment in (adam_state.mu, adam_state.nu):
        for leaf in jax.tree.leaves(moment, is_leaf=jsa.is_scaled_leaf):
            assert isinstance(leaf, jsa.ScaledArray) and leaf.dtype == jnp.float16
            assert float(leaf.scale) == 0.0 and not np.any(np.asarray(leaf.data))


@pytest.mark.parametrize("dtype, top", [(jnp.float16, 2.0**14), (jnp.float8_e4m3fn, 2.0**7), (jnp.float32, 2.0**14)])
def test_init_non_zero_state_has_its_largest_entry_at_the_top_of_the_range(dtype, top):
    """A state that copies the parameters keeps their values, its largest data entry in ``(top/2, top]``."""
    tx = scale_state(optax.GradientTransformation(lambda p: dict(p), lambda u, s, p=None: (u, s)), dtype)
    w = jnp.asarray([[3e-6, -1e-7], [2e-9, 0.0]], jnp.float32)
    copy = tx.init({"w": w}).inner["w"]
    assert isinstance(copy, jsa.ScaledArray) and copy.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(copy.to_array(jnp.float32)), w, rtol=0.07 if dtype == jnp.float8_e4m3fn else 1e-3
    )
    largest = np.max(np.abs(np.asarray(copy.data, np.float32)))
    assert top / 2 < largest <= top


def _mlp_params_in_float16():
    sizes = (6, 5, 3)
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    params = {
        f"layer{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full(b, 0.1 * i)}
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
    }
    return jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)


def _assert_same_state(got, expected):
    chex.assert_trees_all_equal_structs(got, expected)
    for a, b in zip(
        jax.tree.leaves(got, is_leaf=jsa.is_scaled_leaf), jax.tree.leaves(expected, is_leaf=jsa.is_scaled_leaf)
    ):
        assert type(a) is type(b) and a.dtype == b.dtype
        if isinstance(a, jsa.ScaledArray):
            assert float(a.scale) == float(b.scale)
            a, b = a.data, b.data
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Statistics: reductions of numbers (the boundary's check of the input scales is a reduce_and of booleans).
REDUCTIONS = ("reduce", "reduce_max", "reduce_min", "reduce_sum", "argmax", "argmin")


def _reductions(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in REDUCTIONS
        count += sum(
            _reductions(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params)
        )
    return count


def test_update_measures_each_large_tensor_alone_and_small_ones_of_one_shape_together():
    """Adam's update measures each stored moment once (its largest entry) and each update once
    (its RMS). A tensor of more than 4,096 entries is reduced on its own: a variadic reduction
    holds all its operands in memory at once (the float32 moments of every same-shaped weight of
    a 12-layer GPT-2 were 400 MiB of temporaries), and XLA:CPU's variadic sums are slow. Those
    of one smaller shape share one reduction. Here: w's two moments and w's update, one each;
    everything of b together."""
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.full((64, 256), 0.02), "b": jnp.ones(256)}), jnp.float16)
    tx = scale_state(optax.adam(1e-3), jnp.float16)
    state = tx.init(params)
    update = jsa.scalify(tx.update, policy=jsa.RescalePolicy.static())
    assert _reductions(jax.make_jaxpr(update)(params, state, params).jaxpr) == 4


def test_same_shaped_parameters_get_kernels_that_read_no_batch_vector_on_cpu():
    """XLA:CPU compiles identical kernels once, and a kernel that reads its tensor's scale out of a
    vector of the whole batch, at an offset of its own, is distinct from every other: the README
    recipe's AdamW step on three same-shaped layers has no such slice once compiled for the CPU
    (it had 33). Lowered for a GPU the batch's arithmetic stays one vector (sibling kernels fuse)."""
    params = jsa.tree.astype(jsa.as_scaled_array({f"w{i}": jnp.full((16, 16), 0.1) for i in range(3)}), jnp.float16)
    tx = scale_state(optax.adamw(1e-3), jnp.float16)

    def step(p, state, x):
        def loss(p):
            h = x
            for key in sorted(p):
                h = jnp.tanh(h @ p[key])
            return jnp.mean(h**2)

        updates, state = tx.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, updates), state

    traced = jax.jit(jsa.scalify(step)).trace(
        params, tx.init(params), jsa.as_scaled_array(jnp.ones((4, 16), jnp.float16))
    )
    assert " slice(" not in traced.lower().compile().as_text()
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.slice") > 0


def test_a_moment_that_becomes_all_zero_gets_scale_zero_and_keeps_its_zeros():
    """All zeros are stored at scale 0, which the next update reads as "all zero": no floor, no reduction."""
    tx = scale_state(optax.sgd(1.0, momentum=0.5), jnp.float16, compensate=False)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    _, state = jsa.scalify(tx.update)({"w": jnp.asarray([1.0, 0.0, 0.0, 0.0])}, state)
    trace = state[0].trace["w"]
    assert float(trace.scale) > 0 and float(jnp.max(jnp.abs(trace.data))) == 2.0**14
    zeros = optax.TraceState(trace={"w": jsa.ScaledArray(jnp.zeros(4, jnp.float16), jnp.float32(0.0))})
    updates, (new, _) = jsa.scalify(tx.update)({"w": jnp.zeros(4)}, (zeros, optax.EmptyState()))
    assert float(new.trace["w"].scale) == 0.0 and not np.any(np.asarray(new.trace["w"].data))
    np.testing.assert_array_equal(np.asarray(jsa.asarray(updates)["w"]), 0.0)


@pytest.mark.slow  # for time: clears JAX's caches and runs init op by op
def test_init_of_device_arrays_compiles_a_few_programs_and_matches_op_by_op():
    """Called eagerly, ``init`` costs the inner Optax ``init`` and two compiled programs (the
    parameters' float32 values, the stored state): op by op, each state tensor's statistic,
    rescale and cast compiled per operation and shape (140 compilations for a 4-layer MLP
    with AdamW)."""
    params = _mlp_params_in_float16()
    inner = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100))
    tx = scale_state(inner, jnp.float16)
    got = []
    jax.clear_caches()
    (compiles,) = count_xla_compiles([lambda: got.append(tx.init(params))])
    jax.clear_caches()
    (plain_compiles,) = count_xla_compiles([lambda: inner.init(jsa.asarray(params, jnp.float32))])
    assert compiles <= plain_compiles + 2, (compiles, plain_compiles)
    with jax.disable_jit():
        expected = tx.init(params)
    _assert_same_state(got[0], expected)
    _assert_same_state(jax.jit(tx.init)(params), expected)


def test_init_of_a_state_with_python_leaves_keeps_them():
    """A custom state with a non-array leaf is stored op by op, the leaf passed through."""
    tx = scale_state(
        optax.GradientTransformation(
            lambda p: {"trace": jax.tree.map(jnp.ones_like, p), "note": "momentum", "beta": 0.9},
            lambda u, s, p=None: (u, s),
        ),
        jnp.float16,
    )
    state = tx.init(_mlp_params_in_float16())
    assert state.inner["note"] == "momentum" and state.inner["beta"] == 0.9
    trace = state.inner["trace"]["layer0"]["w"]
    assert isinstance(trace, jsa.ScaledArray) and trace.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(trace.to_array(jnp.float32)), 1.0)


def test_count_stays_int32_counts_past_2048_and_the_state_structure_is_stable():
    """Counts are never cast (float16 would freeze at 2048); the state can be a jit or scan
    carry: same tree, shapes and dtypes after an update."""
    params, x, y = task((4, 8, 2), n=16)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    tx = scale_state(inner, jnp.float16)
    sparams = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    start = lambda s: jax.tree.map(lambda c: jnp.full_like(c, 2046) if c.dtype == jnp.int32 else c, s)
    state, ref_state = start(tx.init(sparams)), start(inner.init(params))
    initial = state
    step, ref_step = jax.jit(jsa.scalify(make_step(tx))), jax.jit(make_step(inner))
    p, rp = sparams, params
    for _ in range(4):
        _, p, state = step(p, state, *jsa.tree.astype((x, y), jnp.float16))
        _, rp, ref_state = ref_step(rp, ref_state, x, y)
    leaves = jax.tree.leaves(state, is_leaf=jsa.is_scaled_leaf)
    counts = [leaf for leaf in leaves if not isinstance(leaf, jsa.ScaledArray)]
    assert counts and all(c.dtype == jnp.int32 and int(c) == 2050 for c in counts)
    chex.assert_trees_all_equal_structs(initial, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(initial, state)
    assert_close_values(jsa.asarray(p, jnp.float32), rp, rtol=0.05, atol=0.01)


# --- composition --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "inner",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 4, 40))),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-3),
        optax.chain(optax.adam(1e-2), optax.chain(optax.add_decayed_weights(1e-3), optax.scale(1.0))),
    ],
    ids=["clip_adamw_schedule", "inject_hyperparams", "nested_chains"],
)
def test_composed_transformations_in_float32_equal_the_plain_ones(inner):
    params, x, y = task((4, 8, 2), n=16)
    tx = scale_state(inner, jnp.float32)
    plain_step, scaled_step = jax.jit(make_step(inner)), jax.jit(jsa.scalify(make_step(tx)))
    sparams = jsa.as_scaled_array(params)
    p, s, sp, ss = params, inner.init(params), sparams, tx.init(sparams)
    for _ in range(3):
        _, p, s = plain_step(p, s, x, y)
        _, sp, ss = scaled_step(sp, ss, x, y)
    assert_close_values((sp, ss.inner), (p, s), rtol=2e-5, atol=2e-6)


def _weights_a_biases_b(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "a" if "w" in str(path) else "b", params)


MORE_TRANSFORMATIONS = {
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)}, _weights_a_biases_b
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "masked_weight_decay": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(1e-2), lambda p: jax.tree.map(lambda a: a.ndim > 1, p)),
        optax.adam(1e-2),
    ),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "novograd": lambda: optax.novograd(1e-2),
    "rmsprop_momentum": lambda: optax.rmsprop(1e-2, momentum=0.9),
    "adagrad": lambda: optax.adagrad(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "nadamw": lambda: optax.nadamw(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "sgd_then_ema": lambda: optax.chain(optax.sgd(1e-2), optax.ema(0.9)),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "sm3": lambda: optax.sm3(1e-1),  # its momentum is named nu, like a second moment
    "adan": lambda: optax.adan(1e-2),  # its signed gradient-difference EMA is named v
    "muon": lambda: optax.contrib.muon(1e-2),  # Newton-Schulz on matrices, Adam on vectors
    "prodigy": lambda: optax.contrib.prodigy(1.0),  # learns its rate from params - initial params
    "adopt": lambda: optax.contrib.adopt(1e-2),
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "sgdr_schedule": lambda: optax.sgd(
        optax.sgdr_schedule([dict(init_value=0.0, peak_value=1e-2, warmup_steps=2, decay_steps=5)] * 2)
    ),
}


@pytest.mark.slow  # 21 more optimizers, two compilations each; the default run covers the five main ones
@pytest.mark.parametrize("name", MORE_TRANSFORMATIONS)
def test_more_optax_transformations_equal_the_plain_ones_in_float32_and_train_in_float16(name):
    """Wrappers (MultiSteps, multi_transform, apply_if_finite, masked), factored and
    accumulating optimizers, an EMA and a schedule-free one: with float32 state the
    scalified step equals the plain one; with float16 state and weights it ends where
    float32 does."""
    inner = MORE_TRANSFORMATIONS[name]()
    params, x, y = task((4, 8, 2), n=16)
    plain_step = jax.jit(make_step(inner))
    p, s = params, inner.init(params)
    expected_losses = []
    for _ in range(6):
        loss, p, s = plain_step(p, s, x, y)
        expected_losses.append(float(loss))
    for dtype in (jnp.float32, jnp.float16):
        tx = scale_state(inner, dtype)
        sp = jsa.tree.astype(jsa.as_scaled_array(params), dtype)
        ss, batch = tx.init(sp), jsa.tree.astype((x, y), dtype)
        losses, sp, ss = train(jsa.scalify(make_step(tx)), sp, ss, *batch, 6)
        if dtype == jnp.float32:
            assert_close_values(jsa.asarray(sp), p, rtol=2e-5, atol=2e-6)
        else:
            np.testing.assert_allclose(losses, expected_losses, rtol=1e-2)


def test_inject_hyperparams_scalars_stay_plain_float32():
    tx = scale_state(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), jnp.float16)
    state = tx.init({"w": jnp.ones((2, 2))}).inner
    assert state.hyperparams["learning_rate"].dtype == jnp.float32
    assert not isinstance(state.hyperparams["learning_rate"], jsa.ScaledArray)
    assert isinstance(state.inner_state[0].mu["w"], jsa.ScaledArray)


def test_the_wrapped_state_attributes_read_through_and_a_changed_learning_rate_applies():
    """``opt_state.hyperparams[...] = ...`` (``optax.inject_hyperparams``'s idiom) works on the wrapper."""
    tx = scale_state(optax.inject_hyperparams(optax.sgd)(learning_rate=1e-1), jnp.float16)
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((2, 2))}), jnp.float16)
    state = tx.init(params)
    assert state.hyperparams is state.inner.hyperparams
    state.hyperparams["learning_rate"] = jnp.asarray(1e-2)
    grads = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((2, 2))}), jnp.float16)
    updates, state = jax.jit(jsa.scalify(lambda g, s, p: tx.update(g, s, p)))(grads, state, params)
    # the update float16 weights take (within half an ulp of 1); the rest is carried
    np.testing.assert_allclose(np.asarray(jsa.asarray(updates)["w"], np.float32), -1e-2, rtol=0, atol=2.5e-4)
    assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(1e-2)
    with pytest.raises(AttributeError, match=r"\.inner"):
        state.no_such_field  # noqa: B018


def test_update_outside_scalify_with_plain_gradients_returns_plain_updates():
    """Narrow state in an unscaled float32 loop: plain updates, FP16 scaled moments."""
    inner = optax.adam(1e-3)
    tx = scale_state(inner, jnp.float16)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)}
    grads = {"w": jnp.asarray(rng.standard_normal((8, 4)) * 2.0**-20, jnp.float32)}  # g**2 ~ 2**-40: 0 in FP16
    updates, state = tx.update(grads, tx.init(params), params)
    ref_updates, _ = inner.update(grads, inner.init(params), params)
    assert not isinstance(updates["w"], jsa.ScaledArray) and updates["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(ref_updates["w"]), rtol=2e-3)
    assert state.inner[0].nu["w"].dtype == jnp.float16
    assert optax.apply_updates(params, updates)["w"].dtype == jnp.float32


def test_update_outside_scalify_with_scaled_gradients_returns_scaled_updates():
    tx = scale_state(optax.sgd(1e-2, momentum=0.9), jnp.float16)
    params = jsa.as_scaled_array({"w": jnp.ones((4, 4))})  # float32: the update is not carried
    grads = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.full((4, 4), 2.0**-30)}), jnp.float16)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert isinstance(updates["w"], jsa.ScaledArray) and updates["w"].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(updates["w"].to_array(jnp.float32)), -1e-2 * 2.0**-30, rtol=1e-3)


def test_extra_args_reach_the_inner_transformation():
    inner = optax.chain(optax.sgd(1e-1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0))
    tx = scale_state(inner, jnp.float16)
    params = {"w": jnp.ones((2, 2))}
    grads = {"w": jnp.ones((2, 2))}
    state, ref_state = tx.init(params), inner.init(params)
    for loss in (1.0, 2.0, 3.0):
        updates, state = tx.update(grads, state, params, value=jnp.float32(loss))
        ref_updates, ref_state = inner.update(grads, ref_state, params, value=jnp.float32(loss))
        np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(ref_updates["w"]), rtol=1e-6)
    assert float(state.inner[1].scale) < 1.0  # the plateau halved the rate


@pytest.mark.slow  # 20 s: two compilations of the zoom line search's while loops
def test_lbfgs_with_its_linesearch_trains_in_float16_like_float32():
    """``optax.lbfgs`` as its documentation drives it (``value_and_grad_from_state``, ``value_fn``
    for the zoom line search, ``while`` loops inside the update), its arrays stored in float16.
    The state's value is a float32 scalar, like every floating scalar of the state, so the
    loss is computed in float32 (``value_and_grad_from_state`` selects between the two)."""
    params, x, y = task((16, 4), n=64)
    inner = optax.lbfgs()

    def make_lbfgs_step(tx):
        def step(params, opt_state, x, y):
            objective = lambda p: loss_fn(p, x, y).astype(jnp.float32)  # noqa: E731
            value, grads = optax.value_and_grad_from_state(objective)(params, state=opt_state)
            updates, opt_state = tx.update(grads, opt_state, params, value=value, grad=grads, value_fn=objective)
            return value, optax.apply_updates(params, updates), opt_state

        return step

    expected, *_ = train(make_lbfgs_step(inner), params, inner.init(params), x, y, 8)
    tx = scale_state(inner, jnp.float16)
    sparams = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    batch = jsa.tree.astype((x, y), jnp.float16)
    losses, *_ = train(jsa.scalify(make_lbfgs_step(tx)), sparams, tx.init(sparams), *batch, 8)
    assert expected[-1] < 0.1 * expected[0]
    np.testing.assert_allclose(losses, expected, rtol=2e-2)


def wide_range_gradients(rows=16, cols=32, decades=8.0, seed=0):
    """Row ``i`` of the gradient has magnitude ``10**(-decades * i / (rows - 1))``: a range of 2**26."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** (-decades * np.arange(rows) / (rows - 1))
    return jnp.asarray(rng.standard_normal((rows, cols)) * magnitude[:, None], jnp.float32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float16_adam_on_a_wide_range_gradient_steps_no_further_than_float32(jit):
    """Gradients spanning 2**26 in one tensor put ``nu`` (their squares) 2**52 below its largest entry.

    One scale per tensor cannot hold that range in float16: rounded to nearest, the small
    entries of ``nu`` become 0 beside a first moment that is not, and Adam's step there is
    ``mu / eps`` (seen in a RealNVP flow in FP16: steps 270 times the learning rate, NaN
    at step 39). With its stored zeros widened to float16's smallest subnormal, ``nu`` is overestimated
    there and the step is smaller than float32 Adam's; elsewhere in the subnormal range rounding to nearest
    can lower ``nu`` by up to a third (1.49 units in the last place to 1), a step up to
    ``sqrt(1.5)`` times float32's. The largest row is held to 1%.
    """
    inner = optax.adam(1e-3)
    tx = scale_state(inner, jnp.float16, compensate=False)  # the updates themselves, not rounded to the weights
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((16, 32))}), jnp.float16)
    grads = {"w": wide_range_gradients()}
    step = jsa.scalify(lambda g, s, p: tx.update(g, s, p))
    step = jax.jit(step) if jit else step
    state, ref_state = tx.init(params), inner.init(jsa.asarray(params))
    for _ in range(3):
        updates, state = step(jsa.as_scaled_array(grads), state, params)
        ref_updates, ref_state = inner.update(grads, ref_state)
    got, ref = np.asarray(jsa.asarray(updates)["w"], np.float32), np.asarray(ref_updates["w"])
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got) <= np.abs(ref) * np.sqrt(1.5) * (1 + 1e-2)), "a step far larger than float32 Adam's"
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-2)


def test_a_stored_zero_second_moment_beside_a_first_moment_gives_a_bounded_step():
    """A zero ``nu`` with a non-zero ``mu`` (stored so, or rounded so by a later rescale) is not ``mu / eps``."""
    tx = scale_state(optax.adam(1.0), jnp.float16, compensate=False)
    count, _, _ = tx.init({"w": jnp.ones(3)})[0]

    def stored(values):
        return jsa.ScaledArray(jnp.asarray(values, jnp.float16), jnp.float32(1.0))

    adam_state = optax.ScaleByAdamState(count, {"w": stored([1.0, 1e-3, 0.0])}, {"w": stored([1.0, 0.0, 0.0])})
    grads = {"w": jsa.as_scaled_array(jnp.zeros(3))}
    updates, _ = jsa.scalify(tx.update)(grads, (adam_state, optax.EmptyState()))
    steps = np.abs(np.asarray(jsa.asarray(updates)["w"], np.float32))
    assert steps[2] == 0.0  # no gradient ever: the step stays 0
    assert 0 < steps[1] < 10.0  # mu / sqrt(smallest subnormal), not mu / eps = 1e5
    # mu' = 0.9, nu' = 0.999 after a zero gradient; bias-corrected: 9 / sqrt(999)
    np.testing.assert_allclose(steps[0], 9 / np.sqrt(999), rtol=1e-3)


def test_sams_first_adam_step_after_an_adversarial_step_follows_float32():
    """SAM's adversarial step leaves Adam's ``nu`` at zero, stored at a scale no value set
    (its ``cond * a + (1 - cond) * b`` does not keep the zero scale of the fresh moment); the
    floor under divisors made that 6e-8 against a true 2e-10, and the first Adam step was 16
    times too small. An all-zero divisor keeps its zeros."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    params = {
        "w1": jnp.asarray(init_mlp(rng, [16, 32])[0]["w"]),
        "w2": jnp.asarray(rng.standard_normal((32, 8)) * 1e-3, jnp.float32),
    }
    y = jnp.sin(x[:, :8]) * 1e-3

    def step_of(tx):
        def step(p, s, x):
            grads = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        return step

    make_sam = lambda: optax.contrib.sam(optax.adam(1e-3), optax.sgd(1e-2), sync_period=2)  # noqa: E731
    expected, state = params, make_sam().init(params)
    got, scaled_state = (
        jsa.as_scaled_array(params),
        scale_state(make_sam(), jnp.float16).init(jsa.as_scaled_array(params)),
    )
    plain, scalified = jax.jit(step_of(make_sam())), jax.jit(jsa.scalify(step_of(scale_state(make_sam(), jnp.float16))))
    for _ in range(2):  # the adversarial step, then the first outer (Adam) step
        expected, state = plain(expected, state, x)
        got, scaled_state = scalified(got, scaled_state, jsa.as_scaled_array(x))
    moved = np.asarray(expected["w2"] - params["w2"])
    got_moved = np.asarray(jsa.asarray(got)["w2"], np.float32) - np.asarray(params["w2"])
    np.testing.assert_allclose(got_moved, moved, rtol=0, atol=1e-2 * np.abs(moved).max())


def test_a_signed_field_named_like_a_divisor_keeps_its_negative_entries():
    """SM3's momentum is named ``nu``, the name of Adam's second moment: the floor under
    divisors moves only stored zeros, so its negative entries stay negative (flooring every
    entry at the smallest subnormal made them all tiny and positive: SM3 in FP16 ended 48%
    above FP32 on the MLP of ``tests/programs``)."""
    tx = scale_state(optax.sm3(1.0), jnp.float16, compensate=False)
    sm3_state, empty = tx.init({"w": jnp.ones((2, 2))})
    momentum = jsa.ScaledArray(jnp.asarray([[-1.0, 0.5], [0.0, -0.25]], jnp.float16), jnp.float32(1.0))
    state = (sm3_state._replace(nu={"w": momentum}), empty)
    grads = {"w": jsa.as_scaled_array(jnp.zeros((2, 2)))}
    updates, new_state = jsa.scalify(tx.update)(grads, state)
    # A zero gradient: the new momentum is b1 = 0.9 times the old one, the update its opposite
    # (learning rate 1); its zero entry may become float16's smallest subnormal (scale 1).
    expected = 0.9 * np.asarray([[-1.0, 0.5], [0.0, -0.25]])
    new_momentum, step = jsa.asarray(new_state[0].nu)["w"], jsa.asarray(updates)["w"]
    np.testing.assert_allclose(np.asarray(new_momentum, np.float32), expected, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(np.asarray(step, np.float32), -expected, rtol=1e-3, atol=1e-7)


def test_field_dtypes_store_one_moment_in_fp8():
    tx = scale_state(optax.adam(1e-3), jnp.float16, field_dtypes={"mu": jnp.float8_e4m3fn})
    params, x, y = task((4, 8, 2), n=16)
    state = tx.init(params)
    assert all(
        leaf.dtype == jnp.float8_e4m3fn for leaf in jax.tree.leaves(state.inner[0].mu, is_leaf=jsa.is_scaled_leaf)
    )
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(state.inner[0].nu, is_leaf=jsa.is_scaled_leaf))
    sparams = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    xy16 = jsa.tree.astype((x, y), jnp.float16)
    _, _, new_state = jax.jit(jsa.scalify(make_step(tx)))(sparams, tx.init(sparams), *xy16)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)


def test_field_dtypes_match_state_fields_not_parameter_names():
    tx = scale_state(optax.adam(1e-3), jnp.float16, field_dtypes={"nu": jnp.float32})
    state = tx.init({"mu": jnp.ones(3), "nu": jnp.ones(3)})
    assert state.inner[0].mu["nu"].dtype == jnp.float16
    assert state.inner[0].nu["mu"].dtype == jnp.float32


def test_second_moment_below_float16_precision_warns():
    params = {"w": jnp.ones((2, 2))}
    with pytest.warns(UserWarning, match=r"second moment \(nu\) is stored in bfloat16"):
        scale_state(optax.adam(1e-3), jnp.bfloat16).init(params)
    with pytest.warns(UserWarning, match="float8_e5m2"):
        scale_state(optax.adabelief(1e-3), field_dtypes={"nu": jnp.float8_e5m2}).init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale_state(optax.adam(1e-3), jnp.bfloat16, field_dtypes={"nu": jnp.float16}).init(params)
        scale_state(optax.lion(1e-3), jnp.float8_e4m3fn).init(params)


def test_mechanic_state_below_float32_warns_and_the_advised_storage_does_not():
    """Measured on the MLP of tests/programs: the loss stays at ln(10) unless all five fields are float32."""
    params = {"w": jnp.ones((2, 2))}
    with pytest.warns(UserWarning, match="mechanize"):
        scale_state(optax.contrib.mechanize(optax.adam(1e-3)), jnp.float16).init(params)
    with pytest.warns(UserWarning, match="mechanize"):
        scale_state(optax.contrib.mechanize(optax.adam(1e-3)), jnp.float16, field_dtypes={"x0": jnp.float32}).init(
            params
        )
    advised = {name: jnp.float32 for name in ("r", "m", "v", "s", "x0")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale_state(optax.contrib.mechanize(optax.adam(1e-3)), jnp.float16, field_dtypes=advised).init(params)
        scale_state(optax.adam(1e-3), jnp.float16).init(params)


# --- (e) updates below the weights' rounding step ---------------------------------------------
def sgd_on_float16_ones(learning_rate: float, steps: int, compensate: bool) -> np.ndarray:
    """Weights of 1.0 in float16 after ``steps`` of SGD with a gradient of 1."""
    tx = scale_state(optax.sgd(learning_rate), jnp.float16, compensate=compensate)
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((4, 4))}), jnp.float16)
    grads = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((4, 4))}), jnp.float16)

    @jax.jit
    @jsa.scalify
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state, grads)
    assert params["w"].dtype == jnp.float16
    return np.asarray(jsa.asarray(params)["w"], np.float32)


def test_updates_below_half_an_ulp_of_float16_weights_are_carried_not_dropped():
    """A weight of 1.0 in float16 moves in steps of 2**-11 (below 1): an update of -1e-4 a step
    rounds away every time. The residual carries it until it adds up to a step of the weight."""
    np.testing.assert_allclose(sgd_on_float16_ones(1e-4, 20, compensate=True), 1 - 20 * 1e-4, atol=2.0**-12)
    np.testing.assert_array_equal(sgd_on_float16_ones(1e-4, 20, compensate=False), 1.0)


def test_a_carried_unit_applied_at_a_tiny_learning_rate_stays_finite():
    """The tail of a schedule decaying to 0: the update's scale follows its RMS (one entry of
    16,384 at 2**-20: scale 2**-27), and when the residual crosses half an ulp the whole ulp
    applied (2**-10) was 2**17 in float16 data at that scale: inf, and the weight with it.
    Found in an MLP trained with AdamW and a warmup-cosine schedule decaying to 0: NaN at
    step 3979 of 4000."""
    schedule = lambda count: jnp.where(count == 0, 2.0**-11, 2.0**-20)  # noqa: E731
    tx = scale_state(optax.sgd(schedule), jnp.float16)
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.full((16384,), 1.5)}), jnp.float16)

    @jax.jit
    @jsa.scalify
    def step(params, state):
        grads = jax.grad(lambda p: p["w"][0])(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(2):
        params, state = step(params, state)
    w = np.asarray(jsa.asarray(params)["w"], np.float32)
    assert w[0] == np.float16(1.5 - 2.0**-10) and np.all(w[1:] == 1.5)  # float32: 1.4995108, rounded
    residual = np.asarray(jsa.asarray(state.residual)["w"], np.float32)
    np.testing.assert_allclose(residual[0], 1.5 - 2.0**-11 - 2.0**-20 - w[0], rtol=1e-3)


@pytest.mark.slow  # 20 s: three trainings; the unit test above covers the residual by default
def test_a_small_learning_rate_trains_float16_weights_like_float32():
    """Adam at 3e-5 for 40 steps: without the residual, float16 weights take 30% of float32's
    loss decrease (most updates are below half an ulp); with it, the same decrease within 5%."""
    params, x, y = task()
    inner = optax.adam(3e-5)
    fp32 = train(make_step(inner), params, inner.init(params), x, y, STEPS)[0]
    decrease = {}
    for compensate in (True, False):
        tx = scale_state(inner, jnp.float16, compensate=compensate)
        sparams = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
        sxy = jsa.tree.astype(jsa.as_scaled_array((x, y)), jnp.float16)
        losses = train(jsa.scalify(make_step(tx)), sparams, tx.init(sparams), *sxy, STEPS)[0]
        decrease[compensate] = (losses[0] - losses[-1]) / (fp32[0] - fp32[-1])
    assert abs(decrease[True] - 1) <= 0.05, decrease
    assert decrease[False] < 0.5, decrease


def test_the_residual_is_stored_scaled_and_float32_weights_leave_it_zero():
    tx = scale_state(optax.adam(1e-3), jnp.float16)
    params = {"w16": jsa.tree.astype(jsa.as_scaled_array(jnp.ones((3, 2))), jnp.float16), "w32": jnp.ones((3, 2))}
    state = tx.init(params)
    assert isinstance(state, jsa.optim.CompensatedState)
    for leaf in jax.tree.leaves(state.residual, is_leaf=jsa.is_scaled_leaf):
        assert isinstance(leaf, jsa.ScaledArray) and leaf.dtype == jnp.float16 and float(leaf.scale) == 0.0
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, jnp.float32), jsa.asarray(params))
    _, new_state = jax.jit(jsa.scalify(tx.update))(jsa.as_scaled_array(grads), state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)
    assert float(new_state.residual["w32"].scale) == 0.0  # float32 weights take every update
    assert float(new_state.residual["w16"].scale) > 0.0
    assert_pow2_scales(new_state)


def test_float32_storage_gives_optaxs_float32_updates_bit_for_bit():
    """The inner update runs on plain float32 values, so with float32 storage (power-of-two
    rescales only) the updates are jitted Optax's, bit for bit, step after step."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((16, 16)) * 0.05, jnp.float32)}
    tx = scale_state(optax.adam(3e-3), jnp.float32, compensate=False)
    plain = optax.adam(3e-3)
    update, plain_update = jax.jit(jsa.scalify(tx.update)), jax.jit(plain.update)
    state, plain_state = tx.init(params), plain.init(params)
    for _ in range(8):
        grads = {"w": jnp.asarray(rng.standard_normal((16, 16)) * 1e-3, jnp.float32)}
        updates, state = update(jsa.as_scaled_array(grads), state, params)
        expected, plain_state = plain_update(grads, plain_state, params)
        np.testing.assert_array_equal(np.asarray(jsa.asarray(updates["w"])), np.asarray(expected["w"]))


def test_rescale_none_stores_values_at_scale_one_and_updates_like_the_plain_optimizer():
    """``rescale=None``: no statistic; the new state is stored at scale 1 (which a static policy
    leaves), and the update is Adam's in float32."""
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2)}
    grads = {"w": jnp.full((3, 2), 0.25, jnp.float32)}
    tx = scale_state(optax.adam(1e-2), jnp.float32, rescale=None, compensate=False)
    update = jax.jit(jsa.scalify(tx.update, policy=jsa.RescalePolicy.static()))
    updates, state = update(jsa.as_scaled_array(grads), tx.init(params), params)
    plain_updates, plain_state = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    chex.assert_trees_all_close(jsa.asarray(updates), plain_updates, rtol=1e-6)
    for leaf, plain in zip(jax.tree.leaves(state, is_leaf=jsa.is_scaled_leaf), jax.tree.leaves(plain_state)):
        if isinstance(leaf, jsa.ScaledArray):
            assert float(leaf.scale) == 1.0, leaf.scale
        chex.assert_trees_all_close(jsa.asarray(leaf), plain, rtol=1e-6)


def test_update_without_params_says_to_pass_them():
    tx = scale_state(optax.adam(1e-3), jnp.float16)
    params = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"tx.update\(grads, opt_state, params\)"):
        tx.update(params, tx.init(params))
    updates, _ = scale_state(optax.adam(1e-3), jnp.float16, compensate=False).update(
        params, scale_state(optax.adam(1e-3), jnp.float16, compensate=False).init(params)
    )
    assert updates["w"].shape == (2, 2)


# --- (d) bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bool_, jnp.float64, "not a dtype"])
def test_non_float_storage_dtype_is_rejected(dtype):
    with pytest.raises(TypeError, match="floating dtype"):
        scale_state(optax.adam(1e-3), dtype)


def test_non_float_field_dtype_is_rejected():
    with pytest.raises(TypeError, match=r"field_dtypes\['mu'\]"):
        scale_state(optax.adam(1e-3), field_dtypes={"mu": jnp.int32})


def test_unknown_rescale_is_rejected():
    with pytest.raises(ValueError, match="rescale must be"):
        scale_state(optax.adam(1e-3), rescale="l3")


def test_non_transformation_is_rejected():
    with pytest.raises(TypeError, match="GradientTransformation"):
        scale_state(optax.adam, jnp.float16)


def test_inner_state_passed_to_update_is_rejected_outside_scalify():
    tx = scale_state(optax.adam(1e-3), jnp.float16)
    params = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"tx.init\(params\)"):
        tx.update(params, optax.adam(1e-3).init(params), params)


def test_inner_state_passed_to_update_is_rejected_under_scalify():
    tx = scale_state(optax.adam(1e-3), jnp.float16)
    params = jsa.as_scaled_array({"w": jnp.ones((2, 2))})
    wrong_state = jsa.as_scaled_array(optax.adam(1e-3).init({"w": jnp.ones((2, 2))}))  # float32 data
    with pytest.raises(ValueError, match="storage dtype float16"):
        jsa.scalify(tx.update)(params, wrong_state, params)


def test_a_state_whose_hyperparameters_were_cast_to_float16_is_rejected():
    """``jsa.tree.astype`` on the whole state rounds the float32 scalars ``scale_state`` keeps
    (an Equinox transformer's ``inject_hyperparams(adamw)``: b2 0.999 -> 0.9990234375, kept
    rounded for good); the state as ``init`` returned it keeps them exact."""
    tx = scale_state(optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3, b2=0.999), jnp.float16)
    params = jsa.tree.astype(jsa.as_scaled_array({"w": jnp.ones((2, 2))}), jnp.float16)
    state = tx.init(params)
    _, new_state = jax.jit(jsa.scalify(tx.update))(params, state, params)
    hyperparams = new_state.inner.hyperparams
    assert float(hyperparams["b2"]) == np.float32(0.999) and float(hyperparams["learning_rate"]) == np.float32(3e-3)
    cast_state = jsa.tree.astype(jsa.as_scaled_array(state), jnp.float16)
    with pytest.raises(ValueError, match=r"hyperparams\['b1'\] is a float16 scalar.*cast the parameters"):
        tx.update(params, cast_state, params)
    with pytest.raises(ValueError, match="float16 scalar"):
        jsa.scalify(tx.update)(params, cast_state, params)


def test_plain_adam_on_the_state_of_scaled_float16_params_steps_zero_gradient_weights_like_float32():
    """``optax.adam`` inside ``jax.jit(jsa.scalify(step))`` with its state from ``tx.init`` of scaled
    float16 parameters: two weights with zero gradient stay put, as in float32 ([1.0, 0.9, 1.0]).

    Their moments are asserted zeros (scale 0); ``sqrt(v) + eps`` with ``v`` at scale ``2**-1``
    rounded ``eps = 1e-8`` to 0 in float16, and ``m / (sqrt(v) + eps)`` was ``0 / 0``: NaN.
    """
    tx = optax.adam(0.1)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, grads = jnp.ones(3), jnp.array([0.0, 1.0, 0.0])
    expected, _ = step(params, tx.init(params), grads)

    params16 = jsa.as_scaled_array(params.astype(jnp.float16))
    got, state = jax.jit(jsa.scalify(step))(params16, tx.init(params16), jsa.as_scaled_array(grads.astype(jnp.float16)))
    np.testing.assert_allclose(jsa.asarray(got), expected, rtol=2e-3)
    assert all(np.all(np.isfinite(jsa.asarray(s))) for s in jax.tree.leaves(state, is_leaf=jsa.is_scaled_leaf))


def test_the_papers_recipe_casting_the_whole_optax_state_to_float16_trains_like_float32():
    """Algorithm 1 of the Scalify paper: ``jsa.tree.astype(jsa.as_scaled_array(opt.init(params)),
    jnp.float16)`` and plain ``optax.adam`` in the scalified step, on a 3-layer MLP.

    The zero moments got scale 1 from ``as_scaled_array``; the second moment then kept scale 1
    (a sum takes the larger scale), ``0.001 * g ** 2`` flushed in float16 at that scale and
    ``m / (sqrt(v) + eps)`` was ``m / eps`` (loss 1e5 after one step), or ``0 / 0`` where ``eps``
    rounded to 0 too (NaN at step 1).
    """
    keys = jax.random.split(jax.random.key(0), 5)
    dims = [16, 64, 64, 4]
    params = [
        {"w": jax.random.normal(keys[i], (dims[i], dims[i + 1])) / np.sqrt(dims[i]), "b": jnp.zeros(dims[i + 1])}
        for i in range(3)
    ]
    x = jax.random.normal(keys[3], (128, 16))
    y = jnp.tanh(x @ jax.random.normal(keys[4], (16, 4)))

    def loss_fn(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            h = jax.nn.relu(h) if i < 2 else h
        return jnp.mean((h - y) ** 2)

    opt = optax.adam(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    p32, s32 = params, opt.init(params)
    p16 = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    s16 = jsa.tree.astype(jsa.as_scaled_array(opt.init(params)), jnp.float16)
    x16, y16 = jsa.as_scaled_array(x.astype(jnp.float16)), jsa.as_scaled_array(y.astype(jnp.float16))
    step32, step16 = jax.jit(step), jax.jit(jsa.scalify(step))
    for _ in range(60):
        p32, s32, loss32 = step32(p32, s32, x, y)
        p16, s16, loss16 = step16(p16, s16, x16, y16)
        loss16 = float(jsa.asarray(loss16))
        assert np.isfinite(loss16)
    np.testing.assert_allclose(loss16, float(loss32), rtol=0.02)
