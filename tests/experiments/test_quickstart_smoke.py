"""The quickstart's closing sentences, computed from its results."""

import math

from experiments import quickstart


def test_explain_reports_each_run_against_float32():
    ref = [2.0] * 5 + [1.0] * 10
    sentences = quickstart.explain(
        {
            "float32": ref,
            "float16 (plain)": [2.0] * 5 + [1.005] * 10,
            "float16 (scalify)": [2.0] * 5 + [1.0] * 10,
            "bad": [2.0] * 5 + [1.5] * 10,
            "diverged": [2.0] * 5 + [math.nan] * 10,
        }
    )
    assert sentences[0] == (
        "float16 (plain) ends within 0.50% of float32: this task's values stay inside float16's range "
        "(about 6e-8 to 65504), so scales are not needed here."
    )
    assert sentences[1].startswith("float16 (scalify) ends within 0.00% of float32: the scales keep")
    assert sentences[2].startswith("bad ends +50.00% from float32")
    assert sentences[3].startswith("diverged diverged")


def test_quickstart_shows_plain_float16_adam_failing_and_scalify_following_float32(capsys):
    results = quickstart.main(["--steps", "3", "--batch", "16"])
    assert set(results) == {"float32", "float16 (plain)", "float16 (scalify)"}
    assert math.isnan(results["float16 (plain)"][-1])  # Adam's eps is 0 in float16: 0 / 0
    assert all(math.isfinite(v) for v in results["float16 (scalify)"])
    assert abs(results["float16 (scalify)"][-1] - results["float32"][-1]) <= 0.01 * results["float32"][-1]
    out = capsys.readouterr().out
    assert "float16 (scalify) ends within" in out and "float16 (plain) diverged" in out
