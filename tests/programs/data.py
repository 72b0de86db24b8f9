"""Small bundled data sets: scikit-learn's 8x8 digits and character windows of tiny Shakespeare."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from .harness import shared_data_file

SHAKESPEARE = "tinyshakespeare.txt"


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits: images ``(N, 8, 8)`` in ``[0, 1]`` (float32) and labels (int32)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int32)


def digit_batches(seed: int, count: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` random batches of ``(images (B, 8, 8), labels (B,))``."""
    images, labels = digits()
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(images), batch, replace=False) for _ in range(count)]
    return [(images[idx], labels[idx]) for idx in picks]


@functools.cache
def shakespeare() -> tuple[np.ndarray, int]:
    """Tiny Shakespeare as int32 character ids, and the vocabulary size; skips if the file is absent."""
    path = shared_data_file(SHAKESPEARE)
    if path is None:
        pytest.skip(f"{SHAKESPEARE} not found in ../shared/data next to the repository")
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int32), len(chars)


def text_batches(seed: int, count: int, batch: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` batches of ``(tokens (B, T), next tokens (B, T))`` at random offsets."""
    ids, _ = shakespeare()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start = rng.integers(0, len(ids) - length - 1, batch)
        window = np.stack([ids[s : s + length + 1] for s in start])
        out.append((window[:, :-1], window[:, 1:]))
    return out
