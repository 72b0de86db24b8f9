"""Character-level data for the GPT experiments.

Any UTF-8 text file works: the vocabulary is the sorted set of its characters, the first
90% of the encoded text is the training split and the last 10% the validation split.
Batches are drawn with a NumPy generator seeded by the caller, so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

TRAIN_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class CharDataset:
    """A character-level corpus: its vocabulary and the two token splits.

    Attributes:
        chars: the vocabulary, sorted, one character per token id.
        train: training token ids (int32), the first 90% of the text.
        val: validation token ids (int32), the last 10%.
    """

    chars: tuple[str, ...]
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (every character must be in the vocabulary)."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.array([index[c] for c in text], dtype=np.int32)
        except KeyError as err:
            raise ValueError(f"Character {err.args[0]!r} is not in the vocabulary.") from None

    def decode(self, ids) -> str:
        """The text of a sequence of token ids."""
        return "".join(self.chars[int(i)] for i in ids)


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """The UTF-8 text of ``path`` (optionally only its first ``max_chars`` characters).

    Raises:
        FileNotFoundError: with a hint on where to get the corpus, if ``path`` does not exist.
        ValueError: if the file is not UTF-8 or too short to split.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Data file {str(path)!r} not found. Pass --data with any UTF-8 text file, e.g. "
            "tiny Shakespeare (input.txt of karpathy/char-rnn) saved as ../shared/data/tinyshakespeare.txt."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"Data file {str(path)!r} is not UTF-8 text: {err}") from None
    if max_chars is not None:
        text = text[:max_chars]
    if len(text) < 100:
        raise ValueError(f"Data file {str(path)!r} has {len(text)} characters; need at least 100.")
    return text


def char_dataset(text: str, train_fraction: float = TRAIN_FRACTION) -> CharDataset:
    """Tokenise ``text`` by character and split it into training and validation parts."""
    chars = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
    cut = int(len(ids) * train_fraction)
    return CharDataset(chars=chars, train=ids[:cut], val=ids[cut:])


def load_dataset(path: str | Path, max_chars: int | None = None) -> CharDataset:
    """:func:`char_dataset` of the text in ``path``."""
    return char_dataset(read_text(path, max_chars))


def sample_batch(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``seq + 1`` consecutive tokens, shape ``(batch, seq + 1)``.

    Inputs are ``[:, :-1]`` and next-token targets ``[:, 1:]``.
    """
    if len(tokens) <= seq + 1:
        raise ValueError(f"Split of {len(tokens)} tokens is too short for windows of {seq + 1}.")
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([tokens[s : s + seq + 1] for s in starts])


def fixed_batches(tokens: np.ndarray, count: int, batch: int, seq: int, seed: int) -> list[np.ndarray]:
    """``count`` batches drawn with ``seed``: the same set every call (for evaluation)."""
    rng = np.random.default_rng(seed)
    return [sample_batch(tokens, batch, seq, rng) for _ in range(count)]


def batch_stream(tokens: np.ndarray, steps: int, batch: int, seq: int, seed: int) -> list[np.ndarray]:
    """The training batches of a run: ``steps`` batches, identical for every configuration."""
    return fixed_batches(tokens, steps, batch, seq, seed)
