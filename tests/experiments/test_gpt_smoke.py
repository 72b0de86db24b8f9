"""Smoke test of the GPT experiment: every configuration trains a tiny model for a few steps.

Uses tiny Shakespeare (``../shared/data/tinyshakespeare.txt`` next to the repository) when
it is there, else the source of Python's ``os`` module, so it runs on any machine.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from experiments import data as data_lib
from experiments import gpt
from experiments.train_gpt import CONFIGS, FAST_COMPILE, compile_fns, init_state, make_optimizer, parse_args, run

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
STEPS = 6


def corpus_path() -> Path:
    return SHAKESPEARE if SHAKESPEARE.is_file() else Path(os.__file__)


@pytest.fixture(scope="module")
def setup():
    dataset = data_lib.load_dataset(corpus_path(), max_chars=20_000)
    cfg = gpt.GPTConfig(vocab=dataset.vocab_size, seq=16, width=32, heads=2, layers=1)
    params32 = gpt.init_params(jax.random.PRNGKey(0), cfg)
    batch = jnp.asarray(data_lib.fixed_batches(dataset.train, 1, 4, cfg.seq, seed=0)[0])
    return cfg, params32, batch


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_trains(setup, name):
    """A few Adam steps on one batch: finite losses that go down."""
    cfg, params32, batch = setup
    run_cfg = CONFIGS[name]
    opt = make_optimizer(STEPS, 1e-2, 1, run_cfg)
    update, _ = compile_fns(run_cfg, cfg, opt, FAST_COMPILE)  # cheaper XLA compilation
    state = init_state(run_cfg, params32, opt)
    losses = []
    for _ in range(STEPS):
        loss, state = update(state, batch)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    leaves = jax.tree.leaves(state["params"], is_leaf=jsa.is_scaled_leaf)
    assert all(isinstance(x, jsa.ScaledArray) == run_cfg.scalify for x in leaves)
    assert {np.dtype(x.dtype) for x in leaves} == {np.dtype(run_cfg.master)}


def test_data_split_and_batches():
    dataset = data_lib.char_dataset("abcdefghij" * 20)
    assert dataset.vocab_size == 10
    assert len(dataset.train) == 180 and len(dataset.val) == 20
    assert dataset.decode(dataset.encode("cafe")) == "cafe"
    a = data_lib.fixed_batches(dataset.train, 2, 3, 8, seed=1)
    b = data_lib.fixed_batches(dataset.train, 2, 3, 8, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert a[0].shape == (3, 9)


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        run(parse_args(["--data", str(tmp_path / "nope.txt"), "--steps", "1"]))


def test_cli_writes_results(tmp_path):
    """The CLI end to end on two configurations: JSON, PNG and the FP32 comparison."""
    args = parse_args([
        "--data", str(corpus_path()), "--max-chars", "20000", "--configs", "fp32,bf16",
        "--steps", "3", "--batch", "2", "--seq", "16", "--width", "32", "--heads", "2", "--layers", "1",
        "--eval-every", "2", "--eval-batches", "1", "--out", str(tmp_path), "--no-progress", "--fast-compile",
    ])
    results = run(args)
    assert [r["name"] for r in results] == ["fp32", "bf16"]
    assert (tmp_path / "gpt_results.json").is_file() and (tmp_path / "gpt_loss_curves.png").is_file()
    assert results[0]["delta_vs_fp32_pct_val_loss"] == 0.0
    assert all(not r["diverged"] and len(r["train_loss_curve"]) == 3 for r in results)
