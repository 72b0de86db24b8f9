"""``benchmarks/step_floor.py``: the floor is a real training step, and the table's columns."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import cost_at_scale, step_floor

SHAPE, LAYERS = cost_at_scale.TINY, 0


@pytest.mark.parametrize("name", ["floor", "floor_default"])
def test_the_floor_step_computes_the_loss_and_returns_float16_state(name):
    params32 = cost_at_scale.init_params(SHAPE, LAYERS)
    step, args = step_floor.build(name, SHAPE, LAYERS, params32)
    loss, datas, state = jax.jit(step)(*args)
    tokens, targets = cost_at_scale.batch(SHAPE)
    logits = cost_at_scale.model(SHAPE, LAYERS).apply({"params": params32}, tokens)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-2)
    assert [d.shape for d in datas] == [x.shape for x in jax.tree.leaves(params32)]
    assert all(d.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(d))) for d in datas)
    stored = [x for x in jax.tree.leaves(state.inner, is_leaf=lambda x: hasattr(x, "scale")) if hasattr(x, "scale")]
    assert stored and all(x.data.dtype == jnp.float16 for x in stored)


def test_table_and_json(tmp_path, capsys):
    path = tmp_path / "floor.json"
    argv = ["--tiny", "--layers", str(LAYERS), "--variants", "scalify_fp16_static", "floor", "--no-runtime"]
    rows = step_floor.main([*argv, "--json", str(path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    measured = [name for name, key, _ in step_floor.COLUMNS if not key.startswith(("step_ms", "h100"))]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == measured
    assert json.loads(path.read_text())["rows"] == rows
    plain, static, floor = rows
    assert [r["variant"] for r in rows] == ["plain_fp16", "scalify_fp16_static", "floor"]
    assert plain["eqns_ratio"] == 1.0 and plain["statistics"] == 0
    # With every parameter's scale a constant, the rules' scale arithmetic folds at trace time.
    assert floor["eqns"] < static["eqns"]
    for row in rows:
        for key in ("eqns", "fusions", "temp_bytes"):
            assert isinstance(row[key], int) and row[key] > 0, (row["variant"], key)
