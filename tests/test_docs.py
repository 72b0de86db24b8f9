"""The documentation matches the code: the generated operator table, the README's recipe."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa
from scripts import generate_operators_doc


def test_operators_doc_is_in_sync_with_the_registry():
    expected = generate_operators_doc.render()
    actual = generate_operators_doc.DOC_PATH.read_text()
    assert actual == expected, "docs/operators.md is out of date: run python scripts/generate_operators_doc.py"


def _readme_block(section: str) -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```python", text.index(section)) + len("```python")
    return text[start : text.index("```", start)]


def test_readme_recipe_runs_and_trains_in_float16():
    namespace: dict = {}
    exec(compile(_readme_block("## The recipe"), "README.md", "exec"), namespace)
    params, loss = namespace["params"], namespace["loss"]
    assert params["w1"].dtype == jnp.float16 and isinstance(params["w1"], jsa.ScaledArray)
    assert np.isfinite(float(loss)) and float(loss) < 0.05  # from about 2.3 at the start
