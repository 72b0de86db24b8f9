"""Smoke test of the GPT experiment: every configuration trains a tiny model for a few steps.

The configurations that only repeat code paths of others (the manual placement of #1-#3,
the unscaled counterparts, the BF16 state) are slow-marked, to keep the default run short.

Uses tiny Shakespeare (``../shared/data/tinyshakespeare.txt`` next to the repository) when
it is there, else the source of Python's ``os`` module, so it runs on any machine.
"""

from __future__ import annotations

import json
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
from experiments.train_gpt import (
    CONFIGS,
    FAST_COMPILE,
    GROUPS,
    compile_fns,
    init_state,
    make_optimizer,
    parse_args,
    run,
    select_configs,
)

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
STEPS = 6
# Plain FP16 weights with plain FP16 Adam moments: Adam's eps = 1e-8 is 0 in FP16 and the
# second moment underflows, so the first update is non-finite (loss scaling cannot help:
# the gradients it checks are finite).
FAILS_WITHOUT_SCALIFY = {"fp16_state", "fp16_state_loss_scale"}
SLOW = {
    "fp16_master",
    "fp8",
    "bf16_state",
    "fp16_state_loss_scale",
    "scalify_fp16_manual",
    "scalify_fp16_master_manual",
    "scalify_fp8_manual",
    "scalify_fp8_fp16_adam",  # its parts run in scalify_fp16_fp16_adam and the FP8 runs named below
    "scalify_fp8_fp16_adam_manual",
    "scalify_fp16",  # the recipe trains in scalify_fp16_fp16_adam (FP16 weights and moments)
    "scalify_fp16_master",  # FP16 weights with float32 moments: its parts run in scalify_fp16_fp16_adam
    "scalify_fp8",  # FP8 training: test_digits_smoke.py and tests/nn/test_linear.py (default run), tests/programs (slow)
}


def corpus_path() -> Path:
    return SHAKESPEARE if SHAKESPEARE.is_file() else Path(os.__file__)


@pytest.fixture(scope="module")
def setup():
    dataset = data_lib.load_dataset(corpus_path(), max_chars=20_000)
    cfg = gpt.GPTConfig(vocab=dataset.vocab_size, seq=16, width=32, heads=2, layers=1)
    params32 = gpt.init_params(jax.random.PRNGKey(0), cfg)
    batch = jnp.asarray(data_lib.fixed_batches(dataset.train, 1, 4, cfg.seq, seed=0)[0])
    return cfg, params32, batch


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CONFIGS])
def test_config_trains(setup, name):
    """A few Adam steps on one batch: finite losses that go down (non-finite ones where expected)."""
    cfg, params32, batch = setup
    run_cfg = CONFIGS[name]
    opt = make_optimizer(STEPS, 1e-2, 1, run_cfg)
    update, _ = compile_fns(run_cfg, cfg, opt, FAST_COMPILE)  # cheaper XLA compilation
    state = init_state(run_cfg, params32, opt)
    losses = []
    for _ in range(STEPS):
        loss, state = update(state, batch)
        losses.append(float(loss))
    if name in FAILS_WITHOUT_SCALIFY:
        assert math.isfinite(losses[0]) and not math.isfinite(losses[-1]), losses
        return
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    leaves = jax.tree.leaves(state["params"], is_leaf=jsa.is_scaled_leaf)
    assert all(isinstance(x, jsa.ScaledArray) == run_cfg.scalify for x in leaves)
    assert {np.dtype(x.dtype) for x in leaves} == {np.dtype(run_cfg.master)}


def test_groups_pair_the_default_policy_with_the_manual_placement():
    main = [r.name for r in select_configs("main")]
    for name in ("scalify_fp16", "scalify_fp16_master", "scalify_fp8", "scalify_fp8_fp16_adam"):
        default, manual = CONFIGS[name], CONFIGS[name + "_manual"]
        assert name in main and name + "_manual" in main
        assert default.policy is None and not default.precision.ln_grad_rescale  # no rescale call anywhere
        assert manual.policy == jsa.RescalePolicy.static() and manual.precision.ln_grad_rescale
        assert (default.master, default.opt_state, default.precision.fp8) == (
            manual.master,
            manual.opt_state,
            manual.precision.fp8,
        )
    assert all(set(names) <= set(CONFIGS) for names in GROUPS.values())
    assert [r.name for r in select_configs("fp32,bf16")] == ["fp32", "bf16"]
    with pytest.raises(SystemExit, match="Unknown configuration"):
        select_configs("fp32,nope")


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
    args = parse_args(
        [
            "--data",
            str(corpus_path()),
            "--max-chars",
            "20000",
            "--configs",
            "fp32,bf16",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--width",
            "32",
            "--heads",
            "2",
            "--layers",
            "1",
            "--eval-every",
            "2",
            "--eval-batches",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--fast-compile",
        ]
    )
    results = run(args)
    assert [r["name"] for r in results] == ["fp32", "bf16"]
    assert (tmp_path / "gpt_results.json").is_file() and (tmp_path / "gpt_loss_curves.png").is_file()
    assert results[0]["delta_vs_fp32_pct_val_loss"] == 0.0
    assert all(not r["diverged"] and len(r["train_loss_curve"]) == 3 for r in results)


def test_num_params_counts_every_parameter():
    cfg = gpt.GPTConfig(vocab=11, seq=8, width=16, heads=2, layers=3)
    params = gpt.init_params(jax.random.PRNGKey(0), cfg)
    assert cfg.num_params() == sum(np.size(x) for x in jax.tree.leaves(params))


def test_merge_keeps_each_configuration_once_and_checks_the_settings(tmp_path):
    from experiments.train_gpt import merge_results

    meta = {"data": "d", "model": {"layers": 1, "width": 8, "seq": 4}, "steps": 2, "batch": 1, "num_params": 10}
    entry = lambda name, loss: {
        "name": name,
        "label": name,
        "paper_config": "",
        "scalify": False,
        "final_train_loss": loss,
        "final_val_loss": loss,
        "train_loss_curve": [loss, loss],
        "val_loss_curve": [[2, loss]],
    }
    for part, results in (
        ("a", [entry("fp32", 2.0), entry("fp16", 2.2)]),
        ("b", [entry("fp16", 9.0), entry("bf16", 2.4)]),
    ):
        (tmp_path / part).mkdir()
        (tmp_path / part / "gpt_results.json").write_text(json.dumps({"meta": meta, "results": results}))
    merged = merge_results([str(tmp_path / p / "gpt_results.json") for p in "ab"], tmp_path / "out")
    assert [r["name"] for r in merged] == ["fp32", "fp16", "bf16"]
    assert merged[1]["final_val_loss"] == 2.2 and merged[2]["delta_vs_fp32_pct_val_loss"] == pytest.approx(20.0)
    assert (tmp_path / "out" / "gpt_loss_curves.png").is_file()
    (tmp_path / "b" / "gpt_results.json").write_text(json.dumps({"meta": {**meta, "steps": 3}, "results": []}))
    with pytest.raises(SystemExit, match="other settings"):
        merge_results([str(tmp_path / p / "gpt_results.json") for p in "ab"], tmp_path / "out")


@pytest.mark.slow  # compiles and records a whole FP8 step; the recorder has its own tests
def test_first_step_scales_lists_the_fp8_casts(setup):
    from experiments.train_gpt import first_step_scales

    cfg, params32, batch = setup
    args = parse_args(["--data", "unused", "--steps", "2", "--width", "32", "--heads", "2"])
    lines = first_step_scales(CONFIGS["scalify_fp8_manual"], cfg, args, params32, batch)
    casts = [line for line in lines if "float8" in line]
    # one layer: four E4M3 pairs (input, weight) forward, four E5M2 output gradients backward
    assert sum("e4m3" in line for line in casts) == 8 and sum("e5m2" in line for line in casts) == 4, lines
    with pytest.raises(SystemExit, match="not a scalify configuration"):
        first_step_scales(CONFIGS["fp32"], cfg, args, params32, batch)
