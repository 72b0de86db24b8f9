"""The generated documentation matches the registry."""
from scripts import generate_operators_doc


def test_operators_doc_is_in_sync_with_the_registry():
    expected = generate_operators_doc.render()
    actual = generate_operators_doc.DOC_PATH.read_text()
    assert actual == expected, "docs/operators.md is out of date: run python scripts/generate_operators_doc.py"
