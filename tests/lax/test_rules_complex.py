"""complex and fft: complex values are plain, made from the values of real scaled inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa
from jax_scalify.lax import rules_complex
from tests.invariance import Case, invariance_test, normal
from tests.invariance import scaled as _scaled

N = 16


def _spectral_filter(x, wr, wi):
    """One Fourier layer: rfft, a complex weight per mode, irfft (as in a Fourier neural operator)."""
    modes = jnp.fft.rfft(x, axis=-1) * jax.lax.complex(wr, wi)
    return jnp.fft.irfft(modes, n=x.shape[-1], axis=-1)


def _power_spectrum(x):
    return jnp.abs(jnp.fft.fft2(x)) ** 2


def _complex_parts(x, y):
    z = jax.lax.complex(x, y) * (1 + 2j)
    return jnp.real(z) * jnp.imag(z) + jnp.abs(z)


INVARIANCE_CASES = [
    Case("rfft_irfft", _spectral_filter, [normal(3, N), normal(N // 2 + 1), normal(N // 2 + 1)], grad=True),
    Case("fft2_power", _power_spectrum, [normal(4, N)], grad=True),
    Case("complex_real_imag_abs", _complex_parts, [normal(3, 4), normal(3, 4)], grad=True),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


def test_complex_outputs_are_plain_arrays_of_the_value():
    x = np.random.default_rng(0).standard_normal((2, N)).astype(np.float32)
    out = jsa.scalify(jnp.fft.rfft)(_scaled(x / 2**10, 10))
    assert not isinstance(out, jsa.ScaledArray) and out.dtype == jnp.complex64
    np.testing.assert_allclose(out, np.fft.rfft(x), rtol=1e-5, atol=1e-5)


def test_float16_data_reaches_the_fft_as_its_float32_value():
    """jnp.fft needs float32 input: the user casts, and the data's range does not matter."""
    x = np.random.default_rng(1).standard_normal((2, N)).astype(np.float32)
    scaled = jsa.ScaledArray(jnp.asarray(x, jnp.float16), jnp.float32(2.0**-30))
    out = jsa.scalify(lambda a: jnp.fft.rfft(a.astype(jnp.float32)))(scaled)
    np.testing.assert_allclose(
        out * 2.0**30, np.fft.rfft(x.astype(np.float16).astype(np.float32)), rtol=1e-5, atol=1e-5
    )


def test_a_fourier_layer_trains_in_float16_with_the_recipe():
    """The README recipe on a Fourier layer regression: plain FP16 Adam is NaN, scalified FP16 tracks FP32."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, N)).astype(np.float32)
    target = np.fft.irfft(np.fft.rfft(x) * np.exp(-0.3 * np.arange(N // 2 + 1)), n=N).astype(np.float32)
    params = {"wr": np.zeros(N // 2 + 1, np.float32), "wi": np.zeros(N // 2 + 1, np.float32)}

    def loss_fn(p, x, y):
        f32 = lambda a: a.astype(jnp.float32)
        return jnp.mean((_spectral_filter(f32(x), f32(p["wr"]), f32(p["wi"])) - f32(y)) ** 2)

    def train(tx, params, x, y, wrap):
        step = jax.jit(wrap(lambda p, o, x, y: _update(tx, loss_fn, p, o, x, y)))
        opt_state = tx.init(params)
        for _ in range(60):
            loss, params, opt_state = step(params, opt_state, x, y)
        return float(loss)

    fp32 = train(optax.adam(3e-2), params, x, target, lambda f: f)
    tx16 = jsa.optim.scale_state(optax.adam(3e-2), jnp.float16)
    as16 = lambda t: jsa.tree.astype(jsa.as_scaled_array(t), jnp.float16)
    scaled16 = train(tx16, as16(params), as16(x), as16(target), jsa.scalify)
    assert fp32 < 1e-3  # from 0.21 at the zero initialisation
    assert np.isfinite(scaled16) and abs(scaled16 - fp32) <= 0.05 * fp32, (scaled16, fp32)


def _update(tx, loss_fn, params, opt_state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def test_complex_rules_are_exported():
    assert {"scaled_fft", "scaled_complex"} <= set(rules_complex.__all__)
